"""One layer's round trip from the Attention role to the FFN role and back.

Every Attention-side AFD layer (both MoE runners and the dense proxy) talks to the
FFN role the same way: find the connector of the current step in vLLM's forward
context, send, let the micro-batch scheduler run something else, receive, check
that what came back is the answer to what was sent. That sequence lives here once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from afd_core.connector import AFDConnector
from afd_core.errors import AFDTransferMismatchError
from afd_core.forward_context import find_step_metadata, get_step_metadata
from afd_core.profiling import recorder
from afd_core.transfer import AttentionToFFN, FFNToAttention, dtype_name
from afd_moe_runners.metrics import AttentionMetrics, attention_metrics

__all__ = [
    "MicroBatchYield",
    "PendingExchange",
    "pop_sent",
    "send_to_ffn",
    "no_yield",
    "scheduler_yield",
]

MicroBatchYield = Callable[[int, int], None]
"""``hook(layer_idx, micro_batch_idx)``: called after the send, before the receive."""


def no_yield(layer_idx: int, micro_batch_idx: int) -> None:
    """A yield point that returns at once (no overlap scheduling)."""


def scheduler_yield(layer_idx: int, micro_batch_idx: int) -> None:
    """Default yield point of the AFD layers: hand the turn to the step's micro-batch
    scheduler (``AFDStepMetadata.scheduler``) when there is one, else return at once."""
    meta = find_step_metadata()
    if meta is not None and meta.scheduler is not None:
        meta.scheduler.yield_turn(layer_idx, micro_batch_idx)


_PAYLOAD_FIELDS = ("hidden_states", "topk_ids", "topk_weights", "router_logits", "token_ids")


@dataclass(frozen=True, slots=True)
class PendingExchange:
    """A payload sent to the FFN role whose result has not been received yet."""

    connector: AFDConnector
    layer_idx: int
    micro_batch_idx: int
    num_tokens: int
    """Rows sent (``AFDStepMetadata.num_tokens`` when set, else all rows)."""
    num_rows: int
    """Rows of the caller's tensor; the padding rows beyond ``num_tokens`` are not sent."""
    hidden_size: int
    dtype: torch.dtype
    metrics: AttentionMetrics | None = None
    """Where to record this exchange (None: metrics off)."""
    started_ns: int = 0
    """``perf_counter_ns`` when the send started (0 unless timed)."""

    def receive(self) -> FFNToAttention:
        """Block until the FFN role answers; check it answers what was sent.

        Padding rows that were not sent come back as zeros, so the result has the
        caller's row count.
        """
        counted = getattr(self.connector, "records_exchanges", True)
        rec = recorder("attention", self.connector.rank) if counted else None
        metrics = self.metrics
        timed = rec is not None or metrics is not None
        t0 = time.perf_counter_ns() if timed else 0
        result = self.connector.recv_from_ffn(
            layer_idx=self.layer_idx, micro_batch_idx=self.micro_batch_idx
        )
        if timed:
            t1 = time.perf_counter_ns()
            if rec is not None:
                rec.attention_received(self.layer_idx, self.micro_batch_idx, t0, t1)
            if metrics is not None:
                metrics.received(result, started_ns=self.started_ns, wait_ns=t1 - t0, end_ns=t1)
        output = result.output
        assert isinstance(output, torch.Tensor)
        shape = tuple(output.shape)
        expected = (self.num_tokens, self.hidden_size)
        if shape != expected or output.dtype != self.dtype:
            raise AFDTransferMismatchError(
                f"layer {self.layer_idx} micro-batch {self.micro_batch_idx}: expected an FFN "
                f"output of shape {expected} and dtype {dtype_name(self.dtype)}, received "
                f"{shape} {dtype_name(output.dtype)}"
            )
        if self.num_rows == self.num_tokens:
            return result
        padded = output.new_zeros((self.num_rows, self.hidden_size))
        padded[: self.num_tokens].copy_(output)
        shared = result.shared_output
        if isinstance(shared, torch.Tensor):
            padded_shared = shared.new_zeros((self.num_rows, self.hidden_size))
            padded_shared[: self.num_tokens].copy_(shared)
            shared = padded_shared
        return FFNToAttention(padded, shared_output=shared)


def send_to_ffn(payload: AttentionToFFN, *, layer_idx: int) -> PendingExchange:
    """Send ``payload`` for ``layer_idx`` through the current step's connector.

    When the step metadata says fewer tokens than the tensor has rows (a batch padded
    for a captured graph), only those tokens are sent.
    """
    meta = get_step_metadata()
    rows = payload.num_tokens
    num_tokens = rows if meta.num_tokens is None else meta.num_tokens
    if num_tokens > rows:
        raise AFDTransferMismatchError(
            f"layer {layer_idx}: the step metadata says {num_tokens} tokens but the layer "
            f"input has only {rows} rows"
        )
    if num_tokens < rows:
        payload = AttentionToFFN(
            **{
                name: None if (t := getattr(payload, name)) is None else t[:num_tokens]
                for name in _PAYLOAD_FIELDS
            }
        )
    hidden = payload.hidden_states
    assert isinstance(hidden, torch.Tensor)
    counted = getattr(meta.connector, "records_exchanges", True)
    rec = recorder("attention", meta.connector.rank) if counted else None
    metrics = attention_metrics(meta.connector.rank) if counted else None
    t0 = time.perf_counter_ns() if rec is not None or metrics is not None else 0
    meta.connector.send_to_ffn(payload, layer_idx=layer_idx, micro_batch_idx=meta.micro_batch_idx)
    if rec is not None:
        rec.attention_sent(layer_idx, meta.micro_batch_idx, t0, time.perf_counter_ns(), num_tokens)
    if metrics is not None:
        metrics.sent(payload)
    if meta.scheduler is not None:
        meta.scheduler.on_send(layer_idx, meta.micro_batch_idx, payload)
    return PendingExchange(
        connector=meta.connector,
        layer_idx=layer_idx,
        micro_batch_idx=meta.micro_batch_idx,
        num_tokens=num_tokens,
        num_rows=rows,
        hidden_size=int(hidden.shape[1]),
        dtype=hidden.dtype,
        metrics=metrics,
        started_ns=t0,
    )


def pop_sent(sent: dict[tuple[int, int], Any], label: str, layer_idx: int, mb: int) -> Any:
    """What a wrapping connector recorded at the send of (``layer_idx``, ``mb``), removed;
    a receive without a send is a transfer mismatch."""
    key = (layer_idx, mb)
    if key not in sent:
        raise AFDTransferMismatchError(
            f"{label}: receive for layer {layer_idx} micro-batch {mb} without a send"
        )
    return sent.pop(key)
