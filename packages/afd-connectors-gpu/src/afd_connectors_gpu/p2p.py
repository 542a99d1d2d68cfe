"""Point-to-point AFD connectors over a private torch.distributed process group.

One implementation, :class:`P2pAFDConnector`, with two registered flavours:

* :class:`P2pGlooAFDConnector` — CPU tensors over gloo (the embedded default);
* :class:`P2pNcclAFDConnector` — CUDA tensors over NCCL, frames over gloo, receive
  buffers preallocated per power-of-two token bucket.

Per message: a frame (:mod:`afd_connectors_gpu.wire`: ``TransferHeader.encode()``
plus transport words, int64) then the tensors in a fixed order. The exchange itself
(bookkeeping, fan-in, validation, errors) is :class:`~afd_connectors_gpu.exchange.
ExchangeConnector`; this module only moves frames and tensors. Nothing here imports
torch at module import time; ``init()`` does.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, ClassVar

from afd_connectors_gpu.exchange import ExchangeConnector, _Message, _positive_int, _Spec
from afd_connectors_gpu.rendezvous import DataPlaneGroup, join_data_plane
from afd_connectors_gpu.wire import FRAME_LEN, Frame
from afd_core.config import AFDConfig
from afd_core.errors import AFDConfigError, AFDTransferMismatchError
from afd_core.transfer import dtype_name

__all__ = ["P2pAFDConnector", "P2pGlooAFDConnector", "P2pNcclAFDConnector"]

logger = logging.getLogger(__name__)

_DATA_TAG = 0
_BREAK_TAG = 0x7AFD
_SENTINEL_TAG = 0x7AFE
_SHUTDOWN_GRACE_S = 0.2
_FLUSH_GRACE_S = 1.0
_NCCL_POLL_S = 50e-6


class P2pAFDConnector(ExchangeConnector):
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
        self._group: DataPlaneGroup | None = None
        self._pending_sends: collections.deque[tuple[Any, int, Any]] = collections.deque()
        self._sentinels: dict[int, Any] = {}
        self._buffers: dict[tuple[Any, ...], Any] = {}
        self._device: Any = None

    # -- lifecycle -----------------------------------------------------------------
    def _link(self) -> DataPlaneGroup | None:
        return self._group

    def _join(self) -> None:
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
        logger.debug("%s joined the data plane at %s", self.label, self._where)

    def _shutdown(self) -> None:
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
            peer = self._shutdown_peer()
            if peer is not None:
                # The FFN peer is at a message boundary: tell it we are leaving so its
                # receive fails with "attention rank N closed" rather than a socket error.
                frame = torch.tensor(Frame.shutdown(self._global_rank).encode(), dtype=torch.int64)
                with contextlib.suppress(RuntimeError):
                    group.gloo.send([frame], peer, _DATA_TAG).wait(
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
                    logger.debug("%s: NCCL abort failed", self.label, exc_info=True)
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

    # -- transport -------------------------------------------------------------------
    def _map_error(self, exc: BaseException, peer: int, timeout: float, action: str) -> Exception:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if self._closed:
            return self._closed_error(peer, action)
        if "Timed out" in text or "timed out" in text:
            self._broken[peer] = f"timed out after {timeout:g} s"
            return self._timeout_error(
                peer, timeout, action, "; the connection to that peer is dropped"
            )
        self._broken[peer] = text
        return self._gone_error(peer, action, text)

    def _wait_gloo(
        self, work: Any, peer: int, deadline: float, timeout: float, action: str
    ) -> None:
        remaining = max(deadline - time.monotonic(), 0.001)
        try:
            work.wait(timedelta(seconds=remaining))
        except RuntimeError as exc:
            raise self._map_error(exc, peer, timeout, action) from exc

    def _send_messages(
        self,
        link: DataPlaneGroup,
        messages: Iterable[_Message],
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

        posts = list(messages)  # checks every peer before anything is posted
        self._reap_sends()
        data_pg = link.nccl if link.nccl is not None else link.gloo
        try:
            for peer, frame, tensors in posts:
                head = torch.tensor(frame.encode(), dtype=torch.int64)
                work = link.gloo.send([head], peer, _DATA_TAG)
                self._pending_sends.append((work, peer, head))
                for slot, tensor in enumerate(tensors):
                    if tensor.numel() == 0:
                        continue
                    staged = self._stage_send(tensor, slot, mb)
                    work = data_pg.send([staged], peer, _DATA_TAG)
                    self._pending_sends.append((work, peer, staged))
        except RuntimeError as exc:
            raise self._map_error(exc, posts[0][0], timeout, "sending to") from exc

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
        link: DataPlaneGroup,
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
                works.append(link.gloo.recv([head], peer, _DATA_TAG))
            except RuntimeError as exc:
                raise self._map_error(exc, peer, timeout, action) from exc
        frames = []
        for peer, head, work in zip(peers, heads, works, strict=True):
            self._wait_gloo(work, peer, deadline, timeout, action)
            frames.append(self._decode_frame(peer, head.tolist()))
        return frames

    def _recv_tensors(
        self,
        link: DataPlaneGroup,
        parts: Sequence[tuple[int, int]],
        specs: Sequence[_Spec],
        deadline: float,
        timeout: float,
        action: str,
        mb: int,
    ) -> list[Any]:
        data_pg = link.nccl if link.nccl is not None else link.gloo
        per_peer: list[list[Any]] = []
        posted: list[tuple[Any, int]] = []
        for peer, num_tokens in parts:
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
            per_peer.append(out)
        for work, peer in posted:
            self._wait_data(work, peer, deadline, timeout, action)
        if len(per_peer) == 1:
            return per_peer[0]
        import torch

        return [torch.cat(rows, dim=0) for rows in zip(*per_peer, strict=True)]


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
        cls._check_extra_keys(extra)
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
        cls._check_dtype(out["dtype"])
        return out

    @property
    def max_num_tokens(self) -> int:
        return int(self.extra_config["max_num_tokens"])

    def bucket_of(self, num_tokens: int) -> int:
        """The power-of-two bucket that carries ``num_tokens`` rows."""
        if num_tokens > self.max_num_tokens:
            raise AFDTransferMismatchError(
                f"{self.label}: {num_tokens} tokens exceed max_num_tokens={self.max_num_tokens}; "
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
                f"{self.label}: requires CUDA (torch.cuda.is_available() is False); "
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
                raise self._closed_error(peer, action)
            sentinel = self._sentinels.get(peer)
            if sentinel is not None and sentinel.is_completed():
                self._broken[peer] = "its process exited or closed"
                raise self._gone_error(peer, action)
            if time.monotonic() > deadline:
                self._broken[peer] = f"timed out after {timeout:g} s"
                raise self._timeout_error(peer, timeout, action)
            time.sleep(_NCCL_POLL_S)
        work.wait()
