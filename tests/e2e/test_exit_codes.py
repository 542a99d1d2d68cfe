"""Exit codes of the served roles when a peer dies: a supervisor must be able to tell a
requested stop (SIGTERM: exit 0, checked by every served parity test) from a role that
stopped because AFD lost its peer (exit 1, one log line saying why).

SIGKILL of the FFN server while a completion streams: the client's stream ends with an
error within 10 s, and the attention server exits 1. SIGKILL of the attention server:
the FFN server exits 1.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from afd_processes import FFNServer, Server, afd_settings

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]


def _start(model: Path, tmp: Path) -> tuple[FFNServer, Server]:
    afd = afd_settings("ffn", transfer_timeout_s=60)
    ffn = FFNServer(model, {**afd, "role": "ffn"}, tmp)
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
        body = {
            "model": self.server.served_model,
            "prompt": "The quick brown fox",
            "max_tokens": 400,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.server.port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                for raw in resp:
                    line = raw.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    obj: dict[str, Any] = json.loads(line[5:])
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
        os.killpg(ffn.proc.pid, signal.SIGKILL)
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


def test_attention_killed_makes_the_ffn_server_exit_1(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    ffn, attention = _start(tiny_models["deepseek_v2"], tmp_path)
    try:
        assert len(attention.complete("Hello", max_tokens=4)) == 4
        os.killpg(attention.proc.pid, signal.SIGKILL)
        code = ffn.wait_exit(30)
        assert code == 1, (code, ffn.output[-4000:])
        assert "AFD FFN server stopped: peer gone" in ffn.output, ffn.output[-4000:]
    finally:
        attention.kill()
        ffn.kill()
