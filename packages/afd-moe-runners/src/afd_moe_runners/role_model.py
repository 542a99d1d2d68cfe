"""Model-independent support for role-aware AFD model wrappers.

A model package (afd-models-deepseek, afd-models-qwen) builds vLLM's native model for
one role and needs the same handful of things regardless of the family: the role's
``AFDConfig``, the FusedMoE factory kwargs for the Attention role, parameter-free
stand-ins, the Attention-side connector and per-step forward-context metadata, and a
parameter-inventory check after loading. They live here once.

Over 400 lines: a known debt, not a design. The start-up checks (compile mode, model
runner, micro-batching) could be a module of their own; left for a later clean-up.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.models.utils import PPMissingLayer, extract_layer_index

from afd_core.config import AFDConfig, AFDRole
from afd_core.config import afd_config_of as _afd_config_of
from afd_core.connector import AFDConnector
from afd_core.errors import (
    AFDConfigError,
    AFDPeerLostError,
    AFDTimeoutError,
    AFDTransferMismatchError,
)
from afd_core.forward_context import AFDStepMetadata, set_step_metadata
from afd_core.lifecycle import record_exit_reason
from afd_core.registry import create_connector
from afd_core.weights import RoleWeightStats, WeightOwner, filter_role_weights
from afd_moe_runners.dense import RemoteDenseMLP
from afd_moe_runners.exchange import no_yield, scheduler_yield
from afd_moe_runners.metrics import attention_peers_changed, attention_step_ended
from afd_moe_runners.model_runner_choice import model_runner_problem
from afd_moe_runners.worker_table import is_micro_batch_worker, micro_batch_worker

logger = logging.getLogger(__name__)

__all__ = [
    "AFDRoleModel",
    "NoAttention",
    "NoGate",
    "NoLMHead",
    "RemoteDenseMLP",
    "RoleRuntime",
    "afd_config_of",
    "attention_factory",
    "expert_shard_factory",
    "check_supported_parallelism",
    "tensor_parallel_problem",
    "compiled_graph_problem",
    "real_token_count",
    "micro_batching_problem",
    "model_runner_check",
    "layer_index",
    "no_yield",
    "scheduler_yield",
    "parameter_inventory",
    "reject_unsupported_options",
    "role_identity",
]


def afd_config_of(vllm_config: VllmConfig) -> AFDConfig:
    """The validated ``additional_config["afd"]`` of an AFD model; clear error if absent."""
    afd = _afd_config_of(vllm_config)  # parsed once per process
    if afd is None:
        raise AFDConfigError(
            "an AFD model architecture was selected but additional_config has no 'afd' "
            'section; pass --additional-config \'{"afd": {"role": "attention", ...}}\''
        )
    return afd


def check_supported_parallelism(vllm_config: VllmConfig, model_name: str) -> None:
    """Reject parallel layouts this AFD runtime does not implement yet, before building.

    The configured connector checks the deployment first
    (:meth:`afd_core.connector.AFDConnector.check_deployment`): its message names the
    connector's own limits.
    """
    afd = afd_config_of(vllm_config)
    from afd_moe_runners.builder import connector_class

    connector_class(afd.connector).check_deployment(afd, vllm_config)
    model_runner_check(vllm_config, afd.role.value, model_name)
    if afd.role is AFDRole.ATTENTION:
        problem = compiled_graph_problem(vllm_config, _current_device_type(), model_name)
        if problem is not None:
            raise AFDConfigError(problem)
    pc = vllm_config.parallel_config
    if afd.role is AFDRole.ATTENTION and afd.num_micro_batches > 1:
        problem = micro_batching_problem(vllm_config, afd.num_micro_batches)
        if problem is not None:
            raise AFDConfigError(f"{model_name}: {problem}")
    problem = tensor_parallel_problem(afd, int(pc.tensor_parallel_size))
    if problem is not None:
        raise AFDConfigError(f"{model_name}: {problem}")
    for name, value in (("pipeline_parallel_size", pc.pipeline_parallel_size),):
        if value != 1:
            raise AFDConfigError(
                f"{model_name}: {name}={value} is not supported by afd yet (each AFD rank "
                f"is one process); scale with afd.num_attention_ranks / afd.num_ffn_ranks "
                f"and set {name}=1"
            )
    if pc.enable_eplb:
        raise AFDConfigError(f"{model_name}: EPLB is not supported by afd yet; disable it")


def model_runner_check(vllm_config: Any, role: str, model_name: str) -> None:
    """Refuse an engine that runs vLLM's V2 model runner (its CUDA default), on every
    platform (:mod:`afd_moe_runners.model_runner_choice`). The AFD worker checks the same
    before it sets ``ubatch_size`` (which turns its own copy of the config to V1)."""
    problem = model_runner_problem(bool(vllm_config.use_v2_model_runner), role=role)
    if problem is not None:
        raise AFDConfigError(f"{model_name}: {problem}")


def tensor_parallel_problem(afd: AFDConfig, tensor_parallel_size: int) -> str | None:
    """Why this role cannot run with vLLM's ``tensor_parallel_size``, or None.

    The Attention role may be tensor-parallel (TP worker 0 of each attention rank
    exchanges, :mod:`afd_moe_runners.tensor_parallel`); micro-batching is not combined
    with it yet. The FFN role is one process per rank (``tensor_parallel_size=1``).
    ``afd.attention_tensor_parallel_size``, when set on the Attention role, must be the
    engine's own size (the FFN role reads it to know what to admit).
    """
    tp = tensor_parallel_size
    if afd.role is AFDRole.FFN:
        if tp != 1:
            return (
                f"tensor_parallel_size={tp} is not supported on the AFD FFN role (each FFN "
                "rank is one process); set tensor_parallel_size=1 and scale the FFN side "
                "with afd.num_ffn_ranks"
            )
        return None
    if afd.attention_tensor_parallel_size not in (1, tp):
        return (
            f"afd.attention_tensor_parallel_size={afd.attention_tensor_parallel_size} but "
            f"the Attention engine runs tensor_parallel_size={tp}; make them agree (the "
            "Attention role uses its engine's --tensor-parallel-size)"
        )
    if tp > 1 and afd.num_micro_batches > 1:
        return (
            f"afd.num_micro_batches={afd.num_micro_batches} with tensor_parallel_size={tp} "
            "is not supported yet; set afd.num_micro_batches=1 or tensor_parallel_size=1"
        )
    return None


def micro_batching_problem(vllm_config: Any, num_micro_batches: int) -> str | None:
    """Why this Attention engine cannot run ``num_micro_batches`` > 1, or None."""
    worker = str(getattr(vllm_config.parallel_config, "worker_cls", ""))
    if not is_micro_batch_worker(worker):
        # the runtime registers its workers (afd_moe_runners.worker_table)
        device = _current_device_type()
        wanted = micro_batch_worker(device)
        if wanted is None:
            return (
                f"afd.num_micro_batches={num_micro_batches} is not supported on {device} "
                "yet; set afd.num_micro_batches=1"
            )
        return (
            f"afd.num_micro_batches={num_micro_batches} needs the AFD worker, which "
            f"splits each step into micro-batches: start the Attention role with "
            f"--worker-cls {wanted} (afd serve and afd launch add it), got worker_cls="
            f"{worker!r}"
        )
    if getattr(vllm_config, "speculative_config", None) is not None:
        return (
            f"afd.num_micro_batches={num_micro_batches} cannot be combined with "
            "speculative decoding yet; set afd.num_micro_batches=1 or drop the "
            "speculative config"
        )
    return None


# Platforms whose compile / graph settings afd decides here; others (Ascend) decide in
# their connectors.
_GRAPH_PLATFORMS = frozenset({"cpu", "cuda", "rocm"})
# CUDA graph modes that would capture a whole forward (decode or all batches), exchange
# included: AFD's connectors run host code per layer (headers, deadlines, polling), which
# a replayed graph skips.
_FULL_GRAPH_MODES = frozenset({"FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"})


def _breakable_cuda_graphs() -> bool:
    import vllm.envs as envs

    return bool(envs.VLLM_USE_BREAKABLE_CUDAGRAPH)


def _current_device_type() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def compiled_graph_problem(vllm_config: Any, platform: str, model_name: str) -> str | None:
    """Why the Attention role cannot run this engine's compile / CUDA-graph settings on
    ``platform`` (vLLM's device type), or None. May add the exchange op to
    ``compilation_config.splitting_ops`` (piecewise CUDA graphs).

    The decision matrix (docs/architecture.md, "Compiled execution"):

    * eager (``--enforce-eager``): every platform.
    * torch.compile (any ``CompilationMode``): cpu, cuda, rocm. The exchange is one
      opaque custom op (:mod:`afd_moe_runners.exchange_op`) in the compiled graph.
    * CUDA graphs: ``PIECEWISE`` only, split at the exchange op (added to
      ``splitting_ops`` here): the pieces between two exchanges are captured, the
      exchange runs eagerly between them and writes into the output the piece before it
      allocated (:mod:`afd_moe_runners.exchange_op`). ``FULL``, ``FULL_DECODE_ONLY`` and
      ``FULL_AND_PIECEWISE`` (vLLM's CUDA default) are refused, naming the mode to use;
      so are breakable CUDA graphs (``VLLM_USE_BREAKABLE_CUDAGRAPH=1``, which vLLM also
      switches on for ``VLLM_BATCH_INVARIANT=1`` and some architectures): they capture
      the whole forward, exchange included.
    * other platforms (Ascend): their connectors decide (``check_deployment``; the CAM
      connectors refuse ACL graphs).
    """
    if platform not in _GRAPH_PLATFORMS:
        return None
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "enforce_eager", False):
        return None
    cc = getattr(vllm_config, "compilation_config", None)
    graphs = getattr(cc, "cudagraph_mode", None)
    graph_mode = "NONE" if graphs is None else str(getattr(graphs, "name", graphs))
    if graph_mode == "NONE":
        return None
    if _breakable_cuda_graphs():
        return (
            f"{model_name}: VLLM_USE_BREAKABLE_CUDAGRAPH=1 (breakable CUDA graphs; vLLM "
            "also turns them on for VLLM_BATCH_INVARIANT=1 and some architectures) is not "
            "supported by afd: it captures the whole forward, the per-layer AFD exchange "
            "included, whose connector runs host code every layer. Set "
            "VLLM_USE_BREAKABLE_CUDAGRAPH=0 (afd then splits piecewise graphs at the "
            "exchange) or start the Attention role with --enforce-eager"
        )
    if graph_mode in _FULL_GRAPH_MODES:
        return (
            f"{model_name}: CUDA graph mode {graph_mode} is not supported by afd on "
            f"{platform}: a full graph would capture the per-layer AFD exchange, whose "
            "connector runs host code every layer. Start the Attention role with "
            '--compilation-config \'{"cudagraph_mode": "PIECEWISE"}\' (graphs between '
            "the exchanges; afd serve and afd launch set it) or --enforce-eager"
        )
    from afd_moe_runners.exchange_op import SPLITTING_OP

    ops = getattr(cc, "splitting_ops", None)
    if ops is None or SPLITTING_OP not in ops:
        cc.splitting_ops = [*(ops or []), SPLITTING_OP]
        logger.info("AFD: piecewise CUDA graphs split at %s", SPLITTING_OP)
    return None


def layer_index(prefix: str) -> int:
    return int(extract_layer_index(prefix))


def attention_factory(afd: AFDConfig, native_factory: Any) -> Any:
    """A stand-in for a model module's ``FusedMoEFactory`` name that builds the Attention
    role's AFD layer (see :func:`afd_moe_runners.builder.build_afd_moe`)."""
    from afd_moe_runners.builder import afd_moe_factory

    return afd_moe_factory(afd, role=AFDRole.ATTENTION, factory=native_factory)


def expert_shard_factory(afd: AFDConfig, vllm_config: VllmConfig, native_factory: Any) -> Any:
    """A stand-in for a model module's ``FusedMoEFactory`` name on an FFN rank under FFN
    expert parallelism: the native layer with this rank's routed experts only
    (:class:`afd_moe_runners.expert_shard.ExpertShardRoutedExperts`)."""
    from afd_moe_runners.expert_shard import shard_routed_experts_kwargs

    rank = afd.rank if afd.rank is not None else vllm_config.parallel_config.data_parallel_rank
    extra = shard_routed_experts_kwargs(int(rank), afd.num_ffn_ranks)

    def factory(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("routed_experts_cls") is not None:
            raise AFDConfigError(
                f"{kwargs.get('prefix', 'a MoE layer')}: the model builds its experts with its "
                f"own class {kwargs['routed_experts_cls'].__name__}, which afd cannot shard; "
                "this model cannot use afd.ffn_expert_parallel (start one FFN rank per "
                "expert set instead)"
            )
        kwargs.pop("routed_experts_cls", None)
        kwargs.pop("routed_experts_args", None)
        return native_factory(*args, **kwargs, **extra)

    return factory


class NoAttention(nn.Module):
    """FFN-role placeholder for an attention module: no parameters, no KV cache."""

    def __init__(self, *args: Any, prefix: str = "", **kwargs: Any) -> None:
        super().__init__()
        self.prefix = prefix

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError(
            f"{self.prefix}: attention does not run on the AFD FFN role; the FFN server "
            "computes FFN blocks only (use afd_ffn_blocks())"
        )


class NoLMHead(PPMissingLayer):
    """FFN-role LM head placeholder; ``tie_weights`` is a no-op (nothing to tie)."""

    def tie_weights(self, embed_tokens: nn.Module) -> NoLMHead:
        return self


class NoGate(nn.Module):
    """Attention-role stand-in for a MoE block's router when the gate runs on FFN.

    Blocks that call their gate themselves (``router_logits, _ = self.gate(x)``, then
    ``self.experts(x, router_logits)``) get the hidden states back as the placeholder
    logits, as vLLM's own blocks that hand the gate to the runner pass them; the
    Attention-role runner sends the hidden states only.
    """

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x, None


def reject_unsupported_options(
    vllm_config: Any, model_name: str, *, multimodal_capable: bool = False
) -> None:
    """Fail before any module is built for options the AFD split does not implement.

    ``multimodal_capable``: the native architecture has a vision tower; AFD serves its
    text model only, so ``--language-model-only`` (no image/video input) is required.
    """
    pc = vllm_config.parallel_config
    if getattr(pc, "enable_eplb", False):
        raise AFDConfigError(f"{model_name}: EPLB is not supported by afd; disable it")
    if getattr(pc, "use_sequence_parallel_moe", False):
        raise AFDConfigError(
            f"{model_name}: sequence-parallel MoE (all2all_backend={pc.all2all_backend!r} "
            "with data/expert parallelism) is not supported by afd; each AFD role computes "
            "its MoE layers on whole token batches"
        )
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise AFDConfigError(
            f"{model_name}: speculative decoding (incl. MTP) is not supported by afd; remove "
            "--speculative-config"
        )
    if getattr(vllm_config, "lora_config", None) is not None:
        raise AFDConfigError(
            f"{model_name}: LoRA is not supported by afd (adapters would have to be split "
            "across the Attention and FFN roles); remove --enable-lora"
        )
    if multimodal_capable:
        mm = getattr(vllm_config.model_config, "multimodal_config", None)
        if mm is not None and not getattr(mm, "language_model_only", False):
            raise AFDConfigError(
                f"{model_name}: multimodal input is not supported by afd; the AFD wrapper "
                "serves the text model only. Pass --language-model-only (image/video "
                "inputs disabled, the vision tower is not built)"
            )


_CATEGORIES = (
    ("attention", (".self_attn.", ".linear_attn.", ".attn.")),
    ("routed_experts", (".experts.",)),
    ("shared_experts", (".shared_experts.", ".shared_expert.", ".shared_expert_gate.")),
    ("gate", (".mlp.gate.",)),
    ("embedding", ("embed_tokens.", "lm_head.")),
    ("dense_mlp", (".mlp.",)),
)


def parameter_inventory(model: nn.Module) -> dict[str, int]:
    """Number of parameters (tensors, not elements) per category of a model."""
    counts: Counter[str] = Counter()
    for name, _ in model.named_parameters():
        dotted = f".{name}"
        for category, markers in _CATEGORIES:
            if any(m in dotted for m in markers):
                counts[category] += 1
                break
        else:
            counts["other"] += 1
    counts["total"] = sum(counts.values())
    return dict(counts)


def _forbidden_categories(afd: AFDConfig) -> tuple[str, ...]:
    # Dense layers / shared experts belong to the role that computes them, which the
    # connector's capabilities decide (afd_moe_runners.builder).
    from afd_moe_runners.builder import dense_layers_on_attention, shared_experts_on_attention

    local = {
        "dense_mlp": dense_layers_on_attention(afd),
        "shared_experts": shared_experts_on_attention(afd),
    }
    if afd.role is AFDRole.FFN:
        return ("attention", "embedding", *(c for c, here in local.items() if here))
    forbidden = ["routed_experts", *(c for c, here in local.items() if not here)]
    if not afd.compute_gate_on_attention:
        forbidden.append("gate")
    return tuple(forbidden)


def role_identity(model: nn.Module, vllm_config: VllmConfig, afd: AFDConfig) -> dict[str, str]:
    """The deployment fingerprint of this role's model (compared in the handshake)."""
    from afd_moe_runners.builder import shared_experts_on_attention
    from afd_moe_runners.identity import deployment_identity

    return deployment_identity(
        model, vllm_config, afd, shared_experts_on_attention=shared_experts_on_attention(afd)
    )


# Errors that stop the role; recorded for the server's exit code (afd_core.lifecycle).
_FATAL = (AFDPeerLostError, AFDTimeoutError, AFDTransferMismatchError, AFDConfigError)


class RoleRuntime:
    """Per-process AFD state of one role-aware model: connector, step metadata, checks."""

    def __init__(
        self,
        model: nn.Module,
        afd: AFDConfig,
        vllm_config: VllmConfig,
        *,
        inventory: Callable[[nn.Module], dict[str, int]] = parameter_inventory,
    ) -> None:
        """``inventory``: parameters per category of a model (default: by name markers,
        :func:`parameter_inventory`; the generic path passes its split plan's)."""
        self._model = weakref.ref(model)
        self._inventory = inventory
        self.afd = afd
        self.inventory: dict[str, int] = {}
        self.weight_stats = RoleWeightStats()
        self.connector: AFDConnector | None = None
        self.rank = (
            afd.rank if afd.rank is not None else vllm_config.parallel_config.data_parallel_rank
        )
        self.data_parallel_size = int(vllm_config.parallel_config.data_parallel_size)
        self._text_config = getattr(vllm_config.model_config, "hf_text_config", None)
        self._check_inventory(model, when="construction")
        self.tp_rank, self.tp_size = _tensor_parallel_place(vllm_config)
        if afd.role is AFDRole.ATTENTION:
            self.connector = self._attention_connector(model, vllm_config, afd)
            if self.tp_rank > 0:
                logger.info(
                    "AFD attention rank %d, TP worker %d/%d: takes each FFN answer from TP "
                    "worker 0 (broadcast)",
                    self.rank,
                    self.tp_rank,
                    self.tp_size,
                )
                return
            logger.info(
                "AFD attention rank %d: connecting to the FFN role via %s at %s:%d "
                "(waits up to %.0f s for the FFN server)",
                self.rank,
                afd.connector,
                afd.host,
                afd.port,
                afd.connect_timeout_s,
            )
            try:
                self.connector.init()
            except _FATAL as exc:
                record_exit_reason(f"AFD connector start failed: {type(exc).__name__}: {exc}")
                raise
            atexit.register(self.close)
            logger.info("AFD attention rank %d: connected", self.rank)
            self._peers_changed(connected=True)

    def _attention_connector(
        self, model: nn.Module, vllm_config: VllmConfig, afd: AFDConfig
    ) -> AFDConnector:
        """This worker's connector: the rank's own; under tensor parallelism TP worker
        0's wrapped in a :class:`TensorParallelExchange` (the others hold none)."""
        if self.tp_size == 1:
            return self._rank_connector(model, vllm_config, afd)
        from afd_moe_runners.tensor_parallel import TensorParallelExchange

        inner = None
        if self.tp_rank == 0:
            inner = self._rank_connector(model, vllm_config, afd)
        return TensorParallelExchange(
            afd, rank=self.rank, tp_rank=self.tp_rank, tp_size=self.tp_size, inner=inner
        )

    def _rank_connector(
        self, model: nn.Module, vllm_config: VllmConfig, afd: AFDConfig
    ) -> AFDConnector:
        """The attention rank's exchange with the FFN role: one connector, or with
        ``afd.ffn_expert_parallel`` one per FFN rank (its expert plane) behind an
        :class:`~afd_moe_runners.expert_parallel.ExpertParallelExchange`."""
        identity = role_identity(model, vllm_config, afd)
        if not afd.ffn_expert_parallel:
            return create_connector(afd, rank=self.rank, identity=identity)
        from afd_core.admission import assembling
        from afd_moe_runners.expert_parallel import (
            ExpertParallelExchange,
            has_shared_experts,
            routed_experts_of,
        )

        n = afd.num_ffn_ranks
        # One rendezvous per expert plane, joined one after another: a rank claimed twice
        # at a plane that already assembled stops the planes still waiting (`assembling`).
        with assembling():
            planes = [
                create_connector(
                    afd.expert_plane(f),
                    rank=self.rank,
                    identity={**identity, "expert_shard": f"{f}/{n}"},
                )
                for f in range(n)
            ]
        text = vllm_config.model_config.hf_text_config
        return ExpertParallelExchange(
            afd,
            rank=self.rank,
            planes=planes,
            num_experts=routed_experts_of(text),
            rank0_gets_every_row=has_shared_experts(text),
        )

    @property
    def _counted(self) -> bool:
        # Under tensor parallelism only TP worker 0's exchanges count in the metrics.
        return bool(getattr(self.connector, "records_exchanges", True))

    def _peers_changed(self, *, connected: bool) -> None:
        if self.connector is not None and self._counted:
            attention_peers_changed(self.connector, self.rank, connected=connected)

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()
            self._peers_changed(connected=False)

    def attach_step_metadata(self) -> None:
        """Install this step's AFD metadata in vLLM's forward context (Attention role)."""
        if self.connector is None or not is_forward_context_available():
            return
        set_step_metadata(get_forward_context(), AFDStepMetadata(connector=self.connector))

    def run_forward(self, forward: Any, *args: Any, **kwargs: Any) -> Any:
        """Run the native model ``forward`` for this step, micro-batched when planned.

        The Attention role with ``afd.num_micro_batches`` = m > 1 runs the step as m
        micro-batches (:mod:`afd_moe_runners.micro_batching`) when the model runner
        planned a split, and, with several attention ranks, always (shadow micro-batches
        keep every rank's message sequence the same). Otherwise it runs whole.
        """
        if self.connector is None or not is_forward_context_available():
            return forward(*args, **kwargs)
        try:
            return self._run_forward(forward, *args, **kwargs)
        except _FATAL as exc:
            record_exit_reason(f"{type(exc).__name__}: {exc}")
            if isinstance(exc, AFDPeerLostError):
                self._peers_changed(connected=False)
            raise
        finally:
            if self._counted:
                attention_step_ended(self.rank)

    def _run_forward(self, forward: Any, *args: Any, **kwargs: Any) -> Any:
        from afd_moe_runners import micro_batching

        ctx = get_forward_context()
        plan = ctx.additional_kwargs.pop(micro_batching.MICRO_BATCH_PLAN_KEY, None)
        num_tokens = real_token_count(ctx)
        m = self.afd.num_micro_batches
        if m > 1 and (plan is not None or self.data_parallel_size > 1):
            call = _bind_forward(args, kwargs)
            if call["intermediate_tensors"] is None:
                return micro_batching.run_micro_batches(
                    forward,
                    ctx,
                    self.connector,
                    m,
                    plan,
                    call["input_ids"],
                    call["positions"],
                    call["inputs_embeds"],
                    num_tokens=num_tokens,
                    **call["rest"],
                )
        set_step_metadata(ctx, AFDStepMetadata(connector=self.connector, num_tokens=num_tokens))
        return forward(*args, **kwargs)

    def _check_inventory(self, model: nn.Module, *, when: str) -> None:
        inventory = self._inventory(model)
        bad = {c: inventory[c] for c in _forbidden_categories(self.afd) if inventory.get(c)}
        if bad:
            raise AFDConfigError(
                f"AFD {self.afd.role.value} role built parameters it must not own after "
                f"{when}: {bad}; the role-aware construction of {type(model).__name__} "
                "does not match this vLLM version"
            )
        self.inventory = inventory

    def expert_shard_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """FFN expert parallelism: this FFN rank's checkpoint tensors, the routed experts
        of other ranks dropped (:func:`afd_moe_runners.expert_parallel.shard_checkpoint`)."""
        from afd_moe_runners.expert_parallel import routed_experts_of, shard_checkpoint

        assert self._text_config is not None
        return shard_checkpoint(
            weights, routed_experts_of(self._text_config), self.rank, self.afd.num_ffn_ranks
        )

    def after_weights_loaded(self, stats: RoleWeightStats) -> None:
        model = self._model()
        assert model is not None
        self._check_inventory(model, when="loading")
        self.weight_stats = stats
        logger.info(
            "AFD %s role parameter inventory: %s; checkpoint tensors %s",
            self.afd.role.value,
            " ".join(f"{k}={v}" for k, v in sorted(self.inventory.items())),
            stats.summary(),
        )


def real_token_count(ctx: Any) -> int | None:
    """How many leading rows of this step carry tokens, or None when every row does.

    Only those rows travel to the FFN role (:func:`afd_moe_runners.exchange.send_to_ffn`;
    the others come back as zeros). vLLM pads a step to a captured CUDA-graph size, and
    its dummy steps carry no token at all: CUDA-graph capture (whose exchanges would
    otherwise ship the uninitialised memory a capture leaves in the piece before the op)
    and its warm-up runs, the compile warm-up, an idle data-parallel rank's step. vLLM
    says which rows are padding in ``ForwardContext.is_padding`` (its profile run counts
    every row as real: its dummy tokens are computed eagerly and are finite, and they
    size the FFN role's largest batch). A real step's attention metadata carries the
    same count as a host integer (``num_actual_tokens``), read first so that a real step
    costs no device-to-host read; dummy steps (no attention metadata) read the mask.
    """
    attn = getattr(ctx, "attn_metadata", None)
    if isinstance(attn, dict):
        for metadata in attn.values():
            count = getattr(metadata, "num_actual_tokens", None)
            if isinstance(count, int):
                return count
    pad = getattr(ctx, "is_padding", None)
    if pad is None:
        return None
    return int(pad.shape[0]) - int(pad.sum())


def _tensor_parallel_place(vllm_config: VllmConfig) -> tuple[int, int]:
    """(this worker's TP rank, the TP size) of the engine."""
    size = int(vllm_config.parallel_config.tensor_parallel_size)
    if size == 1:
        return 0, 1
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank()), size


def _bind_forward(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """vLLM's model call ``(input_ids, positions, intermediate_tensors, inputs_embeds,
    **model_kwargs)`` by name."""
    names = ("input_ids", "positions", "intermediate_tensors", "inputs_embeds")
    rest = dict(kwargs)
    call: dict[str, Any] = dict.fromkeys(names)
    for name, value in zip(names, args, strict=False):
        call[name] = value
    for name in names:
        if name in rest:
            call[name] = rest.pop(name)
    call["rest"] = rest
    return call


class AFDRoleModel:
    """Mixin for role-aware model wrappers; list it before the native vLLM model class.

    The wrapper's ``__init__`` builds the native model for its role, then sets
    ``afd_config`` and ``afd_runtime``; this mixin supplies what every family does the
    same way: the per-step metadata hook (``forward``), the FFN role's blocks
    (``afd_ffn_blocks``) and one-pass role-aware weight loading (``load_weights``).
    Subclasses implement :meth:`afd_classify_weight`.
    """

    afd_config: AFDConfig
    afd_runtime: RoleRuntime

    def afd_classify_weight(self, name: str) -> WeightOwner:
        """Which role owns checkpoint tensor ``name`` (per model family)."""
        raise NotImplementedError

    def afd_decoder_layers(self) -> Iterable[nn.Module]:
        """The decoder layers (text model of a multimodal wrapper included)."""
        inner = getattr(self, "language_model", self)
        return inner.model.layers  # type: ignore[no-any-return]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.afd_runtime.run_forward(super().forward, *args, **kwargs)  # type: ignore[misc]

    def afd_ffn_blocks(self) -> dict[int, nn.Module]:
        """Decoder-layer index -> that layer's FFN block (MoE block or dense MLP)."""
        return {
            idx: layer.mlp
            for idx, layer in enumerate(self.afd_decoder_layers())
            if not isinstance(layer, PPMissingLayer)
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        stats = RoleWeightStats()
        mine = filter_role_weights(
            weights, self.afd_config.role, self.afd_classify_weight, stats=stats
        )
        if self.afd_config.role is AFDRole.FFN and self.afd_config.ffn_expert_parallel:
            mine = self.afd_runtime.expert_shard_weights(mine)
        loaded: set[str] = super().load_weights(mine)  # type: ignore[misc]
        self.afd_runtime.after_weights_loaded(stats)
        return loaded
