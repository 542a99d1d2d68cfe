"""Same-host point-to-point AFD connector over shared-memory rings: ``P2pShmAFDConnector``.

Control goes through afd-core's connect phase (store, admission, join), over the same
``TCPStore`` at ``afd.host:afd.port`` as the gloo connector
(:func:`afd_connectors_gpu.rendezvous.join_session`); data goes through one
single-producer/single-consumer ring per (attention rank, FFN rank, direction) in POSIX
shared memory, created by its writer. Per message the sender copies the frame
(:mod:`afd_core.wire`) and each tensor's bytes into a ring slot (one memcpy per
tensor) and publishes it by bumping a sequence counter; the receiver copies the bytes
out into receive buffers reused per (peer, tensor, micro-batch, token bucket) (one
memcpy per tensor, straight into the concatenated fan-in tensor on the FFN side) and
frees the slot. Tensor data is never pickled.

Ring layout (one shared-memory segment)::

    [0, 512)                 control words (int64, one per 64-byte line):
                             magic, write_seq, read_seq, writer_closed, reader_closed
    [512 + i * slot_bytes)   slot i (i = seq % num_slots): 16-int64 frame, padding,
                             then the tensors at 64-byte aligned offsets

A waiter spins (yielding the CPU) for ``spin_us`` (default 0) and then sleeps in the
kernel on the ring counter the peer bumps next (:mod:`afd_connectors_gpu.futex`; the peer
wakes it right after publishing), or, without futexes, in growing steps (50 us .. 1 ms).
Between sleeps (at most 20 ms each) it checks whether the connector was closed (then
:class:`AFDConnectorClosedError`), whether the peer marked its side of the ring closed
or its process is gone (``/proc/<pid>/stat``: missing, zombie, or a different start
time; then :class:`AFDPeerLostError`), and the deadline (:class:`AFDTimeoutError`).

Why not vLLM's ``shm_broadcast.MessageQueue``: see the package README ("Why not vLLM's
MessageQueue"). Nothing here imports torch at module import time; ``init()`` does.

Over 400 lines: the ring, its rendezvous and the transport share the slot layout, which
is written down once, here.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import mmap
import os
import platform
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar

from afd_connectors_gpu import futex
from afd_connectors_gpu.rendezvous import join_session
from afd_core.connector import ConnectorCapabilities, ExtraKey
from afd_core.errors import AFDConfigError, AFDTransferMismatchError
from afd_core.exchange import (
    ExchangeConnector,
    Message,
    Spec,
    TransferContext,
    Transport,
)
from afd_core.procfs import process_start
from afd_core.wire import FRAME_LEN, Frame

__all__ = ["P2pShmAFDConnector", "ShmTransport"]

logger = logging.getLogger(__name__)

_MAGIC = 0x7AFD5A11
_CTL_BYTES = 512
# Indices of the control words (int64), one per 64-byte cache line.
_MAGIC_W, _WRITE_W, _READ_W, _WRITER_CLOSED_W, _READER_CLOSED_W = 0, 8, 16, 24, 32
_SLOT_HEAD = 256  # frame (16 int64 = 128 bytes) + padding: tensors start here
_ALIGN = 64
_FRAME_FMT = f"<{FRAME_LEN}q"
_FRAME_BYTES = struct.calcsize(_FRAME_FMT)
_PER_TOKEN_AUX = 1024  # bytes/token reserved for routing (top-k, router logits, token ids)
_DEFAULT_SLOT_BYTES = 32 << 20
_SLEEP_MIN_S = 50e-6
_SLEEP_MAX_S = 1e-3
_LIVENESS_EVERY_S = 0.02
_SPIN_BURST = 32
_CLOSE_DRAIN_S = 1.0
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4, "int64": 8,
                "float8_e4m3fn": 1, "int8": 1, "uint8": 1}  # fmt: skip

_FRAME_CACHE = 4096
_VIEW_CACHE = 1024

_fence_lock = threading.Lock()


def _fence() -> None:
    """Full memory barrier (a lock round trip), as vLLM's shm_broadcast does.

    Weaker memory models than x86's need it so that a published sequence number is
    never seen before the slot contents; on x86-64 (stores are not reordered with other
    stores, loads not with other loads) :data:`_FENCE` skips it.
    """
    with _fence_lock:
        pass


def _no_fence() -> None:
    pass


#: The barrier around a sequence-number update: none where the CPU keeps stores (and
#: loads) in program order (x86-64), a lock round trip elsewhere.
_FENCE = _no_fence if platform.machine().lower() in ("x86_64", "amd64") else _fence


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Ring:
    """One SPSC ring in a POSIX shared-memory segment (see the module docstring)."""

    def __init__(
        self, mm: mmap.mmap, name: str, num_slots: int, slot_bytes: int, creator: bool
    ) -> None:
        import torch

        self.mm = mm
        self.name = name
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.creator = creator
        self.ctl = memoryview(mm)[:_CTL_BYTES].cast("q")
        self.bytes = memoryview(mm)  # byte views of the slots (receive plans)
        self.data: Any = torch.frombuffer(mm, dtype=torch.uint8)
        base = int(self.data.data_ptr())
        # Futex words: a reader sleeps on write_seq, a writer (ring full) on read_seq.
        self.futex_of = {w: futex.low_word_address(base + 8 * w) for w in (_WRITE_W, _READ_W)}
        self.unlinked = False
        self._views: dict[tuple[Any, ...], Any] = {}
        # (slot start, tokens, specs[, micro-batch]) -> where each tensor of a message goes
        self.plans: dict[tuple[Any, ...], list[Any]] = {}

    def view(self, start: int, shape: tuple[int, ...], dtype: str) -> Any:
        """The ring's bytes from ``start`` as a tensor of ``shape`` and ``dtype`` (a wire
        dtype name), cached: message layouts repeat every step."""
        key = (start, shape, dtype)
        v = self._views.get(key)
        if v is None:
            import torch

            torch_dtype = getattr(torch, dtype)
            nbytes = _DTYPE_BYTES[dtype]
            for d in shape:
                nbytes *= d
            if len(self._views) >= _VIEW_CACHE:
                self._views.clear()
            flat = self.data[start : start + nbytes]
            v = self._views[key] = flat.view(torch_dtype).view(shape)
        return v

    @staticmethod
    def size_of(num_slots: int, slot_bytes: int) -> int:
        return _CTL_BYTES + num_slots * slot_bytes

    @classmethod
    def create(cls, num_slots: int, slot_bytes: int) -> _Ring:
        import _posixshmem

        size = cls.size_of(num_slots, slot_bytes)
        name = f"/afd-shm-{os.getpid()}-{secrets.token_hex(6)}"
        fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)  # sparse: pages are allocated when first written
            mm = mmap.mmap(fd, size)
        except BaseException:
            with contextlib.suppress(OSError):
                _posixshmem.shm_unlink(name)
            raise
        finally:
            os.close(fd)
        ring = cls(mm, name, num_slots, slot_bytes, creator=True)
        ring.ctl[_MAGIC_W] = _MAGIC
        return ring

    @classmethod
    def attach(cls, name: str, num_slots: int, slot_bytes: int) -> _Ring:
        import _posixshmem

        fd = _posixshmem.shm_open(name, os.O_RDWR, 0o600)
        try:
            size = cls.size_of(num_slots, slot_bytes)
            if os.fstat(fd).st_size < size:
                raise AFDConfigError(f"shared-memory ring {name} is smaller than announced")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        ring = cls(mm, name, num_slots, slot_bytes, creator=False)
        if ring.ctl[_MAGIC_W] != _MAGIC:
            ring.release()
            raise AFDConfigError(f"shared-memory ring {name} is not an afd ring")
        return ring

    def unlink(self) -> None:
        import _posixshmem

        if self.creator and not self.unlinked:
            self.unlinked = True
            with contextlib.suppress(OSError):
                _posixshmem.shm_unlink(self.name)

    def release(self) -> None:
        self._views.clear()
        self.plans.clear()
        self.data = None
        self.ctl.release()
        self.bytes.release()
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere: let the GC unmap it
            logger.debug("shared-memory ring %s still in use; not unmapped", self.name)

    # -- SPSC protocol -----------------------------------------------------------
    def readable(self) -> bool:
        return self.ctl[_WRITE_W] > self.ctl[_READ_W]

    def writable(self) -> bool:
        return self.ctl[_WRITE_W] - self.ctl[_READ_W] < self.num_slots

    def read_slot(self) -> int:
        return _CTL_BYTES + (self.ctl[_READ_W] % self.num_slots) * self.slot_bytes

    def write_slot(self) -> int:
        return _CTL_BYTES + (self.ctl[_WRITE_W] % self.num_slots) * self.slot_bytes

    def publish(self) -> None:
        _FENCE()
        self.ctl[_WRITE_W] = self.ctl[_WRITE_W] + 1
        _FENCE()
        if futex.AVAILABLE:
            futex.wake(self.futex_of[_WRITE_W])

    def consume(self) -> None:
        _FENCE()
        self.ctl[_READ_W] = self.ctl[_READ_W] + 1
        _FENCE()
        if futex.AVAILABLE:
            futex.wake(self.futex_of[_READ_W])

    def wake_all(self) -> None:
        """Wake whoever sleeps on this ring (its closed flags just changed)."""
        if futex.AVAILABLE and self.data is not None:
            for address in self.futex_of.values():
                futex.wake(address)


class ShmTransport(Transport):
    """The shared-memory rings of :class:`P2pShmAFDConnector` (one per peer and direction)."""

    def __init__(self, connector: ExchangeConnector) -> None:
        super().__init__(connector)
        config = connector.config
        self.label = connector.label
        self._peers = connector.peers
        self._frames: dict[bytes, Frame] = {}
        extra = connector.extra_config
        self.num_slots = int(extra["num_slots"] or max(4, 2 * config.num_micro_batches))
        if extra["slot_bytes"] is not None:
            self.slot_bytes = _align(int(extra["slot_bytes"]))
        elif extra["hidden_size"] is not None:
            per_token = 2 * int(extra["hidden_size"]) * _DTYPE_BYTES[extra["dtype"]]
            per_token += _PER_TOKEN_AUX
            self.slot_bytes = _align(_SLOT_HEAD + 4 * _ALIGN + extra["max_num_tokens"] * per_token)
        else:
            self.slot_bytes = _DEFAULT_SLOT_BYTES
        self._spin_s = int(extra["spin_us"]) * 1e-6
        self._out: dict[int, _Ring] = {}
        self._in: dict[int, _Ring] = {}
        self._peer_pid: dict[int, tuple[int, str]] = {}
        self._recv_buffers: dict[tuple[Any, ...], Any] = {}
        self._recv_views: dict[tuple[Any, ...], Any] = {}
        self._store: Any = None
        self._desk: Any = None

    # -- lifecycle -----------------------------------------------------------------
    def connect(self) -> None:
        try:
            self._join_rings()
        except BaseException:
            self._release_rings()
            raise
        self.ready = True
        c = self.connector
        logger.debug("%s joined the shared-memory data plane at %s", c.label, c.where)

    def _join_rings(self) -> None:
        c = self.connector
        g = c.global_rank
        session = join_session(
            config=c.config, global_rank=g, label=c.label, prefix="afd-shm", identity=c.identity
        )
        self._store = session.store
        self._desk = session.desk
        s = session.keys
        host = socket.gethostname()
        pid = os.getpid()
        s.set(f"info/{g}", json.dumps({"host": host, "pid": pid, "start": process_start(pid)}))
        self._check_shm_space()
        for peer in self._peers:
            ring = _Ring.create(self.num_slots, self.slot_bytes)
            self._out[peer] = ring
            s.set(
                f"ring/{g}/{peer}",
                json.dumps({"name": ring.name, "slots": ring.num_slots, "bytes": ring.slot_bytes}),
            )
        keys = [f"info/{p}" for p in self._peers] + [f"ring/{p}/{g}" for p in self._peers]
        session.wait_for(keys, [*self._peers, *self._peers], "exchanging shared-memory rings")
        for peer in self._peers:
            info = json.loads(s.get(f"info/{peer}"))
            if info["host"] != host:
                raise AFDConfigError(
                    f"{self.label}: {c.describe(peer)} runs on host {info['host']!r}, this "
                    f"rank on {host!r}; {c.name} only connects ranks of one host (use "
                    "P2pGlooAFDConnector across hosts)"
                )
            start = process_start(int(info["pid"]))
            if start is None or (info["start"] and start != info["start"]):
                raise AFDConfigError(
                    f"{self.label}: process {info['pid']} of {c.describe(peer)} is not "
                    f"visible here; {c.name} needs every rank in one pid namespace and "
                    "one /dev/shm (same host and container, or --pid=host --ipc=host)"
                )
            self._peer_pid[peer] = (int(info["pid"]), info["start"] or "")
            spec = json.loads(s.get(f"ring/{peer}/{g}"))
            try:
                self._in[peer] = _Ring.attach(spec["name"], spec["slots"], spec["bytes"])
            except FileNotFoundError:
                raise AFDConfigError(
                    f"{self.label}: shared-memory ring {spec['name']} of {c.describe(peer)} "
                    "does not exist here; every rank must share one /dev/shm"
                ) from None
        session.barrier("attached", "attaching the shared-memory rings")
        # Every reader has mapped its rings: remove the names, so nothing is left in
        # /dev/shm whatever happens to the processes later.
        for ring in self._out.values():
            ring.unlink()
        # Attention rank 0 hosts the store: it leaves only after everyone has passed
        # the barrier above.
        session.leave()

    def _check_shm_space(self) -> None:
        need = len(self._peers) * _Ring.size_of(self.num_slots, self.slot_bytes)
        try:
            st = os.statvfs("/dev/shm")
        except OSError:
            return
        free = st.f_bavail * st.f_frsize
        if need > free:
            raise AFDConfigError(
                f"{self.label}: its rings need up to {need / 2**20:.0f} MiB of /dev/shm, only "
                f"{free / 2**20:.0f} MiB are free; lower connector_extra_config "
                "'slot_bytes' (or 'max_num_tokens'/'hidden_size') or 'num_slots'"
            )

    def close(self) -> None:
        c = self.connector
        if self._desk is not None:
            self._desk.stop()
        # Operations in other threads see `closed` within a millisecond (sleepers once
        # woken) and leave; only then may the rings be written to for the last time and
        # unmapped.
        for ring in [*self._out.values(), *self._in.values()]:
            ring.wake_all()
        drain = time.monotonic() + _CLOSE_DRAIN_S
        while c.operations_in_progress and time.monotonic() < drain:
            time.sleep(0.0005)
        if c.operations_in_progress:
            logger.warning("%s: an operation is still running; rings left mapped", self.label)
            return
        peer = c.goodbye()
        if self.ready and peer is not None:
            ring = self._out.get(peer)
            if ring is not None and ring.writable():
                # The FFN peer is at a message boundary: tell it we are leaving.
                words = Frame.shutdown(c.global_rank).words
                struct.pack_into(_FRAME_FMT, ring.mm, ring.write_slot(), *words)
                ring.publish()
        for ring in self._out.values():
            ring.ctl[_WRITER_CLOSED_W] = 1
        for ring in self._in.values():
            ring.ctl[_READER_CLOSED_W] = 1
        _fence()
        for ring in [*self._out.values(), *self._in.values()]:
            ring.wake_all()
        self._release_rings()
        self._store = None
        self.ready = False

    def _release_rings(self) -> None:
        for ring in [*self._out.values(), *self._in.values()]:
            ring.unlink()
            ring.release()
        self._out.clear()
        self._in.clear()
        self._recv_views.clear()
        self._recv_buffers.clear()

    # -- transport -------------------------------------------------------------------
    def _peer_gone(self, peer: int) -> bool:
        pid, start = self._peer_pid[peer]
        now = process_start(pid)
        return now is None or (bool(start) and bool(now) and now != start)

    def _wait(self, ctx: TransferContext, ring: _Ring, word: int) -> None:
        """Spin, then sleep, until ``ring`` has a message to read (``word`` =
        ``_WRITE_W``, the counter its writer bumps) or a free slot to write (``_READ_W``,
        its reader's); raise on close, peer loss or timeout.

        Sleeping is on the futex of that counter, or in growing steps without futexes."""
        if word == _WRITE_W:
            ready, closed_w = ring.readable, _WRITER_CLOSED_W
        else:
            ready, closed_w = ring.writable, _READER_CLOSED_W

        def peer_closed() -> bool:
            return bool(ring.ctl[closed_w])

        if ready():
            return
        connector = self.connector
        peer = ctx.peer
        now = time.monotonic()
        spin_until = now + self._spin_s
        next_check = now
        pause = _SLEEP_MIN_S
        while True:
            if connector.closed:
                raise ctx.closed_error()
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _LIVENESS_EVERY_S
                if peer_closed():
                    if ready():
                        return
                    raise ctx.goodbye_error()
                if self._peer_gone(peer):
                    if ready():
                        return
                    ctx.break_peer("its process exited")
                    raise ctx.lost_error(f"process {self._peer_pid[peer][0]} exited")
            if now > ctx.deadline:
                raise ctx.timeout_error()
            if now < spin_until:
                # A burst of yields between the checks above keeps the pick-up latency
                # at one yield plus one counter read.
                for _ in range(_SPIN_BURST):
                    os.sched_yield()
                    if ready():
                        return
            elif futex.AVAILABLE:
                seen = ring.ctl[word]
                if ready():
                    return
                futex.wait(ring.futex_of[word], seen, min(next_check, ctx.deadline) - now + 1e-4)
            else:
                time.sleep(pause)
                pause = min(pause * 2, _SLEEP_MAX_S)
            if ready():
                return

    def _write(self, ctx: TransferContext, frame: Frame, tensors: Sequence[Any]) -> None:
        ring = self._out[ctx.peer]
        base = ring.write_slot()  # waiting below moves only the reader's counter
        key = (base, frame.header.num_tokens, frame.specs)
        plan = ring.plans.get(key)
        if plan is None:
            plan = self._write_plan(ring, ctx.peer, key)
        if not ring.writable():
            ctx.action = "sending to (all ring slots full)"
            self._wait(ctx, ring, _READ_W)
        ring.bytes[base : base + _FRAME_BYTES] = frame.packed
        for dst, t in zip(plan, tensors, strict=True):
            if dst is not None:
                dst.copy_(t)  # one copy per tensor, from any device and layout
        ring.publish()

    def _write_plan(self, ring: _Ring, peer: int, key: tuple[Any, ...]) -> list[Any]:
        """Where each tensor of a message goes in a slot, for the (slot start, token
        count, specs) in ``key``: a typed view of the ring per tensor (None if empty)."""
        base, n, specs = key
        plan = []
        offset = _SLOT_HEAD
        for trailing, dtype in specs:
            shape = (n, *trailing)
            nbytes = n * _DTYPE_BYTES[dtype]
            for d in trailing:
                nbytes *= d
            if offset + nbytes > ring.slot_bytes:
                raise AFDTransferMismatchError(
                    f"{self.label} -> {self.connector.describe(peer)}: a {n}-token message needs "
                    f"{offset + nbytes} bytes, a ring slot holds {ring.slot_bytes}; raise "
                    "connector_extra_config 'slot_bytes' (or set 'max_num_tokens' and "
                    "'hidden_size')"
                )
            plan.append(ring.view(base + offset, shape, dtype) if nbytes else None)
            offset += _align(nbytes)
        if len(ring.plans) >= _VIEW_CACHE:
            ring.plans.clear()
        ring.plans[key] = plan
        return plan

    def send(self, ctx: TransferContext, messages: Iterable[Message]) -> None:
        for peer, frame, tensors in messages:  # each peer is checked just before its write
            self._write(ctx.at(peer), frame, tensors)

    def skip(self, ctx: TransferContext, num_tokens: int, specs: Sequence[Spec]) -> None:
        self._in[ctx.peer].consume()  # drop the slot unread

    def recv_frame(self, ctx: TransferContext) -> Frame:
        """Wait for the next message from ``ctx.peer`` and decode its frame (not consumed)."""
        ring = self._in[ctx.peer]
        if not ring.readable():
            self._wait(ctx, ring, _WRITE_W)
        start = ring.read_slot()
        raw = ring.bytes[start : start + _FRAME_BYTES].tobytes()
        frame = self._frames.get(raw)
        if frame is not None:
            return frame
        frame = ctx.decode_frame(struct.unpack(_FRAME_FMT, raw))
        if len(self._frames) >= _FRAME_CACHE:
            self._frames.clear()
        self._frames[raw] = frame  # frames are immutable; layers repeat every step
        return frame

    def recv_tensors(
        self, ctx: TransferContext, parts: Sequence[tuple[int, int]], specs: Sequence[Spec]
    ) -> list[Any]:
        """Copy the tensors of the current message of each (peer, tokens) out, in order.

        Several peers' rows are copied straight into one concatenated tensor each.
        Every peer's message is consumed afterwards. The tensors returned are views of
        this transport's receive buffers (:meth:`_buffer`).
        """
        mb = ctx.mb
        if len(parts) == 1:
            peer, n = parts[0]
            ring = self._in[peer]
            key = (ring.read_slot(), n, specs, mb)
            plan = ring.plans.get(key)
            if plan is None:
                plan = self._read_plan(ring, peer, key)
            for _, copy in plan:
                if copy is not None:
                    into, src = copy
                    into[:] = src
            ring.consume()
            return [dst for dst, _ in plan]
        total = 0
        for _, n in parts:
            total += n
        outs = []
        offsets = [_SLOT_HEAD] * len(parts)
        peers = tuple(p for p, _ in parts)
        for slot, spec in enumerate(specs):
            out = self._buffer(peers, slot, spec, mb, total)
            if total:
                trailing, dtype = spec
                row_bytes = out.element_size()
                for d in trailing:
                    row_bytes *= d
                row = 0
                for i, (peer, n) in enumerate(parts):
                    nbytes = n * row_bytes
                    if nbytes:
                        ring = self._in[peer]
                        if offsets[i] + nbytes > ring.slot_bytes:
                            raise self._too_large(peer, nbytes, ring)
                        src = ring.view(ring.read_slot() + offsets[i], (n, *trailing), dtype)
                        (out if n == total else out[row : row + n]).copy_(src)
                    offsets[i] += _align(nbytes)
                    row += n
            outs.append(out)
        for peer, _ in parts:
            self._in[peer].consume()
        return outs

    def _too_large(self, peer: int, nbytes: int, ring: _Ring) -> AFDTransferMismatchError:
        self.connector.break_peer(peer, "message larger than a slot")
        return AFDTransferMismatchError(
            f"{self.label} <- {self.connector.describe(peer)}: the frame announces "
            f"{nbytes} bytes past the end of a {ring.slot_bytes}-byte slot"
        )

    def _read_plan(self, ring: _Ring, peer: int, key: tuple[Any, ...]) -> list[Any]:
        """(receive buffer, (its bytes, the slot's bytes) or None if empty) per tensor of a
        message from one peer, for the slot, token count, specs and micro-batch in
        ``key``."""
        base, n, specs, mb = key
        plan = []
        offset = _SLOT_HEAD
        for slot, spec in enumerate(specs):
            dst = self._buffer(peer, slot, spec, mb, n)
            nbytes = dst.numel() * dst.element_size()
            if offset + nbytes > ring.slot_bytes:
                raise self._too_large(peer, nbytes, ring)
            copy = None
            if nbytes:
                # A receive buffer is ours, CPU and contiguous: the copy out of the ring is a
                # plain memcpy between two byte views (~0.1 us, against ~0.8 us of torch's
                # dispatch for a small copy_).
                assert dst.is_contiguous() and dst.device.type == "cpu"
                into = memoryview((ctypes.c_char * nbytes).from_address(dst.data_ptr()))
                copy = (into.cast("B"), ring.bytes[base + offset : base + offset + nbytes])
            plan.append((dst, copy))
            offset += _align(nbytes)
        if len(ring.plans) >= _VIEW_CACHE:
            ring.plans.clear()
        ring.plans[key] = plan
        return plan

    def _buffer(self, peers: Any, slot: int, spec: Spec, mb: int, num_tokens: int) -> Any:
        """A receive buffer of ``num_tokens`` rows for tensor ``slot`` of a message.

        Buffers are kept per (peers, tensor slot, spec, micro-batch) and power-of-two
        token bucket, so nothing is allocated (or page-faulted) per layer; the view handed
        out is valid until the next receive of the same key and bucket (the same rule as
        the NCCL connector's buffer pool).
        """
        key = (peers, slot, spec, mb, num_tokens)
        view = self._recv_views.get(key)
        if view is None:
            import torch

            bucket = 1 << max(num_tokens - 1, 0).bit_length()
            bkey = (peers, slot, spec, mb, bucket)
            buf = self._recv_buffers.get(bkey)
            if buf is None:
                trailing, dtype = spec
                buf = torch.empty((bucket, *trailing), dtype=getattr(torch, dtype))
                self._recv_buffers[bkey] = buf
            if len(self._recv_views) >= _VIEW_CACHE:
                self._recv_views.clear()
            view = self._recv_views[key] = buf[:num_tokens]
        return view


class P2pShmAFDConnector(ExchangeConnector):
    """Same-host attention <-> FFN transfers through shared-memory rings.

    Same contract and failure behaviour as :class:`~afd_connectors_gpu.p2p.P2pGlooAFDConnector`
    (see the package README), for CPU tensors of ranks that share one host (one
    ``/dev/shm`` and one pid namespace). A received tensor is not a view of shared
    memory; it stays valid until the next receive of the same peer, tensor, micro-batch
    and token bucket (as with the NCCL connector's pool). A send copies the tensors into
    the ring and returns at once; it waits only when all ``num_slots`` slots of the ring
    hold unread messages.

    connector_extra_config:
      ``max_num_tokens`` (int, default 8192) with ``hidden_size`` (int, optional) and
      ``dtype`` (``bfloat16`` | ``float16`` | ``float32``, default ``bfloat16``): size
      each slot for the largest message (output + shared output + 1 KiB/token routing).
      ``slot_bytes`` (int, optional): slot size in bytes (wins over the above; default
      32 MiB when ``hidden_size`` is not given).
      ``num_slots`` (int, default ``max(4, 2 * num_micro_batches)``): messages a ring holds.
      ``spin_us`` (int, default 0): how long a waiter spins (yielding its CPU) before it
      sleeps on the ring's futex. A sleeping waiter is woken by the sender within a
      wake-up and leaves its CPU to the other role meanwhile, which matters when the
      roles share CPUs (the launcher's 1A1F default on a CPU host): spinning there took
      CPU time from the role computing (c = 16, 2 vCPUs shared: 211 tok/s spinning
      5 ms, 297 spinning 0.5 ms, each then sleeping in growing steps; 386 sleeping on
      the futex at once; docs/bench/2026-12-03-turn-taking.md).
    """

    name: ClassVar[str] = "P2pShmAFDConnector"
    capabilities: ClassVar[ConnectorCapabilities] = ConnectorCapabilities(
        platforms=frozenset({"cpu"}), same_host_only=True
    )

    extra_schema: ClassVar[Mapping[str, ExtraKey]] = MappingProxyType(
        {
            "max_num_tokens": ExtraKey.integer(default=8192),
            "hidden_size": ExtraKey.integer(),
            "dtype": ExtraKey.one_of(("bfloat16", "float16", "float32"), default="bfloat16"),
            "slot_bytes": ExtraKey.integer(minimum=4096),
            "num_slots": ExtraKey.integer(),
            "spin_us": ExtraKey.integer(minimum=0, default=0),
        }
    )

    transport_class: ClassVar[type[Transport]] = ShmTransport
    transport: ShmTransport

    @property
    def num_slots(self) -> int:
        """Messages one ring holds."""
        return self.transport.num_slots

    @property
    def slot_bytes(self) -> int:
        """Bytes of one ring slot."""
        return self.transport.slot_bytes
