"""Which runner a layer gets: the one place that maps (platform, connector, gate placement).

A model wrapper asks :func:`afd_runner_kwargs` for the extra ``FusedMoEFactory``
arguments of its role and passes them with the model's usual ones; or it calls
:func:`build_afd_moe` / :func:`afd_moe_factory` (a drop-in for ``FusedMoEFactory``).

The connector decides through the capabilities its class declares
(:class:`afd_core.connector.ConnectorCapabilities`, read through the registry), never
by its name:

=========  =====================================  =========================================
role       connector capabilities                 factory kwargs
=========  =====================================  =========================================
ffn        any                                    none: the platform's native runner, experts
attention  generic runners, gate on FFN           RemoteExpertsRunner + RemoteRoutedExperts
attention  generic runners, gate on Attention     ExternalRoutingRunner + RemoteRoutedExperts
attention  ``platform_runners`` on npu, gate FFN  AFDNPURemoteExpertsRunner + remote experts
attention  ``platform_runners`` on npu, gate Att  AFDNPUAttentionGateRunner + remote experts
=========  =====================================  =========================================

Dense (non-MoE) layers (:func:`dense_layers_on_attention`): the FFN role computes them
(the Attention role sends their input as a hidden-states-only payload), except with a
connector that does not carry that payload (CAMAsync carries top-k dispatches only):
the Attention role then builds, loads and runs them itself, and the FFN role does not
build them.

Shared experts (:func:`shared_experts_on_attention`): the FFN role computes them (with
the gate on Attention it returns their output separately), except with a connector
declaring ``shared_experts_on_attention`` on its platform's runners with the gate on
Attention (Ascend's CAM connectors): they then run on the Attention role, between send
and receive, and the FFN role computes routed experts only.

A connector is accepted on the platforms and gate placements it declares; per-layer
features the runners cannot honour (Attention-side EPLB, redundant experts,
routed-expert capture, a non-finite routed scaling factor...) are rejected when the
layer is built, by the runner classes themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from afd_core.config import AFDConfig, AFDRole, RoutingPayload
from afd_core.connector import AFDConnector, ConnectorCapabilities
from afd_core.errors import AFDConfigError
from afd_core.registry import get_connector_class
from afd_core.transfer import PayloadKind

if TYPE_CHECKING:
    from afd_moe_runners.exchange import MicroBatchYield

__all__ = [
    "capabilities",
    "connector_class",
    "afd_runner_kwargs",
    "build_afd_moe",
    "afd_moe_factory",
    "current_platform_name",
    "shared_experts_on_attention",
    "dense_layers_on_attention",
    "ffn_external_routing",
]

_FACTORY_KWARGS = ("runner_cls", "runner_args", "routed_experts_cls", "routed_experts_args")
_RUNNER_KWARGS = ("runner_cls", "runner_args")


def current_platform_name() -> str:
    """vLLM's ``current_platform.device_type`` (``"cpu"``, ``"cuda"``, ``"npu"``...)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


@functools.lru_cache(maxsize=8)
def connector_class(name: str) -> type[AFDConnector]:
    """The connector class registered as ``name``, looked up once per process: the
    builders below ask for it at every MoE layer. (A test that re-registers a name with
    another class calls ``connector_class.cache_clear()``.)"""
    return get_connector_class(name)


def capabilities(afd_config: AFDConfig) -> ConnectorCapabilities:
    """What ``afd.connector`` declares it supports (its class looked up once per process)."""
    return connector_class(afd_config.connector).capabilities


def _check_supported(platform: str, afd_config: AFDConfig) -> None:
    caps = capabilities(afd_config)
    if not caps.supports_platform(platform):
        raise AFDConfigError(
            f"AFD MoE runners: connector {afd_config.connector!r} is not supported on "
            f"platform {platform!r} (it supports {caps.describe_platforms()}); set "
            "additional_config.afd.connector to a connector for this platform"
        )


def _check_gate(afd_config: AFDConfig) -> None:
    caps = capabilities(afd_config)
    gate = "attention" if afd_config.compute_gate_on_attention else "ffn"
    if gate not in caps.gate_placements:
        raise AFDConfigError(
            f"AFD MoE runners: connector {afd_config.connector!r} does not support the gate "
            f"on {gate} (afd.compute_gate_on_attention="
            f"{str(afd_config.compute_gate_on_attention).lower()}); it supports the gate on "
            f"{' or '.join(sorted(caps.gate_placements))}"
        )


def _uses_platform_runners(platform: str, afd_config: AFDConfig) -> bool:
    # The platform's own runners exist on Ascend only (vLLM-Ascend).
    return platform == "npu" and capabilities(afd_config).platform_runners


def shared_experts_on_attention(afd_config: AFDConfig, *, platform: str | None = None) -> bool:
    """Whether the Attention role computes the shared experts (else the FFN role does).

    True only on Ascend with the gate on Attention (CAMP2p or CAMAsync): the Attention
    role runs gate + shared experts and the FFN role the routed experts alone. Both
    roles must agree; the FFN side passes this to ``FFNLayerCompute``.
    """
    if not afd_config.compute_gate_on_attention:
        return False
    platform = platform if platform is not None else current_platform_name()
    return _uses_platform_runners(platform, afd_config) and (
        capabilities(afd_config).shared_experts_on_attention
    )


def dense_layers_on_attention(afd_config: AFDConfig) -> bool:
    """Whether the Attention role computes the dense (non-MoE) layers (else the FFN role).

    True when the connector does not carry hidden states alone
    (:meth:`~afd_core.connector.ConnectorCapabilities.carries` ``PayloadKind.HIDDEN``),
    which a remote dense layer would send: CAMAsync. Both roles must agree; the
    Attention role builds and loads those layers natively, the FFN role builds none of
    them and refuses a request for one.
    """
    return not capabilities(afd_config).carries(PayloadKind.HIDDEN)


def ffn_external_routing(
    afd_config: AFDConfig, layers: Mapping[int, Any], *, platform: str | None = None
) -> dict[int, Any] | None:
    """The FFN role's per-layer external-routing components, or None where not needed.

    Only Ascend's synchronous CAMP2p with the gate on Attention needs them: there the
    received top-k goes through vLLM-Ascend's comm framework
    (:func:`afd_moe_runners.npu.ascend.ascend_external_routing_layers`). ``layers`` maps
    layer index -> FFN block, as given to ``FFNLayerCompute``.
    """
    if not (afd_config.compute_gate_on_attention and capabilities(afd_config).ffn_external_routing):
        return None
    platform = platform if platform is not None else current_platform_name()
    if not _uses_platform_runners(platform, afd_config):
        return None
    from afd_moe_runners.ffn_compute import find_moe_runner
    from afd_moe_runners.npu.ascend import ascend_external_routing_layers

    return ascend_external_routing_layers(
        {idx: find_moe_runner(block) for idx, block in layers.items()}
    )


def _npu_runner_kwargs(
    afd_config: AFDConfig, micro_batch_yield: MicroBatchYield | None
) -> dict[str, Any]:
    # The connector's start-up check (run just before) has accepted the combination:
    # CAMAsync only with the gate on Attention, top-k payloads only.
    gate_on_attention = afd_config.compute_gate_on_attention
    from afd_moe_runners.npu.runners import npu_runner_classes

    classes = npu_runner_classes()
    runner_args: dict[str, Any] = {"micro_batch_yield": micro_batch_yield}
    if gate_on_attention:
        runner_cls = classes.attention_gate_runner
        runner_args["routing_payload"] = RoutingPayload.TOPK
    else:
        runner_cls = classes.remote_experts_runner
    return {
        "runner_cls": runner_cls,
        "runner_args": runner_args,
        "routed_experts_cls": classes.routed_experts,
    }


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
    _check_supported(platform, afd_config)
    if _uses_platform_runners(platform, afd_config):
        # vLLM-Ascend builds the model (no afd wrapper ran check_supported_parallelism):
        # the connector's start-up check runs here, at the first MoE layer.
        from vllm.config import get_current_vllm_config

        connector_cls = connector_class(afd_config.connector)
        connector_cls.check_deployment(afd_config, get_current_vllm_config(), platform=platform)
        _check_gate(afd_config)
        return _npu_runner_kwargs(afd_config, micro_batch_yield)
    _check_gate(afd_config)

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
    # A model's own routed-experts class (gpt-oss passes one) is for the FFN role, which
    # builds the layer natively; on the Attention role AFD's weightless experts replace it.
    clash = sorted(k for k in _RUNNER_KWARGS if factory_kwargs.get(k) is not None)
    if clash:
        raise AFDConfigError(
            f"{factory_kwargs.get('prefix', 'build_afd_moe')}: {clash} are chosen by AFD from "
            "the role and afd config; the model must not pass them (call vLLM's "
            "FusedMoEFactory directly for a custom runner)"
        )
    for key in _FACTORY_KWARGS:
        factory_kwargs.pop(key, None)
    if AFDRole(role if role is not None else afd_config.role) is AFDRole.ATTENTION:
        platform = platform if platform is not None else current_platform_name()
        if not shared_experts_on_attention(afd_config, platform=platform):
            # On cpu/cuda the shared experts live on the FFN role in both gate placements:
            # it returns their output next to the routed output (shared_output) when the
            # gate runs on Attention, and inside the final block output when it runs on
            # FFN. On npu with the gate on Attention they stay here (see the table above).
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
