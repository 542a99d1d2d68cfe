"""Where the role processes of a spec run: ``CUDA_VISIBLE_DEVICES`` and
``VLLM_CPU_OMP_THREADS_BIND`` per role process (``attn``, ``ffn0``..., ``native0``),
with the lines ``afd launch`` prints about them."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from afd.launch.cpus import (
    CPU_BIND,
    CPU_BIND_KEYWORDS,
    assign_cpus,
    cpu_warnings,
    format_cpu_list,
)
from afd.launch.devices import CUDA_VISIBLE_DEVICES, assign_devices, shared_devices
from afd.launch.spec import DeploymentSpec

__all__ = ["device_lines", "plan_cpus", "plan_devices"]


def plan_devices(spec: DeploymentSpec, visible: Sequence[str]) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` per role process: the spec's ``devices`` / role ``env``
    where set, else :func:`~afd.launch.devices.assign_devices` of ``visible``."""
    attention: str | list[str] | None = spec.attention.env.get(CUDA_VISIBLE_DEVICES)
    if attention is None and isinstance(spec.attention.devices, list):
        attention = spec.attention.devices
    if spec.native:
        planned = assign_devices(1, 0, visible, attention=attention)
        return {"native0": planned["attn"]} if "attn" in planned else {}
    ffn_env = spec.ffn.env.get(CUDA_VISIBLE_DEVICES)
    ffn = [ffn_env] * spec.num_ffn if ffn_env is not None else spec.ffn.devices
    return assign_devices(
        spec.num_attention,
        spec.num_ffn,
        visible,
        attention=attention,
        ffn=ffn if isinstance(ffn, list) else None,
    )


def device_lines(devices: Mapping[str, str], visible: Sequence[str]) -> list[str]:
    """What ``afd launch`` prints about the planned devices."""
    if not devices:
        return [f"devices: no CUDA device visible; {CUDA_VISIBLE_DEVICES} left as is"]
    per_role = ", ".join(f"{k}={v}" for k, v in devices.items())
    seen = f"{len(visible)} visible: {','.join(visible)}" if visible else "none visible"
    lines = [f"devices ({CUDA_VISIBLE_DEVICES} per role): {per_role} ({seen})"]
    for warning in shared_devices(devices):
        lines.append(f"WARNING: {warning}; NCCL refuses two ranks on one device")
    return lines


def plan_cpus(
    spec: DeploymentSpec, visible: Sequence[str], usable: Sequence[int]
) -> tuple[dict[str, str], list[str]]:
    """``(VLLM_CPU_OMP_THREADS_BIND per role process, the lines to print about it)``.

    The spec's ``cpus`` / role ``env`` where set; on a CPU host (no ``visible`` CUDA
    device) with no ``VLLM_CPU_OMP_THREADS_BIND`` in the spec's ``env`` or the
    launcher's environment, the other processes get their share of
    :func:`~afd.launch.cpus.split_cpus` of ``usable`` (the native baseline all of
    them); nothing else is set."""
    attention: str | None = spec.attention.env.get(CPU_BIND)
    if attention is None and spec.attention.cpus is not None:
        a = spec.attention.cpus
        attention = a[0] if a[0] in CPU_BIND_KEYWORDS else "|".join(a)
    ffn_env = spec.ffn.env.get(CPU_BIND)
    num_ffn = 0 if spec.native else spec.num_ffn
    ffn = [ffn_env] * num_ffn if ffn_env is not None else spec.ffn.cpus
    if spec.native:
        ffn = None
    inherited = spec.env.get(CPU_BIND, os.environ.get(CPU_BIND))
    where = "the spec's env" if CPU_BIND in spec.env else "the environment"
    procs = 1 if spec.native else spec.num_attention + spec.num_ffn
    split = not visible and inherited is None
    planned = assign_cpus(
        1 if spec.native else spec.num_attention,
        num_ffn,
        usable if split else [],
        attention=attention,
        ffn=ffn,
    )
    if spec.native:
        planned = {"native0": planned["attn"]} if "attn" in planned else {}
    lines = []
    names = ["native0"] if spec.native else ["attn"] + [f"ffn{f}" for f in range(num_ffn)]
    rest = [n for n in names if n not in planned]
    if planned:
        per_role = ", ".join(f"{k}={v}" for k, v in planned.items())
        lines.append(
            f"cpus ({CPU_BIND} per role): {per_role} "
            f"({len(usable)} usable: {format_cpu_list(usable)})"
        )
    if rest:
        left = ", ".join(rest)
        if visible:
            why = "CUDA host"
        elif inherited is not None:
            why = f"{CPU_BIND}={inherited} from {where}"
        else:
            why = None
            lines.append(
                f"WARNING: {len(usable)} usable CPU(s) ({format_cpu_list(usable)}) for "
                f"{procs} role process(es): {CPU_BIND} of {left} left to vLLM "
                "(auto: every role binds to the same first core)"
            )
        if why is not None:
            lines.append(f"cpus: {why}; {CPU_BIND} of {left} left as is")
    lines += [f"WARNING: {w}" for w in cpu_warnings(planned, usable)]
    return planned, lines
