"""``afd bench``'s load generator: one concurrency level of streaming greedy requests
(:func:`afd.tools.client.stream_completion`) and its summary statistics."""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from afd.tools.client import RequestResult, served_model, stream_completion

__all__ = ["percentile", "run_level"]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_level(
    base_url: str,
    prompts: Sequence[str],
    concurrency: int,
    num_requests: int,
    output_len: int,
    *,
    on_done: Any = None,
) -> dict[str, Any]:
    """``num_requests`` streaming requests, ``concurrency`` at a time; summary stats."""
    model = served_model(base_url)
    results: list[RequestResult] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        r = stream_completion(base_url, model, prompts[i % len(prompts)], output_len)
        with lock:
            results.append(r)
        if on_done is not None:
            on_done()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(one, range(num_requests)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    ms = 1000.0
    return {
        "concurrency": concurrency,
        "requests": num_requests,
        "completed": len(ok),
        "errors": errors[:5],
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "output_tok_s": round(tokens / wall, 2) if wall > 0 else 0.0,
        "ttft_ms": {
            "median": _r(statistics.median(ttft) * ms if ttft else math.nan),
            "p99": _r(percentile(ttft, 99) * ms),
        },
        "tpot_ms": {
            "median": _r(statistics.median(tpot) * ms if tpot else math.nan),
            "p99": _r(percentile(tpot, 99) * ms),
        },
        "per_request": [asdict(r) for r in results],
    }


def _r(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 2)
