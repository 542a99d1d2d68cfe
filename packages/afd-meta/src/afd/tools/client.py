"""The OpenAI-compatible completion client of afd's tools and tests.

One implementation of the ``/v1/models`` and ``/v1/completions`` requests that ``afd
demo``, ``afd bench``, the test helpers (``tests/support``) and the scripts in
``tools/`` send to a vLLM API server (native, or an AFD Attention role): greedy
(``temperature=0``), ``ignore_eos``, so every request generates exactly ``max_tokens``
tokens and two servers given the same requests one at a time must answer the same
token ids. Standard library only (``urllib``): no client package to install.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Completion",
    "RequestResult",
    "complete",
    "complete_each",
    "completion_response",
    "post_json",
    "served_model",
    "stream_chunks",
    "stream_completion",
]


def post_json(url: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
    """POST ``payload`` as JSON; the JSON answer. HTTP errors raise ``RuntimeError``
    with the status and the start of the body (vLLM's error message)."""
    req = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return dict(json.loads(r.read()))
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")[:2000]
        raise RuntimeError(f"POST {url}: HTTP {exc.code}: {body}") from None


def served_model(base_url: str, timeout: float = 10.0) -> str:
    """The model name the server answers to (``/v1/models``)."""
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=timeout) as r:
        data = json.loads(r.read())
    return str(data["data"][0]["id"])


def _greedy_payload(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }


@dataclass(frozen=True)
class Completion:
    """One greedy completion: the generated token ids and text."""

    token_ids: list[int]
    text: str


def completion_response(
    base_url: str,
    prompt: str,
    max_tokens: int = 32,
    *,
    model: str | None = None,
    timeout: float = 600.0,
    return_token_ids: bool = True,
) -> dict[str, Any]:
    """The server's whole JSON answer to one greedy completion request (choices, usage)
    (``model``: asked from the server if None)."""
    payload = {
        **_greedy_payload(model or served_model(base_url), prompt, max_tokens),
        "return_token_ids": return_token_ids,
    }
    return post_json(f"{base_url}/v1/completions", payload, timeout)


def complete(
    base_url: str,
    prompt: str,
    max_tokens: int = 32,
    *,
    model: str | None = None,
    timeout: float = 600.0,
) -> Completion:
    """One greedy completion of ``prompt``: its token ids and text."""
    answer = completion_response(base_url, prompt, max_tokens, model=model, timeout=timeout)
    choice = answer["choices"][0]
    return Completion(list(choice.get("token_ids") or []), str(choice.get("text", "")))


def complete_each(
    base_url: str,
    prompts: Sequence[str],
    max_tokens: int = 32,
    *,
    timeout: float = 600.0,
) -> tuple[list[list[int]], list[str]]:
    """Greedy completions, one request per prompt, each awaited: (token ids, texts).

    One prompt at a time keeps every batch identical on both servers. A single request
    holding all prompts would be batched by arrival timing, which can differ between two
    servers, and a different batch can change bf16 results (and thus greedy tokens).
    """
    model = served_model(base_url)
    done = [complete(base_url, p, max_tokens, model=model, timeout=timeout) for p in prompts]
    return [c.token_ids for c in done], [c.text for c in done]


@dataclass
class RequestResult:
    """Timing of one streamed completion (``afd bench``)."""

    ttft_s: float
    tpot_s: float | None
    latency_s: float
    output_tokens: int
    error: str | None = None


def stream_chunks(
    base_url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    *,
    timeout: float = 600.0,
    include_usage: bool = False,
) -> Iterator[dict[str, Any]]:
    """One streaming greedy completion: every server-sent event's JSON object, in order,
    until ``[DONE]`` (``include_usage``: the last one carries ``usage`` and no choice).
    Transport errors (a reset connection, a timeout) and HTTP errors raise as
    ``urllib`` raises them; an error the server sends in the stream is an object with
    an ``error`` key."""
    payload: dict[str, Any] = {**_greedy_payload(model, prompt, max_tokens), "stream": True}
    if include_usage:
        payload["stream_options"] = {"include_usage": True}
    req = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield dict(json.loads(data))


def stream_completion(
    base_url: str, model: str, prompt: str, max_tokens: int, timeout: float = 600.0
) -> RequestResult:
    """One streaming greedy completion (:func:`stream_chunks`); token timing from the
    server-sent events."""
    t0 = time.perf_counter()
    first = None
    chunks = 0
    usage_tokens = None
    try:
        for obj in stream_chunks(
            base_url, model, prompt, max_tokens, timeout=timeout, include_usage=True
        ):
            if obj.get("usage"):
                usage_tokens = obj["usage"].get("completion_tokens")
            if obj.get("choices") and obj["choices"][0].get("text") is not None:
                now = time.perf_counter()
                if obj["choices"][0].get("text") == "" and not obj["choices"][0].get(
                    "finish_reason"
                ):
                    continue
                first = first if first is not None else now
                chunks += 1
    except Exception as exc:
        end = time.perf_counter()
        return RequestResult(math.nan, None, end - t0, 0, f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    n = int(usage_tokens) if usage_tokens is not None else chunks
    if first is None:
        return RequestResult(math.nan, None, end - t0, n, "no tokens streamed")
    # TPOT as in vLLM's serving benchmark: (latency - TTFT) / (output tokens - 1).
    tpot = (end - first) / (n - 1) if n > 1 else None
    return RequestResult(first - t0, tpot, end - t0, n)
