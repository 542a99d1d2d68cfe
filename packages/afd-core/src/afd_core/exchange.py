"""The AFD exchange protocol, once, composed with a small :class:`Transport`.

:class:`ExchangeConnector` implements :class:`~afd_core.connector.AFDConnector` for every
transport: the attention side's bookkeeping of sends awaiting their answer (one per
layer and micro-batch slot), the FFN side's fan-in (one frame per attention peer in
``attention_peers_of`` order, checked to agree on everything but the token count, rows
concatenated) and the split of the answer by ``token_counts``, frame and kind
validation, deadlines (none for the FFN side's wait for the next step), the per-peer
"broken" state, the error messages, the before-init / wrong-role / after-close guards
and an idempotent ``close()``.

A transport only moves frames (:mod:`afd_core.wire`) and the tensors that follow them.
Each call takes one :class:`TransferContext` (peer, deadline, timeout, what is being
done, micro-batch) that also builds the errors the protocol's users see. A connector
is a subclass naming its transport::

    class MyAFDConnector(ExchangeConnector):
        name = "MyAFDConnector"
        transport_class = MyTransport

The design follows vLLM's modular MoE kernel (prepare/finalize composed with experts):
the connectors of afd-connectors-gpu (gloo, NCCL, shared memory) are such compositions,
and a third-party connector implements a transport only (``docs/connectors.md``).
Tensors stay opaque here (typed ``Any``): nothing in this module imports torch.

Over 400 lines on purpose: it is the one place of every rule of the exchange (both
roles' sides, the transport interface and the context whose errors transports raise);
split, each half would have to name the other's private state.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

from afd_core.config import AFDConfig, AFDRole
from afd_core.connector import AFDConnector, FFNBatch
from afd_core.errors import (
    AFDConfigError,
    AFDConnectorClosedError,
    AFDConnectorError,
    AFDPeerLostError,
    AFDTimeoutError,
    AFDTransferMismatchError,
)
from afd_core.transfer import (
    AttentionToFFN,
    FFNToAttention,
    PayloadKind,
    TransferHeader,
    dtype_name,
    layout_of,
)
from afd_core.transfer_dtype import TransferFormat, format_of_wire, transfer_format
from afd_core.wire import Frame, make_frame

__all__ = [
    "IDLE",
    "ExchangeConnector",
    "Message",
    "Spec",
    "TransferContext",
    "Transport",
    "closed_init_error",
    "describe_header",
    "disagree_error",
    "duplicate_send_error",
    "idle_rank_error",
]

#: The deadline of a wait with none: the FFN side waiting for the next step.
IDLE = math.inf

_A2F_KINDS = frozenset(k for k in PayloadKind if k.is_attention_to_ffn)
_F2A_KINDS = frozenset(k for k in PayloadKind if k.is_ffn_to_attention)

#: (trailing shape, dtype name) of one tensor of a message (``Frame.specs``).
Spec = tuple[tuple[int, ...], str]

#: One message to send: (peer global rank, frame, tensors in wire order).
Message = tuple[int, Frame, Sequence[Any]]


def describe_header(h: TransferHeader, **extra: str | None) -> str:
    """``layer=.. micro_batch=.. hidden=.. dtype=.. kind=..`` plus top-k and ``extra``
    words that are set (how fan-in disagreements name what each peer sent)."""
    text = (
        f"layer={h.layer_idx} micro_batch={h.micro_batch_idx} hidden={h.hidden_size} "
        f"dtype={h.dtype} kind={h.kind.name}"
    )
    if h.topk:
        text += f" topk={h.topk}"
    for key, value in extra.items():
        if value:
            text += f" {key}={value}"
    return text


def duplicate_send_error(label: str, layer_idx: int, mb: int) -> AFDTransferMismatchError:
    return AFDTransferMismatchError(
        f"{label}: send_to_ffn(layer_idx={layer_idx}, micro_batch_idx={mb}) again before "
        "recv_from_ffn received the first one"
    )


def closed_init_error(connector: AFDConnector) -> AFDConnectorClosedError:
    return AFDConnectorClosedError(f"{connector.label}: init() after close()")


def disagree_error(label: str, first: str, other: str) -> AFDTransferMismatchError:
    """Two attention peers of one FFN rank sent different layers (``first`` and ``other``:
    "<peer> sent <describe_header(...)>")."""
    return AFDTransferMismatchError(
        f"{label}: attention peers disagree on the layer being sent: {first}, {other}"
    )


def idle_rank_error(connector: AFDConnector) -> AFDConfigError:
    topo = connector.topology
    return AFDConfigError(
        f"{connector.label} serves no attention rank in topology {topo.label} "
        f"(idle FFN ranks: {list(topo.idle_ffn_ranks)}); an idle rank must not call "
        "recv_from_attention"
    )


def _layer_key(frame: Frame) -> tuple[Any, ...]:
    """What every attention peer of one FFN rank must agree on (all but the token count)."""
    h = frame.header
    return (
        h.layer_idx, h.micro_batch_idx, h.hidden_size, h.dtype, h.kind, h.topk, frame.aux_dtype,
        frame.encoding,
    )  # fmt: skip


def _format(name: str) -> TransferFormat | None:
    """The quantized format a side sends in, or None for ``model`` (tensors untouched)."""
    fmt = transfer_format(name)
    return fmt if fmt.quantized else None


def _encode(
    tensors: Sequence[Any], fmt: TransferFormat | None
) -> tuple[Sequence[Any], tuple[str, str, int] | None]:
    """A message's tensors in the sender's transfer dtype (the main tensor quantized, its
    scales last) and the frame's encoding; untouched for ``model``."""
    if fmt is None:
        return tensors, None
    from afd_core.quantize import encode_message

    return encode_message(list(tensors), fmt)


def _decode(tensors: list[Any], frame: Frame) -> list[Any]:
    """Received tensors with the main tensor back in the header's dtype (a frame with no
    encoding: as received)."""
    if frame.encoding is None:
        return tensors
    from afd_core.quantize import decode_message

    h = frame.header
    elements, scales, columns = frame.encoding
    try:
        fmt = format_of_wire(elements, scales, columns, h.hidden_size)
    except ValueError as exc:
        raise AFDTransferMismatchError(f"layer {h.layer_idx}: {exc}") from None
    return decode_message(tensors, fmt, h.dtype)


def _aux(result: FFNToAttention) -> str | None:
    shared = result.shared_output
    return None if shared is None else dtype_name(shared.dtype)


class TransferContext:
    """What one transport call is doing, and the errors it raises.

    ``peer`` (global rank) is the peer of the call (the first one for a call over
    several: :meth:`at` names another), ``deadline`` a ``time.monotonic()`` value or
    :data:`IDLE`, ``timeout`` the seconds it stands for (for error texts), ``action``
    e.g. ``"receiving layer 3 micro-batch 0 from"``, ``mb`` the micro-batch slot.
    """

    __slots__ = ("action", "connector", "deadline", "mb", "peer", "timeout")

    def __init__(
        self,
        connector: ExchangeConnector,
        peer: int,
        deadline: float,
        timeout: float,
        action: str,
        mb: int = 0,
    ) -> None:
        self.connector = connector
        self.peer = peer
        self.deadline = deadline
        self.timeout = timeout
        self.action = action
        self.mb = mb

    def at(self, peer: int) -> TransferContext:
        """The same call, about ``peer``."""
        if peer == self.peer:
            return self
        c = self
        return TransferContext(c.connector, peer, c.deadline, c.timeout, c.action, c.mb)

    def remaining(self) -> float:
        """Seconds left before the deadline (``inf`` for :data:`IDLE`), at least 0."""
        return max(self.deadline - time.monotonic(), 0.0)

    def break_peer(self, reason: str) -> None:
        """The connection to ``peer`` cannot be used any more (later calls say why)."""
        self.connector.break_peer(self.peer, reason)

    def closed_error(self) -> AFDConnectorClosedError:
        c = self.connector
        return AFDConnectorClosedError(
            f"{c.label} was closed while {self.action} {c.describe(self.peer)}"
        )

    def timeout_error(self, note: str = "") -> AFDTimeoutError:
        c = self.connector
        return AFDTimeoutError(
            f"{c.label}: {self.action} {c.describe(self.peer)} timed out after "
            f"{self.timeout:g} s (timeout_s argument or afd.transfer_timeout_s){note}"
            f"{self._shared_ffn_note()}"
        )

    def _shared_ffn_note(self) -> str:
        """For an attention rank's receive from an FFN rank that other attention ranks
        share: that FFN rank answers a layer only once every one of them sent its part,
        so the wait includes the others' lateness (not only the FFN rank's work)."""
        c = self.connector
        if c.role is not AFDRole.ATTENTION or not self.action.startswith("receiving"):
            return ""
        role, rank = c.topology.role_rank_of(self.peer)
        if role is not AFDRole.FFN:
            return ""
        sharing = c.topology.fan_in(rank)
        if sharing < 2:
            return ""
        return (
            f"; {c.describe(self.peer)} answers a layer once all {sharing} of its attention "
            "ranks sent their part, so a late or stalled attention rank (a data-parallel "
            "rank whose step started later, a process starved of CPU) times out the others: "
            "keep afd.transfer_timeout_s well above a step's time on a loaded host"
        )

    def lost_error(self, detail: str = "") -> AFDPeerLostError:
        c = self.connector
        text = f"{c.label}: {c.describe(self.peer)} is gone while {self.action} it"
        return AFDPeerLostError(f"{text}: {detail}" if detail else text)

    def goodbye_error(self) -> AFDPeerLostError:
        """The peer closed its side of the connection (breaks the peer)."""
        self.break_peer("it closed")
        c = self.connector
        return AFDPeerLostError(
            f"{c.label}: {c.describe(self.peer)} closed its connector while {self.action} it",
            goodbye=True,
        )

    def decode_frame(self, words: Sequence[int]) -> Frame:
        """Decode a received frame; a garbled one breaks the connection to ``peer``."""
        try:
            return Frame.decode(list(words))
        except AFDTransferMismatchError as exc:
            self.break_peer("garbled frame")
            c = self.connector
            raise AFDTransferMismatchError(f"{c.label} <- {c.describe(self.peer)}: {exc}") from None


class Transport:
    """How frames and tensors travel between the ranks of one connector.

    Created by :class:`ExchangeConnector` with the connector (``self.connector``: its
    ``config``, ``label``, ``peers``, ``global_rank``, ``closed``...). Set ``ready`` once
    :meth:`connect` succeeded; the protocol calls the others only then, except
    :meth:`close`. Every receive must end on the deadline, on ``connector.closed`` and
    on the loss of the peer, raising the context's errors.
    """

    #: True between a successful :meth:`connect` and :meth:`close`.
    ready: bool = False

    def __init__(self, connector: ExchangeConnector) -> None:
        self.connector = connector

    def connect(self) -> None:
        """Meet every rank and set up the transport (``init()``, under the init lock)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the transport; called once, by the first ``close()``, after the
        connector is marked closed. :meth:`ExchangeConnector.goodbye` says whether (and to
        whom) to send a ``Frame.shutdown`` first."""
        raise NotImplementedError

    def send(self, ctx: TransferContext, messages: Iterable[Message]) -> None:
        """Send each message (frame, then its tensors) to its peer; may return before
        delivery. ``messages`` is lazy: taking the next one checks that its peer is usable."""
        raise NotImplementedError

    def recv_frame(self, ctx: TransferContext) -> Frame:
        """The next frame from ``ctx.peer`` (its message is not consumed yet)."""
        raise NotImplementedError

    def recv_frames(self, ctx: TransferContext, peers: Sequence[int]) -> Iterable[Frame]:
        """The next frame of each of ``peers``, in order (default: one at a time, lazily,
        so the protocol checks each frame before the next wait)."""
        for peer in peers:
            yield self.recv_frame(ctx.at(peer))

    def recv_tensors(
        self, ctx: TransferContext, parts: Sequence[tuple[int, int]], specs: Sequence[Spec]
    ) -> list[Any]:
        """Consume the current message of each (peer, num_tokens) of ``parts``: one tensor
        per spec, the peers' rows concatenated in ``parts`` order."""
        raise NotImplementedError

    def skip(self, ctx: TransferContext, num_tokens: int, specs: Sequence[Spec]) -> None:
        """Get past the current message of ``ctx.peer`` (its tensors are not wanted). By
        default they are received and dropped: the stream stays in step."""
        self.recv_tensors(ctx, [(ctx.peer, num_tokens)], specs)

    def reap(self) -> None:
        """Settle sends posted without waiting; raise the error of a failed one."""


class ExchangeConnector(AFDConnector):
    """The AFD exchange protocol over ``transport_class`` (see the module docstring)."""

    #: The transport this connector composes (subclasses set it).
    transport_class: ClassVar[type[Transport]] = Transport

    def __init__(self, config: AFDConfig, *, rank: int) -> None:
        super().__init__(config, rank=rank)
        topo = self.topology
        self.global_rank = topo.global_rank(self.role, rank)
        if self.role is AFDRole.ATTENTION:
            self._peer_role_ranks: tuple[int, ...] = (topo.ffn_peer_of(rank),)
            peer_role = AFDRole.FFN
        else:
            self._peer_role_ranks = topo.attention_peers_of(rank)
            peer_role = AFDRole.ATTENTION
        #: Global ranks of the peers (FFN peer, or attention peers in fan-in order).
        self.peers = tuple(topo.global_rank(peer_role, r) for r in self._peer_role_ranks)
        self._role = self.role
        self.closed = False
        # One entry per public operation in progress (see _enter / _leave): a list, since
        # append and pop are atomic, so that the hot path takes no lock.
        self._ops: list[int] = []
        self._state_lock = threading.Lock()
        self._init_lock = threading.Lock()
        self._actions: dict[tuple[int, int], str] = {}
        # Attention side: (layer, micro-batch) -> header of a send awaiting its answer.
        self._sent: dict[tuple[int, int], TransferHeader] = {}
        # Peer global rank -> why the connection to it cannot be used any more.
        self._broken: dict[int, str] = {}
        # The transfer dtype this side sends in (None: the model dtype, tensors untouched):
        # afd.transfer_dtype for Attention's hidden states, transfer_dtype_return for the
        # FFN's answers. A receiver decodes what the frame says.
        self._send_format = _format(
            config.transfer_dtype
            if self.role is AFDRole.ATTENTION
            else config.transfer_dtype_return
        )
        self.transport = self.transport_class(self)

    # -- what transports use -----------------------------------------------------------
    @property
    def where(self) -> str:
        return f"{self.config.host}:{self.config.port}"

    @property
    def operations_in_progress(self) -> int:
        return len(self._ops)

    def describe(self, peer: int) -> str:
        role, rank = self.topology.role_rank_of(peer)
        return f"{role.value} rank {rank} (global rank {peer})"

    def break_peer(self, peer: int, reason: str, *, keep_first: bool = False) -> None:
        """Mark the connection to ``peer`` unusable (``keep_first``: unless it already is)."""
        if keep_first:
            self._broken.setdefault(peer, reason)
        else:
            self._broken[peer] = reason

    def goodbye(self) -> int | None:
        """The FFN peer to send ``Frame.shutdown(global_rank)`` to when closing, or None.

        Only an attention rank with no exchange in flight says goodbye: its FFN peer is
        then at a message boundary, waiting for the next layer.
        """
        if self.role is AFDRole.ATTENTION and not self._sent and self.peers:
            peer = self.peers[0]
            if peer not in self._broken:
                return peer
        return None

    # -- lifecycle ---------------------------------------------------------------------
    def init(self) -> None:
        with self._init_lock:
            if self.closed:
                raise closed_init_error(self)
            if not self.transport.ready:
                self.transport.connect()

    @property
    def is_initialized(self) -> bool:
        return self.transport.ready and not self.closed

    def close(self) -> None:
        with self._state_lock:
            if self.closed:
                return
            self.closed = True
        self.transport.close()

    # -- Attention side ----------------------------------------------------------------
    def send_to_ffn(
        self, payload: AttentionToFFN, *, layer_idx: int, micro_batch_idx: int = 0
    ) -> None:
        transport = self._enter(AFDRole.ATTENTION, "send_to_ffn")
        try:
            key = (layer_idx, micro_batch_idx)
            if key in self._sent:
                raise duplicate_send_error(self.label, layer_idx, micro_batch_idx)
            header = payload.header(layer_idx, micro_batch_idx)
            tensors, aux = layout_of(header.kind).tensors(payload)
            peer = self.peers[0]
            if self._broken:
                self._check_peer(peer)
            wire, encoding = _encode(tensors, self._send_format)
            frame = make_frame(header, aux, self.global_rank, encoding)
            ctx = self._context(peer, None, "sending to", micro_batch_idx)
            transport.send(ctx, [(peer, frame, wire)])
            self._sent[key] = header
        finally:
            self._ops.pop()

    def recv_from_ffn(
        self, *, layer_idx: int, micro_batch_idx: int = 0, timeout_s: float | None = None
    ) -> FFNToAttention:
        transport = self._enter(AFDRole.ATTENTION, "recv_from_ffn")
        try:
            return self._recv_from_ffn(transport, layer_idx, micro_batch_idx, timeout_s)
        finally:
            self._ops.pop()

    def _recv_from_ffn(
        self, transport: Transport, layer_idx: int, mb: int, timeout_s: float | None
    ) -> FFNToAttention:
        # With no matching send we still wait for the next message: it says which layer
        # really arrived (a mismatch error), or the receive times out.
        sent = self._sent.get((layer_idx, mb))
        peer = self.peers[0]
        if self._broken:
            self._check_peer(peer)
        ctx = self._context(peer, timeout_s, self._action(layer_idx, mb), mb)
        frame = transport.recv_frame(ctx)
        header = frame.header
        if header.kind not in _F2A_KINDS:
            self._refuse_frame(transport, ctx, frame, f"layer {layer_idx} micro-batch {mb}")
        problem = ""
        if header.layer_idx != layer_idx or header.micro_batch_idx != mb:
            problem = (
                f"recv_from_ffn(layer_idx={layer_idx}, micro_batch_idx={mb}) but the next "
                f"answer is for layer {header.layer_idx} micro-batch {header.micro_batch_idx} "
                f"({header.num_tokens} tokens); the FFN side answers in the order of "
                "send_to_ffn calls"
            )
        elif sent is not None and (
            header.num_tokens != sent.num_tokens
            or header.hidden_size != sent.hidden_size
            or header.dtype != sent.dtype
        ):
            problem = (
                f"the answer to layer {layer_idx} micro-batch {mb} does not fit what was sent: "
                f"expected {sent.num_tokens} tokens of hidden size {sent.hidden_size} and dtype "
                f"{sent.dtype}, received {header.num_tokens} tokens of hidden size "
                f"{header.hidden_size} and dtype {header.dtype}"
            )
        tensors: list[Any] = []
        if not problem:
            tensors = transport.recv_tensors(ctx, [(peer, header.num_tokens)], frame.specs)
        else:
            # Get past the message even on a mismatch, so the stream stays in step (and
            # the FFN side's send completes).
            transport.skip(ctx, header.num_tokens, frame.specs)
        self._sent.pop((header.layer_idx, header.micro_batch_idx), None)
        transport.reap()
        if problem:
            raise AFDTransferMismatchError(f"{self.label} <- {self.describe(peer)}: {problem}")
        result = layout_of(header.kind).build(_decode(tensors, frame))
        assert isinstance(result, FFNToAttention)
        return result

    # -- FFN side ----------------------------------------------------------------------
    def recv_from_attention(self, *, timeout_s: float | None = None) -> FFNBatch:
        transport = self._enter(AFDRole.FFN, "recv_from_attention")
        try:
            return self._recv_from_attention(transport, timeout_s)
        finally:
            self._ops.pop()

    def _recv_from_attention(self, transport: Transport, timeout_s: float | None) -> FFNBatch:
        peers = self.peers
        if not peers:
            raise idle_rank_error(self)
        if self._broken:
            for peer in peers:
                self._check_peer(peer)
        timeout = self.config.transfer_timeout_s if timeout_s is None else float(timeout_s)
        if timeout_s is None:
            # Waiting for the next step is not a transfer: no deadline while the peers are
            # alive (peer loss and close() still end the wait). Once the first peer's frame
            # is here the step has started, and the rest of it is bounded.
            wait = "waiting for the next step from"
            ctx = TransferContext(self, peers[0], IDLE, timeout, wait)
            frame = transport.recv_frame(ctx)
            ctx.deadline = time.monotonic() + timeout
            ctx.action = "receiving from"
        else:
            ctx = TransferContext(
                self, peers[0], time.monotonic() + timeout, timeout, "receiving from"
            )
            frame = transport.recv_frame(ctx)
        head = frame.header
        if head.kind not in _A2F_KINDS:
            self._refuse_frame(transport, ctx, frame, "the next layer")
        if len(peers) == 1:  # the common case: no fan-in
            counts: tuple[int, ...] = (head.num_tokens,)
            parts = [(peers[0], head.num_tokens)]
        else:
            frames = [frame]
            self._fan_in(transport, ctx, frames)
            counts = tuple(f.header.num_tokens for f in frames)
            parts = list(zip(peers, counts, strict=True))
        transport.reap()
        ctx.mb = mb = head.micro_batch_idx
        ctx.action = self._action(head.layer_idx, mb)
        tensors = transport.recv_tensors(ctx, parts, frame.specs)
        payload = layout_of(head.kind).build(_decode(tensors, frame))
        assert isinstance(payload, AttentionToFFN)
        total = sum(counts)
        if head.num_tokens != total:
            head = head.with_tokens(total)
        return FFNBatch(head, payload, self._peer_role_ranks, counts)

    def _fan_in(self, transport: Transport, ctx: TransferContext, frames: list[Frame]) -> None:
        """Add the frames of the other attention peers to ``frames`` (the first one's),
        checking that every peer sends the same layer."""
        first = frames[0]
        ref = _layer_key(first)
        for frame in transport.recv_frames(ctx, self.peers[1:]):
            peer = self.peers[len(frames)]
            if frame.header.kind not in _A2F_KINDS:
                self._refuse_frame(transport, ctx.at(peer), frame, "the next layer")
            if _layer_key(frame) != ref:
                for p in self.peers:
                    self._broken[p] = "attention peers out of step"
                raise disagree_error(
                    self.label,
                    f"{self.describe(self.peers[0])} sent "
                    f"{describe_header(first.header, aux_dtype=first.aux_dtype)}",
                    f"{self.describe(peer)} sent "
                    f"{describe_header(frame.header, aux_dtype=frame.aux_dtype)}",
                )
            frames.append(frame)

    def _refuse_frame(
        self, transport: Transport, ctx: TransferContext, frame: Frame, waited_for: str
    ) -> None:
        """Raise for a frame of the wrong direction: a goodbye or a mismatch."""
        peer, kind = ctx.peer, frame.header.kind
        if kind is PayloadKind.SHUTDOWN:
            transport.skip(ctx, 0, ())
            self._broken[peer] = "it closed"
            sent = " (sent SHUTDOWN)" if self._role is AFDRole.FFN else ""
            raise AFDPeerLostError(
                f"{self.describe(peer)} closed{sent} while {self.label} waited for {waited_for}",
                goodbye=True,
            )
        self._broken[peer] = "stream out of step after a mismatch"
        want = "an FFN->attention" if self._role is AFDRole.ATTENTION else "an attention->FFN"
        raise AFDTransferMismatchError(
            f"{self.label} <- {self.describe(peer)}: expected {want} message, received kind "
            f"{kind.name}"
        )

    def send_to_attention(self, batch: FFNBatch, result: FFNToAttention) -> None:
        transport = self._enter(AFDRole.FFN, "send_to_attention")
        try:
            mb = batch.micro_batch_idx
            peers = self.peers
            ctx = self._context(peers[0] if peers else -1, None, "sending to", mb)
            if batch.peer_ranks is self._peer_role_ranks and len(peers) == 1:
                # One peer, and the batch is this connector's own: the whole result is
                # its answer once the row count matches (else answers() says why).
                header = result.header(batch.layer_idx, mb)
                if header.num_tokens == batch.header.num_tokens and not self._broken:
                    out, sh = result.output, result.shared_output
                    wire, encoding = _encode([out] if sh is None else [out, sh], self._send_format)
                    frame = make_frame(header, _aux(result), self.global_rank, encoding)
                    transport.send(ctx, [(peers[0], frame, wire)])
                    return
            answers = batch.answers(result, serving=self._peer_role_ranks, who=self.label)
            transport.send(ctx, self._messages(batch, answers, _aux(result)))
        finally:
            self._ops.pop()

    def _messages(
        self, batch: FFNBatch, answers: list[tuple[int, FFNToAttention]], aux: str | None
    ) -> Iterator[Message]:
        """One message per attention peer; each peer is checked just before its message
        is produced."""
        layer, mb = batch.layer_idx, batch.micro_batch_idx
        for role_rank, part in answers:
            peer = self.peers[self._peer_role_ranks.index(role_rank)]
            if self._broken:
                self._check_peer(peer)
            out, sh = part.output, part.shared_output
            wire, encoding = _encode([out] if sh is None else [out, sh], self._send_format)
            frame = make_frame(part.header(layer, mb), aux, self.global_rank, encoding)
            yield peer, frame, wire

    # -- plumbing ------------------------------------------------------------------------
    def _enter(self, role: AFDRole, method: str) -> Transport:
        """Start a public operation and return the transport; the caller pops ``_ops``.

        ``close()`` of a transport may wait for the operations in progress to leave:
        close() sets ``closed`` before it counts them, and an operation is counted
        before it reads ``closed``, so one of the two always sees the other.
        """
        self._ops.append(0)
        transport = self.transport
        if self.closed or self._role is not role or not transport.ready:
            self._ops.pop()
            if self.closed:
                raise AFDConnectorClosedError(f"{self.label}: {method}() after close()")
            self.check_side(role, method)
            raise AFDConnectorError(f"{self.label}: {method}() before init()")
        return transport

    def _context(self, peer: int, timeout_s: float | None, action: str, mb: int) -> TransferContext:
        timeout = self.config.transfer_timeout_s if timeout_s is None else float(timeout_s)
        return TransferContext(self, peer, time.monotonic() + timeout, timeout, action, mb)

    def _action(self, layer_idx: int, micro_batch_idx: int) -> str:
        """What a receive of this layer and micro-batch is doing, for its errors (made
        once per key: the hot path formats no string)."""
        key = (layer_idx, micro_batch_idx)
        text = self._actions.get(key)
        if text is None:
            text = self._actions[key] = (
                f"receiving layer {layer_idx} micro-batch {micro_batch_idx} from"
            )
        return text

    def _check_peer(self, peer: int) -> None:
        reason = self._broken.get(peer)
        if reason is not None:
            raise AFDPeerLostError(
                f"{self.label}: the connection to {self.describe(peer)} is gone ({reason}); "
                "create a new connector"
            )
