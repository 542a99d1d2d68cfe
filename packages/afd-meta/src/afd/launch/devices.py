"""CUDA devices of the role processes: ``CUDA_VISIBLE_DEVICES`` per role.

The host's visible devices (``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi -L``; nothing
is imported for it: :func:`detect_cuda_devices`) and one device per rank, attention
ranks first (:func:`assign_devices`). See docs/gpu.md.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence

from afd.launch.errors import DeploymentError

__all__ = [
    "CUDA_VISIBLE_DEVICES",
    "assign_devices",
    "detect_cuda_devices",
    "parse_nvidia_smi_list",
    "parse_visible_devices",
]

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


def parse_visible_devices(value: str) -> list[str]:
    """The entries of a ``CUDA_VISIBLE_DEVICES`` value (CUDA stops at an invalid one;
    an empty value hides every device)."""
    out = []
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        out.append(entry)
    return out


def parse_nvidia_smi_list(output: str) -> list[str]:
    """CUDA device indices ``["0", ..., "n-1"]`` for the ``GPU i: ...`` lines of
    ``nvidia-smi -L`` (its indented MIG lines are not counted)."""
    n = len(re.findall(r"^GPU \d+:", output, flags=re.MULTILINE))
    return [str(i) for i in range(n)]


@functools.cache
def _nvidia_smi_output(cmd: tuple[str, ...], path: str | None) -> str | None:
    return _run_nvidia_smi_uncached(list(cmd))


def _run_nvidia_smi(cmd: list[str]) -> str | None:
    """``nvidia-smi`` output, run once per process and executable (the host's GPUs do
    not change while the launcher runs)."""
    return _nvidia_smi_output(tuple(cmd), shutil.which(cmd[0]))


def _run_nvidia_smi_uncached(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def detect_cuda_devices(
    environ: Mapping[str, str] | None = None,
    run: Callable[[list[str]], str | None] = _run_nvidia_smi,
) -> list[str]:
    """The host's visible CUDA devices, without importing torch or vLLM.

    ``CUDA_VISIBLE_DEVICES`` in ``environ`` (default ``os.environ``), when set, is the
    list; otherwise one index per ``GPU`` line of ``nvidia-smi -L`` (``run`` returns its
    output, or None when it is missing or fails). ``[]``: a CPU host.
    """
    env = os.environ if environ is None else environ
    if CUDA_VISIBLE_DEVICES in env:
        return parse_visible_devices(env[CUDA_VISIBLE_DEVICES])
    output = run(["nvidia-smi", "-L"])
    return parse_nvidia_smi_list(output) if output else []


def assign_devices(
    num_attention: int,
    num_ffn: int,
    visible: Sequence[str],
    *,
    attention: str | Sequence[str] | None = None,
    ffn: Sequence[str] | None = None,
) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` per role process: ``{"attn": ..., "ffn0": ..., ...}``.

    One device per rank, attention ranks first: the attention server (whose DP rank i
    vLLM places on its i-th visible device) gets ``visible[0:num_attention]``, FFN rank
    f ``visible[num_attention + f]``. ``attention`` (the server's whole value) and
    ``ffn`` (one value per FFN rank) are explicit settings; they are used as given, and
    the other role keeps its default positions. With no visible device (a CPU host) only
    explicit settings are returned. Raises :class:`DeploymentError` naming how many
    devices are needed and found when the default positions do not exist.
    """
    if ffn is not None and len(ffn) != num_ffn:
        raise ValueError(f"ffn: {len(ffn)} device values for {num_ffn} FFN ranks")
    needed = 0
    if attention is None:
        needed = num_attention
    if ffn is None and num_ffn:
        needed = num_attention + num_ffn
    if visible and len(visible) < needed:
        shape = f"{num_attention}A{num_ffn}F" if num_ffn else "one server"
        raise DeploymentError(
            f"{shape} needs {needed} CUDA devices (one per rank: attention ranks first, "
            f"then FFN ranks; NCCL refuses two ranks on one device), found {len(visible)} "
            f"({','.join(visible)}); set [attention] devices / [ffn] devices (or "
            f"{CUDA_VISIBLE_DEVICES} in a role's env) to choose the devices yourself"
        )
    out: dict[str, str] = {}
    if attention is not None:
        out["attn"] = attention if isinstance(attention, str) else ",".join(attention)
    elif visible:
        out["attn"] = ",".join(visible[:num_attention])
    for f in range(num_ffn):
        if ffn is not None:
            out[f"ffn{f}"] = ffn[f]
        elif visible:
            out[f"ffn{f}"] = visible[num_attention + f]
    return out


def shared_devices(devices: Mapping[str, str]) -> list[str]:
    """Warnings for devices that two role processes would both use."""
    owner: dict[str, str] = {}
    out = []
    for name, value in devices.items():
        for d in parse_visible_devices(value):
            if d in owner and owner[d] != name:
                out.append(f"{owner[d]} and {name} share device {d}")
            owner.setdefault(d, name)
    return out
