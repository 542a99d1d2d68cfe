"""Which runner a layer gets, as the role's deployment plan says.

The decisions (runner kind, gate, shared-expert and dense-layer placement) are made once
per role, at start-up, into a :class:`~afd_moe_runners.deployment_plan.DeploymentPlan`
(:func:`~afd_moe_runners.deployment_plan.resolve_plan`); the factories here read it for
every MoE layer and decide nothing again. A model wrapper asks :func:`afd_runner_kwargs`
for the extra ``FusedMoEFactory`` arguments of its role and passes them with the
model's usual ones; or it calls :func:`build_afd_moe` / :func:`afd_moe_factory` (a
drop-in for ``FusedMoEFactory``).

The connector decides, when the plan is resolved, through the capabilities its class
declares (:class:`afd_core.connector.ConnectorCapabilities`), never by its name:

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

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from afd_core.config import AFDConfig, AFDRole
from afd_core.errors import AFDConfigError
from afd_moe_runners.deployment_plan import (
    DeploymentPlan,
    RunnerKind,
    capabilities,
    connector_class,
    current_platform_name,
    dense_layers_placement,
    resolve_plan,
    shared_experts_placement,
)

if TYPE_CHECKING:
    from afd_moe_runners.exchange import MicroBatchYield

logger = logging.getLogger(__name__)

__all__ = [
    "capabilities",
    "connector_class",
    "afd_runner_kwargs",
    "build_afd_moe",
    "afd_moe_factory",
    "current_platform_name",
    "runner_kwargs",
    "shared_experts_on_attention",
    "dense_layers_on_attention",
    "ffn_external_routing",
]

_FACTORY_KWARGS = ("runner_cls", "runner_args", "routed_experts_cls", "routed_experts_args")
_RUNNER_KWARGS = ("runner_cls", "runner_args")


def _plan(
    source: AFDConfig | DeploymentPlan,
    *,
    role: AFDRole | str | None = None,
    platform: str | None = None,
) -> DeploymentPlan:
    """``source`` itself when it is a plan (``role`` / ``platform``, when given, must be
    its own), else the plan resolved from the AFD config."""
    if not isinstance(source, DeploymentPlan):
        return resolve_plan(source, role=role, platform=platform)
    if role is not None and AFDRole(role) is not source.role:
        raise AFDConfigError(
            f"AFD MoE runners: asked for the {AFDRole(role).value} role with the deployment "
            f"plan of the {source.role.value} role; resolve a plan for that role"
        )
    if platform is not None and platform != source.platform:
        raise AFDConfigError(
            f"AFD MoE runners: asked for platform {platform!r} with a deployment plan "
            f"resolved for {source.platform!r}; resolve a plan for that platform"
        )
    return source


def shared_experts_on_attention(afd_config: AFDConfig, *, platform: str | None = None) -> bool:
    """Whether the Attention role computes the shared experts (else the FFN role does).

    True only on Ascend with the gate on Attention (CAMP2p or CAMAsync): the Attention
    role runs gate + shared experts and the FFN role the routed experts alone. Both
    roles must agree; the FFN side passes this to ``FFNLayerCompute``. (The plan's
    ``shared_experts``; a role model holds its plan as ``afd_deployment``.)
    """
    return shared_experts_placement(afd_config, platform) is AFDRole.ATTENTION


def dense_layers_on_attention(afd_config: AFDConfig) -> bool:
    """Whether the Attention role computes the dense (non-MoE) layers (else the FFN role).

    True when the connector does not carry hidden states alone
    (:meth:`~afd_core.connector.ConnectorCapabilities.carries` ``PayloadKind.HIDDEN``),
    which a remote dense layer would send: CAMAsync. Both roles must agree; the
    Attention role builds and loads those layers natively, the FFN role builds none of
    them and refuses a request for one. (The plan's ``dense_layers``.)
    """
    return dense_layers_placement(afd_config) is AFDRole.ATTENTION


def ffn_external_routing(
    afd_config: AFDConfig | DeploymentPlan,
    layers: Mapping[int, Any],
    *,
    platform: str | None = None,
) -> dict[int, Any] | None:
    """The FFN role's per-layer external-routing components, or None where not needed.

    Only Ascend's synchronous CAMP2p with the gate on Attention needs them (the plan's
    ``ffn_external_routing``): there the received top-k goes through vLLM-Ascend's comm
    framework (:func:`afd_moe_runners.npu.ascend.ascend_external_routing_layers`).
    ``layers`` maps layer index -> FFN block, as given to ``FFNLayerCompute``.
    """
    plan = _plan(afd_config, role=AFDRole.FFN, platform=platform)
    if not plan.ffn_external_routing:
        return None
    from afd_moe_runners.ffn_compute import find_moe_runner
    from afd_moe_runners.npu.ascend import ascend_external_routing_layers

    return ascend_external_routing_layers(
        {idx: find_moe_runner(block) for idx, block in layers.items()}
    )


def runner_kwargs(
    plan: DeploymentPlan, micro_batch_yield: MicroBatchYield | None = None
) -> dict[str, Any]:
    """The ``FusedMoEFactory`` keyword arguments of the plan's runner kind (``{}`` for
    the FFN role's native runner). ``micro_batch_yield`` is the hook the Attention
    runners call between send and receive."""
    if plan.runner is RunnerKind.NATIVE:
        return {}
    runner_args: dict[str, Any] = {"micro_batch_yield": micro_batch_yield}
    if plan.routing_payload is not None:
        runner_args["routing_payload"] = plan.routing_payload
    runner_cls: type
    experts_cls: type
    if plan.runner in (RunnerKind.NPU_ATTENTION_GATE, RunnerKind.NPU_REMOTE_EXPERTS):
        from afd_moe_runners.npu.runners import npu_runner_classes

        classes = npu_runner_classes()
        runner_cls = (
            classes.attention_gate_runner
            if plan.runner is RunnerKind.NPU_ATTENTION_GATE
            else classes.remote_experts_runner
        )
        experts_cls = classes.routed_experts
    else:
        from afd_moe_runners.remote_experts import RemoteRoutedExperts

        experts_cls = RemoteRoutedExperts
        if plan.runner is RunnerKind.EXTERNAL_ROUTING:
            from afd_moe_runners.external_routing_runner import ExternalRoutingRunner

            runner_cls = ExternalRoutingRunner
        else:
            from afd_moe_runners.remote_runner import RemoteExpertsRunner

            runner_cls = RemoteExpertsRunner
    return {"runner_cls": runner_cls, "runner_args": runner_args, "routed_experts_cls": experts_cls}


def afd_runner_kwargs(
    afd_config: AFDConfig | DeploymentPlan,
    *,
    role: AFDRole | str | None = None,
    platform: str | None = None,
    micro_batch_yield: MicroBatchYield | None = None,
) -> dict[str, Any]:
    """Extra ``FusedMoEFactory`` keyword arguments for this role's MoE layers.

    ``afd_config``: the role's AFD config (its plan is resolved here) or its resolved
    plan. ``role`` defaults to the config's role; ``platform`` to vLLM's current
    platform. The FFN role gets ``{}`` (it runs vLLM's native runner).
    """
    return runner_kwargs(_plan(afd_config, role=role, platform=platform), micro_batch_yield)


def build_planned_moe(
    plan: DeploymentPlan,
    *,
    micro_batch_yield: MicroBatchYield | None = None,
    factory: Callable[..., Any] | None = None,
    **factory_kwargs: Any,
) -> Any:
    """``factory(**factory_kwargs)`` with the plan's runner and experts (one MoE layer)."""
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
    if plan.role is AFDRole.ATTENTION and not plan.shared_experts_on_attention:
        # On cpu/cuda the shared experts live on the FFN role in both gate placements:
        # it returns their output next to the routed output (shared_output) when the
        # gate runs on Attention, and inside the final block output when it runs on
        # FFN. On npu with the gate on Attention they stay here (see the table above).
        factory_kwargs["shared_experts"] = None
    if factory is None:
        from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

        factory = FusedMoEFactory
    return factory(**factory_kwargs, **runner_kwargs(plan, micro_batch_yield))


def build_afd_moe(
    afd_config: AFDConfig | DeploymentPlan,
    *,
    role: AFDRole | str | None = None,
    platform: str | None = None,
    micro_batch_yield: MicroBatchYield | None = None,
    factory: Callable[..., Any] | None = None,
    **factory_kwargs: Any,
) -> Any:
    """``FusedMoEFactory(**factory_kwargs)`` with this role's AFD runner and experts.

    ``afd_config``: the role's AFD config (its plan resolved for this one layer) or its
    resolved plan. ``factory`` is the factory to call (default: vLLM's
    ``FusedMoEFactory``); a model wrapper passes the name its model module calls. A
    model's layers go through :func:`afd_moe_factory`, which resolves the plan once.
    """
    plan = _plan(afd_config, role=role, platform=platform)
    return build_planned_moe(
        plan, micro_batch_yield=micro_batch_yield, factory=factory, **factory_kwargs
    )


class _PlannedFactory:
    """``FusedMoEFactory``'s signature; the plan resolved at the first layer (inside the
    model's construction, under its vLLM config), then read for every layer."""

    def __init__(
        self,
        source: AFDConfig | DeploymentPlan,
        role: AFDRole | str | None,
        platform: str | None,
        micro_batch_yield: MicroBatchYield | None,
        factory: Callable[..., Any] | None,
    ) -> None:
        self._source = source
        self._role = role
        self._platform = platform
        self._plan_value = source if isinstance(source, DeploymentPlan) else None
        if self._plan_value is not None:
            _plan(source, role=role, platform=platform)  # role / platform agree
        self.micro_batch_yield = micro_batch_yield
        self.factory = factory

    @property
    def plan(self) -> DeploymentPlan:
        if self._plan_value is None:
            self._plan_value = _plan(self._source, role=self._role, platform=self._platform)
            logger.info("%s", self._plan_value.describe())
        return self._plan_value

    def __call__(self, **factory_kwargs: Any) -> Any:
        return build_planned_moe(
            self.plan,
            micro_batch_yield=self.micro_batch_yield,
            factory=self.factory,
            **factory_kwargs,
        )


def afd_moe_factory(
    afd_config: AFDConfig | DeploymentPlan,
    *,
    role: AFDRole | str | None = None,
    platform: str | None = None,
    micro_batch_yield: MicroBatchYield | None = None,
    factory: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """A callable with ``FusedMoEFactory``'s signature that builds this role's AFD layer.

    Given an AFD config it resolves the role's plan once, at its first layer (and logs
    it); given a plan (a role model's start-up) it uses that one.
    """
    return _PlannedFactory(afd_config, role, platform, micro_batch_yield, factory)
