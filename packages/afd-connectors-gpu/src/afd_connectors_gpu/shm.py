"""Same-host point-to-point AFD connector over shared-memory rings: ``P2pShmAFDConnector``.

Control (rendezvous) goes through the same ``TCPStore`` at ``afd.host:afd.port`` as the
gloo connector (:func:`afd_connectors_gpu.rendezvous.join_store`); data goes through one
single-producer/single-consumer ring per (attention rank, FFN rank, direction) in POSIX
shared memory, created by its writer. Per message the sender copies the frame
(:mod:`afd_connectors_gpu.wire`) and each tensor's bytes into a ring slot (one memcpy per
tensor) and publishes it by bumping a sequence counter; the receiver copies the bytes
out into fresh tensors (one memcpy per tensor, straight into the concatenated fan-in
tensor on the FFN side) and frees the slot. Tensor data is never pickled.

Ring layout (one shared-memory segment)::

    [0, 512)                 control words (int64, one per 64-byte line):
                             magic, write_seq, read_seq, writer_closed, reader_closed
    [512 + i * slot_bytes)   slot i (i = seq % num_slots): 16-int64 frame, padding,
                             then the tensors at 64-byte aligned offsets

A waiter spins (yielding the CPU) for ``spin_us`` and then sleeps in growing steps
(50 us .. 1 ms), checking on the way whether the connector was closed (then
:class:`AFDConnectorClosedError`), whether the peer marked its side of the ring closed
or its process is gone (``/proc/<pid>/stat``: missing, zombie, or a different start
time; then :class:`AFDPeerLostError`), and the deadline (:class:`AFDTimeoutError`).

Why not vLLM's ``shm_broadcast.MessageQueue``: see the package README ("Why not vLLM's
MessageQueue"). Nothing here imports torch at module import time; ``init()`` does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from afd_connectors_gpu.p2p import (
    _A2F_KINDS,
    _F2A_KINDS,
    _a2f_payload,
    _a2f_specs,
    _a2f_tensors,
    _describe_header,
    _f2a_specs,
    _positive_int,
    _Spec,
)
from afd_connectors_gpu.rendezvous import (
    _wait_for_keys,
    barrier,
    describe_global_rank,
    join_store,
)
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
from afd_core.transfer import AttentionToFFN, FFNToAttention, PayloadKind, dtype_name

__all__ = ["P2pShmAFDConnector"]

logger = logging.getLogger(__name__)

_MAGIC = 0x7AFD5A11
_CTL_BYTES = 512
# Indices of the control words (int64), one per 64-byte cache line.
_MAGIC_W, _WRITE_W, _READ_W, _WRITER_CLOSED_W, _READER_CLOSED_W = 0, 8, 16, 24, 32
_SLOT_HEAD = 256  # frame (16 int64 = 128 bytes) + padding: tensors start here
_ALIGN = 64
_FRAME_FMT = f"<{FRAME_LEN}q"
_PER_TOKEN_AUX = 1024  # bytes/token reserved for routing (top-k, router logits, token ids)
_DEFAULT_SLOT_BYTES = 32 << 20
_SLEEP_MIN_S = 50e-6
_SLEEP_MAX_S = 1e-3
_LIVENESS_EVERY_S = 0.02
_CLOSE_DRAIN_S = 1.0
_DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}

_FRAME_CACHE = 4096
_VIEW_CACHE = 1024

_fence_lock = threading.Lock()


def _layer_key(frame: Frame) -> tuple[Any, ...]:
    """What every attention peer of one FFN rank must agree on (all but the token count)."""
    h = frame.header
    return (h.layer_idx, h.micro_batch_idx, h.hidden_size, h.dtype, h.kind, h.topk, frame.aux_dtype)


def _fence() -> None:
    """Full memory barrier (a lock round trip), as vLLM's shm_broadcast does.

    x86 keeps stores in order anyway; weaker architectures need the fence so that a
    published sequence number is never seen before the slot contents.
    """
    with _fence_lock:
        pass


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _process_start(pid: int) -> str | None:
    """Start time of ``pid`` (from ``/proc``), ``""`` if unknown but alive, None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""
    fields = data[data.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X", b"x"):  # zombie / dead: exited, not yet reaped
        return None
    return fields[19].decode()  # field 22 of stat(5): start time in clock ticks


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
        self.data: Any = torch.frombuffer(mm, dtype=torch.uint8)
        self.unlinked = False
        self._views: dict[tuple[int, int], Any] = {}

    def view(self, start: int, nbytes: int) -> Any:
        """``data[start:start + nbytes]``, cached (message layouts repeat every step)."""
        key = (start, nbytes)
        v = self._views.get(key)
        if v is None:
            if len(self._views) >= _VIEW_CACHE:
                self._views.clear()
            v = self._views[key] = self.data[start : start + nbytes]
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
        self.data = None
        self.ctl.release()
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
        _fence()
        self.ctl[_WRITE_W] = self.ctl[_WRITE_W] + 1
        _fence()

    def consume(self) -> None:
        _fence()
        self.ctl[_READ_W] = self.ctl[_READ_W] + 1
        _fence()


class P2pShmAFDConnector(AFDConnector):
    """Same-host attention <-> FFN transfers through shared-memory rings.

    Same contract and failure behaviour as :class:`~afd_connectors_gpu.p2p.P2pGlooAFDConnector`
    (see the package README), for CPU tensors of ranks that share one host (one
    ``/dev/shm`` and one pid namespace). A received tensor is a fresh tensor (not a
    view of shared memory). A send copies the tensors into the ring and returns at
    once; it waits only when all ``num_slots`` slots of the ring hold unread messages.

    connector_extra_config:
      ``max_num_tokens`` (int, default 8192) with ``hidden_size`` (int, optional) and
      ``dtype`` (``bfloat16`` | ``float16`` | ``float32``, default ``bfloat16``): size
      each slot for the largest message (output + shared output + 1 KiB/token routing).
      ``slot_bytes`` (int, optional): slot size in bytes (wins over the above; default
      32 MiB when ``hidden_size`` is not given).
      ``num_slots`` (int, default ``max(4, 2 * num_micro_batches)``): messages a ring holds.
      ``spin_us`` (int, default 1000): how long a waiter spins before it sleeps.
    """

    name: ClassVar[str] = "P2pShmAFDConnector"

    _KEYS: ClassVar[frozenset[str]] = frozenset(
        {"max_num_tokens", "hidden_size", "dtype", "slot_bytes", "num_slots", "spin_us"}
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
            "hidden_size": extra.get("hidden_size"),
            "dtype": extra.get("dtype", "bfloat16"),
            "slot_bytes": extra.get("slot_bytes"),
            "num_slots": extra.get("num_slots"),
            "spin_us": extra.get("spin_us", 1000),
        }
        for key in ("hidden_size", "slot_bytes", "num_slots"):
            if out[key] is not None:
                _positive_int(cls.name, key, out[key])
        if out["slot_bytes"] is not None and out["slot_bytes"] < 4096:
            raise AFDConfigError(
                f"connector_extra_config['slot_bytes'] of {cls.name}: expected >= 4096, "
                f"got {out['slot_bytes']!r}"
            )
        spin = out["spin_us"]
        if not isinstance(spin, int) or isinstance(spin, bool) or spin < 0:
            raise AFDConfigError(
                f"connector_extra_config['spin_us'] of {cls.name}: expected an int >= 0, "
                f"got {spin!r}"
            )
        if out["dtype"] not in _DTYPE_SIZES:
            raise AFDConfigError(
                f"connector_extra_config['dtype'] of {cls.name}: expected bfloat16, float16 "
                f"or float32, got {out['dtype']!r}"
            )
        return out

    def __init__(self, config: AFDConfig, *, rank: int) -> None:
        super().__init__(config, rank=rank)
        topo = self.topology
        self._global_rank = topo.global_rank(self.role, rank)
        self._gr = self._global_rank
        self._frames: dict[tuple[int, ...], Frame] = {}
        if self.role is AFDRole.ATTENTION:
            self._peer_role_ranks: tuple[int, ...] = (topo.ffn_peer_of(rank),)
            self._peers = tuple(topo.global_rank(AFDRole.FFN, f) for f in self._peer_role_ranks)
        else:
            self._peer_role_ranks = topo.attention_peers_of(rank)
            self._peers = tuple(
                topo.global_rank(AFDRole.ATTENTION, a) for a in self._peer_role_ranks
            )
        extra = self.extra_config
        self.num_slots = int(extra["num_slots"] or max(4, 2 * config.num_micro_batches))
        if extra["slot_bytes"] is not None:
            self.slot_bytes = _align(int(extra["slot_bytes"]))
        elif extra["hidden_size"] is not None:
            per_token = 2 * int(extra["hidden_size"]) * _DTYPE_SIZES[extra["dtype"]]
            per_token += _PER_TOKEN_AUX
            self.slot_bytes = _align(_SLOT_HEAD + 4 * _ALIGN + extra["max_num_tokens"] * per_token)
        else:
            self.slot_bytes = _DEFAULT_SLOT_BYTES
        self._spin_s = int(extra["spin_us"]) * 1e-6
        self._out: dict[int, _Ring] = {}
        self._in: dict[int, _Ring] = {}
        self._peer_pid: dict[int, tuple[int, str]] = {}
        self._store: Any = None
        self._ready = False
        self._closed = False
        self._active = 0
        self._state_lock = threading.Lock()
        self._init_lock = threading.Lock()
        self._sent: dict[tuple[int, int], Any] = {}
        self._broken: dict[int, str] = {}

    # -- lifecycle -----------------------------------------------------------------
    def init(self) -> None:
        with self._init_lock:
            if self._closed:
                raise AFDConnectorClosedError(f"{self._me}: init() after close()")
            if self._ready:
                return
            try:
                self._join()
            except BaseException:
                self._release_rings()
                raise
            self._ready = True
            logger.debug("%s joined the shared-memory data plane at %s", self._me, self._where)

    def _join(self) -> None:
        topo = self.topology
        g = self._global_rank
        store, s, deadline = join_store(
            host=self.config.host,
            port=self.config.port,
            topology=topo,
            global_rank=g,
            connect_timeout_s=self.config.connect_timeout_s,
            prefix="afd-shm",
        )
        self._store = store
        host = socket.gethostname()
        pid = os.getpid()
        s.set(f"info/{g}", json.dumps({"host": host, "pid": pid, "start": _process_start(pid)}))
        self._check_shm_space()
        for peer in self._peers:
            ring = _Ring.create(self.num_slots, self.slot_bytes)
            self._out[peer] = ring
            s.set(
                f"ring/{g}/{peer}",
                json.dumps({"name": ring.name, "slots": ring.num_slots, "bytes": ring.slot_bytes}),
            )
        keys = [f"info/{p}" for p in self._peers] + [f"ring/{p}/{g}" for p in self._peers]
        _wait_for_keys(
            s,
            keys,
            [*self._peers, *self._peers],
            deadline,
            "exchanging shared-memory rings",
            topo,
            self._where,
        )
        for peer in self._peers:
            info = json.loads(s.get(f"info/{peer}"))
            if info["host"] != host:
                raise AFDConfigError(
                    f"{self._me}: {self._describe(peer)} runs on host {info['host']!r}, this "
                    f"rank on {host!r}; {self.name} only connects ranks of one host (use "
                    "P2pGlooAFDConnector across hosts)"
                )
            start = _process_start(int(info["pid"]))
            if start is None or (info["start"] and start != info["start"]):
                raise AFDConfigError(
                    f"{self._me}: process {info['pid']} of {self._describe(peer)} is not "
                    f"visible here; {self.name} needs every rank in one pid namespace and "
                    "one /dev/shm (same host and container, or --pid=host --ipc=host)"
                )
            self._peer_pid[peer] = (int(info["pid"]), info["start"] or "")
            spec = json.loads(s.get(f"ring/{peer}/{g}"))
            try:
                self._in[peer] = _Ring.attach(spec["name"], spec["slots"], spec["bytes"])
            except FileNotFoundError:
                raise AFDConfigError(
                    f"{self._me}: shared-memory ring {spec['name']} of {self._describe(peer)} "
                    "does not exist here; every rank must share one /dev/shm"
                ) from None
        where = self._where
        barrier(s, "attached", topology=topo, global_rank=g, deadline=deadline, where=where,
                what="attaching the shared-memory rings")  # fmt: skip
        # Every reader has mapped its rings: remove the names, so nothing is left in
        # /dev/shm whatever happens to the processes later.
        for ring in self._out.values():
            ring.unlink()
        # Attention rank 0 hosts the store: it leaves only after everyone has passed
        # the barrier above.
        s.set(f"seen/{g}", "1")
        if g == 0:
            ranks = list(range(topo.world_size))
            _wait_for_keys(
                s,
                [f"seen/{r}" for r in ranks],
                ranks,
                deadline + self.config.connect_timeout_s,
                "leaving the rendezvous",
                topo,
                where,
            )

    def _check_shm_space(self) -> None:
        need = len(self._peers) * _Ring.size_of(self.num_slots, self.slot_bytes)
        try:
            st = os.statvfs("/dev/shm")
        except OSError:
            return
        free = st.f_bavail * st.f_frsize
        if need > free:
            raise AFDConfigError(
                f"{self._me}: its rings need up to {need / 2**20:.0f} MiB of /dev/shm, only "
                f"{free / 2**20:.0f} MiB are free; lower connector_extra_config "
                "'slot_bytes' (or 'max_num_tokens'/'hidden_size') or 'num_slots'"
            )

    @property
    def is_initialized(self) -> bool:
        return self._ready and not self._closed

    def close(self) -> None:
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        # Operations in other threads see _closed within a millisecond and leave;
        # only then may the rings be written to for the last time and unmapped.
        drain = time.monotonic() + _CLOSE_DRAIN_S
        while self._active and time.monotonic() < drain:
            time.sleep(0.0005)
        if self._active:
            logger.warning("%s: an operation is still running; rings left mapped", self._me)
            return
        if self._ready and self.role is AFDRole.ATTENTION and not self._sent and self._peers:
            peer = self._peers[0]
            ring = self._out.get(peer)
            if ring is not None and peer not in self._broken and ring.writable():
                # The FFN peer is at a message boundary: tell it we are leaving.
                words = Frame.shutdown(self._global_rank).encode()
                struct.pack_into(_FRAME_FMT, ring.mm, ring.write_slot(), *words)
                ring.publish()
        for ring in self._out.values():
            ring.ctl[_WRITER_CLOSED_W] = 1
        for ring in self._in.values():
            ring.ctl[_READER_CLOSED_W] = 1
        _fence()
        self._release_rings()
        self._store = None

    def _release_rings(self) -> None:
        for ring in [*self._out.values(), *self._in.values()]:
            ring.unlink()
            ring.release()
        self._out.clear()
        self._in.clear()

    # -- Attention side ------------------------------------------------------------
    def send_to_ffn(
        self, payload: AttentionToFFN, *, layer_idx: int, micro_batch_idx: int = 0
    ) -> None:
        self._enter(AFDRole.ATTENTION, "send_to_ffn")
        try:
            self._send_to_ffn(payload, layer_idx, micro_batch_idx)
        finally:
            self._leave()

    def _send_to_ffn(self, payload: AttentionToFFN, layer_idx: int, micro_batch_idx: int) -> None:
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
        self._write(peer, Frame(header, aux, self._global_rank), tensors, deadline, timeout)
        self._sent[key] = header

    def recv_from_ffn(
        self, *, layer_idx: int, micro_batch_idx: int = 0, timeout_s: float | None = None
    ) -> FFNToAttention:
        self._enter(AFDRole.ATTENTION, "recv_from_ffn")
        try:
            return self._recv_from_ffn(layer_idx, micro_batch_idx, timeout_s)
        finally:
            self._leave()

    def _recv_from_ffn(
        self, layer_idx: int, micro_batch_idx: int, timeout_s: float | None
    ) -> FFNToAttention:
        sent = self._sent.get((layer_idx, micro_batch_idx))
        peer = self._peers[0]
        self._check_peer(peer)
        deadline, timeout = self._deadline(timeout_s)
        action = f"receiving layer {layer_idx} micro-batch {micro_batch_idx} from"
        frame = self._next_frame(peer, deadline, timeout, action)
        ring = self._in[peer]
        header = frame.header
        if header.kind is PayloadKind.SHUTDOWN:
            ring.consume()
            self._broken[peer] = "it closed"
            raise AFDPeerLostError(
                f"{self._describe(peer)} closed while {self._me} waited for layer "
                f"{layer_idx} micro-batch {micro_batch_idx}"
            )
        if header.kind not in _F2A_KINDS:
            self._broken[peer] = "stream out of step after a mismatch"
            raise AFDTransferMismatchError(
                f"{self._me} <- {self._describe(peer)}: expected an FFN->attention "
                f"message, received kind {header.kind.name}"
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
        if problem is not None:
            # Drop the message (the stream stays in step) and report.
            ring.consume()
            self._sent.pop((header.layer_idx, header.micro_batch_idx), None)
            raise AFDTransferMismatchError(
                f"{self._me} <- {self._describe(peer)}: recv_from_ffn(layer_idx="
                f"{layer_idx}, micro_batch_idx={micro_batch_idx}) but the next message "
                f"is for layer {header.layer_idx} micro-batch {header.micro_batch_idx} "
                f"({header.num_tokens} tokens); {problem}. The FFN side answers in the "
                "order of send_to_ffn calls"
            )
        specs = _f2a_specs(header, frame.aux_dtype)
        tensors = self._read_tensors([(peer, header.num_tokens)], specs)
        self._sent.pop((header.layer_idx, header.micro_batch_idx), None)
        return FFNToAttention(tensors[0], shared_output=tensors[1] if len(tensors) > 1 else None)

    # -- FFN side ------------------------------------------------------------------
    def recv_from_attention(self, *, timeout_s: float | None = None) -> FFNBatch:
        self._enter(AFDRole.FFN, "recv_from_attention")
        try:
            return self._recv_from_attention(timeout_s)
        finally:
            self._leave()

    def _recv_from_attention(self, timeout_s: float | None) -> FFNBatch:
        if not self._peers:
            raise AFDConfigError(
                f"{self._me} serves no attention rank in topology {self.topology.label} "
                f"(idle FFN ranks: {list(self.topology.idle_ffn_ranks)}); an idle rank "
                "must not call recv_from_attention"
            )
        for peer in self._peers:
            self._check_peer(peer)
        deadline, timeout = self._deadline(timeout_s)
        frames = []
        for peer in self._peers:
            frame = self._next_frame(peer, deadline, timeout, "receiving from")
            kind = frame.header.kind
            if kind is PayloadKind.SHUTDOWN:
                self._in[peer].consume()
                self._broken[peer] = "it closed"
                raise AFDPeerLostError(
                    f"{self._describe(peer)} closed (sent SHUTDOWN) while {self._me} "
                    "waited for the next layer"
                )
            if kind not in _A2F_KINDS:
                self._broken[peer] = "stream out of step after a mismatch"
                raise AFDTransferMismatchError(
                    f"{self._me} <- {self._describe(peer)}: expected an attention->FFN "
                    f"message, received kind {kind.name}"
                )
            frames.append(frame)
        first = frames[0]
        ref = _layer_key(first)
        for peer, frame in zip(self._peers[1:], frames[1:], strict=True):
            if _layer_key(frame) != ref:
                for p in self._peers:
                    self._broken[p] = "attention peers out of step"
                raise AFDTransferMismatchError(
                    f"{self._me}: attention peers disagree on the layer being sent: "
                    f"{self._describe(self._peers[0])} sent "
                    f"{_describe_header(first.header, first.aux_dtype)}, "
                    f"{self._describe(peer)} sent "
                    f"{_describe_header(frame.header, frame.aux_dtype)}"
                )
        counts = tuple(f.header.num_tokens for f in frames)
        specs = _a2f_specs(first.header, first.aux_dtype)
        tensors = self._read_tensors(list(zip(self._peers, counts, strict=True)), specs)
        total = sum(counts)
        return FFNBatch(
            header=first.header
            if first.header.num_tokens == total
            else first.header.with_tokens(total),
            payload=_a2f_payload(first.header.kind, tensors),
            peer_ranks=self._peer_role_ranks,
            token_counts=counts,
        )

    def send_to_attention(self, batch: FFNBatch, result: FFNToAttention) -> None:
        self._enter(AFDRole.FFN, "send_to_attention")
        try:
            self._send_to_attention(batch, result)
        finally:
            self._leave()

    def _send_to_attention(self, batch: FFNBatch, result: FFNToAttention) -> None:
        if tuple(batch.peer_ranks) != self._peer_role_ranks:
            raise AFDTransferMismatchError(
                f"{self._me}: batch is for attention ranks {list(batch.peer_ranks)}, this "
                f"rank serves {list(self._peer_role_ranks)}"
            )
        total = sum(batch.token_counts)
        if result.num_tokens != total:
            raise AFDTransferMismatchError(
                f"{self._me}: result has {result.num_tokens} tokens, the batch of layer "
                f"{batch.layer_idx} micro-batch {batch.micro_batch_idx} had {total} "
                f"({dict(zip(batch.peer_ranks, batch.token_counts, strict=True))})"
            )
        shared_out = result.shared_output
        aux = dtype_name(shared_out.dtype) if shared_out is not None else None
        deadline, timeout = self._deadline(None)
        if len(self._peers) == 1:
            peer = self._peers[0]
            self._check_peer(peer)
            frame = Frame(result.header(batch.layer_idx, batch.micro_batch_idx), aux, self._gr)
            tensors = [result.output] if shared_out is None else [result.output, shared_out]
            self._write(peer, frame, tensors, deadline, timeout)
            return
        counts = list(batch.token_counts)
        outputs = result.output.split(counts, dim=0)
        shared = (
            shared_out.split(counts, dim=0) if shared_out is not None else [None] * len(outputs)
        )
        for peer, out, sh in zip(self._peers, outputs, shared, strict=True):
            self._check_peer(peer)
            part = FFNToAttention(out, shared_output=sh)
            frame = Frame(part.header(batch.layer_idx, batch.micro_batch_idx), aux, self._gr)
            self._write(peer, frame, [out] if sh is None else [out, sh], deadline, timeout)

    # -- transport -------------------------------------------------------------------
    @property
    def _me(self) -> str:
        return f"{type(self).__name__}({self.role.value} rank {self.rank})"

    @property
    def _where(self) -> str:
        return f"{self.config.host}:{self.config.port}"

    def _describe(self, peer: int) -> str:
        return f"{describe_global_rank(self.topology, peer)} (global rank {peer})"

    def _enter(self, role: AFDRole, method: str) -> None:
        """Start a public operation (``close()`` waits for it to leave); pair with _leave."""
        with self._state_lock:
            if self._closed:
                raise AFDConnectorClosedError(f"{self._me}: {method}() after close()")
            if self.role is not role:
                raise AFDConfigError(
                    f"{self._me}: {method}() is a {role.value}-side call; this connector "
                    f"was created for the {self.role.value} role"
                )
            if not self._ready:
                raise AFDConnectorError(f"{self._me}: {method}() before init()")
            self._active += 1

    def _leave(self) -> None:
        with self._state_lock:
            self._active -= 1

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

    def _peer_gone(self, peer: int) -> bool:
        pid, start = self._peer_pid[peer]
        now = _process_start(pid)
        return now is None or (bool(start) and bool(now) and now != start)

    def _wait(
        self,
        ready: Callable[[], bool],
        peer_closed: Callable[[], bool],
        peer: int,
        deadline: float,
        timeout: float,
        action: str,
    ) -> None:
        """Spin, then sleep, until ``ready()``; raise on close, peer loss or timeout."""
        if ready():
            return
        now = time.monotonic()
        spin_until = now + self._spin_s
        next_check = now
        pause = _SLEEP_MIN_S
        while True:
            if self._closed:
                raise AFDConnectorClosedError(
                    f"{self._me} was closed while {action} {self._describe(peer)}"
                )
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _LIVENESS_EVERY_S
                if peer_closed():
                    if ready():
                        return
                    self._broken[peer] = "it closed"
                    raise AFDPeerLostError(
                        f"{self._me}: {self._describe(peer)} closed its connector while {action} it"
                    )
                if self._peer_gone(peer):
                    if ready():
                        return
                    self._broken[peer] = "its process exited"
                    raise AFDPeerLostError(
                        f"{self._me}: {self._describe(peer)} is gone while {action} it: "
                        f"process {self._peer_pid[peer][0]} exited"
                    )
            if now > deadline:
                raise AFDTimeoutError(
                    f"{self._me}: {action} {self._describe(peer)} timed out after {timeout:g} s "
                    "(timeout_s argument or afd.transfer_timeout_s)"
                )
            if now < spin_until:
                os.sched_yield()
            else:
                time.sleep(pause)
                pause = min(pause * 2, _SLEEP_MAX_S)
            if ready():
                return

    def _write(
        self,
        peer: int,
        frame: Frame,
        tensors: Sequence[Any],
        deadline: float,
        timeout: float,
    ) -> None:
        ring = self._out[peer]
        sources = []
        size = _SLOT_HEAD
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            if nbytes:
                if t.device.type != "cpu":
                    t = t.cpu()
                sources.append((size, nbytes, t.contiguous().view(-1)))
            size += _align(nbytes)
        if size > ring.slot_bytes:
            raise AFDTransferMismatchError(
                f"{self._me} -> {self._describe(peer)}: a {frame.header.num_tokens}-token "
                f"message needs {size} bytes, a ring slot holds {ring.slot_bytes}; raise "
                "connector_extra_config 'slot_bytes' (or set 'max_num_tokens' and "
                "'hidden_size')"
            )
        if not ring.writable():
            self._wait(
                ring.writable,
                lambda: bool(ring.ctl[_READER_CLOSED_W]),
                peer,
                deadline,
                timeout,
                "sending to (all ring slots full)",
            )
        import torch

        base = ring.write_slot()
        struct.pack_into(_FRAME_FMT, ring.mm, base, *frame.encode())
        for offset, nbytes, flat in sources:
            ring.view(base + offset, nbytes).copy_(flat.view(torch.uint8))
        ring.publish()

    def _next_frame(self, peer: int, deadline: float, timeout: float, action: str) -> Frame:
        """Wait for the next message from ``peer`` and decode its frame (not consumed)."""
        ring = self._in[peer]
        if not ring.readable():
            self._wait(
                ring.readable,
                lambda: bool(ring.ctl[_WRITER_CLOSED_W]),
                peer,
                deadline,
                timeout,
                action,
            )
        words = struct.unpack_from(_FRAME_FMT, ring.mm, ring.read_slot())
        frame = self._frames.get(words)
        if frame is not None:
            return frame
        try:
            frame = Frame.decode(list(words))
        except AFDTransferMismatchError as exc:
            self._broken[peer] = "garbled frame"
            raise AFDTransferMismatchError(f"{self._me} <- {self._describe(peer)}: {exc}") from None
        if len(self._frames) >= _FRAME_CACHE:
            self._frames.clear()
        self._frames[words] = frame  # frames are immutable; layers repeat every step
        return frame

    def _read_tensors(self, parts: Sequence[tuple[int, int]], specs: Sequence[_Spec]) -> list[Any]:
        """Copy the tensors of the current message of each (peer, tokens) out, in order.

        Several peers' rows are copied straight into one concatenated tensor each.
        Every peer's message is consumed afterwards.
        """
        import torch

        total = sum(n for _, n in parts)
        outs = []
        offsets = [_SLOT_HEAD] * len(parts)
        for trailing, dtype in specs:
            out = torch.empty((total, *trailing), dtype=getattr(torch, dtype))
            row_bytes = out.element_size()
            for d in trailing:
                row_bytes *= d
            row = 0
            for i, (peer, n) in enumerate(parts):
                nbytes = n * row_bytes
                if nbytes:
                    ring = self._in[peer]
                    start = ring.read_slot() + offsets[i]
                    if offsets[i] + nbytes > ring.slot_bytes:
                        self._broken[peer] = "message larger than a slot"
                        raise AFDTransferMismatchError(
                            f"{self._me} <- {self._describe(peer)}: the frame announces "
                            f"{nbytes} bytes past the end of a {ring.slot_bytes}-byte slot"
                        )
                    dst = (out if n == total else out[row : row + n]).view(-1).view(torch.uint8)
                    dst.copy_(ring.view(start, nbytes))
                offsets[i] += _align(nbytes)
                row += n
            outs.append(out)
        for peer, _ in parts:
            self._in[peer].consume()
        return outs
