"""Which CAM deployments are supported, checked at start-up with one-line, actionable errors.

Pure functions over plain values; nothing here imports torch or vLLM (the platform
is read from vLLM only when :func:`shape_from_vllm_config` is not told it).

Rules for the CAM connectors (:data:`CAM_CONNECTORS`):

* they run only on the Ascend platform (vLLM device type ``"npu"``);
* ``afd.routing_payload`` must be ``'topk'`` (CAM carries no router logits);
* CAMAsync needs ``afd.compute_gate_on_attention=true`` (it dispatches top-k routing);
* CAMP2p with the Attention-side gate (``compute_gate_on_attention=true``) is supported
  for DeepSeek-V4 (``DeepseekV4ForCausalLM``) only, with tensor parallel size 1, without
  DBO and without micro-batching (vLLM ``--ubatch-size`` > 1 or ``afd.num_micro_batches`` > 1);
* graph modes: vllm-ascend captures ACL graphs by default, and no CAM transport has
  been shown to be capturable (its operators run between graph pieces on the host, as
  the exchange does on CUDA, or inside a captured graph): the Attention role runs eager
  (``--enforce-eager``) until a CAM transport declares itself capturable
  (:data:`GRAPH_CAPTURABLE_CONNECTORS`, empty today);
* every rank agrees on the settings in :func:`handshake_digest`: the connectors' ``init()``
  runs afd-core's connect phase, whose admission compares the deployment fingerprint
  (connector, topology, gate placement, routing payload, the model) plus
  :func:`admission_settings` with attention rank 0's, and checks the token
  (``afd.auth_token``) like every other transport; :func:`check_roles_agree` compares
  two configs directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from afd_core.config import AFDConfig, AFDRole, RoutingPayload
from afd_core.errors import AFDConfigError

__all__ = [
    "CAMP2P",
    "CAMASYNC",
    "CAM_CONNECTORS",
    "ASCEND_PLATFORM",
    "GATE_ON_ATTENTION_ARCHITECTURES",
    "GRAPH_CAPTURABLE_CONNECTORS",
    "NPUDeploymentShape",
    "shape_from_vllm_config",
    "validate_npu_deployment",
    "handshake_digest",
    "admission_settings",
    "compare_digests",
    "check_roles_agree",
]

CAMP2P = "CAMP2pAFDConnector"
CAMASYNC = "CAMAsyncAFDConnector"
CAM_CONNECTORS = frozenset({CAMP2P, CAMASYNC})
ASCEND_PLATFORM = "npu"
GATE_ON_ATTENTION_ARCHITECTURES = frozenset({"DeepseekV4ForCausalLM"})
"""Native architectures for which CAMP2p's Attention-side gate is supported."""
GRAPH_CAPTURABLE_CONNECTORS: frozenset[str] = frozenset()
"""CAM connectors whose exchange may run under an ACL graph (none has been shown to)."""

_AFD_ARCH_PREFIX = "AFD"  # --hf-overrides selects "AFD<Arch>" wrappers of native models


@dataclass(frozen=True, slots=True)
class NPUDeploymentShape:
    """The parts of a vLLM deployment the CAM rules look at."""

    platform: str
    """vLLM's device type: ``"npu"`` on Ascend, ``"cuda"``, ``"cpu"``..."""
    architecture: str
    """The model's architecture, e.g. ``"DeepseekV4ForCausalLM"`` (an ``AFD`` prefix is ignored)."""
    tensor_parallel_size: int = 1
    enable_dbo: bool = False
    num_ubatches: int = 0
    """vLLM's ``parallel_config.ubatch_size`` (0 or 1: no micro-batching)."""
    graph_mode: str = "NONE"
    """The graph mode this engine runs: ``"NONE"`` when eager (``--enforce-eager``) or when
    ``compilation_config.cudagraph_mode`` is NONE, else that mode's name (on Ascend the
    ACL graph mode vllm-ascend captures)."""

    @property
    def native_architecture(self) -> str:
        arch = self.architecture
        if arch.startswith(_AFD_ARCH_PREFIX) and arch[len(_AFD_ARCH_PREFIX) :][:1].isupper():
            return arch[len(_AFD_ARCH_PREFIX) :]
        return arch


def _detect_platform() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def shape_from_vllm_config(vllm_config: Any, *, platform: str | None = None) -> NPUDeploymentShape:
    """Read the shape from a vLLM 0.32 ``VllmConfig`` (duck-typed).

    Reads ``model_config.architectures`` (else ``model_config.hf_config.architectures``),
    ``parallel_config.tensor_parallel_size``, ``.enable_dbo`` and ``.ubatch_size``.
    ``platform`` defaults to ``vllm.platforms.current_platform.device_type``.
    """
    model_config = vllm_config.model_config
    archs = getattr(model_config, "architectures", None)
    if not archs:
        archs = getattr(getattr(model_config, "hf_config", None), "architectures", None)
    parallel = vllm_config.parallel_config
    graphs = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    graph_mode = "NONE" if graphs is None else str(getattr(graphs, "name", graphs))
    if getattr(model_config, "enforce_eager", False):
        graph_mode = "NONE"
    return NPUDeploymentShape(
        platform=_detect_platform() if platform is None else platform,
        architecture=str(archs[0]) if archs else "",
        tensor_parallel_size=int(getattr(parallel, "tensor_parallel_size", 1)),
        enable_dbo=bool(getattr(parallel, "enable_dbo", False)),
        num_ubatches=int(getattr(parallel, "ubatch_size", 0) or 0),
        graph_mode=graph_mode,
    )


def validate_npu_deployment(afd_config: AFDConfig, shape: NPUDeploymentShape) -> None:
    """Raise :class:`AFDConfigError` if a CAM ``afd.connector`` runs in an unsupported shape.

    Other connectors are not checked here.
    """
    name = afd_config.connector
    if name not in CAM_CONNECTORS:
        return
    if shape.platform != ASCEND_PLATFORM:
        raise AFDConfigError(
            f"afd.connector={name!r} needs the Ascend platform (vllm-ascend, device type "
            f"'npu'), this process runs on {shape.platform!r}; set afd.connector to "
            "'P2pGlooAFDConnector' (CPU) or 'P2pNcclAFDConnector' (CUDA), or run on Ascend"
        )
    if afd_config.routing_payload is not RoutingPayload.TOPK:
        raise AFDConfigError(
            f"afd.routing_payload={afd_config.routing_payload.value!r} is not carried by "
            f"{name}; set afd.routing_payload='topk'"
        )
    if (
        afd_config.role is AFDRole.ATTENTION
        and shape.graph_mode != "NONE"
        and name not in GRAPH_CAPTURABLE_CONNECTORS
    ):
        raise AFDConfigError(
            f"the Attention role would run ACL graphs (cudagraph_mode {shape.graph_mode}, "
            f"vllm-ascend's default), but {name} has not been shown to be capturable: its "
            "exchange would be captured once and replayed without its host-side transfer, "
            "or be fed the memory a capture leaves behind; start the Attention role with "
            "--enforce-eager (or cudagraph_mode NONE)"
        )
    if name == CAMASYNC:
        if not afd_config.compute_gate_on_attention:
            raise AFDConfigError(
                f"afd.compute_gate_on_attention is false but {name} dispatches top-k routing "
                "computed on the Attention role; set afd.compute_gate_on_attention=true"
            )
        return
    if not afd_config.compute_gate_on_attention:
        return
    gate = "with afd.compute_gate_on_attention=true"
    arch = shape.native_architecture
    if arch not in GATE_ON_ATTENTION_ARCHITECTURES:
        raise AFDConfigError(
            f"{name} {gate} supports only {sorted(GATE_ON_ATTENTION_ARCHITECTURES)}, the model "
            f"is {shape.architecture or 'unknown'!r}; set afd.compute_gate_on_attention=false"
        )
    if shape.tensor_parallel_size != 1:
        raise AFDConfigError(
            f"{name} {gate} supports only tensor parallel size 1, got "
            f"--tensor-parallel-size={shape.tensor_parallel_size}; set --tensor-parallel-size=1 "
            "or afd.compute_gate_on_attention=false"
        )
    if shape.enable_dbo:
        raise AFDConfigError(
            f"{name} {gate} does not support DBO, got --enable-dbo; remove --enable-dbo or set "
            "afd.compute_gate_on_attention=false"
        )
    if shape.num_ubatches > 1:
        raise AFDConfigError(
            f"{name} {gate} does not support ubatching, got --ubatch-size={shape.num_ubatches}; "
            "remove --ubatch-size or set afd.compute_gate_on_attention=false"
        )
    if afd_config.num_micro_batches > 1:
        raise AFDConfigError(
            f"{name} {gate} does not support micro-batching, got afd.num_micro_batches="
            f"{afd_config.num_micro_batches}; set afd.num_micro_batches=1 or "
            "afd.compute_gate_on_attention=false"
        )


# Settings both roles must agree on, in the order a mismatch is reported.
_AGREED = (
    "connector",
    "compute_gate_on_attention",
    "routing_payload",
    "num_micro_batches",
    "num_attention_ranks",
    "num_ffn_ranks",
)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(getattr(value, "value", value))


def handshake_digest(config: AFDConfig) -> dict[str, str]:
    """The settings both roles of a CAM deployment must agree on (all strings)."""
    return {key: _text(getattr(config, key)) for key in _AGREED}


def admission_settings(config: AFDConfig) -> dict[str, str]:
    """The CAM settings every rank must agree on beyond afd-core's fingerprint fields
    (:func:`afd_core.admission.config_fields` already holds the connector, the topology,
    the gate placement and the routing payload): compared at admission."""
    return {"num_micro_batches": _text(config.num_micro_batches)}


def _who(key: tuple[AFDRole, int], same_role: bool) -> str:
    role, rank = key
    return f"{role.value} rank {rank}" if same_role else f"{role.value} role"


def compare_digests(
    own: tuple[AFDRole, int], digests: Mapping[tuple[AFDRole, int], Mapping[str, str]]
) -> None:
    """Raise :class:`AFDConfigError` naming the first setting that differs from ``own``'s."""
    mine = digests[own]
    for key in _AGREED:
        for other in sorted(digests, key=lambda k: (k[0] is not own[0], k[0].value, k[1])):
            if other == own:
                continue
            theirs = digests[other].get(key)
            if theirs != mine.get(key):
                same = other[0] is own[0]
                raise AFDConfigError(
                    f"afd.{key} is {mine.get(key)} on the {_who(own, same)} but {theirs} on the "
                    f"{_who(other, same)}; set the same value on both "
                    f"{'ranks' if same else 'roles'}"
                )


def check_roles_agree(attention: AFDConfig, ffn: AFDConfig) -> None:
    """Compare the Attention role's and the FFN role's configs (what the handshake checks)."""
    if attention.role is not AFDRole.ATTENTION or ffn.role is not AFDRole.FFN:
        raise AFDConfigError(
            f"check_roles_agree: expected an attention and an ffn config, got "
            f"{attention.role.value} and {ffn.role.value}"
        )
    compare_digests(
        (AFDRole.ATTENTION, 0),
        {
            (AFDRole.ATTENTION, 0): handshake_digest(attention),
            (AFDRole.FFN, 0): handshake_digest(ffn),
        },
    )
