"""Attention-role MoE runners for Ascend: the shared AFD forwards on ``AscendMoERunner``.

The NPU runners are the GPU runners' forwards mixed into vLLM-Ascend's
``AscendMoERunner`` instead of vLLM's ``MoERunner``; nothing else differs:

``AFDNPURemoteExpertsRunner = RemoteExpertsForward + AscendMoERunner``
    CAMP2p, gate on FFN: send hidden states, yield, receive the final block output.
``AFDNPUAttentionGateRunner = ExternalRoutingForward + AscendMoERunner``
    CAMAsync, and CAMP2p with ``compute_gate_on_attention=true``: the native gate and
    ``router.select_experts`` run here, the top-k ids (int32) and weights (float32) go
    straight to the connector's send (CAMAsync's send is its async dispatch), the
    layer's shared experts run here between send and receive, no local expert runs,
    and the receive returns the weighted, combined routed output; routed scaling,
    top-k weighting, the shared add and the final reduction each happen once.

The classes are composed on first use (:func:`npu_runner_classes`), because
``vllm_ascend`` is importable only on Ascend hosts; the composition itself
(:func:`compose_runner`) takes any ``MoERunner`` subclass, which is how it is tested
on CPU with vLLM's own ``MoERunner``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

from afd_moe_runners.external_routing_runner import ExternalRoutingForward
from afd_moe_runners.npu._ascend_compat import require_vllm_ascend
from afd_moe_runners.remote_experts import RemoteRoutedExperts
from afd_moe_runners.remote_runner import RemoteExpertsForward

__all__ = [
    "AscendRunnerSeams",
    "NPURunnerClasses",
    "ascend_runner_seams",
    "compose_runner",
    "npu_runner_classes",
    "REMOTE_EXPERTS_RUNNER_NAME",
    "ATTENTION_GATE_RUNNER_NAME",
]

REMOTE_EXPERTS_RUNNER_NAME = "AFDNPURemoteExpertsRunner"
ATTENTION_GATE_RUNNER_NAME = "AFDNPUAttentionGateRunner"
_FORWARDS = {
    REMOTE_EXPERTS_RUNNER_NAME: RemoteExpertsForward,
    ATTENTION_GATE_RUNNER_NAME: ExternalRoutingForward,
}


@functools.cache
def compose_runner(forward: type, base: type, name: str) -> type:
    """``class name(forward, base)``, with no body of its own (cached per arguments)."""
    if not issubclass(forward, tuple(_FORWARDS.values())):
        raise TypeError(f"{forward.__name__} is not an AFD runner forward mixin")
    if not (isinstance(base, type) and issubclass(base, MoERunner)):
        raise TypeError(f"{base!r} is not a vLLM MoERunner subclass")
    return type(
        name,
        (forward, base),
        {"__module__": __name__, "__doc__": f"{forward.__name__} on {base.__name__}."},
    )


@dataclass(frozen=True)
class AscendRunnerSeams:
    """What the NPU runners take from vLLM-Ascend."""

    moe_runner_cls: type
    """``vllm_ascend.ops.fused_moe.fused_moe.AscendMoERunner``."""
    quant_type: Any = None
    """``QuantType.NONE``: ``AscendMoERunner.__init__`` reads ``routed_experts.quant_type``."""


def ascend_runner_seams() -> AscendRunnerSeams:
    """Import vLLM-Ascend's runner base (raises ``ImportError`` with the fix without it)."""
    require_vllm_ascend("the NPU MoE runners (platform 'npu')")
    from vllm_ascend.ops.fused_moe.fused_moe import AscendMoERunner
    from vllm_ascend.quantization.quant_type import QuantType

    return AscendRunnerSeams(AscendMoERunner, QuantType.NONE)


@functools.cache
def _remote_routed_experts(quant_type: Any) -> type:
    if quant_type is None:
        return RemoteRoutedExperts
    # Parameter-free experts, plus the one attribute AscendMoERunner reads from them.
    return type(
        "AFDNPURemoteRoutedExperts",
        (RemoteRoutedExperts,),
        {"__module__": __name__, "quant_type": quant_type},
    )


@dataclass(frozen=True)
class NPURunnerClasses:
    remote_experts_runner: type
    """``AFDNPURemoteExpertsRunner`` (gate on FFN)."""
    attention_gate_runner: type
    """``AFDNPUAttentionGateRunner`` (gate on Attention)."""
    routed_experts: type
    """Parameter-free routed experts for both runners."""


def npu_runner_classes(seams: AscendRunnerSeams | None = None) -> NPURunnerClasses:
    """The NPU runner classes on ``seams`` (default: :func:`ascend_runner_seams`)."""
    seams = seams if seams is not None else ascend_runner_seams()
    base = seams.moe_runner_cls
    return NPURunnerClasses(
        remote_experts_runner=compose_runner(
            RemoteExpertsForward, base, REMOTE_EXPERTS_RUNNER_NAME
        ),
        attention_gate_runner=compose_runner(
            ExternalRoutingForward, base, ATTENTION_GATE_RUNNER_NAME
        ),
        routed_experts=_remote_routed_experts(seams.quant_type),
    )


def __getattr__(name: str) -> Any:
    if name == REMOTE_EXPERTS_RUNNER_NAME:
        return npu_runner_classes().remote_experts_runner
    if name == ATTENTION_GATE_RUNNER_NAME:
        return npu_runner_classes().attention_gate_runner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
