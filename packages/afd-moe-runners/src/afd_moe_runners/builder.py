"""Which runner a layer gets: the one place that maps (platform, connector, gate placement).

A model wrapper asks :func:`afd_runner_kwargs` for the extra ``FusedMoEFactory``
arguments of its role and passes them with the model's usual ones; or it calls
:func:`build_afd_moe` / :func:`afd_moe_factory` (a drop-in for ``FusedMoEFactory``).

==========  ===================================  ==========================================
role        compute_gate_on_attention            factory kwargs
==========  ===================================  ==========================================
ffn         either                               none: vLLM's native runner and experts
attention   false (gate on FFN)                  RemoteExpertsRunner + RemoteRoutedExperts
attention   true  (gate on Attention)            ExternalRoutingRunner + RemoteRoutedExperts
==========  ===================================  ==========================================

The Attention-role runners are accepted only on the (platform, connector) pairs in
:data:`SUPPORTED_CONNECTORS`; per-layer features they cannot honour (Attention-side
EPLB, redundant experts, routed-expert capture, a non-finite routed scaling
factor...) are rejected when the layer is built, by the runner classes themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from afd_core.config import AFDConfig, AFDRole
from afd_core.errors import AFDConfigError

if TYPE_CHECKING:
    from afd_moe_runners.exchange import MicroBatchYield

__all__ = [
    "SUPPORTED_CONNECTORS",
    "ANY_PLATFORM_CONNECTORS",
    "afd_runner_kwargs",
    "build_afd_moe",
    "afd_moe_factory",
    "current_platform_name",
]

SUPPORTED_CONNECTORS: Mapping[str, frozenset[str]] = {
    "cpu": frozenset({"P2pGlooAFDConnector", "P2pShmAFDConnector"}),
    "cuda": frozenset({"P2pNcclAFDConnector"}),
}
"""Platform (vLLM ``device_type``) -> connectors the Attention-role runners work with."""

ANY_PLATFORM_CONNECTORS = frozenset({"LoopbackAFDConnector"})
"""In-process connectors (afd_core.testing) accepted on every platform."""

_FACTORY_KWARGS = ("runner_cls", "runner_args", "routed_experts_cls", "routed_experts_args")


def current_platform_name() -> str:
    """vLLM's ``current_platform.device_type`` (``"cpu"``, ``"cuda"``, ``"npu"``...)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def _check_supported(platform: str, connector: str) -> None:
    if connector in ANY_PLATFORM_CONNECTORS:
        return
    if platform == "npu":
        raise AFDConfigError(
            f"AFD MoE runners: platform 'npu' (connector {connector!r}) is not supported by "
            "afd-moe-runners; Ascend Attention roles need runners derived from vLLM-Ascend's "
            "AscendMoERunner. Use a CPU or CUDA Attention role"
        )
    supported = SUPPORTED_CONNECTORS.get(platform)
    if supported is None:
        raise AFDConfigError(
            f"AFD MoE runners: platform {platform!r} is not supported; supported platforms: "
            f"{sorted(SUPPORTED_CONNECTORS)}"
        )
    if connector not in supported:
        raise AFDConfigError(
            f"AFD MoE runners: connector {connector!r} is not supported on platform "
            f"{platform!r}; set additional_config.afd.connector to one of {sorted(supported)}"
        )


def afd_runner_kwargs(
    afd_config: AFDConfig,
    *,
    role: AFDRole | str | None = None,
    platform: str | None = None,
    micro_batch_yield: MicroBatchYield | None = None,
) -> dict[str, Any]:
    """Extra ``FusedMoEFactory`` keyword arguments for this role's MoE layers.

    ``role`` defaults to ``afd_config.role``; ``platform`` to vLLM's current platform.
    The FFN role gets ``{}`` (it runs vLLM's native runner). ``micro_batch_yield`` is
    the hook the Attention runners call between send and receive.
    """
    role = AFDRole(role) if role is not None else afd_config.role
    if role is AFDRole.FFN:
        return {}
    platform = platform if platform is not None else current_platform_name()
    _check_supported(platform, afd_config.connector)

    from afd_moe_runners.remote_experts import RemoteRoutedExperts

    runner_args: dict[str, Any] = {"micro_batch_yield": micro_batch_yield}
    runner_cls: type
    if afd_config.compute_gate_on_attention:
        from afd_moe_runners.external_routing_runner import ExternalRoutingRunner

        runner_cls = ExternalRoutingRunner
        runner_args["routing_payload"] = afd_config.routing_payload
    else:
        from afd_moe_runners.remote_runner import RemoteExpertsRunner

        runner_cls = RemoteExpertsRunner
    return {
        "runner_cls": runner_cls,
        "runner_args": runner_args,
        "routed_experts_cls": RemoteRoutedExperts,
    }


def build_afd_moe(
    afd_config: AFDConfig,
    *,
    role: AFDRole | str | None = None,
    platform: str | None = None,
    micro_batch_yield: MicroBatchYield | None = None,
    factory: Callable[..., Any] | None = None,
    **factory_kwargs: Any,
) -> Any:
    """``FusedMoEFactory(**factory_kwargs)`` with this role's AFD runner and experts.

    ``factory`` is the factory to call (default: vLLM's ``FusedMoEFactory``); a model
    wrapper passes the name its model module calls.
    """
    clash = sorted(k for k in _FACTORY_KWARGS if factory_kwargs.get(k) is not None)
    if clash:
        raise AFDConfigError(
            f"{factory_kwargs.get('prefix', 'build_afd_moe')}: {clash} are chosen by AFD from "
            "the role and afd config; the model must not pass them (call vLLM's "
            "FusedMoEFactory directly for a custom runner)"
        )
    for key in _FACTORY_KWARGS:
        factory_kwargs.pop(key, None)
    if AFDRole(role if role is not None else afd_config.role) is AFDRole.ATTENTION:
        # Shared experts live on the FFN role in both gate placements: it returns their
        # output next to the routed output (FFNToAttention.shared_output) when the gate
        # runs on Attention, and inside the final block output when it runs on FFN.
        factory_kwargs["shared_experts"] = None
    if factory is None:
        from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

        factory = FusedMoEFactory
    extra = afd_runner_kwargs(
        afd_config, role=role, platform=platform, micro_batch_yield=micro_batch_yield
    )
    return factory(**factory_kwargs, **extra)


def afd_moe_factory(
    afd_config: AFDConfig,
    *,
    role: AFDRole | str | None = None,
    platform: str | None = None,
    micro_batch_yield: MicroBatchYield | None = None,
    factory: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """A callable with ``FusedMoEFactory``'s signature that builds this role's AFD layer."""
    return functools.partial(
        build_afd_moe,
        afd_config,
        role=role,
        platform=platform,
        micro_batch_yield=micro_batch_yield,
        factory=factory,
    )
