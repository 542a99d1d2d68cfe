"""What Linux ``/proc/<pid>/stat`` says about a process: the one parser afd uses.

The shared-memory connector asks whether a peer process is still the one that joined
(its start time); ``afd launch`` asks which processes of a role's group are left.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ProcStat", "descendants", "group_members", "process_start", "read_stat"]

_DEAD_STATES = frozenset({"Z", "X", "x"})  # zombie / dead: exited, not yet reaped


@dataclass(frozen=True, slots=True)
class ProcStat:
    pid: int
    state: str
    ppid: int
    pgrp: int
    start_time: str
    """Field 22 of proc(5)'s stat: start time in clock ticks after boot."""

    @property
    def alive(self) -> bool:
        return self.state not in _DEAD_STATES


def _parse(pid: int, data: bytes) -> ProcStat:
    # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
    fields = data[data.rindex(b")") + 2 :].split()
    return ProcStat(pid, fields[0].decode(), int(fields[1]), int(fields[2]), fields[19].decode())


def read_stat(pid: int) -> ProcStat | None:
    """``/proc/<pid>/stat`` parsed; None when the process does not exist.

    Raises :class:`OSError` when it exists but cannot be read.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    return _parse(pid, data)


def process_start(pid: int) -> str | None:
    """Start time of ``pid``: None if it is gone (or a zombie), ``""`` if it is alive but
    ``/proc`` cannot tell (no procfs, no permission)."""
    try:
        stat = read_stat(pid)
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""
    if stat is None or not stat.alive:
        return None
    return stat.start_time


def _live_stats() -> list[ProcStat]:
    stats = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = read_stat(int(entry))
        except (OSError, ValueError, IndexError):
            continue
        if stat is not None and stat.alive:
            stats.append(stat)
    return stats


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) pids whose process group is ``pgid``."""
    return [stat.pid for stat in _live_stats() if stat.pgrp == pgid]


def descendants(pid: int) -> list[int]:
    """Live pids below ``pid`` (children, their children, ...), parents first."""
    children: dict[int, list[int]] = {}
    for stat in _live_stats():
        children.setdefault(stat.ppid, []).append(stat.pid)
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = children.get(todo.pop(0), [])
        found += kids
        todo += kids
    return found
