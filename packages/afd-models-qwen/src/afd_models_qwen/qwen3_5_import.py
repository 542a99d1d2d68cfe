"""Import vLLM 0.32's ``qwen3_5`` model file where torchvision is missing (text only).

Why a seam is needed. vLLM 0.32's ``vllm/model_executor/models/qwen3_5.py`` (text
*and* multimodal Qwen3.5/3.6 classes in one file) imports ``qwen3_vl`` at module level
for its multimodal processor. ``qwen3_vl.py`` (and ``qwen2_vl.py``, which it pulls in
through ``qwen2_5_vl``) import ``smart_resize`` from transformers'
``models.qwen2_vl.image_processing_qwen2_vl``, whose line 26 imports
``torchvision.transforms.v2.functional``. Without torchvision the whole file fails to
import (``ModuleNotFoundError: No module named 'torchvision'``), although nothing in
that chain runs for text. The CPU environment excludes torchvision on purpose (PyPI's
wheels are CUDA builds that break model loading next to ``torch+cpu``). vLLM offers no
public seam: the architectures are registered to that one module, whose import is
unconditional.

What the seam does, and nothing more. While Python executes the module
``vllm.model_executor.models.qwen3_5`` (and only then), a placeholder module stands in
``sys.modules`` for transformers' ``image_processing_qwen2_vl``. It defines exactly the
names vLLM imports from it at module level (:data:`PLACEHOLDER_NAMES`), and each raises
:class:`Qwen3_5ImageInputError` if called (only image/video preprocessing calls them).
The placeholder is removed as soon as that import finishes, so importing the real
transformers module later fails as before, and ``torchvision`` itself is never faked
(transformers' availability checks keep seeing it missing). The seam applies only when
torchvision is not installed and only on vLLM 0.32; on another vLLM the import runs
unchanged and, should it still fail for torchvision, fails with an error saying so.

Where it is installed. :func:`install_import_hook` puts a finder on ``sys.meta_path``
that answers for that one module name and removes itself once the module is imported.
The ``afd`` vLLM plugin calls it in every vLLM process (so native vLLM, the model
inspection subprocess and both AFD roles import the model the same way), and
:func:`import_qwen3_5` calls it for code that imports the wrappers without vLLM's
plugins. ``tests/test_vllm_drift.py`` fails when vLLM's import chain changes so that the
seam is no longer needed or no longer sufficient.

This module imports neither vLLM nor transformers.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from afd_core.errors import AFDError

__all__ = [
    "PLACEHOLDER_MODULE",
    "PLACEHOLDER_NAMES",
    "QWEN3_5",
    "SUPPORTED_VLLM",
    "Qwen3_5ImageInputError",
    "Qwen3_5ImportError",
    "import_qwen3_5",
    "install_import_hook",
    "torchvision_missing",
]

QWEN3_5 = "vllm.model_executor.models.qwen3_5"
#: The transformers module that imports torchvision at module level.
PLACEHOLDER_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
#: What vLLM 0.32 imports from it at module level (qwen3_vl.py:38, qwen2_vl.py:43).
PLACEHOLDER_NAMES: tuple[str, ...] = ("smart_resize",)
#: The vLLM line whose import chain the seam was written against.
SUPPORTED_VLLM = "0.32."


class Qwen3_5ImportError(AFDError, ImportError):
    """vLLM's ``qwen3_5`` needs torchvision and afd's seam does not cover this vLLM."""


class Qwen3_5ImageInputError(AFDError, RuntimeError):
    """Image/video preprocessing for Qwen3.5 was reached without torchvision installed."""


def torchvision_missing() -> bool:
    """True when ``torchvision`` is not installed (not: installed but broken)."""
    return "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is None


def _vllm_version() -> str:
    from vllm.version import __version__  # vLLM is importing already when this is asked

    return str(__version__)


def _image_input_error(name: str) -> Qwen3_5ImageInputError:
    return Qwen3_5ImageInputError(
        f"{PLACEHOLDER_MODULE}.{name} was called: image or video input reached vLLM's "
        "Qwen3.5 preprocessing, which needs torchvision (transformers' Qwen2-VL image "
        "processor), and torchvision is not installed. afd imported vLLM's qwen3_5 model "
        "file without it for text-only serving (afd_models_qwen.qwen3_5_import). Serve "
        "text only (afd requires --language-model-only for the multimodal checkpoints), or "
        "install torchvision built for this torch (CPU builds: "
        "https://download.pytorch.org/whl/cpu)."
    )


def _placeholder_module() -> ModuleType:
    module = ModuleType(
        PLACEHOLDER_MODULE,
        "afd placeholder for transformers' torchvision-based Qwen2-VL image processor, "
        "present only while vLLM's qwen3_5 model file is imported "
        "(afd_models_qwen.qwen3_5_import).",
    )
    for name in PLACEHOLDER_NAMES:

        def unavailable(*args: Any, _name: str = name, **kwargs: Any) -> Any:
            raise _image_input_error(_name)

        unavailable.__name__ = unavailable.__qualname__ = name
        unavailable.__module__ = PLACEHOLDER_MODULE
        setattr(module, name, unavailable)
    return module


@contextmanager
def _placeholder_in_sys_modules() -> Iterator[None]:
    if PLACEHOLDER_MODULE in sys.modules:  # the real module imported: nothing to stand in
        yield
        return
    placeholder = _placeholder_module()
    sys.modules[PLACEHOLDER_MODULE] = placeholder
    try:
        yield
    finally:
        if sys.modules.get(PLACEHOLDER_MODULE) is placeholder:
            del sys.modules[PLACEHOLDER_MODULE]


class _SeamLoader(importlib.abc.Loader):
    """Runs the real loader of ``qwen3_5`` with the placeholder in place."""

    def __init__(self, real: importlib.abc.Loader, hook: _Qwen3_5ImportHook) -> None:
        self.real = real
        self.hook = hook

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package...
        if name == "real":
            raise AttributeError(name)
        return getattr(self.real, name)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # Afterwards the module looks as if imported normally (inspect, reload, get_source).
        module.__loader__ = self.real
        if module.__spec__ is not None:
            module.__spec__.loader = self.real
        version = _vllm_version()
        if not version.startswith(SUPPORTED_VLLM):
            try:
                self.real.exec_module(module)
            except ModuleNotFoundError as exc:
                if (exc.name or "").partition(".")[0] != "torchvision":
                    raise
                raise Qwen3_5ImportError(
                    f"vLLM {version}'s {QWEN3_5} imports torchvision, which is not "
                    f"installed. afd's torchvision-free import of that file was written for "
                    f"vLLM {SUPPORTED_VLLM}x only (afd_models_qwen.qwen3_5_import), so it is "
                    "not applied: install torchvision built for this torch, or the vLLM "
                    "version afd supports."
                ) from exc
        else:
            with _placeholder_in_sys_modules():
                self.real.exec_module(module)
        self.hook.uninstall()


class _Qwen3_5ImportHook(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that answers for ``qwen3_5`` only."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != QWEN3_5 or not torchvision_missing():
            return None
        for finder in sys.meta_path:
            if isinstance(finder, _Qwen3_5ImportHook) or not hasattr(finder, "find_spec"):
                continue
            spec: ModuleSpec | None = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None:
            spec.loader = _SeamLoader(spec.loader, self)
        return spec

    def uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def install_import_hook() -> bool:
    """Prepare the torchvision-free import of vLLM's ``qwen3_5`` (idempotent, cheap).

    Installs nothing where torchvision is installed or ``qwen3_5`` is already imported.
    Returns whether the hook is (now) in place.
    """
    if QWEN3_5 in sys.modules or not torchvision_missing():
        return False
    if not any(isinstance(f, _Qwen3_5ImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Qwen3_5ImportHook())
    return True


def import_qwen3_5() -> ModuleType:
    """``vllm.model_executor.models.qwen3_5``, imported through the seam where needed."""
    install_import_hook()
    return importlib.import_module(QWEN3_5)
