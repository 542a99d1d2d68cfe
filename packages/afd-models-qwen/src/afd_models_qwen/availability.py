"""Can this environment build the Qwen3.5/3.6-MoE wrappers? (asked without importing vLLM)."""

from __future__ import annotations

import functools
import subprocess
import sys

__all__ = ["qwen3_5_import_error"]

_PROBE = "import vllm.model_executor.models.qwen3_5"


@functools.lru_cache(maxsize=1)
def qwen3_5_import_error() -> str | None:
    """The last line of the error importing vLLM's ``qwen3_5`` model file, or None.

    vLLM 0.32's ``qwen3_5`` imports ``qwen3_vl`` (the Qwen3.5 multimodal processor),
    which imports transformers' Qwen2-VL image processor, which imports ``torchvision``
    at module level, even for text-only checkpoints. Where torchvision is missing (the
    CPU environment of this project: the only torchvision wheels for ``torch+cpu``
    2.13 here are CUDA builds that fail to load) that import fails with
    ``ModuleNotFoundError: No module named 'torchvision'``. Checked in a fresh
    interpreter so the caller's process does not import vLLM.
    """
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=False
    )
    if proc.returncode == 0:
        return None
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit status {proc.returncode}"
