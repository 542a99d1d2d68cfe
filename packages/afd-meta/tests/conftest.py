"""Fixtures of the afd-meta unit tests."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from afd.launch import RoleProcess
from afd.runtime.ffn_server import READY_MARKER

_SERVE_HEALTH = (
    "from http.server import HTTPServer, BaseHTTPRequestHandler as B\n"
    "class H(B):\n"
    "    def do_GET(self): self.send_response(200); self.end_headers()\n"
    "    def log_message(self, *a): pass\n"
    "HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n"
)


@pytest.fixture
def healthy_role(tmp_path: Path) -> Callable[..., RoleProcess]:
    """``make(prelude="")``: a fake FFN role process (``ffn0``) that runs ``prelude``,
    prints the FFN ready line, then answers ``GET /health`` with 200, as a started FFN
    server does once its peers are connected (what ``afd launch`` waits for)."""

    def make(prelude: str = "") -> RoleProcess:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        code = (
            prelude + f"\nprint({READY_MARKER!r}, flush=True)\n" + _SERVE_HEALTH.format(port=port)
        )
        return RoleProcess(
            "ffn0",
            "ffn",
            0,
            [sys.executable, "-c", code],
            dict(os.environ),
            tmp_path / "logs" / "ffn0.log",
            health_url=f"http://127.0.0.1:{port}",
        )

    return make
