"""One role's deployment plan: every placement decision of an AFD process, made once.

A role model (or the FFN server, or a model vLLM-Ascend builds with
:func:`afd_moe_runners.afd_moe_factory`) decides at start-up, from the role's
``AFDConfig``, the vLLM config and the platform, what runs where:

* where the router (gate) runs, and so which runner the Attention role's MoE layers get
  (:class:`RunnerKind`; the FFN role runs vLLM's native runner);
* where the shared experts and the dense (non-MoE) layers run, as the connector's
  declared capabilities decide (:class:`afd_core.connector.ConnectorCapabilities`,
  never its name);
* the layout: this process's rank, the engine's tensor-parallel size and worker, the
  attention ranks, the FFN ranks and FFN expert parallelism;
* micro-batching (``num_micro_batches``) and the graph mode the Attention role's engine
  runs (:class:`GraphMode`).

:func:`resolve_plan` makes these decisions into a frozen :class:`DeploymentPlan`; the
factories, the runners' arguments, the role's construction, its parameter inventory
and its connector lifecycle read the plan instead of deciding again.
:meth:`DeploymentPlan.describe` is the one log line per role.

Nothing here imports torch; vLLM only where a value has to be read from it.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Any

from afd_core.config import AFDConfig, AFDRole, RoutingPayload
from afd_core.connector import AFDConnector, ConnectorCapabilities
from afd_core.errors import AFDConfigError
from afd_core.registry import get_connector_class
from afd_core.transfer import PayloadKind

__all__ = [
    "DeploymentPlan",
    "GraphMode",
    "RunnerKind",
    "capabilities",
    "connector_class",
    "current_platform_name",
    "dense_layers_placement",
    "graph_mode_of",
    "resolve_plan",
    "shared_experts_placement",
]


class RunnerKind(enum.StrEnum):
    """The MoE runner a role's layers get (:mod:`afd_moe_runners.builder`)."""

    NATIVE = "native"
    """FFN role: the platform's own runner computes the experts."""
    REMOTE_EXPERTS = "remote-experts"
    """Attention role, gate on FFN: hidden states out, the block output back."""
    EXTERNAL_ROUTING = "external-routing"
    """Attention role, gate on Attention: hidden states and routing out."""
    NPU_REMOTE_EXPERTS = "npu-remote-experts"
    """Ascend's runner base, gate on FFN (connectors with ``platform_runners``)."""
    NPU_ATTENTION_GATE = "npu-attention-gate"
    """Ascend's runner base, gate (and shared experts) on Attention."""


class GraphMode(enum.StrEnum):
    """How the role's engine runs its model forward (docs/architecture.md, "Compiled
    execution")."""

    EAGER = "eager"
    """``--enforce-eager``, the FFN role's server loop, or no compilation."""
    COMPILED = "compiled"
    """torch.compile without CUDA graphs: the exchange is one opaque custom op."""
    PIECEWISE = "piecewise"
    """Piecewise CUDA graphs, split at the exchange op."""
    FULL = "full"
    """A CUDA graph of the whole forward (refused at start-up)."""
    BREAKABLE = "breakable"
    """vLLM's breakable CUDA graphs (refused at start-up)."""
    PLATFORM = "platform"
    """A platform whose connectors decide (Ascend: ``check_deployment``)."""


# Platforms whose compile / graph settings afd decides; others (Ascend) decide in their
# connectors.
_GRAPH_PLATFORMS = frozenset({"cpu", "cuda", "rocm"})
# CUDA graph modes that would capture a whole forward (decode or all batches), exchange
# included: AFD's connectors run host code per layer, which a replayed graph skips.
_FULL_GRAPH_MODES = frozenset({"FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"})


@dataclass(frozen=True)
class DeploymentPlan:
    """What one AFD process runs where (see the module docstring).

    Placements are the role that computes the part (:class:`AFDRole`).
    """

    role: AFDRole
    platform: str
    connector: str
    gate: AFDRole
    runner: RunnerKind
    routing_payload: RoutingPayload | None
    """What the Attention role sends as routing (gate on Attention), else None."""
    shared_experts: AFDRole
    dense_layers: AFDRole
    ffn_external_routing: bool
    """FFN role: received top-k goes through the platform's comm flow (CAMP2p, npu)."""
    rank: int
    tensor_parallel_size: int
    tensor_parallel_rank: int
    data_parallel_size: int
    num_ffn_ranks: int
    ffn_expert_parallel: bool
    num_micro_batches: int
    graph_mode: GraphMode

    @property
    def gate_on_attention(self) -> bool:
        return self.gate is AFDRole.ATTENTION

    @property
    def shared_experts_on_attention(self) -> bool:
        return self.shared_experts is AFDRole.ATTENTION

    @property
    def dense_layers_on_attention(self) -> bool:
        return self.dense_layers is AFDRole.ATTENTION

    @property
    def micro_batched(self) -> bool:
        """The Attention role splits steps into micro-batches."""
        return self.role is AFDRole.ATTENTION and self.num_micro_batches > 1

    def describe(self) -> str:
        """One readable line (logged once per role at start-up)."""
        payload = f"/{self.routing_payload.value}" if self.routing_payload is not None else ""
        experts = (
            f"expert-parallel x{self.num_ffn_ranks}"
            if self.ffn_expert_parallel
            else f"ffn ranks {self.num_ffn_ranks}"
        )
        return (
            f"AFD {self.role.value} rank {self.rank} plan: {self.connector} on {self.platform}; "
            f"gate on {self.gate.value}{payload}; runner {self.runner.value}; shared experts "
            f"on {self.shared_experts.value}; dense layers on {self.dense_layers.value}"
            f"{'; ffn external routing' if self.ffn_external_routing else ''}; tp "
            f"{self.tensor_parallel_rank}/{self.tensor_parallel_size}; dp "
            f"{self.data_parallel_size}; {experts}; micro-batches {self.num_micro_batches}; "
            f"graphs {self.graph_mode.value}"
        )


def current_platform_name() -> str:
    """vLLM's ``current_platform.device_type`` (``"cpu"``, ``"cuda"``, ``"npu"``...)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


@functools.lru_cache(maxsize=8)
def connector_class(name: str) -> type[AFDConnector]:
    """The connector class registered as ``name``, looked up once per process. (A test
    that re-registers a name with another class calls ``connector_class.cache_clear()``.)"""
    return get_connector_class(name)


def capabilities(afd_config: AFDConfig) -> ConnectorCapabilities:
    """What ``afd.connector`` declares it supports (its class looked up once per process)."""
    return connector_class(afd_config.connector).capabilities


def _breakable_cuda_graphs() -> bool:
    import vllm.envs as envs

    return bool(envs.VLLM_USE_BREAKABLE_CUDAGRAPH)


def graph_mode_of(vllm_config: Any, platform: str) -> GraphMode:
    """The graph mode an engine with ``vllm_config`` runs its forward in on ``platform``."""
    if platform not in _GRAPH_PLATFORMS:
        return GraphMode.PLATFORM
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "enforce_eager", False):
        return GraphMode.EAGER
    cc = getattr(vllm_config, "compilation_config", None)
    graphs = getattr(cc, "cudagraph_mode", None)
    name = "NONE" if graphs is None else str(getattr(graphs, "name", graphs))
    if name == "NONE":
        mode = getattr(cc, "mode", None)
        compiled = mode is not None and str(getattr(mode, "name", mode)) != "NONE"
        return GraphMode.COMPILED if compiled else GraphMode.EAGER
    if _breakable_cuda_graphs():
        return GraphMode.BREAKABLE
    return GraphMode.FULL if name in _FULL_GRAPH_MODES else GraphMode.PIECEWISE


def _uses_platform_runners(platform: str, afd_config: AFDConfig) -> bool:
    # The platform's own runners exist on Ascend only (vLLM-Ascend).
    return platform == "npu" and capabilities(afd_config).platform_runners


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


def shared_experts_placement(afd_config: AFDConfig, platform: str | None = None) -> AFDRole:
    """The role computing the shared experts: the Attention role only with the
    platform's own runners, the gate there, and a connector declaring it (Ascend's CAM
    connectors); else the FFN role. ``platform``: default vLLM's current platform."""
    if not afd_config.compute_gate_on_attention:
        return AFDRole.FFN
    platform = platform if platform is not None else current_platform_name()
    here = _uses_platform_runners(platform, afd_config) and (
        capabilities(afd_config).shared_experts_on_attention
    )
    return AFDRole.ATTENTION if here else AFDRole.FFN


def dense_layers_placement(afd_config: AFDConfig) -> AFDRole:
    """The role computing the dense (non-MoE) layers: the Attention role when the
    connector does not carry hidden states alone (CAMAsync), else the FFN role."""
    here = not capabilities(afd_config).carries(PayloadKind.HIDDEN)
    return AFDRole.ATTENTION if here else AFDRole.FFN


def _runner(role: AFDRole, platform_runners: bool, gate_on_attention: bool) -> RunnerKind:
    if role is AFDRole.FFN:
        return RunnerKind.NATIVE
    if platform_runners:
        return RunnerKind.NPU_ATTENTION_GATE if gate_on_attention else RunnerKind.NPU_REMOTE_EXPERTS
    return RunnerKind.EXTERNAL_ROUTING if gate_on_attention else RunnerKind.REMOTE_EXPERTS


def _current_vllm_config() -> Any:
    """vLLM's current config, or None outside ``set_current_vllm_config``."""
    from vllm.config import get_current_vllm_config

    try:
        return get_current_vllm_config()
    except AssertionError:  # vLLM 0.32: "Current vLLM config is not set"
        return None


def _tensor_parallel_rank(size: int) -> int:
    if size == 1:
        return 0
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def resolve_plan(
    afd_config: AFDConfig,
    vllm_config: Any = None,
    *,
    role: AFDRole | str | None = None,
    platform: str | None = None,
) -> DeploymentPlan:
    """Decide what runs where for ``role`` (default ``afd_config.role``) on ``platform``
    (default: vLLM's current platform) under ``vllm_config`` (default: vLLM's current
    config; without one, the layout is one eager process), once per role at start-up.

    The Attention role is refused here, with a one-line reason, on a platform or gate
    placement its connector does not declare. With the platform's own runners (Ascend;
    vLLM-Ascend builds the model, so no afd start-up check ran) the connector's
    ``check_deployment`` runs here too.
    """
    role = AFDRole(role) if role is not None else afd_config.role
    platform = platform if platform is not None else current_platform_name()
    if vllm_config is None:
        vllm_config = _current_vllm_config()
    caps = capabilities(afd_config)
    platform_runners = _uses_platform_runners(platform, afd_config)
    if role is AFDRole.ATTENTION:
        _check_supported(platform, afd_config)
        if platform_runners:
            if vllm_config is None:
                from vllm.config import get_current_vllm_config

                vllm_config = get_current_vllm_config()  # raises, naming the fix
            connector_class(afd_config.connector).check_deployment(
                afd_config, vllm_config, platform=platform
            )
        _check_gate(afd_config)
    gate_on_attention = afd_config.compute_gate_on_attention
    routing: RoutingPayload | None = None
    if gate_on_attention:
        routing = RoutingPayload.TOPK if platform_runners else afd_config.routing_payload
    # Without a vLLM config (blocks built directly, as in unit tests): one process.
    pc = getattr(vllm_config, "parallel_config", None)
    tp = int(getattr(pc, "tensor_parallel_size", 1))
    rank = afd_config.rank
    if rank is None:
        rank = int(getattr(pc, "data_parallel_rank", 0))
    graph_mode = GraphMode.EAGER  # the FFN role's server computes its blocks eagerly
    if role is AFDRole.ATTENTION and vllm_config is not None:
        graph_mode = graph_mode_of(vllm_config, platform)
    return DeploymentPlan(
        role=role,
        platform=platform,
        connector=afd_config.connector,
        gate=AFDRole.ATTENTION if gate_on_attention else AFDRole.FFN,
        runner=_runner(role, platform_runners, gate_on_attention),
        routing_payload=routing,
        shared_experts=shared_experts_placement(afd_config, platform),
        dense_layers=dense_layers_placement(afd_config),
        ffn_external_routing=(
            role is AFDRole.FFN
            and gate_on_attention
            and caps.ffn_external_routing
            and platform_runners
        ),
        rank=int(rank),
        tensor_parallel_size=tp,
        tensor_parallel_rank=_tensor_parallel_rank(tp),
        data_parallel_size=int(getattr(pc, "data_parallel_size", 1)),
        num_ffn_ranks=afd_config.num_ffn_ranks,
        ffn_expert_parallel=afd_config.ffn_expert_parallel,
        num_micro_batches=afd_config.num_micro_batches,
        graph_mode=graph_mode,
    )
