"""FFN-side external routing (CAMP2p, gate on Attention): the generic flow, on CPU.

``ExternalRoutingMoE`` with the real single-rank prepare/finalize
(``LocalExternalRoutingComm``) and a plain-torch routed-experts computation
(:class:`ReferenceExperts`); one test runs vLLM's own routed experts through it.
Failure injection uses small ``Raising*`` wrappers around the real pieces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from afd_core.errors import AFDConfigError, AFDTransferMismatchError
from afd_moe_runners.npu.external_routing import (
    ExternalRouting,
    ExternalRoutingMoE,
    LocalCommSlot,
    LocalExternalRoutingComm,
    RoutedExpertsApply,
    pack_routing,
    prepare_external_with,
    unpack_routing,
)

HIDDEN = 16
NUM_EXPERTS = 8
TOP_K = 2


def routing_for(rows: int, seed: int = 0) -> ExternalRouting:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack(
        [torch.randperm(NUM_EXPERTS, generator=generator)[:TOP_K] for _ in range(rows)]
    )
    weights = torch.rand(rows, TOP_K, generator=generator)
    return ExternalRouting(ids.to(torch.int32), weights.to(torch.float32))


def hidden_for(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(100 + seed))


class ReferenceExperts:
    """Routed experts in plain torch: ``sum_k w[r, k] * x[r] @ W[ids[r, k]]``.

    Like Ascend's quant method it keeps per-token state on itself for the call
    (``active_mask``), which ``release`` clears.
    """

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(7)
        self.weights = torch.randn(NUM_EXPERTS, HIDDEN, HIDDEN, generator=generator) * 0.1
        self.active_mask: torch.Tensor | None = None
        self.seen: list[tuple[torch.Tensor, ExternalRouting]] = []

    def expected(self, x: torch.Tensor, routing: ExternalRouting) -> torch.Tensor:
        per_expert = torch.einsum("rh,rkhd->rkd", x, self.weights[routing.topk_ids.long()])
        return (per_expert * routing.topk_weights.unsqueeze(-1)).sum(dim=1)

    def apply(self, prepared: Any, routing: ExternalRouting) -> torch.Tensor:
        self.active_mask = routing.topk_weights.sum(dim=-1) > 0
        self.seen.append((prepared.hidden_states, routing))
        return self.expected(prepared.hidden_states, routing)

    def release(self) -> None:
        self.active_mask = None


class RaisingExperts(ReferenceExperts):
    def apply(self, prepared: Any, routing: ExternalRouting) -> torch.Tensor:
        super().apply(prepared, routing)
        raise RuntimeError("expert kernel failed")


class RaisingPrepareComm(LocalExternalRoutingComm):
    def __init__(self, comm_type: Any, padded_rows: int | None = None) -> None:
        super().__init__(comm_type, padded_rows)
        real = self.prepare_finalize.prepare_external

        def prepare_external(hidden: torch.Tensor, routing: ExternalRouting) -> Any:
            real(hidden, routing)  # leaves the per-token row count behind
            raise RuntimeError("prepare failed")

        self.prepare_finalize.prepare_external = prepare_external  # type: ignore[method-assign]


class RaisingFinalizeComm(LocalExternalRoutingComm):
    def finalize(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("finalize failed")


NATIVE_ALLGATHER = LocalExternalRoutingComm("ALLGATHER")
"""Stands for the upstream comm instance the native selector put in the context."""


def make_moe(
    moe_cls: type[ExternalRoutingMoE] = ExternalRoutingMoE,
    *,
    comm_cls: type[LocalExternalRoutingComm] = LocalExternalRoutingComm,
    experts: ReferenceExperts | None = None,
    slot: LocalCommSlot | None = None,
    padded_rows: int | None = 32,
) -> tuple[ExternalRoutingMoE, LocalCommSlot]:
    slot = slot if slot is not None else LocalCommSlot("ALLGATHER", NATIVE_ALLGATHER)
    moe = moe_cls(
        {"ALLGATHER": comm_cls("ALLGATHER", None), "MC2": comm_cls("MC2", padded_rows)},
        experts if experts is not None else ReferenceExperts(),
        slot,
    )
    return moe, slot


EXIT_PATHS: dict[str, dict[str, Any]] = {
    "success": {},
    "prepare raises": {"comm_cls": RaisingPrepareComm},
    "expert execution raises": {"experts": RaisingExperts()},
    "finalize raises": {"comm_cls": RaisingFinalizeComm},
}


def exit_path_violations(moe_cls: type[ExternalRoutingMoE]) -> list[str]:
    """What ``moe_cls`` leaves behind on each exit path (empty: nothing)."""
    violations = []
    for path, kwargs in EXIT_PATHS.items():
        for comm_type in ("ALLGATHER", "MC2"):
            native = LocalExternalRoutingComm(comm_type)
            moe, slot = make_moe(moe_cls, slot=LocalCommSlot(comm_type, native), **kwargs)
            try:
                moe(hidden_for(5), routing_for(5))
            except RuntimeError:
                assert path != "success"
            if slot.comm_method is not native:
                violations.append(f"{path}/{comm_type}: comm not restored")
            if moe.experts.active_mask is not None:  # type: ignore[attr-defined]
                violations.append(f"{path}/{comm_type}: expert state kept")
            if any(c.prepare_finalize.num_tokens is not None for c in moe.candidates.values()):
                violations.append(f"{path}/{comm_type}: prepare state kept")
    return violations


# -- the contract ----------------------------------------------------------------------
@pytest.mark.parametrize("comm_type", ["ALLGATHER", "MC2"])
def test_output_is_the_routed_experts_of_the_local_rows(comm_type: str) -> None:
    experts = ReferenceExperts()
    moe, _ = make_moe(experts=experts, slot=LocalCommSlot(comm_type, None))
    x, routing = hidden_for(5), routing_for(5)
    out = moe(x, routing)
    assert torch.equal(out, experts.expected(x, routing))


def test_routing_reaches_the_experts_aligned_with_padded_rows() -> None:
    experts = ReferenceExperts()
    moe, _ = make_moe(experts=experts, slot=LocalCommSlot("MC2", None), padded_rows=8)
    x, routing = hidden_for(5), routing_for(5)
    moe(x, routing)
    ((prepared_x, aligned),) = experts.seen
    assert prepared_x.shape == (8, HIDDEN) and aligned.num_rows == 8
    assert aligned.topk_ids.dtype == torch.int32 and aligned.topk_weights.dtype == torch.float32
    assert torch.equal(aligned.topk_ids[:5], routing.topk_ids)
    assert torch.equal(aligned.topk_weights[:5], routing.topk_weights)
    assert torch.equal(prepared_x[:5], x)
    # Padding rows route to expert 0 with weight 0: they contribute nothing.
    assert not aligned.topk_weights[5:].any() and not aligned.topk_ids[5:].any()


@pytest.mark.parametrize("path", list(EXIT_PATHS))
def test_comm_restored_and_state_cleared_on_every_exit_path(path: str) -> None:
    native = LocalExternalRoutingComm("MC2")
    moe, slot = make_moe(slot=LocalCommSlot("MC2", native), **EXIT_PATHS[path])
    seen_during: list[Any] = []
    original_apply = moe.experts.apply

    def apply(prepared: Any, routing: ExternalRouting) -> torch.Tensor:
        seen_during.append(slot.comm_method)
        return original_apply(prepared, routing)

    moe.experts.apply = apply  # type: ignore[method-assign]
    if path == "success":
        moe(hidden_for(3), routing_for(3))
    else:
        with pytest.raises(RuntimeError, match=path.split()[0]):
            moe(hidden_for(3), routing_for(3))
    if seen_during:
        assert seen_during == [moe.candidates["MC2"]]  # the AFD comm, during the call
    assert slot.comm_method is native
    assert moe.experts.active_mask is None  # type: ignore[attr-defined]
    assert moe.candidates["MC2"].prepare_finalize.num_tokens is None  # type: ignore[attr-defined]


def test_exit_path_checker_finds_nothing_for_the_real_component() -> None:
    assert exit_path_violations(ExternalRoutingMoE) == []


class ForgetsToRestoreComm(ExternalRoutingMoE):
    """FAULT: leaves the AFD comm in the forward context."""

    def _restore(self, previous: Any) -> None:
        pass


class RestoresOnlyOnSuccess(ExternalRoutingMoE):
    """FAULT: restores the comm after a successful call only."""

    def forward(self, hidden_states: torch.Tensor, routing: ExternalRouting) -> torch.Tensor:
        comm = self.select_comm()
        previous = self.slot.comm_method
        self.slot.comm_method = comm
        prepared, aligned = comm.prepare_finalize.prepare_external(hidden_states, routing)
        out = comm.finalize(self.experts.apply(prepared, aligned), self.reduce_results, None)
        self._release(comm)
        self._restore(previous)
        return out

    __call__ = forward


class ForgetsToClearState(ExternalRoutingMoE):
    """FAULT: keeps the per-token state after the call."""

    def _release(self, comm: Any) -> None:
        pass


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        (ForgetsToRestoreComm, "prepare raises/MC2: comm not restored"),
        (RestoresOnlyOnSuccess, "finalize raises/ALLGATHER: comm not restored"),
        (ForgetsToClearState, "success/MC2: expert state kept"),
        (ForgetsToClearState, "success/ALLGATHER: prepare state kept"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else v,
)
def test_faulty_components_fail_the_exit_path_check(fault: type, expected: str) -> None:
    violations = exit_path_violations(fault)
    assert expected in violations, violations


def test_unset_comm_instance_falls_back_to_the_comm_type() -> None:
    experts = ReferenceExperts()
    moe, slot = make_moe(experts=experts, slot=LocalCommSlot("MC2", None), padded_rows=8)
    assert moe.select_comm() is moe.candidates["MC2"]
    moe(hidden_for(2), routing_for(2))
    assert experts.seen[0][1].num_rows == 8  # the MC2 candidate's padding was used
    assert slot.comm_method is None


def test_comm_instance_takes_precedence_over_the_comm_type() -> None:
    moe, _ = make_moe(slot=LocalCommSlot("MC2", NATIVE_ALLGATHER))
    assert moe.select_comm() is moe.candidates["ALLGATHER"]


class FusedMC2Comm:
    comm_type = "FUSED_MC2"


@pytest.mark.parametrize(
    "slot",
    [LocalCommSlot("FUSED_MC2", None), LocalCommSlot("ALLGATHER", FusedMC2Comm())],
    ids=["by-type", "by-instance"],
)
def test_unsupported_comm_type_is_rejected(slot: LocalCommSlot) -> None:
    moe, _ = make_moe(slot=slot)
    previous = slot.comm_method
    with pytest.raises(AFDConfigError, match="FUSED_MC2 is not supported with external routing"):
        moe(hidden_for(2), routing_for(2))
    assert slot.comm_method is previous


def test_comm_of_unknown_kind_is_rejected_with_its_class_name() -> None:
    moe, _ = make_moe(slot=LocalCommSlot("ALLGATHER", object()))
    with pytest.raises(AFDConfigError, match="selected MoE comm object is not supported"):
        moe.select_comm()


def test_no_comm_selected_is_an_error() -> None:
    moe, _ = make_moe(slot=LocalCommSlot(None, None))
    with pytest.raises(AFDConfigError, match="selects no MoE comm"):
        moe.select_comm()


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(AFDConfigError, match="no comm candidates"):
        ExternalRoutingMoE({}, ReferenceExperts(), LocalCommSlot())


def test_routing_rows_must_match_hidden_rows() -> None:
    moe, _ = make_moe()
    with pytest.raises(AFDTransferMismatchError, match="routing for 4 tokens with 5"):
        moe(hidden_for(5), routing_for(4))


def test_routing_dtypes_are_int32_and_float32() -> None:
    with pytest.raises(AFDTransferMismatchError, match="int32 ids and float32 weights"):
        ExternalRouting(torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2))


def test_packed_routing_round_trips_exactly() -> None:
    routing = ExternalRouting(
        torch.tensor([[0, (1 << 24) - 1], [5, 3]], dtype=torch.int32),
        torch.tensor([[0.1, 2.5e-8], [1.0, -3.0]], dtype=torch.float32),
    )
    back = unpack_routing(pack_routing(routing), routing.top_k)
    assert torch.equal(back.topk_ids, routing.topk_ids)
    assert torch.equal(back.topk_weights, routing.topk_weights)
    assert back.topk_ids.is_contiguous() and back.topk_weights.is_contiguous()


@dataclasses.dataclass(frozen=True)
class GatheredOutput:
    hidden_states: torch.Tensor
    router_logits: torch.Tensor | None
    padded_hidden_states_shape: torch.Size | None = None


def two_rank_gather(peer_rows: int) -> Callable[..., GatheredOutput]:
    """A prepare that pads to the DP-wide max and puts a peer's rows first (what an
    all-gather over two DP ranks gives rank 1), in plain torch."""

    def prepare(hidden: torch.Tensor, router_logits: torch.Tensor) -> GatheredOutput:
        rows = max(peer_rows, hidden.shape[0])
        pad = rows - hidden.shape[0]
        h = torch.nn.functional.pad(hidden, (0, 0, 0, pad))
        logits = torch.nn.functional.pad(router_logits, (0, 0, 0, pad))
        return GatheredOutput(
            torch.cat([torch.ones_like(h), h]), torch.cat([torch.ones_like(logits), logits])
        )

    return prepare


def test_prepare_external_aligns_routing_with_gathered_rows() -> None:
    x, routing = hidden_for(3), routing_for(3)
    output, aligned = prepare_external_with(two_rank_gather(peer_rows=4), x, routing)
    assert output.hidden_states.shape[0] == aligned.num_rows == 8
    assert torch.equal(output.hidden_states[4:7], x)
    assert torch.equal(aligned.topk_ids[4:7], routing.topk_ids)
    assert torch.equal(aligned.topk_weights[4:7], routing.topk_weights)
    assert output.router_logits is None  # the slot carried routing, not logits


def test_npu_package_import_is_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys, afd_moe_runners.npu as npu\n"
        "heavy = [m for m in ('torch', 'vllm', 'vllm_ascend') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert 'ExternalRoutingMoE' in dir(npu)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- with vLLM's routed experts --------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.parametrize("comm_type", ["ALLGATHER", "MC2"])
def test_vllm_routed_experts_through_the_component_equal_the_ffn_routed_output(
    moe_env: Any, comm_type: str
) -> None:
    from afd_core.transfer import AttentionToFFN
    from afd_moe_runners.ffn_compute import routed_experts_output

    block = moe_env.build_block(
        "deepseek", torch.float32, prefix=f"ext_routing_{comm_type}.layers.2.mlp"
    )
    moe_env.load(block, moe_env.checkpoint_for(block, seed=99))
    runner = block.experts
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), moe_env.forward_context(x.shape[0]):
        logits, _ = runner.gate(x)
        weights, ids = runner.router.select_experts(hidden_states=x, router_logits=logits)
        routing = ExternalRouting(ids.to(torch.int32), weights.to(torch.float32))
        expected = routed_experts_output(
            runner,
            # Each call gets its own copy: the CPU kernel may write its output in place.
            AttentionToFFN(x.clone(), topk_ids=routing.topk_ids, topk_weights=routing.topk_weights),
        )
        moe = ExternalRoutingMoE(
            {
                "ALLGATHER": LocalExternalRoutingComm("ALLGATHER"),
                "MC2": LocalExternalRoutingComm("MC2", padded_rows=16),
            },
            RoutedExpertsApply(runner),
            LocalCommSlot(comm_type, None),
        )
        actual = moe(x.clone(), routing)
    assert actual.shape == expected.shape
    assert torch.equal(actual, expected)
