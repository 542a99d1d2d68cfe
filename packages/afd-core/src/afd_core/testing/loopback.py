"""An in-process loopback connector and a thread harness to drive it.

:class:`LoopbackAFDConnector` is afd-core's exchange protocol
(:class:`~afd_core.exchange.ExchangeConnector`) over :class:`LoopbackTransport`, which
moves messages between connectors of the same process through a shared hub (one per
``config.host:config.port``) of mailboxes, one per directed (receiver, sender) link.
It serves any topology and is the reference the conformance suite
(:mod:`afd_core.testing.conformance`) is checked against. It needs torch
(``pip install afd-core[testing]``).
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from afd_core.config import AFDConfig, AFDRole
from afd_core.connector import AFDConnector
from afd_core.errors import AFDConnectorError
from afd_core.exchange import IDLE, ExchangeConnector, Message, Spec, TransferContext, Transport
from afd_core.registry import get_connector_class, register_connector
from afd_core.topology import AFDTopology
from afd_core.wire import Frame

if TYPE_CHECKING:
    from afd_core.testing.conformance import Scenario

__all__ = ["LoopbackAFDConnector", "LoopbackHarness", "LoopbackTransport"]

# A mailbox key: (receiver global rank, sender global rank).
_Key = tuple[int, int]
_Box = collections.deque[tuple[Frame, list[Any]]]


@dataclass
class _Hub:
    """Mailboxes shared by the connectors of one ``host:port`` in this process."""

    address: str
    cond: threading.Condition = field(default_factory=threading.Condition)
    boxes: dict[_Key, _Box] = field(default_factory=dict)
    members: set[int] = field(default_factory=set)
    closed: set[int] = field(default_factory=set)
    refs: int = 0

    def box(self, key: _Key) -> _Box:
        return self.boxes.setdefault(key, collections.deque())


_hubs_lock = threading.Lock()
_hubs: dict[str, _Hub] = {}


def _attach(address: str, member: int, who: str) -> _Hub:
    with _hubs_lock:
        hub = _hubs.get(address)
        if hub is None:
            hub = _hubs[address] = _Hub(address)
        with hub.cond:
            if member in hub.members:
                raise AFDConnectorError(
                    f"loopback {address}: {who} is already connected in this process (two "
                    "connectors for one rank?)"
                )
            hub.members.add(member)
            hub.refs += 1
        return hub


def _detach(hub: _Hub) -> None:
    with _hubs_lock:
        hub.refs -= 1
        if hub.refs == 0 and _hubs.get(hub.address) is hub:
            del _hubs[hub.address]


class LoopbackTransport(Transport):
    """Mailboxes of an in-process hub. A message is put whole (tensors cloned), so a
    mailbox is always at a message boundary: ``close()`` leaves a ``Frame.shutdown`` in
    every peer's mailbox, behind what was already sent."""

    def __init__(self, connector: ExchangeConnector) -> None:
        super().__init__(connector)
        self.hub: _Hub | None = None

    def connect(self) -> None:
        c = self.connector
        who = f"{c.role.value} rank {c.rank}"
        self.hub = _attach(c.where, c.global_rank, who)
        self.ready = True

    def close(self) -> None:
        hub, c = self.hub, self.connector
        self.ready = False
        if hub is None:
            return
        with hub.cond:
            hub.closed.add(c.global_rank)
            for peer in c.peers:
                hub.box((peer, c.global_rank)).append((Frame.shutdown(c.global_rank), []))
            hub.cond.notify_all()
        _detach(hub)

    def send(self, ctx: TransferContext, messages: Iterable[Message]) -> None:
        hub, me = self.hub, self.connector.global_rank
        assert hub is not None
        for peer, frame, tensors in messages:
            copies = [t.detach().clone() for t in tensors]
            with hub.cond:
                if peer in hub.closed:
                    raise ctx.at(peer).goodbye_error()
                hub.box((peer, me)).append((frame, copies))
                hub.cond.notify_all()

    def recv_frame(self, ctx: TransferContext) -> Frame:
        hub = self.hub
        assert hub is not None
        box = hub.box((self.connector.global_rank, ctx.peer))
        with hub.cond:
            while not box:
                if self.connector.closed:
                    raise ctx.closed_error()
                if ctx.deadline == IDLE:  # the next step: no deadline
                    hub.cond.wait()
                    continue
                remaining = ctx.remaining()
                if remaining <= 0:
                    raise ctx.timeout_error()
                hub.cond.wait(remaining)
            return box[0][0]

    def recv_tensors(
        self, ctx: TransferContext, parts: Sequence[tuple[int, int]], specs: Sequence[Spec]
    ) -> list[Any]:
        hub = self.hub
        assert hub is not None
        me = self.connector.global_rank
        with hub.cond:
            got = [hub.box((me, peer)).popleft()[1] for peer, _ in parts]
        if len(got) == 1:
            return got[0]
        return [torch.cat(rows, dim=0) for rows in zip(*got, strict=True)]


class LoopbackAFDConnector(ExchangeConnector):
    """In-process connector: every rank is a connector object in the same Python process."""

    name: ClassVar[str] = "LoopbackAFDConnector"
    transport_class: ClassVar[type[Transport]] = LoopbackTransport

    @property
    def address(self) -> str:
        return self.where


_ports = itertools.count(40000)


class LoopbackHarness:
    """Runs a conformance scenario with one thread per rank (in-process connectors).

    ``connector`` is a registered name or an :class:`AFDConnector` subclass used
    directly (e.g. a deliberately broken subclass in a test). Every run uses a
    fresh loopback address, so runs never see each other's messages.
    """

    def __init__(
        self,
        connector: str | type[AFDConnector] = LoopbackAFDConnector.name,
        *,
        host: str = "loopback",
        run_timeout_s: float = 60.0,
    ) -> None:
        self.connector_cls = (
            connector if isinstance(connector, type) else get_connector_class(connector)
        )
        self.connector_name = (
            connector if isinstance(connector, str) else (connector.name or connector.__name__)
        )
        self.host = host
        self.run_timeout_s = run_timeout_s

    def configs(
        self, topology: AFDTopology, overrides: Mapping[str, Any] | None = None
    ) -> dict[tuple[AFDRole, int], AFDConfig]:
        port = next(_ports)
        out: dict[tuple[AFDRole, int], AFDConfig] = {}
        for role in AFDRole:
            for rank in range(topology.size_of(role)):
                values: dict[str, Any] = {
                    "role": role,
                    "connector": self.connector_name,
                    "host": self.host,
                    "port": port,
                    "num_attention_ranks": topology.num_attention_ranks,
                    "num_ffn_ranks": topology.num_ffn_ranks,
                    "rank": rank,
                    **(overrides or {}),
                }
                out[(role, rank)] = AFDConfig(**values)
        return out

    def run(self, scenario: Scenario, topology: AFDTopology) -> dict[tuple[str, int], Any]:
        from afd_core.testing.conformance import RankContext

        return self.run_ranks(
            topology,
            lambda conn, role, rank: scenario.run_rank(conn, RankContext(role, rank, topology)),
            scenario.config_overrides,
        )

    def run_ranks(
        self,
        topology: AFDTopology,
        body: Callable[[AFDConnector, AFDRole, int], Any],
        overrides: Mapping[str, Any] | None = None,
    ) -> dict[tuple[str, int], Any]:
        from afd_core.testing.threads import run_rank_threads

        configs = self.configs(topology, overrides)
        return run_rank_threads(
            configs,
            lambda key: self.connector_cls(configs[key], rank=key[1]),
            body,
            run_timeout_s=self.run_timeout_s,
            barrier_after_init=True,
        )


def register_loopback() -> type[LoopbackAFDConnector]:
    """Register :class:`LoopbackAFDConnector` under its name in this process; returns it.

    The test double is not an installed connector (no ``afd.connectors`` entry point, so
    a deployment cannot select it by accident); tests that select it by name call this.
    Registering again does nothing.
    """
    register_connector(LoopbackAFDConnector.name, LoopbackAFDConnector)
    return LoopbackAFDConnector
