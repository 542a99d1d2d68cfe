"""afd.tools.client against a fake OpenAI-compatible server (stdlib HTTP, one thread)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from afd.tools import client


class _Handler(BaseHTTPRequestHandler):
    requests: ClassVar[list[dict[str, Any]]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._json(200, {"data": [{"id": "tiny"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        if body["prompt"] == "bad":
            self._json(400, {"error": "prompt refused"})
            return
        n = body["max_tokens"]
        ids = [len(body["prompt"]) + i for i in range(n)]
        if not body.get("stream"):
            choice = {"text": "x" * n, "token_ids": ids if body.get("return_token_ids") else None}
            self._json(200, {"choices": [choice], "usage": {"completion_tokens": n}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(n):
            chunk = {"choices": [{"text": "x", "finish_reason": "length" if i == n - 1 else None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if body.get("stream_options", {}).get("include_usage"):
            usage = {"choices": [], "usage": {"completion_tokens": n}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def server() -> Iterator[str]:
    _Handler.requests = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_complete_sends_a_greedy_request(server: str) -> None:
    assert client.served_model(server) == "tiny"
    done = client.complete(server, "abc", 4)
    assert done.token_ids == [3, 4, 5, 6] and done.text == "xxxx"
    sent = _Handler.requests[-1]
    assert sent == {
        "model": "tiny",
        "prompt": "abc",
        "max_tokens": 4,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def test_complete_each_one_request_per_prompt(server: str) -> None:
    ids, texts = client.complete_each(server, ["a", "bb"], 2)
    assert ids == [[1, 2], [2, 3]] and texts == ["xx", "xx"]
    assert [r["prompt"] for r in _Handler.requests] == ["a", "bb"]


def test_completion_response_is_the_whole_answer(server: str) -> None:
    answer = client.completion_response(server, "ab", 3, model="m", return_token_ids=False)
    assert answer["usage"] == {"completion_tokens": 3}
    assert _Handler.requests[-1]["model"] == "m"
    assert _Handler.requests[-1]["return_token_ids"] is False


def test_http_errors_name_status_and_body(server: str) -> None:
    with pytest.raises(RuntimeError, match=r"HTTP 400: .*prompt refused"):
        client.complete(server, "bad", 2, model="tiny")


def test_stream_completion_times_the_tokens(server: str) -> None:
    r = client.stream_completion(server, "tiny", "abc", 5)
    assert r.error is None and r.output_tokens == 5
    assert 0 <= r.ttft_s <= r.latency_s and r.tpot_s is not None
    assert _Handler.requests[-1]["stream"] is True


def test_stream_chunks_yields_every_event_until_done(server: str) -> None:
    chunks = list(client.stream_chunks(server, "tiny", "abc", 3))
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    sent = _Handler.requests[-1]
    assert sent["stream"] is True and "stream_options" not in sent
    with_usage = list(client.stream_chunks(server, "tiny", "abc", 2, include_usage=True))
    assert with_usage[-1] == {"choices": [], "usage": {"completion_tokens": 2}}
    assert _Handler.requests[-1]["stream_options"] == {"include_usage": True}


def test_stream_completion_reports_a_refused_connection() -> None:
    r = client.stream_completion("http://127.0.0.1:9", "tiny", "abc", 5, timeout=5)
    assert r.error is not None and r.output_tokens == 0


def test_python_m_afd_reference_still_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "afd.reference", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "python -m afd.reference" in proc.stdout and "--groups-file" in proc.stdout
