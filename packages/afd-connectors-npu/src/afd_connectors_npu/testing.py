"""A fake of the CAM operators (the hardware boundary) and a thread harness over it.

:class:`FakeCAMFabric` stands in for the Ascend CAM world of one deployment: every
:class:`FakeCAMOps` built by :meth:`FakeCAMFabric.ops_factory` (one per role and rank,
each typically driven by its own thread) talks to the others through in-process
mailboxes. It implements the :class:`~afd_connectors_npu.ops.CAMOps` contract the
connectors rely on: ordered delivery per (sender, receiver, operator), copies of the
tensors (as a device transfer would), timeouts, ``close()`` unblocking receives, peer
loss (:meth:`FakeCAMFabric.lose`), a non-blocking dispatch with optional latency, and
a record of what each operator was handed (:attr:`FakeCAMFabric.records`).

The fabric also holds the deployment's rendezvous store (in memory,
:class:`~afd_core.testing.store.MemoryRendezvous`), so the connectors' connect phase
(admission: token, rank, fingerprint) runs over it as it does over TCP on Ascend.

It moves tensors; it does not model CAM's expert-major dispatch layout, quantisation,
buffer capacities or HCCL. :class:`CAMThreadHarness` implements afd-core's
``ConnectorHarness`` (one thread per rank) so ``run_scenario`` runs over the fake.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from afd_connectors_npu.ops import A2EMessage, CAMHandle, E2AMessage, RankKey
from afd_core.config import AFDConfig, AFDRole
from afd_core.connector import AFDConnector
from afd_core.errors import (
    AFDConnectorClosedError,
    AFDPeerLostError,
    AFDTimeoutError,
)
from afd_core.testing.store import MemoryRendezvous
from afd_core.topology import AFDTopology

__all__ = ["FakeCAMFabric", "FakeCAMOps", "FakeCAMHandle", "OpRecord", "CAMThreadHarness"]

_Message = A2EMessage | E2AMessage
# Mailbox key: (operator family, receiver role, receiver rank, sender rank).
_Box = tuple[str, AFDRole, int, int]


def _clone(t: Any) -> Any:
    return None if t is None else t.detach().clone()


def _copy(message: _Message) -> _Message:
    if isinstance(message, A2EMessage):
        return A2EMessage(
            tuple(message.meta),
            _clone(message.hidden_states),
            _clone(message.ids),
            _clone(message.scales),
            _clone(message.hidden_scales),
        )
    return E2AMessage(
        tuple(message.meta),
        _clone(message.output),
        _clone(message.extra),
        _clone(message.output_scales),
    )


@dataclass(frozen=True)
class OpRecord:
    """One operator call as the fake received it (tensors copied at call time)."""

    op: str
    role: AFDRole
    rank: int
    peer: int
    message: _Message


def _other(role: AFDRole) -> AFDRole:
    return AFDRole.FFN if role is AFDRole.ATTENTION else AFDRole.ATTENTION


class FakeCAMHandle:
    """Handle of a fake asynchronous dispatch."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float) -> None:
        if not self._event.wait(timeout_s):
            raise AFDTimeoutError(f"fake CAM dispatch not completed within {timeout_s:g} s")
        if self._error is not None:
            raise self._error


@dataclass
class FakeCAMFabric:
    """The in-process CAM world shared by the :class:`FakeCAMOps` of one deployment.

    ``dispatch_latency_s`` delays the delivery of each asynchronous dispatch (on a
    background thread) so tests can see that ``dispatch_send`` does not block.
    """

    dispatch_latency_s: float = 0.0
    records: list[OpRecord] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _boxes: dict[_Box, collections.deque[_Message]] = field(default_factory=dict)
    rendezvous: MemoryRendezvous = field(default_factory=MemoryRendezvous)
    """The store the ranks meet at (on Ascend: the binding's TCP store at afd.host:afd.port)."""
    _gone: set[RankKey] = field(default_factory=set)

    def ops_factory(self, config: AFDConfig, rank: int) -> FakeCAMOps:
        """A :data:`~afd_connectors_npu.ops.CAMOpsFactory` over this fabric."""
        return FakeCAMOps(self, config, rank)

    def lose(self, role: AFDRole | str, rank: int) -> None:
        """Simulate the death of ``(role, rank)``: its peers see ``AFDPeerLostError``."""
        with self._cond:
            self._gone.add((AFDRole(role), rank))
            self._cond.notify_all()

    def recorded(self, op: str, role: AFDRole | str | None = None) -> list[OpRecord]:
        """The records of operator ``op`` (e.g. ``"dispatch_send"``), optionally of one role."""
        with self._cond:
            return [
                r for r in self.records if r.op == op and (role is None or r.role is AFDRole(role))
            ]

    # -- used by FakeCAMOps ------------------------------------------------------------
    def _record(self, op: str, me: RankKey, peer: int, message: _Message) -> None:
        with self._cond:
            self.records.append(OpRecord(op, me[0], me[1], peer, _copy(message)))

    def _deliver(self, family: str, sender: RankKey, peer: int, message: _Message) -> None:
        dst = (_other(sender[0]), peer)
        with self._cond:
            if sender in self._gone:
                raise AFDConnectorClosedError(
                    f"fake CAM {family}: {sender[0].value} rank {sender[1]} is closed"
                )
            if dst in self._gone:
                raise AFDPeerLostError(
                    f"fake CAM {family}: {dst[0].value} rank {peer} is gone; cannot send to it"
                )
            box = self._boxes.setdefault((family, dst[0], dst[1], sender[1]), collections.deque())
            box.append(_copy(message))
            self._cond.notify_all()

    def _take(self, family: str, me: RankKey, peer: int, timeout_s: float) -> _Message:
        src = (_other(me[0]), peer)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            box = self._boxes.setdefault((family, me[0], me[1], peer), collections.deque())
            while True:
                if me in self._gone:
                    raise AFDConnectorClosedError(
                        f"fake CAM {family}: {me[0].value} rank {me[1]} closed while waiting "
                        f"for {src[0].value} rank {peer}"
                    )
                if box:
                    return box.popleft()
                if src in self._gone:
                    raise AFDPeerLostError(
                        f"fake CAM {family}: {src[0].value} rank {peer} is gone while "
                        f"{me[0].value} rank {me[1]} waited for it"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AFDTimeoutError(
                        f"fake CAM {family}: {me[0].value} rank {me[1]} received nothing from "
                        f"{src[0].value} rank {peer} within {timeout_s:g} s "
                        "(timeout_s argument or afd.transfer_timeout_s)"
                    )
                self._cond.wait(remaining)


class FakeCAMOps:
    """:class:`~afd_connectors_npu.ops.CAMOps` of one (role, rank) over a :class:`FakeCAMFabric`."""

    def __init__(self, fabric: FakeCAMFabric, config: AFDConfig, rank: int) -> None:
        self.fabric = fabric
        self.key: RankKey = (config.role, rank)
        self.topology = AFDTopology(config.num_attention_ranks, config.num_ffn_ranks)
        self._closed = False
        self.store: Any = None

    def rendezvous(self) -> MemoryRendezvous:
        """The fabric's in-memory store: afd-core's connect phase runs over it unchanged."""
        return self.fabric.rendezvous

    def join(self, store: Any, *, timeout_s: float) -> None:
        if self._closed:
            raise AFDConnectorClosedError("fake CAM join: closed while joining")
        self.store = store

    # -- synchronous ----------------------------------------------------------------------
    def a2e_send(self, ffn_rank: int, message: A2EMessage, *, timeout_s: float) -> None:
        self.fabric._record("a2e_send", self.key, ffn_rank, message)
        self.fabric._deliver("a2e", self.key, ffn_rank, message)

    def a2e_recv(self, attention_rank: int, *, timeout_s: float) -> A2EMessage:
        message = self.fabric._take("a2e", self.key, attention_rank, timeout_s)
        assert isinstance(message, A2EMessage)
        return message

    def e2a_send(self, attention_rank: int, message: E2AMessage, *, timeout_s: float) -> None:
        self.fabric._record("e2a_send", self.key, attention_rank, message)
        self.fabric._deliver("e2a", self.key, attention_rank, message)

    def e2a_recv(self, ffn_rank: int, *, timeout_s: float) -> E2AMessage:
        message = self.fabric._take("e2a", self.key, ffn_rank, timeout_s)
        assert isinstance(message, E2AMessage)
        return message

    # -- asynchronous ---------------------------------------------------------------------
    def dispatch_send(self, ffn_rank: int, message: A2EMessage) -> CAMHandle:
        self.fabric._record("dispatch_send", self.key, ffn_rank, message)
        handle = FakeCAMHandle()
        copy = _copy(message)

        def deliver() -> None:
            try:
                self.fabric._deliver("dispatch", self.key, ffn_rank, copy)
            except BaseException as exc:
                handle._finish(exc)
            else:
                handle._finish()

        if self.fabric.dispatch_latency_s > 0:
            timer = threading.Timer(self.fabric.dispatch_latency_s, deliver)
            timer.daemon = True
            timer.start()
        else:
            deliver()
        return handle

    def dispatch_recv(self, attention_rank: int, *, timeout_s: float) -> A2EMessage:
        message = self.fabric._take("dispatch", self.key, attention_rank, timeout_s)
        assert isinstance(message, A2EMessage)
        return message

    def combine_send(self, attention_rank: int, message: E2AMessage, *, timeout_s: float) -> None:
        self.fabric._record("combine_send", self.key, attention_rank, message)
        self.fabric._deliver("combine", self.key, attention_rank, message)

    def combine_recv(self, ffn_rank: int, *, timeout_s: float) -> E2AMessage:
        message = self.fabric._take("combine", self.key, ffn_rank, timeout_s)
        assert isinstance(message, E2AMessage)
        return message

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self.fabric._cond:
            self.fabric._gone.add(self.key)
            self.fabric._cond.notify_all()


RankBody = Callable[[AFDConnector, Any], Any]
"""``body(connector, RankContext) -> result``."""


class CAMThreadHarness:
    """afd-core ``ConnectorHarness``: a fresh :class:`FakeCAMFabric` per run, a thread per rank.

    ``connector_cls`` is a CAM connector class (a broken subclass in a test, too);
    ``config`` is merged into every rank's :class:`AFDConfig` (a scenario's overrides
    win). After a run, :attr:`last_fabric` holds the fabric (for its records).
    """

    def __init__(
        self,
        connector_cls: type[AFDConnector],
        *,
        config: Mapping[str, Any] | None = None,
        run_timeout_s: float = 30.0,
        dispatch_latency_s: float = 0.0,
    ) -> None:
        self.connector_cls = connector_cls
        self.config = {"connect_timeout_s": 10.0, **(config or {})}
        self.run_timeout_s = run_timeout_s
        self.dispatch_latency_s = dispatch_latency_s
        self.last_fabric: FakeCAMFabric | None = None

    def run(self, scenario: Any, topology: AFDTopology) -> dict[tuple[str, int], Any]:
        return self.run_ranks(topology, scenario.run_rank, scenario.config_overrides)

    def configs(
        self, topology: AFDTopology, overrides: Mapping[str, Any] | None = None
    ) -> dict[RankKey, AFDConfig]:
        out: dict[RankKey, AFDConfig] = {}
        for role in AFDRole:
            for rank in range(topology.size_of(role)):
                values: dict[str, Any] = {
                    "role": role,
                    "connector": self.connector_cls.name or self.connector_cls.__name__,
                    "host": "fake-cam",
                    "num_attention_ranks": topology.num_attention_ranks,
                    "num_ffn_ranks": topology.num_ffn_ranks,
                    "rank": rank,
                    **self.config,
                    **dict(overrides or {}),
                }
                out[(role, rank)] = AFDConfig(**values)
        return out

    def run_ranks(
        self,
        topology: AFDTopology,
        body: RankBody,
        overrides: Mapping[str, Any] | None = None,
        *,
        configs: Mapping[RankKey, AFDConfig] | None = None,
    ) -> dict[tuple[str, int], Any]:
        """Run ``body(connector, RankContext)`` on every rank; exceptions are returned."""
        from afd_core.testing.conformance import RankContext
        from afd_core.testing.threads import run_rank_threads

        fabric = self.last_fabric = FakeCAMFabric(dispatch_latency_s=self.dispatch_latency_s)
        configs = configs or self.configs(topology, overrides)
        return run_rank_threads(
            configs,
            lambda key: self.connector_cls(  # type: ignore[call-arg]
                configs[key], rank=key[1], ops_factory=fabric.ops_factory
            ),
            lambda conn, role, rank: body(conn, RankContext(role, rank, topology)),
            run_timeout_s=self.run_timeout_s,
            thread_prefix="fake-cam",
        )
