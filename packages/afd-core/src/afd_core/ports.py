"""Free TCP ports that stay free until their owner binds them.

A port the OS hands out for ``bind(host, 0)`` lies in the host's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, usually 32768-60999), the same range every
process's outgoing connections and ``bind(0)`` sockets draw from. A role told to listen
on such a port some seconds later (the rendezvous store, an HTTP server) can find it
taken by then: vLLM alone binds a handful of ephemeral ports while a role starts.
:func:`free_port` therefore picks, at random, a bindable port *outside* the ephemeral
range (20000 up to it, or above it), which only an explicit bind can take; where the
range leaves no room it falls back to the OS's choice.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterable

__all__ = ["ephemeral_range", "free_port", "port_bindable"]

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_DEFAULT_RANGE = (32768, 60999)
#: Lowest port :func:`free_port` picks: below are well-known services' usual ports and
#: Ray's default worker ports (10002-19999), which a Ray node binds as workers start.
LOWEST = 20000
_TRIES = 200
_random = random.SystemRandom()


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
    """A port of ``host`` that is bindable now, not in ``taken``, and outside the
    ephemeral range (see the module docstring); the OS's choice when no such port is
    found."""
    low, high = ephemeral or ephemeral_range()
    avoid = set(taken)
    spans = [(LOWEST, low - 1), (high + 1, 65535)]
    spans = [(a, b) for a, b in spans if a <= b]
    size = sum(b - a + 1 for a, b in spans)
    for _ in range(_TRIES if size else 0):
        port = _nth(spans, _random.randrange(size))
        if port not in avoid and port_bindable(host, port):
            return port
    for _ in range(_TRIES):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in avoid:
            return port
    raise OSError(f"no free TCP port on {host}")
