"""Point-to-point AFD connectors over a private torch.distributed process group.

One implementation, :class:`P2pAFDConnector`, with two registered flavours:

* :class:`P2pGlooAFDConnector` — CPU tensors over gloo (the embedded default); with
  ``connector_extra_config["buffer_pool"]`` it moves tensors through the same
  preallocated per-peer buffers as NCCL (:mod:`afd_connectors_gpu.buffers`), so that
  path runs on any machine;
* :class:`P2pNcclAFDConnector` — CUDA tensors over NCCL (one communicator per
  direction), frames over gloo, tensors through the buffer pool.

Per message: a frame (:mod:`afd_core.wire`: ``TransferHeader.encode()`` plus transport
words, int64) then the tensors in a fixed order. The exchange itself (bookkeeping,
fan-in, validation, errors) is afd-core's :class:`~afd_core.exchange.ExchangeConnector`;
this module only has its transports, :class:`GlooTransport` and :class:`NcclTransport`.
Nothing here imports torch at module import time; ``init()`` does.

Over 400 lines: the NCCL transport is the gloo transport plus its device, warm-up,
watchdog and abort rules, and the three registered classes' extra-config schemas sit
with the transports they configure.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from types import MappingProxyType
from typing import Any, ClassVar

from afd_connectors_gpu.buffers import DEFAULT_MAX_NUM_TOKENS, BufferPool, Reservation
from afd_connectors_gpu.rendezvous import A2F, F2A, DataPlaneGroup, join_data_plane
from afd_core.config import AFDConfig, AFDRole, RoutingPayload
from afd_core.connector import ConnectorCapabilities, ExtraKey
from afd_core.errors import AFDConfigError, AFDPeerLostError, AFDTransferMismatchError
from afd_core.exchange import (
    IDLE,
    ExchangeConnector,
    Message,
    Spec,
    TransferContext,
    Transport,
)
from afd_core.transfer_dtype import scale_columns, transfer_format
from afd_core.wire import FRAME_LEN, Frame

__all__ = [
    "GlooTransport",
    "NcclTransport",
    "P2pAFDConnector",
    "P2pGlooAFDConnector",
    "P2pNcclAFDConnector",
]

logger = logging.getLogger(__name__)

_DATA_TAG = 0
_BREAK_TAG = 0x7AFD
_SENTINEL_TAG = 0x7AFE
_SHUTDOWN_GRACE_S = 0.2
_FLUSH_GRACE_S = 1.0
_NCCL_POLL_S = 50e-6
# gloo's wait takes a finite timeout (a receive that times out drops the connection):
# a wait with no deadline (the FFN waiting for the next step) waits this long.
_FOREVER = timedelta(days=365)
# NCCL's own watchdog timeout: well past afd's transfer deadline, so that afd aborts a
# late operation (and reports it) before torch's watchdog tears the process down.
_NCCL_WATCHDOG_MARGIN_S = 60.0
# NCCL communicator set-up (the warm-up's calls) is polled this often; an abort of
# communicators still being set up is waited for at most this long.
_SETUP_POLL_S = 0.005
_ABORT_GRACE_S = 1.0

# Bytes reserved by the pool connectors of this process:
# id(transport) -> ("attention rank 0", "plane 1/2" or the connector's label, bytes).
_reserved_lock = threading.Lock()
_reserved: dict[int, tuple[str, str, int]] = {}


def _is_last_plane(plane: str) -> bool:
    """``"1/2"`` (FFN expert plane 1 of 2) -> True."""
    index, _, count = plane.partition("/")
    return index.isdigit() and count.isdigit() and int(index) == int(count) - 1


def _engine_config() -> Any:
    """vLLM's current config when this process runs inside vLLM (the model build and
    the FFN server set it), else None; never imports vLLM."""
    module = sys.modules.get("vllm.config")
    getter = getattr(module, "get_current_vllm_config_or_none", None)
    if getter is None:
        return None
    try:
        return getter()
    except Exception:  # a vLLM without the helper, or no config: nothing to read
        return None


def _role_rank(connector: ExchangeConnector, peer: int) -> tuple[str, int]:
    role, rank = connector.topology.role_rank_of(peer)
    return role.value, rank


def _int_or_none(value: Any) -> int | None:
    try:
        n = int(value)
    except (TypeError, ValueError):
        return None
    return n if n > 0 else None


def buffer_plan(
    connector: ExchangeConnector,
) -> tuple[int, int, str, list[tuple[str, int, Spec]]] | None:
    """``(tokens, hidden size, dtype, [(direction, slot, spec)])``: what a pool
    connector reserves in ``init()``, or None when the hidden size is unknown.

    * tokens: the engine's ``max_num_batched_tokens`` (vLLM's current config) when it is
      below ``connector_extra_config['max_num_tokens']``, else that limit;
    * hidden size and dtype: ``connector_extra_config['hidden_size']`` / ``['dtype']``,
      else the deployment fingerprint the connector was created with (``hidden_size``,
      ``dtype``), else vLLM's model config;
    * tensors: the hidden-width tensor of each direction (A->F hidden states, F->A
      output; this role sends one and receives the other; in a low-precision transfer
      dtype its 8-bit elements and its scales), plus top-k ids and weights
      when the gate runs on Attention and sends top-k (their width from the fingerprint's
      ``top_k`` or the model config). Router logits, token ids and a separate
      shared-expert output are made on first use (sized for the same largest bucket).
    """
    extra = connector.extra_config
    identity = connector.identity or {}
    engine = _engine_config()
    model = getattr(engine, "model_config", None)
    text = getattr(model, "hf_text_config", None)
    hidden = _int_or_none(extra.get("hidden_size"))
    if hidden is None:
        hidden = _int_or_none(identity.get("hidden_size"))
    if hidden is None and model is not None:
        with contextlib.suppress(Exception):
            hidden = _int_or_none(model.get_hidden_size())
    if hidden is None:
        return None
    dtype = extra.get("dtype") or identity.get("dtype")
    if dtype is None and model is not None:
        dtype = str(getattr(model, "dtype", "")).removeprefix("torch.") or None
    if dtype not in ("bfloat16", "float16", "float32"):
        dtype = "bfloat16"
    tokens = int(extra["max_num_tokens"])
    scheduler = getattr(engine, "scheduler_config", None)
    budget = _int_or_none(getattr(scheduler, "max_num_batched_tokens", None))
    if budget is not None:
        tokens = min(tokens, budget)
    attention = connector.role is AFDRole.ATTENTION
    a2f, f2a = ("send", "recv") if attention else ("recv", "send")
    config = connector.config
    to_ffn = transfer_format(config.transfer_dtype)
    back = transfer_format(config.transfer_dtype_return)
    steps: list[tuple[str, int, Spec]] = [
        (a2f, 0, ((hidden,), to_ffn.element_dtype or dtype)),
        (f2a, 0, ((hidden,), back.element_dtype or dtype)),
    ]
    a2f_slots = 1
    if config.compute_gate_on_attention and config.routing_payload is RoutingPayload.TOPK:
        top_k = _int_or_none(identity.get("top_k"))
        if top_k is None:
            top_k = _int_or_none(getattr(text, "num_experts_per_tok", None))
        if top_k is not None:
            steps += [(a2f, 1, ((top_k,), "int32")), (a2f, 2, ((top_k,), "float32"))]
            a2f_slots = 3
    # A quantized main tensor's scales travel last in the message (afd_core.wire).
    for direction, fmt, slot in ((a2f, to_ffn, a2f_slots), (f2a, back, 1)):
        if fmt.scale_dtype is not None:
            steps.append((direction, slot, ((scale_columns(fmt, hidden),), fmt.scale_dtype)))
    return tokens, hidden, dtype, steps


class GlooTransport(Transport):
    """Frames over gloo, tensors over gloo (or, with a buffer pool, through it)."""

    def __init__(self, connector: ExchangeConnector) -> None:
        super().__init__(connector)
        c = connector
        self.label = c.label
        self._group: DataPlaneGroup | None = None
        # (work, peer, tensor kept alive until the send completed, True for a tensor on
        # the data plane / False for a frame on gloo)
        self._pending_sends: collections.deque[tuple[Any, int, Any, bool]] = collections.deque()
        # ids of sends waited for once that another list still holds (the pending list or
        # the buffer pool's in-flight sends): a gloo send must not be waited for twice, or
        # the second wait can take the completion of the buffer's next send and block past
        # its timeout (seen as a close() that hung in the flush below).
        self._waited: set[int] = set()
        # gloo reports a send complete only through wait(); a send is settled by wait()
        # once more than this many are queued. In the AFD protocol at most one message
        # per (peer, micro-batch) is undelivered at a time (4 operations at most), so the
        # oldest one past this bound has long been delivered and wait() returns at once.
        self._max_pending = 8 * c.config.num_micro_batches * max(1, len(c.peers)) + 8
        self._pool: BufferPool | None = None
        if self._uses_pool():
            limit = int(c.extra_config["max_num_tokens"])
            self._pool = BufferPool(max_num_tokens=limit, device=None, label=c.label)
        self._device: Any = None
        self._attention = c.role is AFDRole.ATTENTION
        #: What ``init()`` reserved in the buffer pool (None: nothing) and the line it logged.
        self.reservation: Reservation | None = None
        self.buffer_report = ""

    # -- lifecycle -----------------------------------------------------------------
    def connect(self) -> None:
        c = self.connector
        self._device = self._select_device()
        group = join_data_plane(
            config=c.config,
            global_rank=c.global_rank,
            label=c.label,
            nccl_device=self._device if self.backend == "nccl" else None,
            nccl_timeout_s=c.config.transfer_timeout_s + _NCCL_WATCHDOG_MARGIN_S,
            device_identity=self._device_identity(),
            identity=c.identity,
        )
        if self._pool is not None:
            self._pool.device = self._device
        self._after_join(group)
        self._group = group
        self._reserve_buffers()
        self.ready = True
        logger.debug("%s joined the data plane at %s", c.label, c.where)

    #: "gloo" or "nccl": which backend carries the tensors (frames always use gloo).
    backend: ClassVar[str] = "gloo"

    def close(self) -> None:
        group = self._group
        if group is None:
            return
        if group.desk is not None:
            group.desk.stop()
        import torch

        try:
            # Let sends already posted finish (the peer may still be receiving our last
            # answer), but never for long: close() must not hang on a peer that is gone.
            flush_deadline = time.monotonic() + _FLUSH_GRACE_S
            while self._pending_sends:
                work, *_ = self._pending_sends.popleft()
                if id(work) in self._waited:
                    continue
                remaining = flush_deadline - time.monotonic()
                if remaining <= 0:
                    break
                with contextlib.suppress(RuntimeError):
                    work.wait(timedelta(seconds=remaining))
            peer = self.connector.goodbye()
            if peer is not None:
                # The FFN peer is at a message boundary: tell it we are leaving so its
                # receive fails with "attention rank N closed" rather than a socket error.
                frame = _cpu_tensor(Frame.shutdown(self.connector.global_rank).encode())
                with contextlib.suppress(RuntimeError):
                    group.gloo.send([frame], peer, _DATA_TAG).wait(
                        timedelta(seconds=_SHUTDOWN_GRACE_S)
                    )
            # A receive that times out makes gloo close the connection to that peer, which
            # also fails any receive another thread has pending on it: that is how close()
            # unblocks waiters (gloo's abort() does not interrupt point-to-point waits).
            dummy = torch.zeros(1, device="cpu")
            for peer in self.connector.peers:
                with contextlib.suppress(RuntimeError):
                    group.gloo.recv([dummy], peer, _BREAK_TAG).wait(timedelta(milliseconds=1))
            self._abort_nccl(group)
        finally:
            self._pending_sends.clear()
            self._waited.clear()
            if self._pool is not None:
                self._pool.clear()
            with _reserved_lock:
                _reserved.pop(id(self), None)
            self._group = None
            self.ready = False

    # -- buffers reserved in init --------------------------------------------------
    def _reserve_buffers(self) -> None:
        """Make the pool's buffers of the largest bucket for every peer and micro-batch
        now (see :func:`buffer_plan`), and log what the AFD buffers take.

        Called in ``init()``: the Attention role builds its connectors while vLLM builds
        the model, before vLLM's memory profiling sizes the KV cache, so vLLM counts
        these bytes; a connector made per FFN expert plane reserves its own.
        """
        c = self.connector
        if self._pool is None:
            self.buffer_report = (
                f"AFD buffers of {c.label}: 0 bytes reserved (gloo without buffer_pool "
                "allocates each message's tensors when it arrives)"
            )
            logger.info("%s", self.buffer_report)
            return
        plan = buffer_plan(c)
        if plan is None:
            self.buffer_report = (
                f"AFD buffers of {c.label}: 0 bytes reserved in init (hidden size unknown: "
                "no vLLM config in this process and no connector_extra_config['hidden_size']); "
                "buffers are made on first use"
            )
            logger.warning("%s", self.buffer_report)
            return
        tokens, hidden, dtype, steps = plan
        res = self._pool.reserve(
            c.peers, steps, c.config.num_micro_batches, min(tokens, self._pool.max_num_tokens)
        )
        self.reservation = res
        plane = (c.identity or {}).get("expert_shard")
        me = f"{c.role.value} rank {c.rank}"
        with _reserved_lock:
            _reserved[id(self)] = (me, f"plane {plane}" if plane else c.label, res.total)
            process = [(w, n) for who, w, n in _reserved.values() if who == me]
        per_peer = ", ".join(
            "{} rank {}: {}".format(*_role_rank(c, p), n) for p, n in sorted(res.per_peer.items())
        )
        self.buffer_report = (
            f"AFD buffers of {c.label}{f' (expert plane {plane})' if plane else ''}: "
            f"{res.total} bytes ({res.total / 2**20:.1f} MiB) reserved in init, per peer "
            f"[{per_peer}] ({res.buffers} buffers of {res.rows} tokens: largest bucket for "
            f"{tokens} tokens, hidden {hidden} {dtype}, {c.config.num_micro_batches} "
            f"micro-batch(es)); {me} in this process: {sum(n for _, n in process)} bytes "
            f"over {len(process)} connector(s) ({', '.join(f'{w}: {n}' for w, n in process)})"
        )
        # One line per role: under FFN expert parallelism an Attention rank joins its
        # planes in order, and the last one's line sums them all (an FFN rank has one).
        last = plane is None or not self._attention or _is_last_plane(plane)
        logger.log(logging.INFO if last else logging.DEBUG, "%s", self.buffer_report)

    # -- hooks for the NCCL flavour ------------------------------------------------
    def _uses_pool(self) -> bool:
        return bool(self.connector.extra_config.get("buffer_pool", False))

    def _select_device(self) -> Any:
        import torch

        return torch.device("cpu")

    def _device_identity(self) -> str | None:
        """What identifies this rank's device across the deployment (None: no check)."""
        return None

    def _after_join(self, group: DataPlaneGroup) -> None:
        """Called once the process group exists (before ``init()`` returns)."""

    def _abort_nccl(self, group: DataPlaneGroup) -> None:
        for pg in group.nccl.values():
            try:
                pg.abort()
            except RuntimeError:
                logger.debug("%s: NCCL abort failed", self.label, exc_info=True)

    def _wait_data(self, work: Any, ctx: TransferContext) -> None:
        self._wait_gloo(work, ctx)

    # -- transport -------------------------------------------------------------------
    def _data_pg(self, link: DataPlaneGroup, direction: str) -> Any:
        return link.nccl.get(direction, link.gloo)

    def _map_error(self, exc: BaseException, ctx: TransferContext) -> Exception:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if self.connector.closed:
            return ctx.closed_error()
        if "Timed out" in text or "timed out" in text:
            ctx.break_peer(f"timed out after {ctx.timeout:g} s")
            return ctx.timeout_error("; the connection to that peer is dropped")
        ctx.break_peer(text)
        return ctx.lost_error(text)

    def _wait_gloo(self, work: Any, ctx: TransferContext) -> None:
        if ctx.deadline == IDLE:
            limit = _FOREVER
        else:
            limit = timedelta(seconds=max(ctx.deadline - time.monotonic(), 0.001))
        try:
            work.wait(limit)
        except RuntimeError as exc:  # DistBackendError / DistNetworkError included
            raise self._map_error(exc, ctx) from exc

    def _settle(self, work: Any, peer: int, *, data: bool) -> None:
        """Wait for a send posted earlier (it has normally completed long ago).

        A tensor send (``data``) is waited for as a tensor receive is: on NCCL a late one
        aborts both communicators and raises :class:`AFDTimeoutError`. A frame is a gloo
        send.
        """
        timeout = self.connector.config.transfer_timeout_s
        ctx = TransferContext(self.connector, peer, time.monotonic() + timeout, timeout,
                              "sending to")  # fmt: skip
        (self._wait_data if data else self._wait_gloo)(work, ctx)

    def _settle_staged(self, work: Any, peer: int) -> None:
        """Wait for the send that last read a pool buffer about to be written again; it
        stays in the pending list (in order) but is not waited for a second time."""
        if id(work) in self._waited:  # reap() waited for it already
            self._waited.discard(id(work))
            return
        self._settle(work, peer, data=True)
        self._waited.add(id(work))

    def _stage(self, tensor: Any, peer: int, slot: int, mb: int) -> tuple[Any, Any]:
        """(tensor to send, pool key or None): on the connector's device, contiguous."""
        if self._pool is not None:
            return self._pool.stage(
                tensor,
                peer=peer,
                slot=slot,
                mb=mb,
                settle=lambda w: self._settle_staged(w, peer),
            )
        t = tensor if tensor.device == self._device else tensor.to(self._device)
        return t.contiguous(), None

    def send(self, ctx: TransferContext, messages: Iterable[Message]) -> None:
        """Post the sends and return without waiting for them.

        A gloo send completes only once the receiver has posted the matching receive,
        so waiting here would deadlock as soon as both sides send before receiving
        (micro-batches). Pending sends keep their tensors alive and are settled (and
        their errors raised) by later calls; the caller must not modify a sent tensor
        in place before the answer to it has been received. Every tensor is staged
        before the first frame is posted, so a message over the buffer limit is refused
        with nothing on the wire.
        """
        link = self._group
        assert link is not None
        posts = list(messages)  # checks every peer before anything is posted
        self.reap()
        data_pg = self._data_pg(link, A2F if self._attention else F2A)
        mb = ctx.mb
        staged = [
            [
                self._stage(t, peer, slot, mb) if t.numel() else (None, None)
                for slot, t in enumerate(tensors)
            ]
            for peer, _, tensors in posts
        ]
        try:
            for (peer, frame, _), parts in zip(posts, staged, strict=True):
                head = _cpu_tensor(frame.encode())
                work = link.gloo.send([head], peer, _DATA_TAG)
                self._pending_sends.append((work, peer, head, False))
                for tensor, key in parts:
                    if tensor is None:
                        continue
                    work = data_pg.send([tensor], peer, _DATA_TAG)
                    self._pending_sends.append((work, peer, tensor, True))
                    if key is not None and self._pool is not None:
                        self._pool.sent(key, work)
        except RuntimeError as exc:
            raise self._map_error(exc, ctx.at(posts[0][0])) from exc

    def reap(self) -> None:
        """Settle the oldest sends past the bound; raise the error of a failed one."""
        pending = self._pending_sends
        while len(pending) > self._max_pending:
            work, peer, _, data = pending.popleft()
            if id(work) in self._waited:  # the pool waited for it already
                self._waited.discard(id(work))
                continue
            self._settle(work, peer, data=data)
            if data and self._pool is not None:  # the pool holds it until its buffer's reuse
                self._waited.add(id(work))

    def recv_frame(self, ctx: TransferContext) -> Frame:
        [frame] = self.recv_frames(ctx, (ctx.peer,))
        return frame

    def recv_frames(self, ctx: TransferContext, peers: Sequence[int]) -> list[Frame]:
        """Every peer's receive is posted before the first wait."""
        link = self._group
        assert link is not None
        heads = [_cpu_tensor([0] * FRAME_LEN) for _ in peers]
        works = []
        for peer, head in zip(peers, heads, strict=True):
            try:
                works.append(link.gloo.recv([head], peer, _DATA_TAG))
            except RuntimeError as exc:
                raise self._map_error(exc, ctx.at(peer)) from exc
        frames = []
        for peer, head, work in zip(peers, heads, works, strict=True):
            at = ctx.at(peer)
            self._wait_gloo(work, at)
            frames.append(at.decode_frame(head.tolist()))
        return frames

    def _recv_buffer(
        self, peer: int, num_tokens: int, spec: Spec, slot: int, mb: int
    ) -> tuple[Any, Any]:
        """(buffer to receive into, tensor to hand out)."""
        if self._pool is not None:
            return self._pool.receive(peer, num_tokens, spec, slot, mb)
        import torch

        trailing, dtype = spec
        t = torch.empty((num_tokens, *trailing), dtype=getattr(torch, dtype), device=self._device)
        return t, t

    def recv_tensors(
        self, ctx: TransferContext, parts: Sequence[tuple[int, int]], specs: Sequence[Spec]
    ) -> list[Any]:
        link = self._group
        assert link is not None
        data_pg = self._data_pg(link, F2A if self._attention else A2F)
        per_peer: list[list[Any]] = []
        posted: list[tuple[Any, TransferContext]] = []
        for peer, num_tokens in parts:
            at = ctx.at(peer)
            out = []
            for slot, spec in enumerate(specs):
                try:
                    buf, view = self._recv_buffer(peer, num_tokens, spec, slot, ctx.mb)
                except AFDTransferMismatchError:
                    at.break_peer("message over the buffer limit")
                    raise
                out.append(view)
                if num_tokens == 0:
                    continue
                try:
                    posted.append((data_pg.recv([buf], peer, _DATA_TAG), at))
                except RuntimeError as exc:
                    raise self._map_error(exc, at) from exc
            per_peer.append(out)
        for work, at in posted:
            self._wait_data(work, at)
        if len(per_peer) == 1:
            return per_peer[0]
        import torch

        return [torch.cat(rows, dim=0) for rows in zip(*per_peer, strict=True)]


class NcclTransport(GlooTransport):
    """CUDA tensors over NCCL (one communicator per direction), frames over gloo, tensors
    through the buffer pool; the communicators are warmed up in ``connect()``."""

    backend: ClassVar[str] = "nccl"

    def __init__(self, connector: ExchangeConnector) -> None:
        super().__init__(connector)
        # Peer global rank -> why its process is gone (set by the sentinel watchers).
        self._lost: dict[int, str] = {}

    def _uses_pool(self) -> bool:
        return True

    def _select_device(self) -> Any:
        import torch

        if not torch.cuda.is_available():
            raise AFDConfigError(
                f"{self.label}: requires CUDA (torch.cuda.is_available() is False); "
                "use P2pGlooAFDConnector on CPU"
            )
        index = self.connector.extra_config["device"]
        if index is None:
            index = torch.cuda.current_device()
        # No torch.cuda.set_device: the model's allocations stay where vLLM put them.
        return torch.device("cuda", index)

    def _device_identity(self) -> str | None:
        import torch

        index = self._device.index
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        ident = str(uuid) if uuid is not None else f"pci {getattr(props, 'pci_bus_id', index)}"
        return f"{socket.gethostname()} cuda:{index} ({props.name}, {ident})"

    def _after_join(self, group: DataPlaneGroup) -> None:
        import torch

        # NCCL never notices a dead peer by itself. Each rank keeps one gloo receive
        # pending per peer on a tag nobody sends on, waited for by a watcher thread:
        # when the peer's process dies (or it closes), gloo fails that receive and the
        # NCCL wait loop sees the peer in ``_lost``. (A gloo work reports completion only
        # through wait(), so polling is_completed() would never see it.)
        for peer in self.connector.peers:
            work = group.gloo.recv([torch.zeros(1, device="cpu")], peer, _SENTINEL_TAG)
            threading.Thread(
                target=self._watch_peer,
                args=(work, peer),
                name=f"afd-nccl-watch-{peer}",
                daemon=True,
            ).start()

    def connect(self) -> None:
        super().connect()
        self._warm_up_communicators()

    def _warm_up_communicators(self) -> None:
        """Set up the NCCL communicator of every (peer, direction) pair now, with one
        one-element message each way, instead of inside the first real exchange (the
        Attention role's profiling run). torch creates a pair's communicator at its first
        operation, together on both ranks, blocking: every rank visits its pairs in the
        same global order (attention rank, FFN rank, A->F before F->A), so two ranks never
        wait for each other in opposite orders. A peer that does not answer within
        ``transfer_timeout_s`` fails ``init()`` as a late exchange would.

        The first operation of a pair builds its communicator inside the call itself
        (``pg.send`` / ``pg.recv`` do not return until NCCL's set-up has met the peer), so
        each call is posted from a helper thread and bounded (:meth:`_post_bounded`): a
        peer that died after the gloo barrier fails ``init()`` with
        :class:`AFDPeerLostError` (seen by its sentinel) or, at the latest after
        ``transfer_timeout_s``, with :class:`AFDTimeoutError`, and the communicators are
        aborted."""
        import torch

        group = self._group
        assert group is not None
        t0 = time.monotonic()
        timeout = self.connector.config.transfer_timeout_s
        attention = self._attention
        a2f, f2a = group.nccl[A2F], group.nccl[F2A]
        for peer in sorted(self.connector.peers):
            one = torch.zeros(1, device=self._device)
            steps = (
                ((a2f, "send", "sending to"), (f2a, "recv", "receiving from"))
                if attention
                else ((a2f, "recv", "receiving from"), (f2a, "send", "sending to"))
            )
            for pg, op, action in steps:
                ctx = TransferContext(self.connector, peer, time.monotonic() + timeout, timeout,
                                      action)  # fmt: skip
                tensor = one if op == "send" else torch.empty_like(one)
                post = functools.partial(getattr(pg, op), [tensor], peer, _DATA_TAG)
                work = self._post_bounded(post, ctx)
                self._wait_data(work, ctx)
        logger.info(
            "%s: NCCL communicators with %d peer(s) set up in %.2f s (both directions)",
            self.label,
            len(self.connector.peers),
            time.monotonic() - t0,
        )

    def _post_bounded(self, post: Callable[[], Any], ctx: TransferContext) -> Any:
        """``post()`` (an NCCL send or receive, which may block while NCCL builds the
        pair's communicator) run on a helper thread; its work, or an error once this
        connector is closed, the peer's sentinel reports it gone, or ``ctx``'s deadline
        passes (then the communicators are aborted; a call still blocked in NCCL's
        set-up stays on its daemon thread until the abort or NCCL ends it)."""
        import torch

        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["work"] = post()
            except BaseException as exc:  # handed to the caller below
                box["error"] = exc
            finally:
                done.set()

        threading.Thread(target=run, name=f"afd-nccl-setup-{ctx.peer}", daemon=True).start()
        while not done.wait(_SETUP_POLL_S):
            if self.connector.closed:
                raise ctx.closed_error()
            lost = self._lost.get(ctx.peer)
            if lost is not None:
                self._fail_nccl("its process exited or closed", background=True)
                ctx.break_peer("its process exited or closed")
                raise ctx.lost_error(f"{lost} (during NCCL's communicator set-up)")
            if time.monotonic() > ctx.deadline:
                self._fail_nccl(
                    f"NCCL's communicator set-up did not finish within {ctx.timeout:g} s",
                    background=True,
                )
                raise ctx.timeout_error(
                    "; NCCL's communicator set-up with it did not finish, the NCCL "
                    "communicators were aborted"
                )
        error = box.get("error")
        if error is not None:
            if isinstance(error, (RuntimeError, torch.distributed.DistError)):
                raise self._map_error(error, ctx) from error
            raise error
        return box["work"]

    def _watch_peer(self, work: Any, peer: int) -> None:
        try:
            work.wait(_FOREVER)
        except RuntimeError as exc:
            if not self.connector.closed:
                self._lost[peer] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__

    def _map_error(self, exc: BaseException, ctx: TransferContext) -> Exception:
        """An NCCL error (torch's DistBackendError) aborts the communicators and says so;
        gloo errors (frames, sentinels) map as on the gloo connector."""
        text = str(exc)
        if self.connector.closed or "NCCL" not in text:
            return super()._map_error(exc, ctx)
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        detail = lines[0]
        if "Last error:" in lines and lines.index("Last error:") + 1 < len(lines):
            detail += f" ({lines[lines.index('Last error:') + 1]})"
        self._fail_nccl(f"NCCL error: {detail}")
        return AFDPeerLostError(
            f"{self.label}: NCCL failed while {ctx.action} {self.connector.describe(ctx.peer)}: "
            f"{detail}; "
            "the NCCL communicators were aborted, create a new connector"
        )

    def _fail_nccl(self, reason: str, *, background: bool = False) -> None:
        """An NCCL operation failed or is late: abort the communicators (queued operations
        would otherwise run later or trip torch's watchdog); no peer is usable after that.

        ``background``: abort from a helper thread, waiting for it at most
        ``_ABORT_GRACE_S`` (a communicator still being set up may hold torch's locks)."""
        group = self._group
        if group is not None and background:
            aborter = threading.Thread(
                target=self._abort_nccl, args=(group,), name="afd-nccl-abort", daemon=True
            )
            aborter.start()
            aborter.join(_ABORT_GRACE_S)
            if aborter.is_alive():
                logger.warning(
                    "%s: aborting the NCCL communicators has not returned after %g s; "
                    "leaving it to a background thread",
                    self.label,
                    _ABORT_GRACE_S,
                )
        elif group is not None:
            self._abort_nccl(group)
        for p in self.connector.peers:
            self.connector.break_peer(p, reason, keep_first=True)

    def _wait_data(self, work: Any, ctx: TransferContext) -> None:
        import torch

        connector = self.connector
        while not work.is_completed():
            if connector.closed:
                raise ctx.closed_error()
            lost = self._lost.get(ctx.peer)
            if lost is not None:
                self._fail_nccl("its process exited or closed")
                ctx.break_peer("its process exited or closed")
                raise ctx.lost_error(lost)
            if time.monotonic() > ctx.deadline:
                self._fail_nccl(f"NCCL aborted after a timeout of {ctx.timeout:g} s")
                raise ctx.timeout_error("; the NCCL communicators were aborted")
            time.sleep(_NCCL_POLL_S)
        try:
            work.wait()
        except (RuntimeError, torch.distributed.DistError) as exc:
            raise self._map_error(exc, ctx) from exc


class P2pAFDConnector(ExchangeConnector):
    """Attention <-> FFN point-to-point transfers over a private process group.

    Failure behaviour: a receive that outlives its timeout raises
    :class:`AFDTimeoutError` (gloo then drops the connection to that peer, so later
    transfers with it raise :class:`AFDPeerLostError`; NCCL aborts its communicators); a
    peer process that exits or crashes closes its sockets and the blocked side raises
    :class:`AFDPeerLostError` at once; ``close()`` (from any thread) makes blocked
    and later calls raise :class:`AFDConnectorClosedError`. The FFN side's wait for the
    next step (``recv_from_attention()`` without ``timeout_s``) has no deadline.
    """

    transport_class: ClassVar[type[Transport]] = GlooTransport
    transport: GlooTransport

    @classmethod
    def check_deployment(
        cls, config: AFDConfig, vllm_config: Any, *, platform: str | None = None
    ) -> None:
        """With a buffer pool, the engine's token budget must fit the buffer limit.

        vLLM's memory-profiling run sends one batch of ``max_num_batched_tokens`` tokens
        through every layer; a message over the limit would fail both roles mid-step.
        """
        extra = cls.validate_extra_config(config.connector_extra_config)
        if not (cls.transport_class.backend == "nccl" or extra.get("buffer_pool")):
            return
        sched = getattr(vllm_config, "scheduler_config", None)
        budget = getattr(sched, "max_num_batched_tokens", None)
        limit = int(extra["max_num_tokens"])
        if isinstance(budget, int) and budget > limit:
            raise AFDConfigError(
                f"{cls.name}: the engine's token budget max_num_batched_tokens={budget} "
                f"(--max-num-batched-tokens) exceeds the connector's buffer limit "
                f"connector_extra_config['max_num_tokens']={limit}; set max_num_tokens to "
                f"at least {budget} in afd.connector_extra_config, or lower "
                "--max-num-batched-tokens"
            )


#: dtypes a buffer may be preallocated in.
DTYPES = ("bfloat16", "float16", "float32")

#: The buffer-pool keys of both flavours.
_POOL_KEYS: Mapping[str, ExtraKey] = {
    "max_num_tokens": ExtraKey.integer(default=DEFAULT_MAX_NUM_TOKENS),
    "hidden_size": ExtraKey.integer(),
    "dtype": ExtraKey.one_of(DTYPES),
}


def _cpu_tensor(values: Sequence[int]) -> Any:
    """An int64 CPU tensor, whatever default device or dtype the caller set."""
    import torch

    return torch.tensor(list(values), dtype=torch.int64, device="cpu")


def _is_device(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class P2pGlooAFDConnector(P2pAFDConnector):
    """CPU tensors over gloo.

    connector_extra_config (all optional):
      ``buffer_pool`` (bool, default false): move tensors through preallocated per-peer
      bucket buffers, as the NCCL connector does (a received tensor is then a view of a
      pool buffer, valid until the next receive of the same bucket, peer and micro-batch).
      ``max_num_tokens`` (int, default 16384): largest message with ``buffer_pool``.
    """

    name: ClassVar[str] = "P2pGlooAFDConnector"
    capabilities: ClassVar[ConnectorCapabilities] = ConnectorCapabilities(
        platforms=frozenset({"cpu"})
    )
    extra_schema: ClassVar[Mapping[str, ExtraKey]] = MappingProxyType(
        {"buffer_pool": ExtraKey.flag(), **_POOL_KEYS}
    )


class P2pNcclAFDConnector(P2pAFDConnector):
    """CUDA tensors over NCCL; frames (headers) over gloo on the CPU.

    Tensors move through a :class:`~afd_connectors_gpu.buffers.BufferPool`: power-of-two
    token buckets, one buffer per (direction, peer, bucket, shape, dtype, slot,
    micro-batch), so addresses stay fixed after the first step of each size and two
    peers never share a buffer. A received tensor is a view of such a buffer: it stays
    valid until the next receive of the same bucket, peer and micro-batch. A->F and F->A
    tensors use two NCCL communicators (two streams), so messages in flight in opposite
    directions never queue behind each other.

    Every rank must have a device of its own: ``init()`` refuses two ranks on one GPU,
    naming both. A late NCCL operation aborts the communicators and raises
    :class:`AFDTimeoutError`; an NCCL error surfaces as :class:`AFDPeerLostError`.

    connector_extra_config:
      ``max_num_tokens`` (int, default 16384): largest message; must be at least the
      engine's ``--max-num-batched-tokens`` (checked at start-up).
      ``device`` (int, default ``torch.cuda.current_device()``): CUDA device index of
      the connector's buffers (the process's current device is left as it is).
      ``hidden_size`` (int, optional) and ``dtype`` (str, default "bfloat16"):
      preallocate the hidden-state receive buffers of every bucket in ``init()``.
    """

    name: ClassVar[str] = "P2pNcclAFDConnector"
    capabilities: ClassVar[ConnectorCapabilities] = ConnectorCapabilities(
        platforms=frozenset({"cuda"})
    )
    transport_class: ClassVar[type[Transport]] = NcclTransport

    extra_schema: ClassVar[Mapping[str, ExtraKey]] = MappingProxyType(
        {"device": ExtraKey(_is_device, "a CUDA device index >= 0"), **_POOL_KEYS}
    )

    @property
    def max_num_tokens(self) -> int:
        return int(self.extra_config["max_num_tokens"])

    def bucket_of(self, num_tokens: int) -> int:
        """The power-of-two bucket that carries ``num_tokens`` rows."""
        pool = self.transport._pool
        assert pool is not None
        return pool.bucket_of(num_tokens)

    def buckets(self) -> list[int]:
        """Every bucket: powers of two up to the first one >= ``max_num_tokens``."""
        pool = self.transport._pool
        assert pool is not None
        return pool.buckets()
