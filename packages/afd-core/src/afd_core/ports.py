"""Free TCP ports that stay free until their owner binds them.

A port the OS hands out for ``bind(host, 0)`` lies in the host's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, usually 32768-60999), the same range every
process's outgoing connections and ``bind(0)`` sockets draw from. A role told to listen
on such a port some seconds later (the rendezvous store, an HTTP server) can find it
taken by then: vLLM alone binds a handful of ephemeral ports while a role starts.
:func:`free_port` therefore picks, at random, a bindable port *outside* the ephemeral
range (20000 up to it, or above it), which only an explicit bind can take; where the
range leaves no room it falls back to the OS's choice.

A port is free for a while before its role binds it (a vLLM role binds its rendezvous
store tens of seconds after its launcher picked the port), and in that window another
launcher on the host may pick the same one: two deployments started side by side did
(CI, 2026-12-06: the second one's FFN server met the first one's attention rank at its
rendezvous, and the admission token refused it). So every port :func:`free_port` picks is
also *reserved* host-wide for :data:`RESERVATION_S` seconds: a file named after the port,
created exclusively in :func:`reservation_dir` (``$AFD_PORT_DIR``, else
``/tmp/afd-ports-<uid>``); no other :func:`free_port` call on the host hands it out while
the reservation lasts. A reservation older than that is taken over; where the folder
cannot be written, ports are picked as before (bind test only).
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = ["ephemeral_range", "free_port", "port_bindable", "reservation_dir", "reserve"]

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_DEFAULT_RANGE = (32768, 60999)
#: Lowest port :func:`free_port` picks: below are well-known services' usual ports and
#: Ray's default worker ports (10002-19999), which a Ray node binds as workers start.
LOWEST = 20000
_TRIES = 200
_random = random.SystemRandom()
#: How long a picked port stays reserved for the role it was picked for: longer than a
#: role's start-up (compiled ranks on a loaded host: minutes).
RESERVATION_S = 900.0


def reservation_dir() -> Path:
    """Where the host's port reservations live: ``$AFD_PORT_DIR``, else
    ``/tmp/afd-ports-<uid>`` (one folder for every afd process of the user, whatever its
    ``TMPDIR``)."""
    explicit = os.environ.get("AFD_PORT_DIR")
    if explicit:
        return Path(explicit)
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path("/tmp") / f"afd-ports-{uid}"


def reserve(port: int, *, now: float | None = None) -> bool:
    """Reserve ``port`` host-wide (see the module docstring): True when this call holds it
    now (a new reservation, one older than :data:`RESERVATION_S` taken over, or no folder
    to keep reservations in), False while another reservation holds it."""
    folder = reservation_dir()
    path = folder / str(port)
    stamp = time.time() if now is None else now
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return True
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                age = stamp - path.stat().st_mtime
            except FileNotFoundError:
                continue  # released meanwhile: try again
            if age <= RESERVATION_S:
                return False
            path.unlink(missing_ok=True)  # stale: take it over
            continue
        except OSError:
            return True
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()}\n")
        os.utime(path, (stamp, stamp))
        return True
    return False


def ephemeral_range(path: str = _RANGE_FILE) -> tuple[int, int]:
    """The host's ephemeral port range ``(low, high)``, both included (Linux's default
    where it cannot be read)."""
    try:
        with open(path) as f:
            low, high = (int(v) for v in f.read().split()[:2])
    except (OSError, ValueError):
        return _DEFAULT_RANGE
    return (low, high) if 0 < low <= high <= 65535 else _DEFAULT_RANGE


def port_bindable(host: str, port: int) -> bool:
    """Whether a TCP socket can bind ``(host, port)`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _nth(spans: list[tuple[int, int]], n: int) -> int:
    for a, b in spans:
        if n <= b - a:
            return a + n
        n -= b - a + 1
    raise IndexError(n)


def free_port(
    host: str = "127.0.0.1",
    taken: Iterable[int] = (),
    *,
    ephemeral: tuple[int, int] | None = None,
) -> int:
    """A port of ``host`` that is bindable now, not in ``taken``, outside the ephemeral
    range and reserved host-wide for this caller (see the module docstring); the OS's
    choice when no such port is found."""
    low, high = ephemeral or ephemeral_range()
    avoid = set(taken)
    spans = [(LOWEST, low - 1), (high + 1, 65535)]
    spans = [(a, b) for a, b in spans if a <= b]
    size = sum(b - a + 1 for a, b in spans)
    for _ in range(_TRIES if size else 0):
        port = _nth(spans, _random.randrange(size))
        if port not in avoid and port_bindable(host, port) and reserve(port):
            return port
    for _ in range(_TRIES):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in avoid:
            return port
    raise OSError(f"no free TCP port on {host}")
