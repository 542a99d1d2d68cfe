"""Ports of a deployment: the attention server's HTTP port, the AFD connector's
rendezvous port and the FFN servers' ``/health`` + ``/metrics`` ports, all distinct.

A fixed port from the spec is bind-tested (a :class:`DeploymentError` names the one in
use); 0 picks free ports outside the host's ephemeral range, each reserved host-wide
until its role has had time to bind it (:func:`afd_core.ports.free_port`: two launchers
started side by side do not pick the same one), no two roles the same one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from afd.launch.errors import DeploymentError
from afd.launch.spec import DeploymentSpec
from afd_core.ports import free_port, port_bindable, reserve

__all__ = ["allocate_health_ports", "allocate_ports", "reserve_ports"]


class _FreePorts:
    """Free ports of ``host`` (:func:`afd_core.ports.free_port`: outside the ephemeral
    range, so that no other process's outgoing socket takes one before its role binds
    it), none of them in ``taken``, which grows with every port given."""

    def __init__(self, host: str, taken: set[int]) -> None:
        self.host = host
        self.taken = taken

    def in_use(self, port: int) -> bool:
        """Whether a fixed ``port`` is taken already or cannot be bound."""
        return port in self.taken or not port_bindable(self.host, port)

    def pick(self) -> int:
        try:
            port = free_port(self.host, self.taken)
        except OSError as exc:
            raise DeploymentError(f"could not find a free port: {exc}") from None
        self.taken.add(port)
        return port


def allocate_ports(spec: DeploymentSpec, *, avoid: Iterable[int] = ()) -> tuple[list[int], int]:
    """``(http ports of the attention servers, connector port)``: all distinct.

    Fixed ports from the spec are bind-tested (a :class:`DeploymentError` names the
    one in use); 0 picks free ports (:func:`afd_core.ports.free_port`), all distinct.
    """
    n_http = 1  # one attention server; its data-parallel ranks are the attention ranks
    ports = _FreePorts(spec.host, set(avoid))
    if spec.http_port:
        http = list(range(spec.http_port, spec.http_port + n_http))
        for i, p in enumerate(http):
            if ports.in_use(p):
                raise DeploymentError(
                    f"port {p} (HTTP of attention server {i}) is in use; "
                    "choose another http_port or 0 for free ports"
                )
        ports.taken.update(http)
    else:
        http = [ports.pick() for _ in range(n_http)]
    if spec.native:
        return http, 0
    # With FFN expert parallelism FFN rank f rendezvous on connector_port + f.
    planes = spec.num_ffn if spec.ffn_expert_parallel else 1
    if spec.connector_port:
        conn = spec.connector_port
        for p in range(conn, conn + planes):
            if ports.in_use(p):
                raise DeploymentError(
                    f"port {p} (AFD connector rendezvous) is in use or taken by an HTTP "
                    "port; choose another connector_port or 0 for a free port"
                )
        ports.taken.update(range(conn, conn + planes))
    else:
        conn = ports.pick()  # reserved host-wide (afd_core.ports), and so are the planes'
        while any(ports.in_use(p) or not reserve(p) for p in range(conn + 1, conn + planes)):
            conn = ports.pick()
        ports.taken.update(range(conn, conn + planes))
    return http, conn


def allocate_health_ports(spec: DeploymentSpec, *, avoid: Iterable[int] = ()) -> list[int]:
    """The ``/health`` + ``/metrics`` ports of the FFN servers, distinct from ``avoid``
    (the ports :func:`allocate_ports` gave): ``ffn_health_port + rank`` bind-tested, or
    free ports when it is 0."""
    if spec.native:
        return []
    ports = _FreePorts(spec.host, set(avoid))
    if not spec.ffn_health_port:
        return [ports.pick() for _ in range(spec.num_ffn)]
    fixed = list(range(spec.ffn_health_port, spec.ffn_health_port + spec.num_ffn))
    for rank, p in enumerate(fixed):
        if ports.in_use(p):
            raise DeploymentError(
                f"port {p} (health/metrics of FFN server {rank}) is in use or taken by "
                "another port of the deployment; choose another ffn_health_port or 0 "
                "for free ports"
            )
    return fixed


def reserve_ports(
    host: str, wanted: Sequence[tuple[str, int, str]], *, avoid: Iterable[int] = ()
) -> list[int]:
    """Ports on ``host`` for ``wanted``: ``(what it is, port or 0, the spec field)``
    entries; a fixed port is bind-tested (a :class:`DeploymentError` names it and its
    field), 0 picks a free one; all distinct and none in ``avoid``. A Ray role actor
    runs this on its node (:mod:`afd.launch.ray`)."""
    ports = _FreePorts(host, set(avoid))
    out = []
    for what, port, field in wanted:
        if port:
            if ports.in_use(port):
                raise DeploymentError(
                    f"port {port} ({what}) is in use on {host}; choose another {field} or "
                    "0 for a free port"
                )
            ports.taken.add(port)
            out.append(port)
        else:
            out.append(ports.pick())
    return out
