"""What every connector of this package shares, whatever moves the bytes.

:class:`ExchangeConnector` implements the AFD exchange on top of a few transport
hooks: the attention side's bookkeeping of sends awaiting their answer, the FFN side's
fan-in (one frame per attention peer in ``attention_peers_of`` order, checked to agree
on everything but the token count, tensors concatenated) and the split of the answer
by ``token_counts``, frame and kind validation, the per-peer "broken" state, the error
messages, the before-init / wrong-role / after-close guards and idempotent
``close()``. Subclasses supply how frames and tensors travel:

* :class:`~afd_connectors_gpu.p2p.P2pAFDConnector`: gloo / NCCL point-to-point ops;
* :class:`~afd_connectors_gpu.shm.P2pShmAFDConnector`: shared-memory rings.

The message layout helpers (which tensors follow a frame, in which order) live here
too. Nothing here imports torch.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

from afd_connectors_gpu.rendezvous import describe_global_rank
from afd_connectors_gpu.wire import Frame, make_frame
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

__all__ = ["IDLE", "ExchangeConnector"]

#: The deadline of a wait with none: the FFN side waiting for the next step.
IDLE = math.inf

_A2F_KINDS = frozenset(k for k in PayloadKind if k.is_attention_to_ffn)
_F2A_KINDS = frozenset(k for k in PayloadKind if k.is_ffn_to_attention)
_NO_SEND: tuple[int, int, int, str] = (-1, -1, -1, "")

# (trailing shape, dtype name) of every tensor of a message, main tensor first.
_Spec = tuple[tuple[int, ...], str]

# One message to send: (peer global rank, frame, tensors in wire order).
_Message = tuple[int, Frame, Sequence[Any]]


def _layer_key(frame: Frame) -> tuple[Any, ...]:
    """What every attention peer of one FFN rank must agree on (all but the token count)."""
    h = frame.header
    return (h.layer_idx, h.micro_batch_idx, h.hidden_size, h.dtype, h.kind, h.topk, frame.aux_dtype)


def _describe_header(h: TransferHeader, aux: str | None) -> str:
    text = (
        f"layer={h.layer_idx} micro_batch={h.micro_batch_idx} hidden={h.hidden_size} "
        f"dtype={h.dtype} kind={h.kind.name}"
    )
    if h.topk:
        text += f" topk={h.topk}"
    if aux:
        text += f" aux_dtype={aux}"
    return text


def _positive_int(cls_name: str, key: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise AFDConfigError(
            f"connector_extra_config[{key!r}] of {cls_name}: expected an int >= 1, got {value!r}"
        )
    return value


def _aux(result: FFNToAttention) -> str | None:
    shared = result.shared_output
    return None if shared is None else dtype_name(shared.dtype)


class ExchangeConnector(AFDConnector):
    """The transport-independent half of the connectors of this package.

    Transport hooks (subclasses implement them):

    * :meth:`_link`: the handle every operation uses (``None`` before ``init()``);
    * :meth:`_join`: the rendezvous of ``init()``, which makes :meth:`_link` non-None;
    * :meth:`_shutdown`: what ``close()`` does after marking the connector closed;
    * :meth:`_send_messages`: send frames plus tensors (may return before delivery);
    * :meth:`_recv_frames`: the next frame from each peer, in order;
    * :meth:`_recv_tensors`: the tensors announced by the current frame of each peer,
      concatenated over the peers (one tensor per spec);
    * :meth:`_skip_message`: get past the current message of a peer without keeping
      it (default: receive its tensors and drop them);
    * :meth:`_reap_sends`: settle sends posted without waiting (default: nothing).
    """

    #: extra-config keys this connector accepts (see :meth:`_check_extra_keys`).
    _KEYS: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, config: AFDConfig, *, rank: int) -> None:
        super().__init__(config, rank=rank)
        topo = self.topology
        self._global_rank = topo.global_rank(self.role, rank)
        if self.role is AFDRole.ATTENTION:
            self._peer_role_ranks: tuple[int, ...] = (topo.ffn_peer_of(rank),)
            self._peers = tuple(topo.global_rank(AFDRole.FFN, f) for f in self._peer_role_ranks)
        else:
            self._peer_role_ranks = topo.attention_peers_of(rank)
            self._peers = tuple(
                topo.global_rank(AFDRole.ATTENTION, a) for a in self._peer_role_ranks
            )
        self._role = self.role
        self._closed = False
        # One entry per public operation in progress (see _enter / _leave): a list, since
        # append and pop are atomic, so that the hot path takes no lock.
        self._ops: list[int] = []
        self._state_lock = threading.Lock()
        self._actions: dict[tuple[int, int], str] = {}
        self._init_lock = threading.Lock()
        # Attention side: (layer, micro-batch) -> header of a send awaiting its answer.
        self._sent: dict[tuple[int, int], TransferHeader] = {}
        # Peer global rank -> why the connection to it cannot be used any more.
        self._broken: dict[int, str] = {}

    # -- extra config helpers ----------------------------------------------------------
    @classmethod
    def _check_extra_keys(cls, extra: Mapping[str, Any]) -> None:
        unknown = sorted(set(extra) - cls._KEYS)
        if unknown:
            raise AFDConfigError(
                f"connector_extra_config of {cls.name}: unknown keys {unknown}; "
                f"allowed: {sorted(cls._KEYS)}"
            )

    @classmethod
    def _check_dtype(cls, value: Any) -> None:
        if value not in ("bfloat16", "float16", "float32"):
            raise AFDConfigError(
                f"connector_extra_config['dtype'] of {cls.name}: expected bfloat16, float16 "
                f"or float32, got {value!r}"
            )

    # -- transport hooks ---------------------------------------------------------------
    def _link(self) -> Any:
        """The transport handle passed to the hooks; ``None`` until ``init()`` succeeded."""
        raise NotImplementedError

    def _join(self) -> None:
        """Meet every rank and set up the transport (``init()``, under the init lock)."""
        raise NotImplementedError

    def _shutdown(self) -> None:
        """Release the transport; called once, by the first ``close()``."""
        raise NotImplementedError

    def _send_messages(
        self,
        link: Any,
        messages: Iterable[_Message],
        deadline: float,
        timeout: float,
        mb: int,
    ) -> None:
        """Send each message (frame, then its tensors) to its peer.

        ``messages`` is lazy: taking the next one checks that its peer is still usable.
        """
        raise NotImplementedError

    def _recv_frames(
        self, link: Any, peers: Sequence[int], deadline: float, timeout: float, action: str
    ) -> Iterable[Frame]:
        """The next frame of each of ``peers``, in order (the message is not consumed).

        ``deadline`` may be :data:`IDLE` (no deadline: only close() or the loss of the
        peer ends the wait).
        """
        raise NotImplementedError

    def _recv_frame(
        self, link: Any, peer: int, deadline: float, timeout: float, action: str
    ) -> Frame:
        """The next frame of one peer (default: through :meth:`_recv_frames`; a transport
        may answer it more directly)."""
        [frame] = self._recv_frames(link, [peer], deadline, timeout, action)
        return frame

    def _recv_tensors(
        self,
        link: Any,
        parts: Sequence[tuple[int, int]],
        specs: Sequence[_Spec],
        deadline: float,
        timeout: float,
        action: str,
        mb: int,
    ) -> list[Any]:
        """Receive the tensors of the current message of each (peer, num_tokens).

        Returns one tensor per spec: the peers' rows concatenated in ``parts`` order.
        """
        raise NotImplementedError

    def _skip_message(
        self,
        link: Any,
        peer: int,
        num_tokens: int,
        specs: Sequence[_Spec],
        deadline: float,
        timeout: float,
        action: str,
        mb: int,
    ) -> None:
        """Get past the current message of ``peer`` (its tensors are not wanted).

        By default the announced tensors are received anyway and dropped: the stream
        stays in step and the sender's pending sends complete.
        """
        self._recv_tensors(link, [(peer, num_tokens)], specs, deadline, timeout, action, mb)

    def _reap_sends(self) -> None:
        """Settle sends that were posted without waiting; raise the error of a failed one."""

    # -- lifecycle ---------------------------------------------------------------------
    def init(self) -> None:
        with self._init_lock:
            if self._closed:
                raise AFDConnectorClosedError(f"{self.label}: init() after close()")
            if self._link() is not None:
                return
            self._join()

    @property
    def is_initialized(self) -> bool:
        return self._link() is not None and not self._closed

    def close(self) -> None:
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        self._shutdown()

    def _shutdown_peer(self) -> int | None:
        """The FFN peer to tell "attention rank N closed", or None.

        Only an attention rank with no exchange in flight says goodbye: its FFN peer is
        then at a message boundary, waiting for the next layer.
        """
        if self.role is AFDRole.ATTENTION and not self._sent and self._peers:
            peer = self._peers[0]
            if peer not in self._broken:
                return peer
        return None

    # -- Attention side ----------------------------------------------------------------
    def send_to_ffn(
        self, payload: AttentionToFFN, *, layer_idx: int, micro_batch_idx: int = 0
    ) -> None:
        link = self._enter(AFDRole.ATTENTION, "send_to_ffn")
        try:
            key = (layer_idx, micro_batch_idx)
            if key in self._sent:
                raise AFDTransferMismatchError(
                    f"{self.label}: send_to_ffn(layer_idx={layer_idx}, micro_batch_idx="
                    f"{micro_batch_idx}) again before recv_from_ffn received the first one"
                )
            header = payload.header(layer_idx, micro_batch_idx)
            tensors, aux = layout_of(header.kind).tensors(payload)
            peer = self._peers[0]
            if self._broken:
                self._check_peer(peer)
            deadline, timeout = self._deadline(None)
            frame = make_frame(header, aux, self._global_rank)
            self._send_messages(link, [(peer, frame, tensors)], deadline, timeout, micro_batch_idx)
            self._sent[key] = header
        finally:
            self._leave()

    def recv_from_ffn(
        self, *, layer_idx: int, micro_batch_idx: int = 0, timeout_s: float | None = None
    ) -> FFNToAttention:
        link = self._enter(AFDRole.ATTENTION, "recv_from_ffn")
        try:
            return self._recv_from_ffn(link, layer_idx, micro_batch_idx, timeout_s)
        finally:
            self._leave()

    def _recv_from_ffn(
        self, link: Any, layer_idx: int, micro_batch_idx: int, timeout_s: float | None
    ) -> FFNToAttention:
        # With no matching send we still wait for the next message: it says which layer
        # really arrived (a mismatch error), or the receive times out.
        sent = self._sent.get((layer_idx, micro_batch_idx))
        peer = self._peers[0]
        if self._broken:
            self._check_peer(peer)
        deadline, timeout = self._deadline(timeout_s)
        action = self._action(layer_idx, micro_batch_idx)
        frame = self._recv_frame(link, peer, deadline, timeout, action)
        header = frame.header
        if header.kind is PayloadKind.SHUTDOWN:
            self._skip_message(link, peer, 0, (), deadline, timeout, action, micro_batch_idx)
            self._broken[peer] = "it closed"
            raise AFDPeerLostError(
                f"{self._describe(peer)} closed while {self.label} waited for layer "
                f"{layer_idx} micro-batch {micro_batch_idx}",
                goodbye=True,
            )
        if header.kind not in _F2A_KINDS:
            self._broken[peer] = "stream out of step after a mismatch"
            raise AFDTransferMismatchError(
                f"{self.label} <- {self._describe(peer)}: expected an FFN->attention message, "
                f"received kind {header.kind.name}"
            )
        problem: AFDTransferMismatchError | None = None
        if (
            header.layer_idx != layer_idx
            or header.micro_batch_idx != micro_batch_idx
            or (
                sent is not None
                and (
                    header.num_tokens != sent.num_tokens
                    or header.hidden_size != sent.hidden_size
                    or header.dtype != sent.dtype
                )
            )
        ):
            try:
                header.expect(
                    layer_idx=layer_idx,
                    micro_batch_idx=micro_batch_idx,
                    num_tokens=None if sent is None else sent.num_tokens,
                    hidden_size=None if sent is None else sent.hidden_size,
                    dtype=None if sent is None else sent.dtype,
                )
            except AFDTransferMismatchError as exc:
                problem = exc
        layout = layout_of(header.kind)
        specs = frame.specs
        n = header.num_tokens
        tensors: list[Any] = []
        if problem is None:
            tensors = self._recv_tensors(
                link, [(peer, n)], specs, deadline, timeout, action, micro_batch_idx
            )
        else:
            # Get past the message even on a mismatch, so the stream stays in step (and
            # the FFN side's send completes).
            self._skip_message(link, peer, n, specs, deadline, timeout, action, micro_batch_idx)
        self._sent.pop((header.layer_idx, header.micro_batch_idx), None)
        self._reap_sends()
        if problem is not None:
            raise AFDTransferMismatchError(
                f"{self.label} <- {self._describe(peer)}: recv_from_ffn(layer_idx={layer_idx}, "
                f"micro_batch_idx={micro_batch_idx}) but the next message is for layer "
                f"{header.layer_idx} micro-batch {header.micro_batch_idx} "
                f"({header.num_tokens} tokens); {problem}. The FFN side answers in the "
                "order of send_to_ffn calls"
            )
        result = layout.build(tensors)
        assert isinstance(result, FFNToAttention)
        return result

    # -- FFN side ----------------------------------------------------------------------
    def recv_from_attention(self, *, timeout_s: float | None = None) -> FFNBatch:
        link = self._enter(AFDRole.FFN, "recv_from_attention")
        try:
            return self._recv_from_attention(link, timeout_s)
        finally:
            self._leave()

    def _recv_from_attention(self, link: Any, timeout_s: float | None) -> FFNBatch:
        if len(self._peers) == 1 and not self._broken:
            return self._recv_from_one_peer(link, timeout_s)
        if not self._peers:
            raise AFDConfigError(
                f"{self.label} serves no attention rank in topology {self.topology.label} "
                f"(idle FFN ranks: {list(self.topology.idle_ffn_ranks)}); an idle rank must "
                "not call recv_from_attention"
            )
        if self._broken:
            for peer in self._peers:
                self._check_peer(peer)
        action = "receiving from"
        received: Iterable[Frame]
        if timeout_s is None:
            # Waiting for the next step is not a transfer: no deadline while the peers are
            # alive (peer loss and close() still end the wait). Once the first peer's frame
            # is here the step has started, and the rest of it is bounded.
            first = list(
                self._recv_frames(
                    link, self._peers[:1], IDLE, self.config.transfer_timeout_s,
                    "waiting for the next step from",
                )
            )  # fmt: skip
            deadline, timeout = self._deadline(None)
            rest = self._recv_frames(link, self._peers[1:], deadline, timeout, action)
            received = itertools.chain(first, rest)
        else:
            deadline, timeout = self._deadline(timeout_s)
            received = self._recv_frames(link, self._peers, deadline, timeout, action)
        frames: list[Frame] = []
        for peer, frame in zip(self._peers, received, strict=True):
            if frame.header.kind not in _A2F_KINDS:
                self._refuse_frame(link, peer, frame, deadline, timeout, action)
            frames.append(frame)
        first = frames[0]
        ref = _layer_key(first)
        for peer, frame in zip(self._peers[1:], frames[1:], strict=True):
            if _layer_key(frame) != ref:
                for p in self._peers:
                    self._broken[p] = "attention peers out of step"
                raise AFDTransferMismatchError(
                    f"{self.label}: attention peers disagree on the layer being sent: "
                    f"{self._describe(self._peers[0])} sent "
                    f"{_describe_header(first.header, first.aux_dtype)}, "
                    f"{self._describe(peer)} sent {_describe_header(frame.header, frame.aux_dtype)}"
                )
        self._reap_sends()
        head = first.header
        counts = tuple(f.header.num_tokens for f in frames)
        mb = head.micro_batch_idx
        layout = layout_of(head.kind)
        tensors = self._recv_tensors(
            link,
            list(zip(self._peers, counts, strict=True)),
            first.specs,
            deadline,
            timeout,
            self._action(head.layer_idx, mb),
            mb,
        )
        total = sum(counts)
        payload = layout.build(tensors)
        assert isinstance(payload, AttentionToFFN)
        return FFNBatch(
            header=head if head.num_tokens == total else head.with_tokens(total),
            payload=payload,
            peer_ranks=self._peer_role_ranks,
            token_counts=counts,
        )

    def _recv_from_one_peer(self, link: Any, timeout_s: float | None) -> FFNBatch:
        """:meth:`_recv_from_attention` for an FFN rank with one attention peer (the
        common case): the same checks, without the fan-in."""
        peer = self._peers[0]
        if timeout_s is None:
            # Waiting for the next step is not a transfer: no deadline while the peer is
            # alive (its loss and close() still end the wait).
            wait = "waiting for the next step from"
            frame = self._recv_frame(link, peer, IDLE, self.config.transfer_timeout_s, wait)
            deadline, timeout = self._deadline(None)
        else:
            deadline, timeout = self._deadline(timeout_s)
            frame = self._recv_frame(link, peer, deadline, timeout, "receiving from")
        head = frame.header
        if head.kind not in _A2F_KINDS:
            self._refuse_frame(link, peer, frame, deadline, timeout, "receiving from")
        self._reap_sends()
        n = head.num_tokens
        mb = head.micro_batch_idx
        tensors = self._recv_tensors(
            link, [(peer, n)], frame.specs, deadline, timeout, self._action(head.layer_idx, mb), mb
        )  # fmt: skip
        payload = layout_of(head.kind).build(tensors)
        assert isinstance(payload, AttentionToFFN)
        return FFNBatch(head, payload, self._peer_role_ranks, (n,))

    def _refuse_frame(
        self, link: Any, peer: int, frame: Frame, deadline: float, timeout: float, action: str
    ) -> None:
        """Raise for a frame that is not an attention->FFN message (goodbye or mismatch)."""
        kind = frame.header.kind
        if kind is PayloadKind.SHUTDOWN:
            self._skip_message(link, peer, 0, (), deadline, timeout, action, 0)
            self._broken[peer] = "it closed"
            raise AFDPeerLostError(
                f"{self._describe(peer)} closed (sent SHUTDOWN) while {self.label} waited "
                "for the next layer",
                goodbye=True,
            )
        self._broken[peer] = "stream out of step after a mismatch"
        raise AFDTransferMismatchError(
            f"{self.label} <- {self._describe(peer)}: expected an attention->FFN "
            f"message, received kind {kind.name}"
        )

    def send_to_attention(self, batch: FFNBatch, result: FFNToAttention) -> None:
        link = self._enter(AFDRole.FFN, "send_to_attention")
        try:
            mb = batch.micro_batch_idx
            if batch.peer_ranks is self._peer_role_ranks and len(self._peers) == 1:
                # One peer, and the batch is this connector's own: the whole result is
                # its answer once the row count matches (else answers() says why).
                header = result.header(batch.layer_idx, mb)
                if header.num_tokens == batch.header.num_tokens and not self._broken:
                    deadline, timeout = self._deadline(None)
                    frame = make_frame(header, _aux(result), self._global_rank)
                    tensors = [result.output] if result.shared_output is None else [
                        result.output, result.shared_output
                    ]  # fmt: skip
                    self._send_messages(
                        link, [(self._peers[0], frame, tensors)], deadline, timeout, mb
                    )
                    return
            answers = batch.answers(result, serving=self._peer_role_ranks, who=self.label)
            deadline, timeout = self._deadline(None)
            messages = self._messages(batch, answers, _aux(result))
            self._send_messages(link, messages, deadline, timeout, mb)
        finally:
            self._leave()

    def _messages(
        self, batch: FFNBatch, answers: list[tuple[int, FFNToAttention]], aux: str | None
    ) -> Iterator[_Message]:
        """One message per attention peer (``aux``: the shared output's dtype, or None);
        each peer is checked (``_check_peer``) just before its message is produced."""
        layer, mb = batch.layer_idx, batch.micro_batch_idx
        for peer, part in answers:
            if self._broken:
                self._check_peer(peer)
            frame = make_frame(part.header(layer, mb), aux, self._global_rank)
            out, sh = part.output, part.shared_output
            yield peer, frame, [out] if sh is None else [out, sh]

    # -- shared plumbing ---------------------------------------------------------------
    @property
    def _where(self) -> str:
        return f"{self.config.host}:{self.config.port}"

    def _describe(self, peer: int) -> str:
        return f"{describe_global_rank(self.topology, peer)} (global rank {peer})"

    @property
    def _active(self) -> int:
        """Public operations in progress."""
        return len(self._ops)

    def _enter(self, role: AFDRole, method: str) -> Any:
        """Start a public operation and return the link; pair with :meth:`_leave`.

        ``close()`` of a transport may wait for the operations in progress to leave:
        close() sets ``_closed`` before it counts them, and an operation is counted
        before it reads ``_closed``, so one of the two always sees the other.
        """
        self._ops.append(0)
        link = self._link()
        if self._closed or self._role is not role or link is None:
            self._ops.pop()
            if self._closed:
                raise AFDConnectorClosedError(f"{self.label}: {method}() after close()")
            self.check_side(role, method)
            raise AFDConnectorError(f"{self.label}: {method}() before init()")
        return link

    def _leave(self) -> None:
        self._ops.pop()

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
                f"{self.label}: the connection to {self._describe(peer)} is gone ({reason}); "
                "create a new connector"
            )

    def _deadline(self, timeout_s: float | None) -> tuple[float, float]:
        timeout = self.config.transfer_timeout_s if timeout_s is None else float(timeout_s)
        return time.monotonic() + timeout, timeout

    def _decode_frame(self, peer: int, words: Sequence[int]) -> Frame:
        """Decode a received frame; a garbled one breaks the connection to ``peer``."""
        try:
            return Frame.decode(list(words))
        except AFDTransferMismatchError as exc:
            self._broken[peer] = "garbled frame"
            raise AFDTransferMismatchError(
                f"{self.label} <- {self._describe(peer)}: {exc}"
            ) from None

    def _closed_error(self, peer: int, action: str) -> AFDConnectorClosedError:
        return AFDConnectorClosedError(
            f"{self.label} was closed while {action} {self._describe(peer)}"
        )

    def _timeout_error(
        self, peer: int, timeout: float, action: str, note: str = ""
    ) -> AFDTimeoutError:
        return AFDTimeoutError(
            f"{self.label}: {action} {self._describe(peer)} timed out after {timeout:g} s "
            f"(timeout_s argument or afd.transfer_timeout_s){note}"
        )

    def _gone_error(self, peer: int, action: str, detail: str = "") -> AFDPeerLostError:
        text = f"{self.label}: {self._describe(peer)} is gone while {action} it"
        return AFDPeerLostError(f"{text}: {detail}" if detail else text)
