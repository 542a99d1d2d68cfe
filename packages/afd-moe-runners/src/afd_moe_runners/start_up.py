"""An AFD role's start-up: the checks before any module is built, then its plan.

:func:`start_role` is what a role-aware model's constructor calls first: it reads the
role's ``AFDConfig`` from the vLLM config (:func:`afd_config_of`), refuses layouts and
options this runtime does not implement (:func:`check_supported_parallelism`: the
connector's own ``check_deployment``, vLLM's V2 model runner, the compile / CUDA-graph
mode, micro-batching, tensor and pipeline parallelism, EPLB;
:func:`reject_unsupported_options`: sequence-parallel MoE, speculative decoding with a
drafter model (n-gram passes; :mod:`afd_moe_runners.speculation`), LoRA, multimodal
input), each with a one-line reason naming the fix, and then resolves the role's
:class:`~afd_moe_runners.deployment_plan.DeploymentPlan` once and logs it.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.config import VllmConfig

from afd_core.config import AFDConfig, AFDRole
from afd_core.config import afd_config_of as _afd_config_of
from afd_core.errors import AFDConfigError
from afd_moe_runners import deployment_plan
from afd_moe_runners.deployment_plan import DeploymentPlan, GraphMode, graph_mode_of
from afd_moe_runners.model_runner_choice import model_runner_problem
from afd_moe_runners.speculation import (
    micro_batched_speculation_problem,
    speculative_method,
    speculative_problem,
)
from afd_moe_runners.worker_table import is_micro_batch_worker, micro_batch_worker

logger = logging.getLogger(__name__)

__all__ = [
    "afd_config_of",
    "check_supported_parallelism",
    "compiled_graph_problem",
    "micro_batching_problem",
    "model_runner_check",
    "reject_unsupported_options",
    "start_role",
    "tensor_parallel_problem",
]


def start_role(
    vllm_config: VllmConfig, model_name: str, *, multimodal_capable: bool = False
) -> DeploymentPlan:
    """The start-up of a role-aware model named ``model_name``: every check below, then
    the role's deployment plan, resolved once and logged in one line."""
    afd = afd_config_of(vllm_config)
    check_supported_parallelism(vllm_config, model_name)
    reject_unsupported_options(vllm_config, model_name, multimodal_capable=multimodal_capable)
    plan = deployment_plan.resolve_plan(afd, vllm_config)
    logger.info("%s (%s)", plan.describe(), model_name)
    return plan


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
    deployment_plan.connector_class(afd.connector).check_deployment(afd, vllm_config)
    model_runner_check(vllm_config, afd.role.value, model_name)
    if afd.role is AFDRole.ATTENTION:
        platform = deployment_plan.current_platform_name()
        problem = compiled_graph_problem(vllm_config, platform, model_name)
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
        device = deployment_plan.current_platform_name()
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
        return micro_batched_speculation_problem(num_micro_batches)
    return None


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
    mode = graph_mode_of(vllm_config, platform)
    if mode is GraphMode.BREAKABLE:
        return (
            f"{model_name}: VLLM_USE_BREAKABLE_CUDAGRAPH=1 (breakable CUDA graphs; vLLM "
            "also turns them on for VLLM_BATCH_INVARIANT=1 and some architectures) is not "
            "supported by afd: it captures the whole forward, the per-layer AFD exchange "
            "included, whose connector runs host code every layer. Set "
            "VLLM_USE_BREAKABLE_CUDAGRAPH=0 (afd then splits piecewise graphs at the "
            "exchange) or start the Attention role with --enforce-eager"
        )
    cc = getattr(vllm_config, "compilation_config", None)
    if mode is GraphMode.FULL:
        graph_mode = str(getattr(cc.cudagraph_mode, "name", cc.cudagraph_mode))
        return (
            f"{model_name}: CUDA graph mode {graph_mode} is not supported by afd on "
            f"{platform}: a full graph would capture the per-layer AFD exchange, whose "
            "connector runs host code every layer. Start the Attention role with "
            '--compilation-config \'{"cudagraph_mode": "PIECEWISE"}\' (graphs between '
            "the exchanges; afd serve and afd launch set it) or --enforce-eager"
        )
    if mode is GraphMode.PIECEWISE:
        split_graphs_at_exchange(cc)
    return None


def split_graphs_at_exchange(compilation_config: Any) -> None:
    """Add the exchange op to vLLM's ``splitting_ops`` (once; vLLM's own kept): the
    piecewise CUDA graphs of a :attr:`GraphMode.PIECEWISE` engine end at each exchange."""
    from afd_moe_runners.exchange_op import SPLITTING_OP

    ops = getattr(compilation_config, "splitting_ops", None)
    if ops is None or SPLITTING_OP not in ops:
        compilation_config.splitting_ops = [*(ops or []), SPLITTING_OP]
        logger.info("AFD: piecewise CUDA graphs split at %s", SPLITTING_OP)


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
    method = speculative_method(getattr(vllm_config, "speculative_config", None))
    ranks = int(getattr(pc, "data_parallel_size", 1) or 1)
    problem = speculative_problem(method, model_name, num_attention_ranks=ranks)
    if problem is not None:
        raise AFDConfigError(problem)
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
