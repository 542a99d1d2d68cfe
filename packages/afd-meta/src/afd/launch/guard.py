"""The guard of a role process that a Ray actor started: stops the role when the actor is
gone.

A role process runs in a process group of its own (so that a signal reaches vLLM's
children too), which also means it outlives the actor that started it: Ray kills a dead
actor's worker, not its children's children. ``python -m afd.launch.guard OWNER START
PGID GRACE`` detaches itself (so Ray does not kill it with the actor), then watches: once
the process ``OWNER`` (the actor, identified by its ``/proc`` start time ``START``) is
gone, it sends SIGTERM to the process group ``PGID``, SIGKILL after ``GRACE`` seconds,
and exits; it also exits once the group is empty. Nothing but afd-core's ``/proc``
reader is imported.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

from afd_core.procfs import group_members, process_start

__all__ = ["guard", "main"]

POLL_S = 0.5


def _signal(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def guard(owner: int, owner_start: str, pgid: int, grace_s: float, poll_s: float = POLL_S) -> bool:
    """Watch until the group is empty (False) or the owner is gone and the group has been
    stopped (True)."""
    while group_members(pgid):
        if process_start(owner) != owner_start:
            _signal(pgid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while group_members(pgid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if group_members(pgid):
                _signal(pgid, signal.SIGKILL)
            return True
        time.sleep(poll_s)
    return False


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 4:
        print("usage: python -m afd.launch.guard OWNER START PGID GRACE", file=sys.stderr)
        return 2
    owner, owner_start, pgid, grace = int(args[0]), args[1], int(args[2]), float(args[3])
    if os.fork() > 0:  # the child carries on, no longer a child of the actor
        return 0
    os.setsid()
    guard(owner, owner_start, pgid, grace)
    return 0


if __name__ == "__main__":
    os._exit(main())
