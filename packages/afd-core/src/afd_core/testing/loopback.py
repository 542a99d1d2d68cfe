"""An in-process loopback connector and a thread harness to drive it.

:class:`LoopbackAFDConnector` moves messages between connectors of the same
process through a shared hub (one per ``config.host:config.port``) of
mailboxes, one per directed (receiver, sender) link. It implements the full
:class:`~afd_core.connector.AFDConnector` contract (fan-in, split, headers,
timeouts, close, peer loss) for any topology and is the reference the
conformance suite (:mod:`afd_core.testing.conformance`) is checked against.
It needs torch (``pip install afd-core[testing]``).
"""

from __future__ import annotations

import collections
import itertools
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from afd_core.config import AFDConfig, AFDRole
from afd_core.connector import AFDConnector, FFNBatch
from afd_core.errors import (
    AFDConnectorClosedError,
    AFDConnectorError,
    AFDPeerLostError,
    AFDTimeoutError,
    AFDTransferMismatchError,
)
from afd_core.registry import get_connector_class, register_connector
from afd_core.topology import AFDTopology
from afd_core.transfer import AttentionToFFN, FFNToAttention, PayloadKind, TransferHeader

if TYPE_CHECKING:
    from afd_core.testing.conformance import Scenario

__all__ = ["LoopbackAFDConnector", "LoopbackHarness"]

_F2A_KINDS = frozenset({PayloadKind.OUTPUT, PayloadKind.OUTPUT_WITH_SHARED})
_A2F_FIELDS = ("hidden_states", "topk_ids", "topk_weights", "router_logits", "token_ids")

# A mailbox key: (receiver role, receiver rank, sender rank).
_Key = tuple[AFDRole, int, int]


@dataclass(frozen=True)
class _Message:
    header: TransferHeader
    payload: AttentionToFFN | FFNToAttention | None  # None: SHUTDOWN


@dataclass
class _Hub:
    """Mailboxes shared by the connectors of one ``host:port`` in this process."""

    address: str
    cond: threading.Condition = field(default_factory=threading.Condition)
    boxes: dict[_Key, collections.deque[_Message]] = field(default_factory=dict)
    members: set[tuple[AFDRole, int]] = field(default_factory=set)
    closed: set[tuple[AFDRole, int]] = field(default_factory=set)
    refs: int = 0

    def box(self, key: _Key) -> collections.deque[_Message]:
        return self.boxes.setdefault(key, collections.deque())


_hubs_lock = threading.Lock()
_hubs: dict[str, _Hub] = {}


def _attach(address: str, member: tuple[AFDRole, int]) -> _Hub:
    with _hubs_lock:
        hub = _hubs.get(address)
        if hub is None:
            hub = _hubs[address] = _Hub(address)
        with hub.cond:
            if member in hub.members:
                raise AFDConnectorError(
                    f"loopback {address}: {member[0].value} rank {member[1]} is already "
                    "connected in this process (two connectors for one rank?)"
                )
            hub.members.add(member)
            hub.refs += 1
        return hub


def _detach(hub: _Hub) -> None:
    with _hubs_lock:
        hub.refs -= 1
        if hub.refs == 0 and _hubs.get(hub.address) is hub:
            del _hubs[hub.address]


def _clone(t: Any) -> Any:
    return None if t is None else t.detach().clone()


class LoopbackAFDConnector(AFDConnector):
    """In-process connector: every rank is a connector object in the same Python process."""

    name: ClassVar[str] = "LoopbackAFDConnector"

    def __init__(self, config: AFDConfig, *, rank: int) -> None:
        super().__init__(config, rank=rank)
        self._hub: _Hub | None = None
        self._closed = False
        self._lifecycle = threading.Lock()
        # (layer, micro-batch) -> tokens sent, to check the answer's token count.
        self._pending: dict[tuple[int, int], int] = {}

    # -- lifecycle -----------------------------------------------------------------
    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.config.port}"

    def init(self) -> None:
        with self._lifecycle:
            if self._closed:
                raise AFDConnectorClosedError(
                    f"{self._who}: init() after close(); create a new connector"
                )
            if self._hub is None:
                self._hub = _attach(self.address, (self.role, self.rank))

    @property
    def is_initialized(self) -> bool:
        return self._hub is not None and not self._closed

    def close(self) -> None:
        with self._lifecycle:
            if self._closed:
                return
            self._closed = True
            hub = self._hub
        if hub is None:
            return
        with hub.cond:
            hub.closed.add((self.role, self.rank))
            header = TransferHeader(0, 0, 0, 0, "float32", PayloadKind.SHUTDOWN)
            for peer in self.topology.peers_of(self.role, self.rank):
                hub.box((self._peer_role, peer, self.rank)).append(_Message(header, None))
            hub.cond.notify_all()
        _detach(hub)

    # -- helpers -------------------------------------------------------------------
    @property
    def _who(self) -> str:
        return f"{type(self).__name__}({self.role.value} rank {self.rank})"

    @property
    def _peer_role(self) -> AFDRole:
        return AFDRole.FFN if self.role is AFDRole.ATTENTION else AFDRole.ATTENTION

    def _live_hub(self, op: str, role: AFDRole) -> _Hub:
        if self.role is not role:
            raise AFDConnectorError(
                f"{self._who}: {op}() is a {role.value}-side call; this connector has role "
                f"{self.role.value!r}"
            )
        if self._closed:
            raise AFDConnectorClosedError(f"{self._who}: {op}() after close()")
        if self._hub is None:
            raise AFDConnectorError(f"{self._who}: {op}() before init(); call init() first")
        return self._hub

    def _put(self, hub: _Hub, peer: int, message: _Message) -> None:
        with hub.cond:
            if (self._peer_role, peer) in hub.closed:
                raise AFDPeerLostError(
                    f"{self._who}: {self._peer_role.value} rank {peer} closed its connector; "
                    "cannot send"
                )
            hub.box((self._peer_role, peer, self.rank)).append(message)
            hub.cond.notify_all()

    def _get(self, hub: _Hub, peer: int, deadline: float, timeout_s: float) -> _Message:
        box = hub.box((self.role, self.rank, peer))
        with hub.cond:
            while True:
                if self._closed:
                    raise AFDConnectorClosedError(
                        f"{self._who}: connector closed while waiting for "
                        f"{self._peer_role.value} rank {peer}"
                    )
                if box:
                    message = box[0]
                    if message.header.kind is PayloadKind.SHUTDOWN:
                        # Left in place: every later receive fails the same way.
                        raise AFDPeerLostError(
                            f"{self._who}: {self._peer_role.value} rank {peer} closed its "
                            "connector (peer gone)",
                            goodbye=True,
                        )
                    return box.popleft()
                if deadline == math.inf:  # the next step: no deadline
                    hub.cond.wait()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AFDTimeoutError(
                        f"{self._who}: nothing received from {self._peer_role.value} rank "
                        f"{peer} within {timeout_s:g} s (transfer_timeout_s / timeout_s)"
                    )
                hub.cond.wait(remaining)

    def _deadline(self, timeout_s: float | None) -> tuple[float, float]:
        timeout = self.config.transfer_timeout_s if timeout_s is None else float(timeout_s)
        return time.monotonic() + timeout, timeout

    # -- Attention side ------------------------------------------------------------
    def send_to_ffn(
        self, payload: AttentionToFFN, *, layer_idx: int, micro_batch_idx: int = 0
    ) -> None:
        hub = self._live_hub("send_to_ffn", AFDRole.ATTENTION)
        header = payload.header(layer_idx, micro_batch_idx)
        copy = AttentionToFFN(**{f: _clone(getattr(payload, f)) for f in _A2F_FIELDS})
        self._put(hub, self.topology.ffn_peer_of(self.rank), _Message(header, copy))
        self._pending[(layer_idx, micro_batch_idx)] = header.num_tokens

    def recv_from_ffn(
        self, *, layer_idx: int, micro_batch_idx: int = 0, timeout_s: float | None = None
    ) -> FFNToAttention:
        hub = self._live_hub("recv_from_ffn", AFDRole.ATTENTION)
        deadline, timeout = self._deadline(timeout_s)
        message = self._get(hub, self.topology.ffn_peer_of(self.rank), deadline, timeout)
        message.header.expect(
            layer_idx=layer_idx, micro_batch_idx=micro_batch_idx, kinds=_F2A_KINDS
        )
        sent = self._pending.pop((layer_idx, micro_batch_idx), None)
        if sent is not None:
            message.header.expect(num_tokens=sent)
        assert isinstance(message.payload, FFNToAttention)
        return message.payload

    # -- FFN side ------------------------------------------------------------------
    def recv_from_attention(self, *, timeout_s: float | None = None) -> FFNBatch:
        hub = self._live_hub("recv_from_attention", AFDRole.FFN)
        peers = self.topology.attention_peers_of(self.rank)
        if not peers:
            raise AFDConnectorError(
                f"{self._who}: this FFN rank has no attention peers "
                f"(idle in topology {self.topology.label}); do not run a receive loop on it"
            )
        if timeout_s is None:
            # The next step has no deadline; once its first message is here, the rest of
            # the step is bounded by transfer_timeout_s.
            messages = [self._get(hub, peers[0], math.inf, self.config.transfer_timeout_s)]
            deadline, timeout = self._deadline(None)
        else:
            deadline, timeout = self._deadline(timeout_s)
            messages = []
        messages += [self._get(hub, peer, deadline, timeout) for peer in peers[len(messages) :]]
        first = messages[0].header
        for peer, message in zip(peers[1:], messages[1:], strict=True):
            h = message.header
            try:
                h.expect(
                    layer_idx=first.layer_idx,
                    micro_batch_idx=first.micro_batch_idx,
                    hidden_size=first.hidden_size,
                    dtype=first.dtype,
                    kinds=frozenset({first.kind}),
                )
            except AFDTransferMismatchError as exc:
                raise AFDTransferMismatchError(
                    f"{self._who}: attention rank {peer} disagrees with rank {peers[0]}: {exc}"
                ) from None
            if h.topk != first.topk:
                raise AFDTransferMismatchError(
                    f"{self._who}: attention rank {peer} sent topk={h.topk}, rank {peers[0]} "
                    f"sent topk={first.topk}"
                )
        payloads = [m.payload for m in messages]
        assert all(isinstance(p, AttentionToFFN) for p in payloads)
        fields: dict[str, Any] = {}
        for name in _A2F_FIELDS:
            parts = [getattr(p, name) for p in payloads]
            fields[name] = None if parts[0] is None else torch.cat(parts, dim=0)
        counts = tuple(m.header.num_tokens for m in messages)
        return FFNBatch(
            header=first.with_tokens(sum(counts)),
            payload=AttentionToFFN(**fields),
            peer_ranks=peers,
            token_counts=counts,
        )

    def send_to_attention(self, batch: FFNBatch, result: FFNToAttention) -> None:
        hub = self._live_hub("send_to_attention", AFDRole.FFN)
        serving = tuple(self.topology.attention_peers_of(self.rank))
        for peer, rows in batch.answers(result, serving=serving, who=self._who):
            part = FFNToAttention(
                output=_clone(rows.output),
                shared_output=None if rows.shared_output is None else _clone(rows.shared_output),
            )
            header = part.header(batch.layer_idx, batch.micro_batch_idx)
            self._put(hub, peer, _Message(header, part))


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
