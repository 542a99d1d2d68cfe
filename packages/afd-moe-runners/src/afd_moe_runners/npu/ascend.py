"""vLLM-Ascend side of FFN-role external routing (CAMP2p, gate on Attention). Needs Ascend.

Never run in this repository's CI (no Ascend host); the generic flow it plugs into
(:mod:`afd_moe_runners.npu.external_routing`) is tested on CPU. ``vllm_ascend`` is
imported only inside the functions below, so importing this module is cheap.

What it provides, all by subclassing (no upstream class is patched):

``AFDPrepareAndFinalizeWithAllGather(PrepareAndFinalizeWithAllGather)``
``AFDPrepareAndFinalizeWithMC2(PrepareAndFinalizeWithMC2)``
    add ``prepare_external(hidden_states, routing)``: the native ``prepare`` with the
    routing in the per-row ``router_logits`` slot, so padding, DP gathering and TP
    sharding follow the activation's own rules; returns the prepare output and the
    aligned routing. ``finalize`` is the upstream one.
``AFDAllGatherCommImpl(AllGatherCommImpl)``, ``AFDMC2CommImpl(MC2CommImpl)``
    override only ``_get_prepare_finalize()`` to return the classes above. They are
    instantiated only by :func:`build_ascend_external_routing_moe`, i.e. only for the
    external-routing FFN path; ordinary execution and fused MC2 keep the upstream
    classes.
:class:`AscendCommSlot`, :class:`AscendExpertsApply`, :func:`ascend_comm_type_of`
    the :mod:`~afd_moe_runners.npu.external_routing` seams over ``_EXTRA_CTX`` and
    ``AscendRoutedExperts``.

Upstream members used and the revisions read: :mod:`afd_moe_runners.npu._ascend_compat`.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Mapping
from typing import Any

import torch

from afd_moe_runners.npu._ascend_compat import require_vllm_ascend
from afd_moe_runners.npu.external_routing import (
    ExternalRouting,
    ExternalRoutingMoE,
    prepare_external_with,
)

__all__ = [
    "ascend_prepare_finalize_classes",
    "ascend_comm_classes",
    "ascend_comm_type_of",
    "AscendCommSlot",
    "AscendExpertsApply",
    "build_ascend_external_routing_moe",
    "ascend_external_routing_layers",
]

_LAZY_CLASSES = {
    "AFDPrepareAndFinalizeWithAllGather": ("ascend_prepare_finalize_classes", 0),
    "AFDPrepareAndFinalizeWithMC2": ("ascend_prepare_finalize_classes", 1),
    "AFDAllGatherCommImpl": ("ascend_comm_classes", 0),
    "AFDMC2CommImpl": ("ascend_comm_classes", 1),
}


def __getattr__(name: str) -> Any:
    entry = _LAZY_CLASSES.get(name)
    if entry is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    factory, index = entry
    return globals()[factory]()[index]


class _PrepareExternal:
    """``prepare_external`` for an upstream ``PrepareAndFinalize`` subclass."""

    prepare: Any

    def prepare_external(
        self,
        hidden_states: torch.Tensor,
        routing: ExternalRouting,
        *,
        replace_allreduce: bool = False,
        quant_type: Any = None,
    ) -> tuple[Any, ExternalRouting]:
        kwargs: dict[str, Any] = {"replace_allreduce": replace_allreduce}
        if quant_type is not None:
            kwargs["quant_type"] = quant_type
        return prepare_external_with(self.prepare, hidden_states, routing, **kwargs)


@functools.cache
def ascend_prepare_finalize_classes() -> tuple[type, type]:
    """``(AFDPrepareAndFinalizeWithAllGather, AFDPrepareAndFinalizeWithMC2)``."""
    require_vllm_ascend("AFD external-routing prepare/finalize")
    from vllm_ascend.ops.fused_moe.prepare_finalize import (
        PrepareAndFinalizeWithAllGather,
        PrepareAndFinalizeWithMC2,
    )

    all_gather = type(
        "AFDPrepareAndFinalizeWithAllGather",
        (_PrepareExternal, PrepareAndFinalizeWithAllGather),
        {"__module__": __name__, "__doc__": "All-gather prepare/finalize + prepare_external."},
    )
    mc2 = type(
        "AFDPrepareAndFinalizeWithMC2",
        (_PrepareExternal, PrepareAndFinalizeWithMC2),
        {"__module__": __name__, "__doc__": "MC2 prepare/finalize + prepare_external."},
    )
    return all_gather, mc2


@functools.cache
def ascend_comm_classes() -> tuple[type, type]:
    """``(AFDAllGatherCommImpl, AFDMC2CommImpl)``: only ``_get_prepare_finalize`` differs."""
    require_vllm_ascend("AFD external-routing comm implementations")
    from vllm_ascend.ops.fused_moe.moe_comm_method import AllGatherCommImpl, MC2CommImpl

    all_gather_pf, mc2_pf = ascend_prepare_finalize_classes()

    def all_gather_prepare_finalize(self: Any) -> Any:
        return all_gather_pf(self.moe_config)

    def mc2_prepare_finalize(self: Any) -> Any:
        return mc2_pf(self.moe_config)

    all_gather = type(
        "AFDAllGatherCommImpl",
        (AllGatherCommImpl,),
        {"__module__": __name__, "_get_prepare_finalize": all_gather_prepare_finalize},
    )
    mc2 = type(
        "AFDMC2CommImpl",
        (MC2CommImpl,),
        {"__module__": __name__, "_get_prepare_finalize": mc2_prepare_finalize},
    )
    return all_gather, mc2


def ascend_comm_type_of(comm: Any) -> Hashable | None:
    """The ``MoECommType`` of a comm instance (None for one external routing cannot use)."""
    from vllm_ascend.ascend_forward_context import MoECommType
    from vllm_ascend.ops.fused_moe.moe_comm_method import (
        AllGatherCommImpl,
        AlltoAllCommImpl,
        FusedMC2CommImpl,
        MC2CommImpl,
    )

    # Most specific first: a later revision may derive fused MC2 from MC2.
    for cls, comm_type in (
        (FusedMC2CommImpl, MoECommType.FUSED_MC2),
        (MC2CommImpl, MoECommType.MC2),
        (AlltoAllCommImpl, MoECommType.ALLTOALL),
        (AllGatherCommImpl, MoECommType.ALLGATHER),
    ):
        if isinstance(comm, cls):
            return comm_type
    return None


class AscendCommSlot:
    """The forward context's MoE comm, read and written through ``_EXTRA_CTX``."""

    @property
    def comm_type(self) -> Hashable | None:
        from vllm_ascend.ascend_forward_context import _EXTRA_CTX

        value = _EXTRA_CTX.moe_comm_type
        return value if isinstance(value, Hashable) else None

    @property
    def comm_method(self) -> Any:
        from vllm_ascend.ascend_forward_context import _EXTRA_CTX

        return _EXTRA_CTX.moe_comm_method

    @comm_method.setter
    def comm_method(self, value: Any) -> None:
        from vllm_ascend.ascend_forward_context import _EXTRA_CTX

        _EXTRA_CTX.moe_comm_method = value


class AscendExpertsApply:
    """Routed experts of an ``AscendRoutedExperts`` on prepared rows, aligned routing.

    The quant method reads the MC2 mask and per-token scale from the layer; they are
    set for the call and cleared again by :meth:`release`.
    """

    def __init__(self, routed_experts: Any) -> None:
        self.routed_experts = routed_experts

    def apply(self, prepared: Any, routing: ExternalRouting) -> torch.Tensor:
        experts = self.routed_experts
        experts.ascend_mc2_mask = getattr(prepared, "mc2_mask", None)
        experts.ascend_pertoken_scale = getattr(prepared, "pertoken_scale", None)
        result = experts.quant_method.apply(
            layer=experts,
            x=prepared.hidden_states,
            topk_weights=routing.topk_weights,
            topk_ids=routing.topk_ids,
            shared_experts=None,
            shared_experts_input=None,
        )
        routed = getattr(result, "routed_out", result)
        assert isinstance(routed, torch.Tensor)
        return routed

    def release(self) -> None:
        self.routed_experts.ascend_mc2_mask = None
        self.routed_experts.ascend_pertoken_scale = None


def build_ascend_external_routing_moe(
    routed_experts: Any, *, reduce_results: bool = True
) -> ExternalRoutingMoE:
    """The FFN-role external-routing component of one layer (call at model init).

    ``routed_experts`` is the layer's ``AscendRoutedExperts`` (``runner.routed_experts``,
    accessed directly so an upstream rename fails as an ``AttributeError``).
    """
    from vllm_ascend.ascend_forward_context import MoECommType

    all_gather, mc2 = ascend_comm_classes()
    moe_config = routed_experts.moe_config
    return ExternalRoutingMoE(
        {
            MoECommType.ALLGATHER: all_gather(moe_config),
            MoECommType.MC2: mc2(moe_config),
        },
        AscendExpertsApply(routed_experts),
        AscendCommSlot(),
        comm_type_of=ascend_comm_type_of,
        reduce_results=reduce_results,
        layer_name=f"FFN-role MoE layer {routed_experts.layer_name!r}",
    )


def ascend_external_routing_layers(
    runners: Mapping[int, Any | None], *, reduce_results: bool = True
) -> dict[int, ExternalRoutingMoE]:
    """One :func:`build_ascend_external_routing_moe` per MoE layer (``None``: dense layer)."""
    require_vllm_ascend("the FFN role's external routing (CAMP2p, gate on Attention)")
    return {
        idx: build_ascend_external_routing_moe(runner.routed_experts, reduce_results=reduce_results)
        for idx, runner in runners.items()
        if runner is not None
    }
