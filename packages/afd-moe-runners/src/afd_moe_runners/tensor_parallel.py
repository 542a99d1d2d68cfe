"""Attention tensor parallelism: one exchange per attention rank, not one per TP worker.

An attention rank may be a vLLM tensor-parallel group of t workers. After attention
(``o_proj``'s all-reduce) every TP worker holds the same hidden states, so sending
them t times would only multiply the FFN role's work. Here TP worker 0 (the *leader*)
owns the rank's connector and does the exchange; after its receive it broadcasts the
FFN answer over vLLM's TP group, and the other workers (*followers*) send nothing and
take the broadcast answer. The FFN role sees one peer per attention (DP) rank, whatever
t is.

:class:`TensorParallelExchange` is an :class:`~afd_core.connector.AFDConnector` that
wraps the leader's real connector (a follower wraps none), so the runners, the dense
proxy and :mod:`afd_moe_runners.exchange` stay unchanged.

Why broadcast rather than shard the tokens over the TP workers (each sends 1/t of the
rows, the answers are all-gathered): on the CPU connectors the exchange's cost is per
message plus per byte; sharding keeps the bytes per worker lower but t times the
messages to the FFN role and an all-gather of the answer, while the broadcast has one
message per rank and a broadcast of the same size as that all-gather. See
docs/architecture.md ("Attention tensor parallelism") for what was measured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from afd_core.config import AFDConfig
from afd_core.connector import AFDConnector, FFNBatch
from afd_core.errors import (
    AFDConfigError,
    AFDConnectorClosedError,
    AFDConnectorError,
    AFDPeerLostError,
    AFDTimeoutError,
    AFDTransferMismatchError,
)
from afd_core.transfer import AttentionToFFN, FFNToAttention
from afd_moe_runners.exchange import pop_sent

__all__ = ["Broadcast", "TensorParallelExchange", "vllm_tp_broadcast"]

Broadcast = Callable[[torch.Tensor], torch.Tensor]
"""``broadcast(tensor)``: the leader's ``tensor`` on every TP worker (in place on the
followers, which pass a buffer of the right shape and dtype)."""


def vllm_tp_broadcast() -> Broadcast:
    """Broadcast from TP rank 0 over vLLM's tensor-parallel group of this worker."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()

    def broadcast(tensor: torch.Tensor) -> torch.Tensor:
        return group.broadcast(tensor, src=0)

    return broadcast


# Header broadcast before each answer: [status, rows, hidden, dtype code]. A status >= 0
# says whether a shared output follows (0 or 1); a negative one that the leader's
# exchange failed, and how (:data:`_FAILURES`), so the followers raise the same error
# instead of waiting in a broadcast the leader never joins.
_HEADER_LEN = 4
_FAILURES: tuple[type[AFDConnectorError], ...] = (
    AFDTimeoutError,
    AFDConnectorClosedError,
    AFDPeerLostError,
    AFDTransferMismatchError,
    AFDConnectorError,
)
"""Status ``-(i + 1)``: the leader raised ``_FAILURES[i]`` (the first that matches)."""
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.int8,
)


def _failure_status(exc: BaseException) -> int:
    for i, kind in enumerate(_FAILURES):
        if isinstance(exc, kind):
            return -(i + 1)
    return -len(_FAILURES)


class TensorParallelExchange(AFDConnector):
    """The AFD connector of one TP worker of an attention rank (Attention side only).

    ``inner``: the rank's real connector on the leader (TP rank 0), None on a follower.
    ``tp_rank`` / ``tp_size``: this worker's place in its TP group. ``broadcast``: see
    :data:`Broadcast` (default: vLLM's TP group, :func:`vllm_tp_broadcast`).
    """

    name = "TensorParallelExchange"

    def __init__(
        self,
        config: AFDConfig,
        *,
        rank: int,
        tp_rank: int,
        tp_size: int,
        inner: AFDConnector | None,
        broadcast: Broadcast | None = None,
    ) -> None:
        super().__init__(config, rank=rank)
        if tp_size < 2 or not 0 <= tp_rank < tp_size:
            raise AFDConfigError(
                f"TensorParallelExchange: expected tp_size >= 2 and tp_rank in 0..tp_size-1, "
                f"got tp_rank={tp_rank} tp_size={tp_size}"
            )
        if (tp_rank == 0) != (inner is not None):
            raise AFDConfigError(
                f"TensorParallelExchange: TP rank 0 (and only it) holds the rank's connector; "
                f"got tp_rank={tp_rank} with{'out' if inner is None else ''} a connector"
            )
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.inner = inner
        self._broadcast = broadcast
        # (layer, micro-batch) -> (rows, hidden, dtype, device) of what this worker would
        # have sent: a follower sizes its receive buffers from it.
        self._sent: dict[tuple[int, int], tuple[int, int, torch.dtype, torch.device]] = {}
        # Where the broadcasts' buffers live: the device of the last send (the TP group's
        # device); before any send, the accelerator's if there is one.
        self._device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        if inner is not None:
            self.identity = inner.identity

    #: The wrapped connector checks the extra config (the same mapping).
    extra_schema = None

    @property
    def is_leader(self) -> bool:
        return self.inner is not None

    @property
    def records_exchanges(self) -> bool:
        """Whether this worker's exchanges count in the metrics and profiles: the
        leader's only (a follower's would count every exchange t times)."""
        return self.is_leader

    @property
    def label(self) -> str:
        return f"{type(self).__name__}(attention rank {self.rank} tp {self.tp_rank}/{self.tp_size})"

    def _bcast(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._broadcast is None:
            self._broadcast = vllm_tp_broadcast()
        return self._broadcast(tensor)

    # -- lifecycle -----------------------------------------------------------
    def init(self) -> None:
        if self.inner is not None:
            self.inner.init()

    @property
    def is_initialized(self) -> bool:
        return self.inner.is_initialized if self.inner is not None else True

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()

    # -- Attention side ------------------------------------------------------
    def send_to_ffn(
        self, payload: AttentionToFFN, *, layer_idx: int, micro_batch_idx: int = 0
    ) -> None:
        hidden = payload.hidden_states
        assert isinstance(hidden, torch.Tensor)
        rows, size = int(hidden.shape[0]), int(hidden.shape[1])
        self._sent[(layer_idx, micro_batch_idx)] = (rows, size, hidden.dtype, hidden.device)
        self._device = hidden.device
        if self.inner is not None:
            self.inner.send_to_ffn(payload, layer_idx=layer_idx, micro_batch_idx=micro_batch_idx)

    def recv_from_ffn(
        self, *, layer_idx: int, micro_batch_idx: int = 0, timeout_s: float | None = None
    ) -> FFNToAttention:
        if self.inner is not None:
            return self._leader_recv(layer_idx, micro_batch_idx, timeout_s)
        return self._follower_recv(layer_idx, micro_batch_idx)

    def _leader_recv(self, layer: int, mb: int, timeout_s: float | None) -> FFNToAttention:
        assert self.inner is not None
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=self._device)
        try:
            if (layer, mb) not in self._sent:
                # No send of this layer: as the exchange protocol does, the rank's
                # connector receives anyway, to say which answer really arrived (getting
                # past it, so its stream stays in step) or to time out.
                self.inner.recv_from_ffn(layer_idx=layer, micro_batch_idx=mb, timeout_s=timeout_s)
            pop_sent(self._sent, self.label, layer, mb)
            result = self.inner.recv_from_ffn(
                layer_idx=layer, micro_batch_idx=mb, timeout_s=timeout_s
            )
        except BaseException as exc:
            # Tell the followers, which wait in the header's broadcast, then raise here.
            header[0] = _failure_status(exc)
            try:
                self._bcast(header)
            except Exception as bcast_exc:  # the original error is the one to report
                exc.add_note(f"{self.label}: telling the TP followers failed: {bcast_exc!r}")
            raise
        output, shared = result.output, result.shared_output
        assert isinstance(output, torch.Tensor)
        header[0] = int(shared is not None)
        header[1], header[2] = int(output.shape[0]), int(output.shape[1])
        header[3] = _DTYPES.index(output.dtype)
        self._bcast(header)
        if shared is None:
            self._bcast(output.contiguous())
            return result
        assert isinstance(shared, torch.Tensor)
        both = torch.stack((output, shared)).contiguous()
        self._bcast(both)
        return FFNToAttention(both[0], shared_output=both[1])

    def _follower_recv(self, layer: int, mb: int) -> FFNToAttention:
        sent = self._sent.pop((layer, mb), None)
        header = self._bcast(torch.zeros(_HEADER_LEN, dtype=torch.int64, device=self._device))
        status = int(header[0])
        if status < 0:
            kind = _FAILURES[-status - 1]
            raise kind(
                f"{self.label}: layer {layer} micro-batch {mb}: TP rank 0's exchange with the "
                f"FFN role failed with {kind.__name__} (its log says why)"
            )
        got_rows, size, dtype = int(header[1]), int(header[2]), _DTYPES[int(header[3])]
        # Take part in the answer's broadcast whatever it holds (the leader must not
        # hang), then check it answers what this worker computed.
        shape = (2, got_rows, size) if status else (got_rows, size)
        answer = self._bcast(torch.empty(shape, dtype=dtype, device=self._device))
        if sent is None:
            raise AFDTransferMismatchError(
                f"{self.label}: receive for layer {layer} micro-batch {mb} without a send"
            )
        rows = sent[0]
        if got_rows != rows:
            raise AFDTransferMismatchError(
                f"{self.label}: layer {layer} micro-batch {mb}: TP rank 0 "
                f"received {got_rows} rows from the FFN role, this worker sent {rows}; the "
                "TP workers of one attention rank must run the same batch"
            )
        if not status:
            return FFNToAttention(answer)
        return FFNToAttention(answer[0], shared_output=answer[1])

    # -- FFN side (never on this connector) ------------------------------------
    def recv_from_attention(self, *, timeout_s: float | None = None) -> FFNBatch:
        raise AFDConfigError(f"{self.label}: recv_from_attention() is an FFN-side call")

    def send_to_attention(self, batch: FFNBatch, result: FFNToAttention) -> None:
        raise AFDConfigError(f"{self.label}: send_to_attention() is an FFN-side call")

    def __getattr__(self, name: str) -> Any:
        # Connector-specific members (capabilities aside) the runtime reads on the
        # leader's real connector, e.g. its peers for the metrics.
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)
