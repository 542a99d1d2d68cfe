"""Point-to-point AFD connectors over a private torch.distributed process group.

One implementation, :class:`P2pAFDConnector`, with two registered flavours:

* :class:`P2pGlooAFDConnector` — CPU tensors over gloo (the embedded default);
* :class:`P2pNcclAFDConnector` — CUDA tensors over NCCL, frames over gloo, receive
  buffers preallocated per power-of-two token bucket.

Per message: a frame (:mod:`afd_connectors_gpu.wire`: ``TransferHeader.encode()``
plus transport words, int64) then the tensors in a fixed order. Nothing here
imports torch at module import time; ``init()`` does.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, ClassVar

from afd_connectors_gpu.rendezvous import DataPlaneGroup, describe_global_rank, join_data_plane
from afd_connectors_gpu.wire import FRAME_LEN, Frame
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
)

__all__ = ["P2pAFDConnector", "P2pGlooAFDConnector", "P2pNcclAFDConnector"]

logger = logging.getLogger(__name__)

_DATA_TAG = 0
_BREAK_TAG = 0x7AFD
_SENTINEL_TAG = 0x7AFE
_SHUTDOWN_GRACE_S = 0.2
_FLUSH_GRACE_S = 1.0
_NCCL_POLL_S = 50e-6

_A2F_KINDS = frozenset(k for k in PayloadKind if k.is_attention_to_ffn)
_F2A_KINDS = frozenset(k for k in PayloadKind if k.is_ffn_to_attention)

# (trailing shape, dtype name) of every tensor of a message, main tensor first.
_Spec = tuple[tuple[int, ...], str]


def _a2f_specs(header: TransferHeader, aux_dtype: str | None) -> list[_Spec]:
    specs: list[_Spec] = [((header.hidden_size,), header.dtype)]
    if header.kind is PayloadKind.HIDDEN_TOPK:
        specs += [((header.topk,), "int32"), ((header.topk,), "float32")]
    elif header.kind is PayloadKind.HIDDEN_ROUTER_LOGITS:
        specs.append(((header.topk,), aux_dtype or header.dtype))
    elif header.kind is PayloadKind.HIDDEN_TOKEN_IDS:
        specs.append(((), aux_dtype or "int64"))
    return specs


def _f2a_specs(header: TransferHeader, aux_dtype: str | None) -> list[_Spec]:
    specs: list[_Spec] = [((header.hidden_size,), header.dtype)]
    if header.kind is PayloadKind.OUTPUT_WITH_SHARED:
        specs.append(((header.hidden_size,), aux_dtype or header.dtype))
    return specs


def _a2f_tensors(payload: AttentionToFFN) -> tuple[list[Any], str | None]:
    tensors = [payload.hidden_states]
    aux: str | None = None
    if payload.topk_ids is not None:
        tensors += [payload.topk_ids, payload.topk_weights]
    elif payload.router_logits is not None:
        tensors.append(payload.router_logits)
        aux = dtype_name(payload.router_logits.dtype)
    elif payload.token_ids is not None:
        tensors.append(payload.token_ids)
        aux = dtype_name(payload.token_ids.dtype)
    return tensors, aux


def _a2f_payload(kind: PayloadKind, tensors: Sequence[Any]) -> AttentionToFFN:
    if kind is PayloadKind.HIDDEN_TOPK:
        return AttentionToFFN(tensors[0], topk_ids=tensors[1], topk_weights=tensors[2])
    if kind is PayloadKind.HIDDEN_ROUTER_LOGITS:
        return AttentionToFFN(tensors[0], router_logits=tensors[1])
    if kind is PayloadKind.HIDDEN_TOKEN_IDS:
        return AttentionToFFN(tensors[0], token_ids=tensors[1])
    return AttentionToFFN(tensors[0])


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


class P2pAFDConnector(AFDConnector):
    """Attention <-> FFN point-to-point transfers over a private process group.

    Failure behaviour: a receive that outlives its timeout raises
    :class:`AFDTimeoutError` (gloo then drops the connection to that peer, so later
    transfers with it raise :class:`AFDPeerLostError`); a peer process that exits
    or crashes closes its sockets and the blocked side raises
    :class:`AFDPeerLostError` at once; ``close()`` (from any thread) makes blocked
    and later calls raise :class:`AFDConnectorClosedError`.
    """

    #: "gloo" or "nccl": which backend carries the tensors (frames always use gloo).
    backend: ClassVar[str] = "gloo"

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
        self._group: DataPlaneGroup | None = None
        self._closed = False
        self._state_lock = threading.Lock()
        self._init_lock = threading.Lock()
        self._sent: dict[tuple[int, int], TransferHeader] = {}
        self._pending_sends: collections.deque[tuple[Any, int, Any]] = collections.deque()
        self._broken: dict[int, str] = {}
        self._sentinels: dict[int, Any] = {}
        self._buffers: dict[tuple[Any, ...], Any] = {}
        self._device: Any = None

    # -- lifecycle -----------------------------------------------------------------
    def init(self) -> None:
        with self._init_lock:
            if self._closed:
                raise AFDConnectorClosedError(f"{self._me}: init() after close()")
            if self._group is not None:
                return
            self._device = self._select_device()
            group = join_data_plane(
                host=self.config.host,
                port=self.config.port,
                topology=self.topology,
                global_rank=self._global_rank,
                connect_timeout_s=self.config.connect_timeout_s,
                transfer_timeout_s=self.config.transfer_timeout_s,
                nccl_device=self._device if self.backend == "nccl" else None,
            )
            self._after_join(group)
            self._group = group
            logger.debug("%s joined the data plane at %s", self._me, self._where)

    @property
    def is_initialized(self) -> bool:
        return self._group is not None and not self._closed

    def close(self) -> None:
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        group = self._group
        if group is None:
            return
        import torch

        try:
            # Let sends already posted finish (the peer may still be receiving our last
            # answer), but never for long: close() must not hang on a peer that is gone.
            flush_deadline = time.monotonic() + _FLUSH_GRACE_S
            while self._pending_sends and time.monotonic() < flush_deadline:
                if self._pending_sends[0][0].is_completed():
                    self._pending_sends.popleft()
                else:
                    time.sleep(0.001)
            if (
                self.role is AFDRole.ATTENTION
                and not self._sent
                and self._peers[0] not in self._broken
            ):
                # The FFN peer is at a message boundary: tell it we are leaving so its
                # receive fails with "attention rank N closed" rather than a socket error.
                frame = torch.tensor(Frame.shutdown(self._global_rank).encode(), dtype=torch.int64)
                with contextlib.suppress(RuntimeError):
                    group.gloo.send([frame], self._peers[0], _DATA_TAG).wait(
                        timedelta(seconds=_SHUTDOWN_GRACE_S)
                    )
            # A receive that times out makes gloo close the connection to that peer, which
            # also fails any receive another thread has pending on it: that is how close()
            # unblocks waiters (gloo's abort() does not interrupt point-to-point waits).
            dummy = torch.zeros(1)
            for peer in self._peers:
                with contextlib.suppress(RuntimeError):
                    group.gloo.recv([dummy], peer, _BREAK_TAG).wait(timedelta(milliseconds=1))
            if group.nccl is not None:
                try:
                    group.nccl.abort()
                except RuntimeError:
                    logger.debug("%s: NCCL abort failed", self._me, exc_info=True)
        finally:
            self._sentinels.clear()
            self._pending_sends.clear()
            self._buffers.clear()
            self._group = None

    # -- hooks for the NCCL flavour ------------------------------------------------
    def _select_device(self) -> Any:
        import torch

        return torch.device("cpu")

    def _after_join(self, group: DataPlaneGroup) -> None:
        """Called once the process group exists (before ``init()`` returns)."""

    def _stage_send(self, tensor: Any, slot: int, mb: int) -> Any:
        t = tensor if tensor.device == self._device else tensor.to(self._device)
        return t.contiguous()

    def _recv_buffer(self, num_tokens: int, spec: _Spec, slot: int, mb: int) -> tuple[Any, Any]:
        """(buffer to receive into, tensor to hand out)."""
        import torch

        trailing, dtype = spec
        t = torch.empty((num_tokens, *trailing), dtype=getattr(torch, dtype), device=self._device)
        return t, t

    def _wait_data(
        self, work: Any, peer: int, deadline: float, timeout: float, action: str
    ) -> None:
        self._wait_gloo(work, peer, deadline, timeout, action)

    # -- Attention side ------------------------------------------------------------
    def send_to_ffn(
        self, payload: AttentionToFFN, *, layer_idx: int, micro_batch_idx: int = 0
    ) -> None:
        group = self._usable(AFDRole.ATTENTION, "send_to_ffn")
        key = (layer_idx, micro_batch_idx)
        if key in self._sent:
            raise AFDTransferMismatchError(
                f"{self._me}: send_to_ffn(layer_idx={layer_idx}, micro_batch_idx="
                f"{micro_batch_idx}) again before recv_from_ffn received the first one"
            )
        header = payload.header(layer_idx, micro_batch_idx)
        tensors, aux = _a2f_tensors(payload)
        peer = self._peers[0]
        self._check_peer(peer)
        deadline, timeout = self._deadline(None)
        self._send_message(
            group,
            peer,
            Frame(header, aux, self._global_rank),
            tensors,
            deadline,
            timeout,
            micro_batch_idx,
        )
        self._sent[key] = header

    def recv_from_ffn(
        self, *, layer_idx: int, micro_batch_idx: int = 0, timeout_s: float | None = None
    ) -> FFNToAttention:
        group = self._usable(AFDRole.ATTENTION, "recv_from_ffn")
        key = (layer_idx, micro_batch_idx)
        # With no matching send we still wait for the next message: it says which layer
        # really arrived (a mismatch error), or the receive times out.
        sent = self._sent.get(key)
        peer = self._peers[0]
        self._check_peer(peer)
        deadline, timeout = self._deadline(timeout_s)
        action = f"receiving layer {layer_idx} micro-batch {micro_batch_idx} from"
        frame = self._recv_frames(group, [peer], deadline, timeout, action)[0]
        header = frame.header
        if header.kind is PayloadKind.SHUTDOWN:
            self._broken[peer] = "it closed"
            raise AFDPeerLostError(
                f"{self._describe(peer)} closed while {self._me} waited for layer "
                f"{layer_idx} micro-batch {micro_batch_idx}"
            )
        if header.kind not in _F2A_KINDS:
            self._broken[peer] = "stream out of step after a mismatch"
            raise AFDTransferMismatchError(
                f"{self._me} <- {self._describe(peer)}: expected an FFN->attention message, "
                f"received kind {header.kind.name}"
            )
        problem: AFDTransferMismatchError | None = None
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
        # Receive the tensors the frame announces even on a mismatch, so the stream
        # stays in step (and the FFN side's send completes).
        specs = _f2a_specs(header, frame.aux_dtype)
        tensors = self._recv_tensors(
            group, [(peer, header.num_tokens, specs)], deadline, timeout, action, micro_batch_idx
        )[0]
        self._sent.pop((header.layer_idx, header.micro_batch_idx), None)
        self._reap_sends()
        if problem is not None:
            raise AFDTransferMismatchError(
                f"{self._me} <- {self._describe(peer)}: recv_from_ffn(layer_idx={layer_idx}, "
                f"micro_batch_idx={micro_batch_idx}) but the next message is for layer "
                f"{header.layer_idx} micro-batch {header.micro_batch_idx} "
                f"({header.num_tokens} tokens); {problem}. The FFN side answers in the "
                "order of send_to_ffn calls"
            )
        return FFNToAttention(tensors[0], shared_output=tensors[1] if len(tensors) > 1 else None)

    # -- FFN side ------------------------------------------------------------------
    def recv_from_attention(self, *, timeout_s: float | None = None) -> FFNBatch:
        import torch

        group = self._usable(AFDRole.FFN, "recv_from_attention")
        if not self._peers:
            raise AFDConfigError(
                f"{self._me} serves no attention rank in topology {self.topology.label} "
                f"(idle FFN ranks: {list(self.topology.idle_ffn_ranks)}); an idle rank must "
                "not call recv_from_attention"
            )
        for peer in self._peers:
            self._check_peer(peer)
        deadline, timeout = self._deadline(timeout_s)
        frames = self._recv_frames(group, list(self._peers), deadline, timeout, "receiving from")
        for peer, frame in zip(self._peers, frames, strict=True):
            kind = frame.header.kind
            if kind is PayloadKind.SHUTDOWN:
                self._broken[peer] = "it closed"
                raise AFDPeerLostError(
                    f"{self._describe(peer)} closed (sent SHUTDOWN) while {self._me} waited "
                    "for the next layer"
                )
            if kind not in _A2F_KINDS:
                self._broken[peer] = "stream out of step after a mismatch"
                raise AFDTransferMismatchError(
                    f"{self._me} <- {self._describe(peer)}: expected an attention->FFN "
                    f"message, received kind {kind.name}"
                )
        first = frames[0]
        ref = (first.header.with_tokens(0), first.aux_dtype)
        for peer, frame in zip(self._peers[1:], frames[1:], strict=True):
            if (frame.header.with_tokens(0), frame.aux_dtype) != ref:
                for p in self._peers:
                    self._broken[p] = "attention peers out of step"
                raise AFDTransferMismatchError(
                    f"{self._me}: attention peers disagree on the layer being sent: "
                    f"{self._describe(self._peers[0])} sent "
                    f"{_describe_header(first.header, first.aux_dtype)}, "
                    f"{self._describe(peer)} sent {_describe_header(frame.header, frame.aux_dtype)}"
                )
        self._reap_sends()
        counts = tuple(f.header.num_tokens for f in frames)
        specs = _a2f_specs(first.header, first.aux_dtype)
        mb = first.header.micro_batch_idx
        per_peer = self._recv_tensors(
            group,
            [(p, n, specs) for p, n in zip(self._peers, counts, strict=True)],
            deadline,
            timeout,
            f"receiving layer {first.header.layer_idx} micro-batch {mb} from",
            mb,
        )
        if len(per_peer) == 1:
            tensors = per_peer[0]
        else:
            tensors = [torch.cat(parts, dim=0) for parts in zip(*per_peer, strict=True)]
        return FFNBatch(
            header=first.header.with_tokens(sum(counts)),
            payload=_a2f_payload(first.header.kind, tensors),
            peer_ranks=self._peer_role_ranks,
            token_counts=counts,
        )

    def send_to_attention(self, batch: FFNBatch, result: FFNToAttention) -> None:
        group = self._usable(AFDRole.FFN, "send_to_attention")
        if tuple(batch.peer_ranks) != self._peer_role_ranks:
            raise AFDTransferMismatchError(
                f"{self._me}: batch is for attention ranks {list(batch.peer_ranks)}, this rank "
                f"serves {list(self._peer_role_ranks)}"
            )
        total = sum(batch.token_counts)
        if result.num_tokens != total:
            raise AFDTransferMismatchError(
                f"{self._me}: result has {result.num_tokens} tokens, the batch of layer "
                f"{batch.layer_idx} micro-batch {batch.micro_batch_idx} had {total} "
                f"({dict(zip(batch.peer_ranks, batch.token_counts, strict=True))})"
            )
        outputs = result.output.split(list(batch.token_counts), dim=0)
        shared = (
            result.shared_output.split(list(batch.token_counts), dim=0)
            if result.shared_output is not None
            else [None] * len(outputs)
        )
        deadline, timeout = self._deadline(None)
        aux = dtype_name(result.shared_output.dtype) if result.shared_output is not None else None
        messages = []
        for peer, out, sh in zip(self._peers, outputs, shared, strict=True):
            self._check_peer(peer)
            part = FFNToAttention(out, shared_output=sh)
            frame = Frame(
                part.header(batch.layer_idx, batch.micro_batch_idx), aux, self._global_rank
            )
            messages.append((peer, frame, [out] if sh is None else [out, sh]))
        self._send_messages(group, messages, deadline, timeout, batch.micro_batch_idx)

    # -- transport -------------------------------------------------------------------
    @property
    def _me(self) -> str:
        return f"{type(self).__name__}({self.role.value} rank {self.rank})"

    @property
    def _where(self) -> str:
        return f"{self.config.host}:{self.config.port}"

    def _describe(self, peer: int) -> str:
        return f"{describe_global_rank(self.topology, peer)} (global rank {peer})"

    def _usable(self, role: AFDRole, method: str) -> DataPlaneGroup:
        if self._closed:
            raise AFDConnectorClosedError(f"{self._me}: {method}() after close()")
        if self.role is not role:
            raise AFDConfigError(
                f"{self._me}: {method}() is a {role.value}-side call; this connector was "
                f"created for the {self.role.value} role"
            )
        group = self._group
        if group is None:
            raise AFDConnectorError(f"{self._me}: {method}() before init()")
        return group

    def _check_peer(self, peer: int) -> None:
        reason = self._broken.get(peer)
        if reason is not None:
            raise AFDPeerLostError(
                f"{self._me}: the connection to {self._describe(peer)} is gone ({reason}); "
                "create a new connector"
            )

    def _deadline(self, timeout_s: float | None) -> tuple[float, float]:
        timeout = self.config.transfer_timeout_s if timeout_s is None else float(timeout_s)
        return time.monotonic() + timeout, timeout

    def _map_error(self, exc: BaseException, peer: int, timeout: float, action: str) -> Exception:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if self._closed:
            return AFDConnectorClosedError(
                f"{self._me} was closed while {action} {self._describe(peer)}"
            )
        if "Timed out" in text or "timed out" in text:
            self._broken[peer] = f"timed out after {timeout:g} s"
            return AFDTimeoutError(
                f"{self._me}: {action} {self._describe(peer)} timed out after {timeout:g} s "
                "(timeout_s argument or afd.transfer_timeout_s); the connection to that peer "
                "is dropped"
            )
        self._broken[peer] = text
        return AFDPeerLostError(
            f"{self._me}: {self._describe(peer)} is gone while {action} it: {text}"
        )

    def _wait_gloo(
        self, work: Any, peer: int, deadline: float, timeout: float, action: str
    ) -> None:
        remaining = max(deadline - time.monotonic(), 0.001)
        try:
            work.wait(timedelta(seconds=remaining))
        except RuntimeError as exc:
            raise self._map_error(exc, peer, timeout, action) from exc

    def _send_message(
        self,
        group: DataPlaneGroup,
        peer: int,
        frame: Frame,
        tensors: Sequence[Any],
        deadline: float,
        timeout: float,
        mb: int,
    ) -> None:
        self._send_messages(group, [(peer, frame, tensors)], deadline, timeout, mb)

    def _send_messages(
        self,
        group: DataPlaneGroup,
        messages: Sequence[tuple[int, Frame, Sequence[Any]]],
        deadline: float,
        timeout: float,
        mb: int,
    ) -> None:
        """Post the sends and return without waiting for them.

        A gloo send completes only once the receiver has posted the matching receive,
        so waiting here would deadlock as soon as both sides send before receiving
        (micro-batches). Pending sends keep their tensors alive and are reaped (and
        their errors raised) by later calls; the caller must not modify a sent tensor
        in place before the answer to it has been received.
        """
        import torch

        self._reap_sends()
        data_pg = group.nccl if group.nccl is not None else group.gloo
        try:
            for peer, frame, tensors in messages:
                head = torch.tensor(frame.encode(), dtype=torch.int64)
                work = group.gloo.send([head], peer, _DATA_TAG)
                self._pending_sends.append((work, peer, head))
                for slot, tensor in enumerate(tensors):
                    if tensor.numel() == 0:
                        continue
                    staged = self._stage_send(tensor, slot, mb)
                    work = data_pg.send([staged], peer, _DATA_TAG)
                    self._pending_sends.append((work, peer, staged))
        except RuntimeError as exc:
            raise self._map_error(exc, messages[0][0], timeout, "sending to") from exc

    def _reap_sends(self) -> None:
        """Forget completed sends; raise the error of a failed one."""
        pending = self._pending_sends
        while pending and pending[0][0].is_completed():
            work, peer, _ = pending.popleft()
            try:
                work.wait()
            except RuntimeError as exc:
                timeout = self.config.transfer_timeout_s
                raise self._map_error(exc, peer, timeout, "sending to") from exc

    def _recv_frames(
        self,
        group: DataPlaneGroup,
        peers: Sequence[int],
        deadline: float,
        timeout: float,
        action: str,
    ) -> list[Frame]:
        import torch

        heads = [torch.empty(FRAME_LEN, dtype=torch.int64) for _ in peers]
        works = []
        for peer, head in zip(peers, heads, strict=True):
            try:
                works.append(group.gloo.recv([head], peer, _DATA_TAG))
            except RuntimeError as exc:
                raise self._map_error(exc, peer, timeout, action) from exc
        frames = []
        for peer, head, work in zip(peers, heads, works, strict=True):
            self._wait_gloo(work, peer, deadline, timeout, action)
            try:
                frames.append(Frame.decode(head.tolist()))
            except AFDTransferMismatchError as exc:
                self._broken[peer] = "garbled frame"
                raise AFDTransferMismatchError(
                    f"{self._me} <- {self._describe(peer)}: {exc}"
                ) from None
        return frames

    def _recv_tensors(
        self,
        group: DataPlaneGroup,
        requests: Sequence[tuple[int, int, Sequence[_Spec]]],
        deadline: float,
        timeout: float,
        action: str,
        mb: int,
    ) -> list[list[Any]]:
        data_pg = group.nccl if group.nccl is not None else group.gloo
        results: list[list[Any]] = []
        posted: list[tuple[Any, int]] = []
        for peer, num_tokens, specs in requests:
            out = []
            for slot, spec in enumerate(specs):
                buf, view = self._recv_buffer(num_tokens, spec, slot, mb)
                out.append(view)
                if num_tokens == 0:
                    continue
                try:
                    posted.append((data_pg.recv([buf], peer, _DATA_TAG), peer))
                except RuntimeError as exc:
                    raise self._map_error(exc, peer, timeout, action) from exc
            results.append(out)
        for work, peer in posted:
            self._wait_data(work, peer, deadline, timeout, action)
        return results


class P2pGlooAFDConnector(P2pAFDConnector):
    """CPU tensors over gloo; no extra configuration."""

    name: ClassVar[str] = "P2pGlooAFDConnector"
    backend: ClassVar[str] = "gloo"


class P2pNcclAFDConnector(P2pAFDConnector):
    """CUDA tensors over NCCL; frames (headers) over gloo on the CPU.

    Tensors move as power-of-two token buckets (``1, 2, 4, ... max_num_tokens``): the
    sender copies into a preallocated bucket buffer and sends the whole bucket, the
    receiver receives into a preallocated buffer of the same bucket and hands out the
    first ``num_tokens`` rows. Buffers are keyed by (bucket, shape, dtype, micro-batch),
    so their addresses stay fixed after the first step of each size, which is what
    CUDA-graph capture of the tensor transfers needs. A received tensor is a view of
    such a buffer: it stays valid until the next receive of the same bucket and
    micro-batch.

    connector_extra_config:
      ``max_num_tokens`` (int, default 8192): largest message; bigger ones are refused.
      ``device`` (int, default ``torch.cuda.current_device()``): CUDA device index.
      ``hidden_size`` (int, optional) and ``dtype`` (str, default "bfloat16"):
      preallocate the hidden-state receive buffers of every bucket in ``init()``.
    """

    name: ClassVar[str] = "P2pNcclAFDConnector"
    backend: ClassVar[str] = "nccl"

    _KEYS: ClassVar[frozenset[str]] = frozenset(
        {"max_num_tokens", "device", "hidden_size", "dtype"}
    )

    @classmethod
    def validate_extra_config(cls, extra: Mapping[str, Any]) -> Mapping[str, Any]:
        unknown = sorted(set(extra) - cls._KEYS)
        if unknown:
            raise AFDConfigError(
                f"connector_extra_config of {cls.name}: unknown keys {unknown}; "
                f"allowed: {sorted(cls._KEYS)}"
            )
        out: dict[str, Any] = {
            "max_num_tokens": _positive_int(
                cls.name, "max_num_tokens", extra.get("max_num_tokens", 8192)
            ),
            "device": extra.get("device"),
            "hidden_size": extra.get("hidden_size"),
            "dtype": extra.get("dtype", "bfloat16"),
        }
        if out["device"] is not None and (
            not isinstance(out["device"], int)
            or isinstance(out["device"], bool)
            or out["device"] < 0
        ):
            raise AFDConfigError(
                f"connector_extra_config['device'] of {cls.name}: expected a CUDA device "
                f"index >= 0, got {out['device']!r}"
            )
        if out["hidden_size"] is not None:
            _positive_int(cls.name, "hidden_size", out["hidden_size"])
        if out["dtype"] not in ("bfloat16", "float16", "float32"):
            raise AFDConfigError(
                f"connector_extra_config['dtype'] of {cls.name}: expected bfloat16, float16 "
                f"or float32, got {out['dtype']!r}"
            )
        return out

    @property
    def max_num_tokens(self) -> int:
        return int(self.extra_config["max_num_tokens"])

    def bucket_of(self, num_tokens: int) -> int:
        """The power-of-two bucket that carries ``num_tokens`` rows."""
        if num_tokens > self.max_num_tokens:
            raise AFDTransferMismatchError(
                f"{self._me}: {num_tokens} tokens exceed max_num_tokens={self.max_num_tokens}; "
                "raise connector_extra_config['max_num_tokens']"
            )
        return 1 << max(num_tokens - 1, 0).bit_length()

    def buckets(self) -> list[int]:
        """Every bucket: powers of two up to the first one >= ``max_num_tokens``."""
        return [1 << i for i in range(self.bucket_of(self.max_num_tokens).bit_length())]

    def _select_device(self) -> Any:
        import torch

        if not torch.cuda.is_available():
            raise AFDConfigError(
                f"{self._me}: requires CUDA (torch.cuda.is_available() is False); "
                "use P2pGlooAFDConnector on CPU"
            )
        index = self.extra_config["device"]
        if index is None:
            index = torch.cuda.current_device()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    def _after_join(self, group: DataPlaneGroup) -> None:
        import torch

        # NCCL never notices a dead peer by itself. Each rank keeps one gloo receive
        # pending per peer on a tag nobody sends on; when the peer's process dies (or
        # it closes), gloo fails that receive, and the NCCL wait loop sees it.
        for peer in self._peers:
            self._sentinels[peer] = group.gloo.recv([torch.zeros(1)], peer, _SENTINEL_TAG)
        hidden = self.extra_config["hidden_size"]
        if hidden is not None:
            spec: _Spec = ((int(hidden),), str(self.extra_config["dtype"]))
            for bucket in self.buckets():
                for mb in range(self.config.num_micro_batches):
                    self._recv_buffer(bucket, spec, 0, mb)

    def _buffer(self, kind: str, bucket: int, spec: _Spec, slot: int, mb: int) -> Any:
        import torch

        trailing, dtype = spec
        key = (kind, bucket, trailing, dtype, slot, mb)
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.zeros((bucket, *trailing), dtype=getattr(torch, dtype), device=self._device)
            self._buffers[key] = buf
        return buf

    def _stage_send(self, tensor: Any, slot: int, mb: int) -> Any:
        n = int(tensor.shape[0])
        spec: _Spec = (tuple(int(s) for s in tensor.shape[1:]), dtype_name(tensor.dtype))
        buf = self._buffer("send", self.bucket_of(n), spec, slot, mb)
        buf[:n].copy_(tensor, non_blocking=True)
        return buf

    def _recv_buffer(self, num_tokens: int, spec: _Spec, slot: int, mb: int) -> tuple[Any, Any]:
        buf = self._buffer("recv", self.bucket_of(num_tokens), spec, slot, mb)
        return buf, buf[:num_tokens]

    def _wait_data(
        self, work: Any, peer: int, deadline: float, timeout: float, action: str
    ) -> None:
        while not work.is_completed():
            if self._closed:
                raise AFDConnectorClosedError(
                    f"{self._me} was closed while {action} {self._describe(peer)}"
                )
            sentinel = self._sentinels.get(peer)
            if sentinel is not None and sentinel.is_completed():
                self._broken[peer] = "its process exited or closed"
                raise AFDPeerLostError(
                    f"{self._me}: {self._describe(peer)} is gone while {action} it"
                )
            if time.monotonic() > deadline:
                self._broken[peer] = f"timed out after {timeout:g} s"
                raise AFDTimeoutError(
                    f"{self._me}: {action} {self._describe(peer)} timed out after {timeout:g} s "
                    "(timeout_s argument or afd.transfer_timeout_s)"
                )
            time.sleep(_NCCL_POLL_S)
        work.wait()
