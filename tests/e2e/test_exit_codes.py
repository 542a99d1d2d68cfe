"""Exit codes of the served roles when a peer dies: a supervisor must be able to tell a
requested stop (SIGTERM: exit 0, checked by every served parity test) from a role that
stopped because AFD lost its peer (exit 1, one log line saying why).

SIGKILL of the FFN server while a completion streams: the client's stream ends with an
error within 10 s, and the attention server exits 1. SIGKILL of the attention server:
the FFN server exits 1.

The second deployment also checks operability: the FFN server's ``/health`` goes 503
(starting) -> 200 (serving) -> 503 (peers gone), both ``/metrics`` endpoints parse, and
the per-layer exchange histogram counts every layer of every step of a completion.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from afd_processes import (
    FFNServer,
    HealthWatch,
    Server,
    afd_settings,
    free_port,
    metric_samples,
    settled_metric_samples,
)

from afd.tools.client import stream_chunks

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]


def _start(
    model: Path,
    tmp: Path,
    *,
    health_port: int | None = None,
    ffn_env: dict[str, str] | None = None,
) -> tuple[FFNServer, Server]:
    afd = afd_settings("ffn", transfer_timeout_s=60)
    ffn = FFNServer(model, {**afd, "role": "ffn"}, tmp, env=ffn_env, health_port=health_port)
    attention = Server.afd_attention(model, {**afd, "role": "attention"}, tmp)
    ffn.wait_ready()
    attention.wait_ready()
    return ffn, attention


class _Stream(threading.Thread):
    """One streaming completion; records its chunks and how it ended."""

    def __init__(self, server: Server) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.chunks = 0
        self.first = threading.Event()
        self.ended_at: float | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None

    def run(self) -> None:
        try:
            for obj in stream_chunks(
                self.server.url,
                self.server.served_model,
                "The quick brown fox",
                400,
                timeout=120,
            ):
                if "error" in obj:
                    self.error = str(obj["error"])
                    break
                self.chunks += 1
                self.first.set()
                reason = obj["choices"][0].get("finish_reason")
                if reason:
                    self.finish_reason = reason
        except Exception as exc:  # connection reset / closed: the error the client sees
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.ended_at = time.monotonic()
            self.first.set()


def _wait_exit(proc: Any, timeout: float) -> int | None:
    try:
        return int(proc.wait(timeout=timeout))
    except Exception:
        return None


def test_ffn_killed_while_streaming_fails_the_client_and_the_attention_server_exits_1(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    ffn, attention = _start(tiny_models["deepseek_v2"], tmp_path)
    try:
        stream = _Stream(attention)
        stream.start()
        assert stream.first.wait(60) and stream.chunks > 0, stream.error
        killed_at = time.monotonic()
        ffn.signal(signal.SIGKILL)
        stream.join(timeout=30)
        assert stream.ended_at is not None, "the client's stream did not end"
        assert stream.ended_at - killed_at < 10.0
        assert stream.finish_reason != "length", "the stream finished as if nothing happened"
        assert stream.error is not None or stream.finish_reason not in (None, "length")
        code = _wait_exit(attention.proc, 60)
        out = attention.output
        assert code == 1, (code, out[-4000:])
        assert "AFD attention server stopped by AFD: AFDPeerLostError" in out, out[-4000:]
    finally:
        attention.kill()
        ffn.kill()


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_attention_killed_makes_the_ffn_server_exit_1(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    model = tiny_models["deepseek_v2"]
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    health_port = free_port()
    ffn_url = f"http://127.0.0.1:{health_port}"
    # AFD_FFN_LINGER_S: the FFN server keeps answering after its peers are gone, so the
    # 503 that follows is seen by this poller before the process exits.
    watch = HealthWatch(f"{ffn_url}/health")
    watch.start()
    ffn, attention = _start(
        model, tmp_path, health_port=health_port, ffn_env={"AFD_FFN_LINGER_S": "3"}
    )
    attn_url = attention.url
    try:
        # Both roles are ready: the FFN server serves (the poller may lag on a busy host).
        assert watch.wait_for((200, "serving 1 attention peer(s)")), watch.changes

        ffn_before = metric_samples(f"{ffn_url}/metrics")
        attn_before = metric_samples(f"{attn_url}/metrics")
        assert _value(ffn_before, "afd_ffn_peers_connected", rank="0") == 1
        assert _value(attn_before, "afd_attention_peers_connected", rank="0") == 1
        # vLLM's own metrics still come through its multiprocess registry.
        assert any(name.startswith("vllm:") for name, _ in attn_before), sorted(attn_before)[:20]
        max_tokens = 4
        assert len(attention.complete("Hello", max_tokens=max_tokens)) == max_tokens
        ffn_after = settled_metric_samples(f"{ffn_url}/metrics")
        attn_after = metric_samples(f"{attn_url}/metrics")

        def delta(before: Any, after: Any, name: str) -> float:
            return _value(after, name, rank="0") - _value(before, name, rank="0")

        # One step per token (a prefill, then decode steps), one exchange per layer.
        exchanges = delta(attn_before, attn_after, "afd_exchange_latency_seconds_count")
        assert exchanges == max_tokens * layers, (exchanges, layers)
        assert delta(ffn_before, ffn_after, "afd_ffn_layers_served_total") == exchanges
        assert delta(ffn_before, ffn_after, "afd_ffn_compute_seconds_count") == exchanges
        assert delta(attn_before, attn_after, "afd_attention_ffn_wait_seconds_count") == (
            max_tokens
        )
        assert delta(attn_before, attn_after, "afd_exchange_latency_seconds_sum") > 0
        sent = delta(attn_before, attn_after, "afd_attention_sent_bytes_total")
        assert sent > 0
        assert delta(ffn_before, ffn_after, "afd_ffn_received_bytes_total") == sent
        assert delta(ffn_before, ffn_after, "afd_ffn_tokens_served_total") >= max_tokens * layers

        attention.signal(signal.SIGKILL)
        code = ffn.wait_exit(30)
        assert code == 1, (code, ffn.output[-4000:])
        assert "AFD FFN server stopped: peer gone" in ffn.output, ffn.output[-4000:]
        watch.stop()
        changes = watch.statuses()
        # Connection refused while vLLM loads, 503 until the attention peer connected,
        # 200 while serving, 503 once it is gone, then nothing (the server exited).
        assert changes[-3:] == [200, 503, None], watch.changes
        assert 503 in changes[: changes.index(200)], watch.changes
        served = max(i for i, (status, _) in enumerate(watch.changes) if status == 200)
        gone = [body for status, body in watch.changes[served:] if status == 503]
        # The worker reports its peers gone; then the server says why it stopped.
        assert set(gone[:-1]) <= {"attention peers gone"}, watch.changes
        assert gone[-1].startswith("stopped: peer gone: "), watch.changes
    finally:
        watch.stop()
        attention.kill()
        ffn.kill()
