"""Options the Qwen AFD wrappers reject at construction (no vLLM import needed here)."""

from __future__ import annotations

from typing import Any

from afd_core.errors import AFDConfigError

__all__ = ["reject_unsupported_options"]


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
