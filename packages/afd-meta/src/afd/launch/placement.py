"""Where the role processes of a spec run: ``CUDA_VISIBLE_DEVICES`` and
``VLLM_CPU_OMP_THREADS_BIND`` per role process (``attn``, ``ffn0``..., ``native0``),
with the lines ``afd launch`` prints about them; on Ray, the placement group of the
role actors (:func:`plan_ray`) and the CPUs per Ray node (:func:`plan_node_cpus`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from afd.launch.cpus import (
    CPU_BIND,
    CPU_BIND_KEYWORDS,
    SHARED_OMP_ENV,
    assign_cpus,
    cpu_warnings,
    format_cpu_list,
    share_cpus,
)
from afd.launch.devices import CUDA_VISIBLE_DEVICES, assign_devices, shared_devices
from afd.launch.spec import DeploymentSpec
from afd_core.roles import AFDRole

__all__ = [
    "NodeInfo",
    "RayBundle",
    "RayPlan",
    "device_lines",
    "plan_cpus",
    "plan_devices",
    "plan_node_cpus",
    "plan_ray",
    "role_names",
    "takes_turns",
]


def role_names(spec: DeploymentSpec) -> list[tuple[str, AFDRole, int]]:
    """``(name, role, rank)`` of every role process of an AFD spec, in start order: the
    FFN servers, then the attention server (its ranks are the DP ranks of one process)."""
    ffn = [(f"ffn{f}", AFDRole.FFN, f) for f in range(spec.num_ffn)]
    return [*ffn, ("attn", AFDRole.ATTENTION, 0)]


def plan_devices(spec: DeploymentSpec, visible: Sequence[str]) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` per role process: the spec's ``devices`` / role ``env``
    where set, else :func:`~afd.launch.devices.assign_devices` of ``visible``."""
    attention: str | list[str] | None = spec.attention.env.get(CUDA_VISIBLE_DEVICES)
    if attention is None and isinstance(spec.attention.devices, list):
        attention = spec.attention.devices
    workers = spec.num_workers(AFDRole.ATTENTION)
    if spec.native:
        planned = assign_devices(
            spec.attention_tensor_parallel_size, 0, visible, attention=attention
        )
        return {"native0": planned["attn"]} if "attn" in planned else {}
    ffn_env = spec.ffn.env.get(CUDA_VISIBLE_DEVICES)
    ffn = [ffn_env] * spec.num_ffn if ffn_env is not None else spec.ffn.devices
    return assign_devices(
        workers,
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


def _explicit_cpus(spec: DeploymentSpec) -> tuple[str | None, list[str] | None]:
    """The spec's own CPU settings: the attention server's whole value, one per FFN rank
    (the role ``env`` wins over ``cpus``); None where unset."""
    attention: str | None = spec.attention.env.get(CPU_BIND)
    if attention is None and spec.attention.cpus is not None:
        a = spec.attention.cpus
        attention = a[0] if a[0] in CPU_BIND_KEYWORDS else "|".join(a)
    if spec.native:
        return attention, None
    ffn_env = spec.ffn.env.get(CPU_BIND)
    ffn = [ffn_env] * spec.num_ffn if ffn_env is not None else spec.ffn.cpus
    return attention, None if ffn is None else list(ffn)


def plan_cpus(
    spec: DeploymentSpec, visible: Sequence[str], usable: Sequence[int]
) -> tuple[dict[str, str], list[str]]:
    """``(VLLM_CPU_OMP_THREADS_BIND per role process, the lines to print about it)``.

    The spec's ``cpus`` / role ``env`` where set; on a CPU host (no ``visible`` CUDA
    device) with no ``VLLM_CPU_OMP_THREADS_BIND`` in the spec's ``env`` or the
    launcher's environment, the other processes get their share of
    :func:`~afd.launch.cpus.split_cpus` of ``usable`` (the native baseline all of
    them); nothing else is set.

    Except when the roles take turns (:func:`takes_turns`: one attention rank without
    TP, one FFN rank, one micro-batch, no CPUs given): at most one of them computes at
    any time, so both get every usable CPU, and their OpenMP threads stop spinning soon
    after a parallel region (:data:`~afd.launch.cpus.SHARED_OMP_ENV`, set by
    :func:`~afd.launch.processes.role_env`). Splitting the CPUs would leave half of them
    idle in every step."""
    attention, ffn = _explicit_cpus(spec)
    num_ffn = 0 if spec.native else spec.num_ffn
    inherited = spec.env.get(CPU_BIND, os.environ.get(CPU_BIND))
    where = "the spec's env" if CPU_BIND in spec.env else "the environment"
    tp = spec.attention_tensor_parallel_size
    workers = tp if spec.native else spec.num_workers(AFDRole.ATTENTION)
    procs = workers + num_ffn
    split = not visible and inherited is None
    turns = split and len(usable) >= 2 and takes_turns(spec) and (attention, ffn) == (None, None)
    if turns:
        planned = dict.fromkeys(("attn", "ffn0"), format_cpu_list(usable))
    else:
        planned = assign_cpus(
            workers, num_ffn, usable if split else [], attention=attention, ffn=ffn
        )
    if split and tp > 1 and "attn" not in planned and usable:
        # Fewer CPUs than workers: vLLM's automatic binding refuses several TP workers on
        # one NUMA node, so the workers share CPUs (warned about below).
        planned = {**share_cpus(usable, workers, num_ffn), **planned}
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
    if turns:
        omp = ", ".join(f"{k}={v}" for k, v in SHARED_OMP_ENV.items())
        lines.append(
            "cpus: the roles take turns (1 attention rank, 1 FFN rank, one micro-batch), "
            f"so both use every usable CPU; OpenMP threads sleep soon after work ({omp}). "
            "Set [attention] / [ffn] cpus to split them."
        )
    else:
        lines += [f"WARNING: {w}" for w in cpu_warnings(planned, usable)]
    return planned, lines


def takes_turns(spec: DeploymentSpec) -> bool:
    """Whether the roles of ``spec`` compute one at a time: one attention rank without
    tensor parallelism, one FFN rank, one micro-batch (each waits for the other every
    layer). More ranks or micro-batches compute at the same time."""
    if spec.native or spec.num_ffn != 1 or spec.num_workers(AFDRole.ATTENTION) != 1:
        return False
    return spec.afd.num_micro_batches == 1


# ---------------------------------------------------------------------------- Ray


@dataclass(frozen=True)
class RayBundle:
    """One role process's bundle in the deployment's placement group."""

    name: str
    role: AFDRole
    rank: int
    resources: dict[str, float]
    """Ray resources: ``CPU``, ``GPU`` and custom ones such as ``NPU``."""


@dataclass(frozen=True)
class RayPlan:
    """The placement group of a Ray deployment: one bundle per role process (in start
    order) and the strategy that places them."""

    strategy: str
    """Ray's name: ``STRICT_PACK``, ``PACK``, ``SPREAD`` or ``STRICT_SPREAD``."""
    bundles: list[RayBundle]
    why: str

    def describe(self) -> str:
        parts = ", ".join(
            f"{b.name}={{{', '.join(f'{k}: {v:g}' for k, v in b.resources.items())}}}"
            for b in self.bundles
        )
        return f"ray placement group {self.strategy} ({self.why}): {parts}"


def plan_ray(spec: DeploymentSpec) -> RayPlan:
    """The placement group of an AFD spec with ``[ray]``: one bundle per role process
    (each FFN server asks for its role's resources once, the attention server once per
    vLLM worker: attention ranks x attention TP size); ``STRICT_PACK`` when the
    connector needs one host (shared memory), else the spec's ``[ray] placement``
    (default ``SPREAD``)."""
    if spec.ray is None:
        raise ValueError("plan_ray: the spec has no [ray] table")
    bundles = [
        RayBundle(
            name,
            role,
            rank,
            spec.ray.resources(role).bundle(
                spec.num_workers(role) if role is AFDRole.ATTENTION else 1
            ),
        )
        for name, role, rank in role_names(spec)
    ]
    placement = spec.ray_placement
    if spec.ray.placement:
        why = "from [ray] placement"
    elif placement == "strict_pack":
        why = f"{spec.connector} needs one host"
    else:
        why = f"{spec.connector} reaches other hosts"
    return RayPlan(placement.upper(), bundles, why)


@dataclass(frozen=True)
class NodeInfo:
    """Where a role actor landed, as the actor saw it."""

    node_id: str
    ip: str
    """``ray.util.get_node_ip_address()`` in the actor: the address its role binds."""
    hostname: str = ""
    cpus: tuple[int, ...] = ()
    """The CPUs the actor may run on (``os.sched_getaffinity``)."""
    gpus: tuple[str, ...] = ()
    """The GPUs Ray gave the actor (``ray.get_gpu_ids()``)."""
    cpu_bind: str | None = None
    """``VLLM_CPU_OMP_THREADS_BIND`` in the node's environment, if set."""

    @property
    def label(self) -> str:
        host = f"{self.hostname} " if self.hostname else ""
        return f"{host}{self.ip} (node {self.node_id[:8]})"


def plan_node_cpus(
    spec: DeploymentSpec, nodes: Mapping[str, NodeInfo]
) -> tuple[dict[str, str], list[str]]:
    """``(VLLM_CPU_OMP_THREADS_BIND per role process, the lines to print)`` for role
    processes placed on Ray nodes (``nodes``: role process name -> its node).

    The local launcher's rule (:func:`plan_cpus`), per node: the spec's ``cpus`` / role
    ``env`` where set; the role processes of one CPU node (no GPU given to them, no
    ``VLLM_CPU_OMP_THREADS_BIND`` in the spec's ``env`` or the node's environment) split
    that node's CPUs (:func:`~afd.launch.cpus.split_cpus`: the attention server first,
    then the FFN ranks there); nothing else is set."""
    attention, ffn = _explicit_cpus(spec)
    by_node: dict[str, list[str]] = {}
    for name, *_ in role_names(spec):
        by_node.setdefault(nodes[name].node_id, []).append(name)
    planned: dict[str, str] = {}
    lines: list[str] = []
    for names in by_node.values():
        node = nodes[names[0]]
        ffn_here = [n for n in names if n.startswith("ffn")]
        attn_here = "attn" in names
        inherited = spec.env.get(CPU_BIND, node.cpu_bind)
        split = not any(nodes[n].gpus for n in names) and inherited is None
        workers = spec.num_workers(AFDRole.ATTENTION) if attn_here else 0
        got = assign_cpus(
            workers,
            len(ffn_here),
            list(node.cpus) if split else [],
            attention=attention if attn_here else None,
            ffn=None if ffn is None else [ffn[int(n[3:])] for n in ffn_here],
        )
        if split and attn_here and spec.attention_tensor_parallel_size > 1 and "attn" not in got:
            # Fewer CPUs than workers: vLLM's automatic binding refuses several TP workers
            # on one NUMA node, so the workers share CPUs (as the local launcher does).
            got = {**share_cpus(list(node.cpus), workers, len(ffn_here)), **got}
        here = {}
        if "attn" in got:
            here["attn"] = got["attn"]
        for i, name in enumerate(ffn_here):
            if f"ffn{i}" in got:
                here[name] = got[f"ffn{i}"]
        planned.update(here)
        rest = [n for n in names if n not in here]
        usable = format_cpu_list(node.cpus) if node.cpus else "?"
        if here:
            per_role = ", ".join(f"{k}={v}" for k, v in here.items())
            lines.append(
                f"cpus on {node.label} ({CPU_BIND} per role): {per_role} "
                f"({len(node.cpus)} usable: {usable})"
            )
        if rest:
            if not split:
                why = "GPUs given by Ray" if inherited is None else f"{CPU_BIND}={inherited}"
                lines.append(
                    f"cpus on {node.label}: {why}; {CPU_BIND} of {', '.join(rest)} left as is"
                )
            else:
                lines.append(
                    f"WARNING: {len(node.cpus)} usable CPU(s) ({usable}) on {node.label} for "
                    f"{len(names)} role process(es): {CPU_BIND} of {', '.join(rest)} left to vLLM"
                )
        lines += [f"WARNING: {w}" for w in cpu_warnings(here, list(node.cpus))]
    return planned, lines
