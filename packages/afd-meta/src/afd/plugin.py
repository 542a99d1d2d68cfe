"""vLLM general plugin: ``vllm.general_plugins`` entry point ``afd = afd.plugin:register``.

vLLM calls :func:`register` in every process it starts (API server, engine core,
workers, the model-inspection subprocess), possibly several times, so it must be
idempotent and cheap. It only registers lazy ``module:Class`` strings; nothing
heavy is imported until a model is actually built.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

#: AFD architecture name -> "module:Class" of its role-aware wrapper.
AFD_MODEL_ALIASES: dict[str, str] = {}

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
