"""Module-level rank bodies for the process tests (spawned processes import them by name)."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import torch

from afd_core.config import AFDRole
from afd_core.transfer import AttentionToFFN, FFNToAttention


def _timed(fn: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return {"error": exc, "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start}


def ffn_dies_mid_exchange(connector: Any, ctx: Any) -> Any:
    """The FFN process receives one layer, then is SIGKILLed instead of answering."""
    if ctx.role is AFDRole.FFN:
        batch = connector.recv_from_attention()
        connector.send_to_attention(batch, FFNToAttention(batch.payload.hidden_states * 2))
        connector.recv_from_attention()
        os.kill(os.getpid(), signal.SIGKILL)
        return None
    hidden = torch.ones(4, 16, dtype=torch.bfloat16)
    connector.send_to_ffn(AttentionToFFN(hidden), layer_idx=0)
    first = connector.recv_from_ffn(layer_idx=0, timeout_s=30.0)
    connector.send_to_ffn(AttentionToFFN(hidden), layer_idx=1)
    result = _timed(lambda: connector.recv_from_ffn(layer_idx=1, timeout_s=60.0))
    result["first_ok"] = bool(torch.equal(first.output, hidden * 2))
    return result


def close_from_other_thread(connector: Any, ctx: Any) -> Any:
    """Every rank blocks in a receive; another thread closes the connector after 0.5 s."""
    if ctx.is_idle:
        return None
    closer_elapsed: dict[str, float] = {}

    def closer() -> None:
        time.sleep(0.5)
        start = time.monotonic()
        connector.close()
        connector.close()  # idempotent
        closer_elapsed["close_s"] = time.monotonic() - start

    thread = threading.Thread(target=closer)
    thread.start()
    if ctx.role is AFDRole.FFN:
        result = _timed(lambda: connector.recv_from_attention(timeout_s=60.0))
    else:
        result = _timed(lambda: connector.recv_from_ffn(layer_idx=0, timeout_s=60.0))
    thread.join()
    after = _timed(lambda: connector.recv_from_ffn(layer_idx=0))
    return {**result, **closer_elapsed, "after_close": after["error"]}


def attention_closes_gracefully(connector: Any, ctx: Any) -> Any:
    """Attention does one layer and closes; the FFN's next receive reports who left."""
    if ctx.role is AFDRole.FFN:
        batch = connector.recv_from_attention()
        connector.send_to_attention(batch, FFNToAttention(batch.payload.hidden_states + 1))
        return _timed(lambda: connector.recv_from_attention(timeout_s=60.0))
    hidden = torch.zeros(2, 8)
    connector.send_to_ffn(AttentionToFFN(hidden), layer_idx=0)
    connector.recv_from_ffn(layer_idx=0)
    connector.close()
    return None


def bf16_round_trip(connector: Any, ctx: Any) -> Any:
    if ctx.role is AFDRole.FFN:
        batch = connector.recv_from_attention()
        connector.send_to_attention(batch, FFNToAttention(batch.payload.hidden_states))
        return None
    hidden = torch.randn(64, 2048).to(torch.bfloat16)
    connector.send_to_ffn(AttentionToFFN(hidden), layer_idx=3)
    return bool(torch.equal(connector.recv_from_ffn(layer_idx=3).output, hidden))


def hang_forever(connector: Any, ctx: Any) -> Any:
    time.sleep(3600)


def attention_dies_mid_exchange(connector: Any, ctx: Any) -> Any:
    """The attention process does one layer, then is SIGKILLed; the FFN waits for the next."""
    if ctx.role is AFDRole.FFN:
        batch = connector.recv_from_attention()
        connector.send_to_attention(batch, FFNToAttention(batch.payload.hidden_states))
        return _timed(lambda: connector.recv_from_attention(timeout_s=60.0))
    hidden = torch.ones(4, 16, dtype=torch.bfloat16)
    connector.send_to_ffn(AttentionToFFN(hidden), layer_idx=0)
    connector.recv_from_ffn(layer_idx=0, timeout_s=30.0)
    time.sleep(0.3)  # the FFN is waiting for layer 1 by now
    os.kill(os.getpid(), signal.SIGKILL)
    return None


def oversized_message_then_normal(connector: Any, ctx: Any) -> Any:
    """A message bigger than a ring slot is refused; the connector stays usable."""
    if ctx.role is AFDRole.FFN:
        batch = connector.recv_from_attention()
        connector.send_to_attention(batch, FFNToAttention(batch.payload.hidden_states + 1))
        return None
    big = torch.zeros(64, 2048, dtype=torch.bfloat16)
    refused = _timed(lambda: connector.send_to_ffn(AttentionToFFN(big), layer_idx=0))
    small = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    connector.send_to_ffn(AttentionToFFN(small), layer_idx=0)
    out = connector.recv_from_ffn(layer_idx=0)
    return {"refused": refused["error"], "ok": bool(torch.equal(out.output, small + 1))}


def many_layers_in_flight(connector: Any, ctx: Any) -> Any:
    """More messages in flight than ring slots: the sender waits for free slots."""
    layers = 12
    if ctx.role is AFDRole.FFN:
        for _ in range(layers):
            batch = connector.recv_from_attention()
            connector.send_to_attention(batch, FFNToAttention(batch.payload.hidden_states * 2))
        return None
    xs = [torch.randn(3, 8) for _ in range(layers)]
    for layer in range(layers):
        connector.send_to_ffn(AttentionToFFN(xs[layer]), layer_idx=layer)
        if layer >= 2:  # keep three outstanding
            out = connector.recv_from_ffn(layer_idx=layer - 2)
            assert torch.equal(out.output, xs[layer - 2] * 2)
    for layer in range(layers - 2, layers):
        out = connector.recv_from_ffn(layer_idx=layer)
        assert torch.equal(out.output, xs[layer] * 2)
    return True


def pool_after_init(connector: Any, ctx: Any) -> Any:
    """What the buffer pool holds right after init(), before any exchange."""
    transport = connector.transport
    pool = transport._pool
    storages = pool.buffers()
    res = transport.reservation
    return {
        "peers": list(connector.peers),
        "storages": {key: (tuple(b.shape), str(b.dtype)) for key, b in storages.items()},
        "nbytes": sum(b.numel() * b.element_size() for b in storages.values()),
        "reported": None if res is None else res.total,
        "per_peer": None if res is None else dict(res.per_peer),
        "report": transport.buffer_report,
    }
