"""Can this environment build the Qwen3.5/3.6-MoE wrappers? (asked without importing vLLM)."""

from __future__ import annotations

import functools
import subprocess
import sys

__all__ = ["qwen3_5_import_error"]

_PROBE = "from afd_models_qwen.qwen3_5_import import import_qwen3_5; import_qwen3_5()"


@functools.lru_cache(maxsize=1)
def qwen3_5_import_error() -> str | None:
    """The last line of the error importing vLLM's ``qwen3_5`` model file, or None.

    Imported the way afd imports it (:func:`afd_models_qwen.qwen3_5_import.
    import_qwen3_5`): on vLLM 0.32 without torchvision the file's torchvision-only
    multimodal import is stood in for, so this is None on the CPU build. It names the
    blocker elsewhere, e.g. another vLLM version whose ``qwen3_5`` still needs
    torchvision (``Qwen3_5ImportError``). Checked in a fresh interpreter so the
    caller's process does not import vLLM.
    """
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, check=False
    )
    if proc.returncode == 0:
        return None
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit status {proc.returncode}"
