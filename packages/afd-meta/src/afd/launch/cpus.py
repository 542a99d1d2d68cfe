"""CPUs of the role processes on a CPU host: ``VLLM_CPU_OMP_THREADS_BIND`` per role.

vLLM's CPU list format (``"0-2,4"``; ``|`` between the DP ranks of one server), the
usable CPUs, their split between the attention server and the FFN ranks
(:func:`split_cpus`, :func:`assign_cpus`), the affinity of a whole role process tree
(:func:`bind_affinity`) and the OpenMP settings of an in-process worker
(:func:`omp_bind_env`).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable, Mapping, Sequence

__all__ = [
    "CPU_BIND",
    "SHARED_OMP_ENV",
    "assign_cpus",
    "bind_affinity",
    "format_cpu_list",
    "omp_bind_env",
    "parse_cpu_list",
    "share_cpus",
    "shares_cpus",
    "split_cpus",
    "usable_cpus",
]

CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"
# vLLM's own values of VLLM_CPU_OMP_THREADS_BIND besides CPU lists.
CPU_BIND_KEYWORDS = ("auto", "nobind")
CPU_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")
#: OpenMP settings of a role process whose CPUs another role process uses too (the roles
#: of a 1A1F deployment take turns on every CPU, see :func:`afd.launch.placement.plan_cpus`):
#: its OpenMP threads stop spinning soon after a parallel region (libgomp spins ~300000
#: times by default, Intel OpenMP 5 ms with vLLM's settings), so a role that waits for
#: the other one leaves it the CPUs. One spin costs ~25 ns here, so 10000 spins are
#: ~0.25 ms: long enough to bridge the gaps inside a role's turn, short enough not to eat
#: the other role's turn. Measured on the bench-size Qwen3-MoE, 2 vCPUs, two deployments
#: each, c = 16 and 32 (docs/bench/2026-12-03-handover-tax.md): 10000 and 3000 beat
#: 30000 (the earlier default) by 7-13 %. KMP_BLOCKTIME is Intel OpenMP's counterpart,
#: not measured here (vLLM's CPU build preloads libgomp).
SHARED_OMP_ENV = {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "1"}


def parse_cpu_list(value: str) -> list[int]:
    """CPU ids of a CPU list in vLLM's format (``"0-2,4"`` -> ``[0, 1, 2, 4]``), sorted."""
    value = value.replace(" ", "")
    if not CPU_LIST.match(value):
        raise ValueError(f"{value!r} is not a CPU list (e.g. 0, 0-3, 1,3)")
    out: set[int] = set()
    for part in value.split(","):
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if last < first:
            raise ValueError(f"{value!r}: the range {part} is empty")
        out.update(range(first, last + 1))
    return sorted(out)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The shortest CPU list in vLLM's format: ``[0, 1, 2, 4]`` -> ``"0-2,4"``."""
    ids = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (``os.sched_getaffinity``), sorted."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def _blocks(cpus: Sequence[int], n: int) -> list[list[int]]:
    """``cpus`` cut into ``n`` contiguous blocks, as even as possible (first ones larger)."""
    size, extra = divmod(len(cpus), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(list(cpus[start:end]))
        start = end
    return out


def split_cpus(cpus: Sequence[int], num_attention: int, num_ffn: int) -> dict[str, str] | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` per role process from the usable ``cpus``, or None
    when there are fewer CPUs than role processes (``num_attention + num_ffn``).

    The attention server gets the first half, rounded up (but leaving one CPU per FFN
    rank), cut into one block per DP rank (``"0|1"``, vLLM's format for the DP ranks of
    one server); the FFN ranks get the rest, one block each. Every process gets at least
    one CPU. ``num_ffn = 0`` (the native baseline): all of them. ``num_attention = 0``
    (a host of FFN ranks only, as a Ray node can be): the FFN ranks share all of them.
    2 CPUs, 1A1F: ``{"attn": "0", "ffn0": "1"}``.
    """
    cpus = sorted(set(cpus))
    n = len(cpus)
    if n < num_attention + num_ffn or n == 0 or num_attention + num_ffn == 0:
        return None
    if num_attention == 0:
        n_attn = 0
    elif num_ffn == 0:
        n_attn = n
    else:
        n_attn = max(num_attention, min((n + 1) // 2, n - num_ffn))
    out = {}
    if num_attention:
        out["attn"] = "|".join(format_cpu_list(b) for b in _blocks(cpus[:n_attn], num_attention))
    for f, block in enumerate(_blocks(cpus[n_attn:], num_ffn) if num_ffn else []):
        out[f"ffn{f}"] = format_cpu_list(block)
    return out


def share_cpus(cpus: Sequence[int], num_attention: int, num_ffn: int) -> dict[str, str]:
    """Like :func:`split_cpus` when there are fewer ``cpus`` than role processes: each
    process gets one CPU, so some share one (``num_attention``: CPU lists of the attention
    server, one per worker). The attention workers take the CPUs from the first, the FFN
    ranks from the last: a tensor-parallel rank's worker 0 (on the first CPU) runs the
    exchange, the other workers mostly wait in its broadcast while the FFN rank computes.
    2 CPUs, two attention workers and one FFN rank: ``{"attn": "0|1", "ffn0": "1"}``."""
    ids = sorted(set(cpus))
    if not ids:
        return {}
    n = len(ids)
    out = {"attn": "|".join(str(ids[i % n]) for i in range(num_attention))}
    for f in range(num_ffn):
        out[f"ffn{f}"] = str(ids[n - 1 - f % n])
    return out


def assign_cpus(
    num_attention: int,
    num_ffn: int,
    usable: Sequence[int],
    *,
    attention: str | None = None,
    ffn: Sequence[str] | None = None,
) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` per role process: ``{"attn": ..., "ffn0": ...}``.

    ``attention`` (the server's whole value) and ``ffn`` (one value per FFN rank) are
    explicit settings, used as given; the other processes get their share of
    :func:`split_cpus` of ``usable`` (none when ``usable`` is empty or too short).
    ``num_ffn = 0``: the native baseline (``"attn"``: all of ``usable``).
    """
    if ffn is not None and len(ffn) != num_ffn:
        raise ValueError(f"ffn: {len(ffn)} CPU values for {num_ffn} FFN ranks")
    split = (split_cpus(usable, num_attention, num_ffn) if usable else None) or {}
    out: dict[str, str] = {}
    if attention is not None:
        out["attn"] = attention
    elif "attn" in split:
        out["attn"] = split["attn"]
    for f in range(num_ffn):
        if ffn is not None:
            out[f"ffn{f}"] = ffn[f]
        elif f"ffn{f}" in split:
            out[f"ffn{f}"] = split[f"ffn{f}"]
    return out


def _ids(value: str) -> set[int]:
    """CPU ids of a ``VLLM_CPU_OMP_THREADS_BIND`` value (every ``|`` part); none for a
    keyword or anything that is not a CPU list."""
    ids: set[int] = set()
    if value in CPU_BIND_KEYWORDS:
        return ids
    for part in value.split("|"):
        with contextlib.suppress(ValueError):
            ids.update(parse_cpu_list(part))
    return ids


def shares_cpus(cpus: Mapping[str, str], name: str) -> bool:
    """Whether role process ``name`` uses a CPU that another one in ``cpus`` uses too."""
    mine = _ids(cpus.get(name, ""))
    return any(mine & _ids(v) for k, v in cpus.items() if k != name)


def cpu_warnings(cpus: Mapping[str, str], usable: Sequence[int]) -> list[str]:
    """Warnings for CPUs that two role processes would both use, or that are not usable."""
    owner: dict[int, str] = {}
    out = []
    for name, value in cpus.items():
        ids = _ids(value)
        for c in sorted(ids):
            if c in owner and owner[c] != name:
                out.append(f"{owner[c]} and {name} share CPU {c}")
            owner.setdefault(c, name)
        missing = sorted(ids - set(usable)) if usable else []
        if missing:
            out.append(
                f"{name}: CPU {format_cpu_list(missing)} not usable by this process "
                f"(usable: {format_cpu_list(usable)})"
            )
    return out


def bind_affinity(value: str) -> list[int] | None:
    """The CPUs a whole role process tree is confined to for its ``VLLM_CPU_OMP_THREADS_BIND``
    value: the union of its CPU lists (``"0|1"``, a DP server's ranks, -> ``[0, 1]``), or
    None for ``auto`` / ``nobind`` / anything that is not a CPU list (left to vLLM).

    vLLM binds only its worker's OpenMP threads; the API server, the engine core (which
    spins on ``sched_yield`` while it waits for the worker) and every other thread of the
    role would otherwise float onto the cores given to the other role."""
    ids: set[int] = set()
    for part in value.split("|"):
        try:
            ids.update(parse_cpu_list(part))
        except ValueError:
            return None
    return sorted(ids) or None


def omp_bind_env(cpus: str, ld_preload: str = "") -> dict[str, str]:
    """The OpenMP settings vLLM gives a worker process for the CPU list ``cpus``
    (``vllm.utils.ompmultiprocessing``): ``OMP_NUM_THREADS`` plus ``KMP_AFFINITY`` (Intel
    OpenMP preloaded), ``GOMP_CPU_AFFINITY`` (libgomp preloaded) or ``OMP_PLACES`` /
    ``OMP_PROC_BIND``."""
    ids = [str(c) for c in parse_cpu_list(cpus)]
    env = {"OMP_NUM_THREADS": str(len(ids))}
    if "libiomp" in ld_preload or "libomp" in ld_preload:
        env["KMP_AFFINITY"] = f"granularity=fine,explicit,proclist=[{','.join(ids)}]"
        env["KMP_BLOCKTIME"] = "5"
        env["KMP_TPAUSE"] = "0"
    elif "libgomp" in ld_preload:
        env["GOMP_CPU_AFFINITY"] = " ".join(ids)
    else:
        env["OMP_PLACES"] = "{" + ",".join(ids) + "}"
        env["OMP_PROC_BIND"] = "true"
    return env
