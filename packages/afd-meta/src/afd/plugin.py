"""vLLM general plugin: ``vllm.general_plugins`` entry point ``afd = afd.plugin:register``.

vLLM calls :func:`register` in every process it starts (API server, engine core,
workers, the model-inspection subprocess), possibly several times, so it must be
idempotent and cheap. It only registers lazy ``module:Class`` strings; nothing
heavy is imported until a model is actually built.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

#: Checkpoint architecture -> AFD alias selected with ``--hf-overrides``.
AFD_ARCHITECTURES: dict[str, str] = {
    "DeepseekV2ForCausalLM": "AFDDeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "AFDDeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM": "AFDDeepseekV32ForCausalLM",
}

#: AFD alias -> "module:Class" of its role-aware wrapper (resolved lazily by vLLM).
AFD_MODEL_ALIASES: dict[str, str] = {
    "AFDDeepseekV2ForCausalLM": "afd_models_deepseek.model:AFDDeepseekV2ForCausalLM",
    "AFDDeepseekV3ForCausalLM": "afd_models_deepseek.model:AFDDeepseekV3ForCausalLM",
    "AFDDeepseekV32ForCausalLM": "afd_models_deepseek.model:AFDDeepseekV32ForCausalLM",
}

_registered = False


def register() -> None:
    """Register the AFD model aliases with vLLM's ModelRegistry (idempotent)."""
    global _registered
    if _registered:
        return
    if AFD_MODEL_ALIASES:
        from vllm import ModelRegistry

        supported = set(ModelRegistry.get_supported_archs())
        for arch, target in AFD_MODEL_ALIASES.items():
            if arch not in supported:
                ModelRegistry.register_model(arch, target)
    _registered = True
