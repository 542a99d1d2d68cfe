"""The default rendezvous of :func:`afd_core.connect.connect_phase`: a TCP store at
``afd.host:afd.port`` that attention rank 0 hosts (imports torch when used, not here).
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

from afd_core.admission import KeyValueStore
from afd_core.config import AFDConfig
from afd_core.errors import AFDConfigError, AFDTimeoutError

__all__ = ["TCPRendezvous"]


class TCPRendezvous:
    """A ``torch.distributed.TCPStore`` at ``afd.host:afd.port``, hosted by attention rank 0.

    The host listens on ``afd.host`` only (torch's own listener would take every address
    of the machine); a joining rank polls for the listener first, so it joins within
    0.1 s of the host's start (torch's client backs off by seconds). Scoped views are
    ``torch.distributed.PrefixStore`` s, so process groups can be built on them.
    """

    def __init__(self, config: AFDConfig) -> None:
        self.host = config.host
        self.port = config.port
        self.world_size = config.topology.world_size
        self.timeout_s = config.connect_timeout_s

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    def open(self, *, host: bool, deadline: float) -> KeyValueStore:
        import torch.distributed as dist
        from torch.distributed import TCPStore

        listen_fd = None
        if host:
            listen_fd = _listen(self.host, self.port, self.where)
        else:
            _wait_for_listener(self.host, self.port, deadline)
        try:
            store: KeyValueStore = TCPStore(
                self.host,
                self.port,
                self.world_size,
                host,
                timeout=timedelta(seconds=self.timeout_s),
                wait_for_workers=False,
                master_listen_fd=listen_fd,
            )
        except (RuntimeError, dist.DistError) as exc:  # DistStoreError / DistNetworkError
            if host:
                raise AFDConfigError(
                    f"AFD rendezvous: attention rank 0 could not listen on {self.where} "
                    f"({exc}); choose a free afd.port"
                ) from exc
            raise AFDTimeoutError(
                f"AFD rendezvous: could not reach the store at {self.where} hosted by "
                f"attention rank 0 within {self.timeout_s:g} s ({type(exc).__name__}: {exc}); "
                "is attention rank 0 running with the same afd.host/afd.port?"
            ) from exc
        return store

    def scoped(self, store: KeyValueStore, prefix: str) -> KeyValueStore:
        from torch.distributed import PrefixStore

        # PrefixStore adds "/" between its prefix and a key.
        scoped: KeyValueStore = PrefixStore(prefix.rstrip("/"), store)
        return scoped


def _listen(host: str, port: int, where: str) -> int:
    """A socket listening on ``host:port`` only, as a file descriptor for the TCPStore
    (which takes it over)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise AFDConfigError(
            f"AFD rendezvous: afd.host {host!r} does not resolve to an address of this "
            f"machine ({exc}); set afd.host to attention rank 0's address"
        ) from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(512)
    except OSError as exc:
        sock.close()
        why = exc.strerror or exc
        raise AFDConfigError(
            f"AFD rendezvous: attention rank 0 could not listen on {where} ({why}); choose "
            "a free afd.port, and an afd.host that is an address of this machine"
        ) from exc
    return sock.detach()


def _wait_for_listener(host: str, port: int, deadline: float) -> None:
    """Wait until something listens at ``host:port`` (polling every 50 ms); at the
    deadline the TCPStore client reports the failure."""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1.0) as sock:
                # On loopback a connect to a port nobody listens on can pick that very
                # port as its source and connect to itself (TCP simultaneous open),
                # holding the port attention rank 0 is about to bind: not a listener.
                if sock.getsockname() != sock.getpeername():
                    return
        except OSError:
            pass
        time.sleep(0.05)
