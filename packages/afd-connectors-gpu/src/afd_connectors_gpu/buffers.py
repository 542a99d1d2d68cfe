"""Preallocated transfer buffers of the point-to-point connectors (:class:`BufferPool`).

Tensors travel as power-of-two token *buckets* (``1, 2, 4, ... >= max_num_tokens``):
the sender copies a tensor into the first rows of a send buffer of its bucket and sends
the whole bucket, the receiver receives into a receive buffer of the same bucket and
hands out a view of the first ``num_tokens`` rows. A buffer's address stays fixed once
its bucket has been used, which is what a captured CUDA graph of the transfers needs,
and no tensor is allocated per layer.

The buffers of the largest bucket the engine can send (its ``max_num_batched_tokens``)
are made in the connector's ``init()`` (:meth:`BufferPool.reserve`): the Attention role
builds its connectors while vLLM builds the model, so vLLM's memory profiling counts
them before it sizes the KV cache. A smaller bucket's buffers (all of them together
smaller than the largest) are made on its first use.

A buffer is keyed by everything that may be in flight at the same time:
(direction, peer, bucket, trailing shape, dtype, tensor slot, micro-batch). The peer is
part of the key because an FFN rank receives from (and answers) several attention
ranks per layer: two peers' messages of one bucket must never share a buffer, or the
second receive overwrites the first (and the second answer overwrites the first
before its send has read it).

The pool is torch-free until a buffer is made; the NCCL connector always uses one, the
gloo connector when ``connector_extra_config["buffer_pool"]`` is true (so every code
path of the NCCL connector except NCCL itself runs on CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from afd_core.errors import AFDTransferMismatchError
from afd_core.transfer import dtype_name

__all__ = ["BufferPool", "DEFAULT_MAX_NUM_TOKENS", "Reservation"]

#: Default largest message (tokens). Only the bucket of the engine's token budget is
#: reserved in init(), so a large limit costs nothing until it is used.
DEFAULT_MAX_NUM_TOKENS = 16384

# (trailing shape, dtype name) of one tensor of a message.
Spec = tuple[tuple[int, ...], str]


@dataclass(frozen=True)
class Reservation:
    """What the pool holds after :meth:`BufferPool.reserve`: ``per_peer[peer]`` bytes
    of each peer's buffers, ``buffers`` buffers in all, ``rows``: the reserved bucket."""

    rows: int
    per_peer: dict[int, int]
    buffers: int

    @property
    def total(self) -> int:
        return sum(self.per_peer.values())


class BufferPool:
    """Send and receive buffers per (direction, peer, bucket, spec, slot, micro-batch).

    ``settle(work)`` is called before a send buffer is written again while the send that
    last read it may still be in flight (gloo: until the receiver took the data; NCCL:
    until the send kernel ran), so a staged answer is never overwritten early.
    """

    def __init__(self, *, max_num_tokens: int, device: Any, label: str) -> None:
        self.max_num_tokens = max_num_tokens
        self.device = device
        self.label = label
        self._buffers: dict[tuple[Any, ...], Any] = {}
        self._in_flight: dict[tuple[Any, ...], Any] = {}

    def bucket_of(self, num_tokens: int) -> int:
        """The power-of-two bucket that carries ``num_tokens`` rows."""
        if num_tokens > self.max_num_tokens:
            raise AFDTransferMismatchError(
                f"{self.label}: a {num_tokens}-token message exceeds the connector's buffer "
                f"limit max_num_tokens={self.max_num_tokens}; raise "
                "connector_extra_config['max_num_tokens'] (it must be at least the engine's "
                "--max-num-batched-tokens)"
            )
        return 1 << max(num_tokens - 1, 0).bit_length()

    def buckets(self) -> list[int]:
        """Every bucket: powers of two up to the first one >= ``max_num_tokens``."""
        return [1 << i for i in range(self.bucket_of(self.max_num_tokens).bit_length())]

    def key(
        self, direction: str, peer: int, bucket: int, spec: Spec, slot: int, mb: int
    ) -> tuple[Any, ...]:
        trailing, dtype = spec
        return (direction, peer, bucket, trailing, dtype, slot, mb)

    def buffer(self, key: tuple[Any, ...]) -> Any:
        buf = self._buffers.get(key)
        if buf is None:
            import torch

            _, _, bucket, trailing, dtype, _, _ = key
            buf = torch.zeros((bucket, *trailing), dtype=getattr(torch, dtype), device=self.device)
            self._buffers[key] = buf
        return buf

    def stage(
        self,
        tensor: Any,
        *,
        peer: int,
        slot: int,
        mb: int,
        settle: Callable[[Any], None],
    ) -> tuple[Any, tuple[Any, ...]]:
        """Copy ``tensor`` into its send buffer; returns (buffer to send, its key).

        Raises before anything is written when ``tensor`` is larger than the limit.
        Call :meth:`sent` with the key and the send's work once the send is posted.
        """
        n = int(tensor.shape[0])
        spec: Spec = (tuple(int(s) for s in tensor.shape[1:]), dtype_name(tensor.dtype))
        key = self.key("send", peer, self.bucket_of(n), spec, slot, mb)
        previous = self._in_flight.pop(key, None)
        if previous is not None:
            settle(previous)
        buf = self.buffer(key)
        buf[:n].copy_(tensor, non_blocking=True)
        return buf, key

    def sent(self, key: tuple[Any, ...], work: Any) -> None:
        self._in_flight[key] = work

    def receive(
        self, peer: int, num_tokens: int, spec: Spec, slot: int, mb: int
    ) -> tuple[Any, Any]:
        """(buffer to receive into, view of its first ``num_tokens`` rows to hand out)."""
        key = self.key("recv", peer, self.bucket_of(num_tokens), spec, slot, mb)
        buf = self.buffer(key)
        return buf, buf[:num_tokens]

    def reserve(
        self,
        peers: Iterable[int],
        plan: Iterable[tuple[str, int, Spec]],
        num_micro_batches: int,
        num_tokens: int,
    ) -> Reservation:
        """Make, now, the buffers of the bucket of ``num_tokens`` for every (direction,
        slot, spec) of ``plan``, every peer and every micro-batch. Returns what the pool
        holds then, per peer (buffers made earlier included)."""
        rows = self.bucket_of(num_tokens)
        per_peer: dict[int, int] = {}
        steps = list(plan)
        for peer in peers:
            for direction, slot, spec in steps:
                for mb in range(num_micro_batches):
                    self.buffer(self.key(direction, peer, rows, spec, slot, mb))
            per_peer[peer] = 0
        for key, buf in self._buffers.items():
            if key[1] in per_peer:
                per_peer[key[1]] += buf.numel() * buf.element_size()
        return Reservation(rows=rows, per_peer=per_peer, buffers=len(self._buffers))

    def nbytes(self) -> int:
        """Bytes of every buffer of the pool."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def buffers(self) -> dict[tuple[Any, ...], Any]:
        """Key -> buffer, every buffer made so far (for inspection)."""
        return dict(self._buffers)

    def clear(self) -> None:
        self._buffers.clear()
        self._in_flight.clear()

    def __len__(self) -> int:
        return len(self._buffers)
