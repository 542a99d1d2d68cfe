"""The prefill -> decode proxy of a disaggregated deployment (``[prefill]`` in a spec).

``python -m afd.launch.pd_proxy --prefill URL --decode URL --port P`` serves the
OpenAI completions API in front of two vLLM servers: a native **prefill** instance
(``kv_role`` ``kv_producer``) and the AFD deployment's Attention server, the **decode**
side (``kv_consumer``), which share a KV connector (afd's ``WholePromptConnector`` or
vLLM's ``ExampleConnector``: the prefill instance writes each prompt's KV cache to a
folder, the decode side reads it).
Modelled on vLLM's toy proxies (examples/online_serving/disaggregated_*), written here.

One ``POST /v1/completions`` (one prompt, ``n`` = 1, not streamed):

1. to the prefill instance with ``max_tokens`` = 1: it computes the prompt, stores its KV
   and samples the first token ``t1``;
2. to the decode side with the prompt's token ids plus ``t1`` and ``max_tokens - 1``:
   the connector finds the KV stored for that prompt (it keys a decode request by its
   prompt less the last token, which is ``t1``: vLLM's example layout) and loads it,
   every token with ``WholePromptConnector`` (whole KV blocks only with
   ``ExampleConnector``); the decode side computes the rest (``t1`` alone, or with
   ``ExampleConnector`` also the prompt's last partial block) and generates;
3. the answer: ``t1`` then the decode side's tokens, text and usage joined, as one
   completion of the original prompt.

``GET /health`` answers 200 when both servers do; ``GET /v1/models`` is the decode side's.
Anything else (chat, streaming, ``n`` > 1, ``echo``, ``logprobs``) is refused with 400 and
a message naming what the proxy serves.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["PDProxy", "join_completions", "main", "prefill_request", "decode_request"]

logger = logging.getLogger("afd.pd_proxy")

DEFAULT_MAX_TOKENS = 16
"""vLLM's ``max_tokens`` of a completions request that names none."""

_REFUSED = {
    "stream": "streaming",
    "echo": "echo",
    "logprobs": "logprobs",
    "prompt_logprobs": "prompt_logprobs",
}


class ProxyRequestError(ValueError):
    """A request the proxy does not serve (answered 400 with the message)."""


def _check(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ProxyRequestError("expected a JSON object")
    for key, what in _REFUSED.items():
        if body.get(key):
            raise ProxyRequestError(f"{what} is not served by the afd PD proxy; leave out {key!r}")
    if body.get("n", 1) != 1 or body.get("best_of", 1) not in (None, 1):
        raise ProxyRequestError("the afd PD proxy serves n = 1 only")
    prompt = body.get("prompt")
    single = isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    )
    if not single:
        raise ProxyRequestError(
            "the afd PD proxy serves one prompt per request (a string or token ids)"
        )
    return body


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """What the prefill instance is asked: the prompt, one token, its token ids back."""
    out = {**body, "max_tokens": 1, "return_token_ids": True, "stream": False}
    if "min_tokens" in out:
        out["min_tokens"] = min(int(out["min_tokens"] or 0), 1)
    return out


def decode_request(body: dict[str, Any], prompt_ids: list[int], first: list[int]) -> dict[str, Any]:
    """What the decode side is asked: the prompt's token ids plus the first token, the
    remaining tokens."""
    max_tokens = int(body.get("max_tokens") or DEFAULT_MAX_TOKENS)
    out = {
        **body,
        "prompt": [*prompt_ids, *first],
        "max_tokens": max_tokens - len(first),
        "return_token_ids": True,
        "stream": False,
    }
    if out.get("min_tokens"):
        out["min_tokens"] = max(int(out["min_tokens"]) - len(first), 0)
    return out


def join_completions(
    body: dict[str, Any], prefilled: dict[str, Any], decoded: dict[str, Any] | None
) -> dict[str, Any]:
    """One completion of the original prompt from the prefill answer (first token) and
    the decode answer (the rest; None when the first token ended the request)."""
    first = prefilled["choices"][0]
    prompt_ids = list(first.get("prompt_token_ids") or [])
    if decoded is None:
        out = dict(prefilled)
    else:
        rest = decoded["choices"][0]
        choice = {
            **rest,
            "text": str(first.get("text", "")) + str(rest.get("text", "")),
            "token_ids": [*(first.get("token_ids") or []), *(rest.get("token_ids") or [])],
            "prompt_token_ids": prompt_ids,
        }
        completion = len(choice["token_ids"])
        out = {
            **decoded,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion,
                "total_tokens": len(prompt_ids) + completion,
            },
        }
    if not body.get("return_token_ids"):
        out["choices"] = [
            {k: v for k, v in c.items() if k not in ("token_ids", "prompt_token_ids")}
            for c in out["choices"]
        ]
    return out


class UpstreamError(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status, self.body = status, body


def _post(url: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
    data = json.dumps(payload).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return dict(json.loads(r.read()))
    except urllib.error.HTTPError as e:
        raise UpstreamError(e.code, e.read()) from None


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2.0) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class PDProxy:
    """The proxy's routing, apart from HTTP serving (:func:`main`)."""

    def __init__(self, prefill_url: str, decode_url: str, timeout: float = 600.0) -> None:
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.timeout = timeout

    def complete(self, body: Any) -> dict[str, Any]:
        body = _check(body)
        prefilled = _post(f"{self.prefill_url}/v1/completions", prefill_request(body), self.timeout)
        first = prefilled["choices"][0]
        max_tokens = int(body.get("max_tokens") or DEFAULT_MAX_TOKENS)
        if max_tokens <= 1 or first.get("finish_reason") == "stop":
            return join_completions(body, prefilled, None)
        prompt_ids = list(first.get("prompt_token_ids") or [])
        ask = decode_request(body, prompt_ids, list(first.get("token_ids") or []))
        decoded = _post(f"{self.decode_url}/v1/completions", ask, self.timeout)
        return join_completions(body, prefilled, decoded)

    def healthy(self) -> bool:
        return _healthy(self.prefill_url) and _healthy(self.decode_url)

    def handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt: str, *args: Any) -> None:
                logger.debug(fmt, *args)

            def _answer(self, status: int, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _error(self, status: int, message: str) -> None:
                body = {"error": {"message": message, "type": "BadRequestError", "code": status}}
                self._answer(status, json.dumps(body).encode())

            def do_GET(self) -> None:
                if self.path == "/health":
                    ok = proxy.healthy()
                    self._answer(200 if ok else 503, b"{}" if ok else b'{"status": "starting"}')
                elif self.path == "/v1/models":
                    try:
                        with urllib.request.urlopen(
                            f"{proxy.decode_url}/v1/models", timeout=10
                        ) as r:
                            self._answer(r.status, r.read())
                    except (urllib.error.URLError, OSError) as e:
                        self._error(502, f"decode side: {e}")
                else:
                    self._error(404, f"{self.path}: the afd PD proxy serves /v1/completions")

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                if self.path != "/v1/completions":
                    self._error(404, f"{self.path}: the afd PD proxy serves /v1/completions only")
                    return
                try:
                    answer = proxy.complete(json.loads(raw or b"null"))
                except (ProxyRequestError, ValueError) as e:
                    self._error(400, str(e))
                except UpstreamError as e:
                    self._answer(e.status, e.body)
                except (urllib.error.URLError, OSError) as e:
                    self._error(502, f"upstream: {e}")
                else:
                    self._answer(200, json.dumps(answer).encode())

        return Handler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m afd.launch.pd_proxy", description=__doc__)
    ap.add_argument("--prefill", required=True, help="the prefill instance's base URL")
    ap.add_argument("--decode", required=True, help="the decode side's (Attention) base URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    proxy = PDProxy(args.prefill, args.decode, args.timeout)
    server = ThreadingHTTPServer((args.host, args.port), proxy.handler())
    print(
        f"afd PD proxy on http://{args.host}:{args.port}: prefill {proxy.prefill_url} -> "
        f"decode {proxy.decode_url}",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
