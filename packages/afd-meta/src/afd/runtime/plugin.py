"""vLLM general plugin: ``vllm.general_plugins`` entry point ``afd = afd.runtime.plugin:register``.

vLLM calls :func:`register` in every process it starts (API server, engine core,
workers, the model-inspection subprocess), possibly several times, so it must be
idempotent and cheap. It only registers lazy ``module:Class`` strings; nothing
heavy is imported until a model is actually built. It also runs the import hooks of the
installed model families (:func:`afd.model_families.install_import_hooks`; the Qwen family's
prepares the torchvision-free import of vLLM 0.32's ``qwen3_5`` model file), so native
vLLM, the model-inspection subprocess and both AFD roles import every family's models the
same way.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

#: Checkpoint architecture -> AFD alias of a hand-written role-aware wrapper, and that
#: alias -> "module:Class" (resolved lazily by vLLM). A wrapper here takes precedence
#: over the generic path; none is needed today: every supported family, DeepSeek V2/V3/
#: V3.2 and Qwen3-MoE / Qwen3.5 included, is split by the generic path. The maps stay as
#: the extension point for a family the generic path cannot split.
AFD_ARCHITECTURES: dict[str, str] = {}
AFD_MODEL_ALIASES: dict[str, str] = {}

#: Where every other architecture's ``AFD<Arch>`` comes from: the generic role-aware
#: path, which splits vLLM's own model class (``afd models check`` says whether it can).
GENERIC_MODULE = "afd_moe_runners.generic"
#: Architecture names the generic path is registered for (generative models).
GENERIC_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration")

_registered = False


def afd_alias_of(architecture: str) -> tuple[str, str]:
    """``(AFD alias, "module:Class" providing it)`` for a checkpoint architecture: its
    hand-written wrapper when afd has one, else the generic path's ``AFD<Arch>``."""
    alias = AFD_ARCHITECTURES.get(architecture)
    if alias is not None:
        return alias, AFD_MODEL_ALIASES[alias]
    alias = f"AFD{architecture}"
    return alias, f"{GENERIC_MODULE}:{alias}"


#: Loggers of the afd packages below the model families (whose packages are added by
#: :func:`afd_loggers`); vLLM configures only its own ("vllm") logger.
AFD_LOGGERS = (
    "afd",
    "afd_core",
    "afd_connectors_gpu",
    "afd_connectors_npu",
    "afd_moe_runners",
)


def afd_loggers() -> tuple[str, ...]:
    """:data:`AFD_LOGGERS` and the installed model families' packages."""
    from afd.model_families import family_packages

    return (*AFD_LOGGERS, *family_packages())


def configure_logging() -> None:
    """Give the afd loggers a stderr handler in vLLM processes (INFO, vLLM-like format).

    Respects ``VLLM_CONFIGURE_LOGGING=0`` and leaves loggers that already have handlers
    (an application's own logging setup) alone.
    """
    import os

    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    level = os.environ.get("AFD_LOGGING_LEVEL", os.environ.get("VLLM_LOGGING_LEVEL", "INFO"))
    formatter = logging.Formatter(
        "%(levelname)s %(asctime)s [%(name)s] %(message)s", datefmt="%m-%d %H:%M:%S"
    )
    for name in afd_loggers():
        log = logging.getLogger(name)
        if log.handlers:
            continue
        handler = logging.StreamHandler()
        handler.setFormatter(formatter)
        log.addHandler(handler)
        log.setLevel(level.upper())
        log.propagate = False


def register() -> None:
    """Register the AFD model aliases with vLLM's ModelRegistry (idempotent): the
    hand-written wrappers, and ``AFD<Arch>`` of the generic path for every other
    generative architecture vLLM knows."""
    global _registered
    if _registered:
        return
    configure_logging()
    from afd.runtime.worker import register_workers

    register_workers()
    from afd.model_families import install_import_hooks

    install_import_hooks()
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    for arch, target in AFD_MODEL_ALIASES.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, target)
    # Lazy "module:Class" strings: nothing is imported until a role builds one.
    for arch in sorted(supported):
        if arch.startswith("AFD") or not arch.endswith(GENERIC_SUFFIXES):
            continue
        alias, target = afd_alias_of(arch)
        if alias not in supported and alias not in AFD_MODEL_ALIASES:
            ModelRegistry.register_model(alias, target)
    _registered = True
