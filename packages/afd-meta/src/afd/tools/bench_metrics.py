"""The AFD counters of every role of a deployment over one bench level.

``afd bench`` reads each role's Prometheus endpoint before and after a concurrency
level (FFN ranks: their health server's ``/metrics``; the Attention role: vLLM's API
server's ``/metrics``, which carries the attention ranks' AFD metrics) and reports
the difference per rank: tokens, layers and bytes each FFN rank received and sent, its
compute time, and each attention rank's bytes and time spent waiting for the FFN side.
Under FFN expert parallelism the FFN ranks' token counts show the dispatch (each rank
gets the tokens routed to its experts).
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["delta", "format_level", "scrape"]

#: Per FFN rank: (report key, Prometheus sample name).
FFN_SAMPLES = (
    ("tokens", "afd_ffn_tokens_served_total"),
    ("layers", "afd_ffn_layers_served_total"),
    ("received_bytes", "afd_ffn_received_bytes_total"),
    ("sent_bytes", "afd_ffn_sent_bytes_total"),
    ("compute_s", "afd_ffn_compute_seconds_sum"),
)
#: Per attention rank.
ATTENTION_SAMPLES = (
    ("sent_bytes", "afd_attention_sent_bytes_total"),
    ("received_bytes", "afd_attention_received_bytes_total"),
    ("ffn_wait_s", "afd_attention_ffn_wait_seconds_sum"),
)


#: ``(sample name, sorted label pairs) -> value`` of one ``/metrics`` page.
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def metric_samples(url: str) -> Samples:
    """``GET url/metrics`` parsed with prometheus_client's parser; empty if it fails."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            body = r.read().decode()
    except OSError:
        return {}
    return {
        (s.name, tuple(sorted(s.labels.items()))): float(s.value)
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def settled(
    scrape: Callable[[], Samples], *, quiet_s: float = 0.3, timeout_s: float = 15.0
) -> Samples:
    """``scrape()`` once two calls ``quiet_s`` apart agree (a role writes a step's or a
    layer's counters one after another, just after it answered), or the last one after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = scrape()
    while True:
        time.sleep(quiet_s)
        now = scrape()
        if now == last or time.monotonic() > deadline:
            return now
        last = now


def _samples(url: str) -> dict[tuple[str, str], float]:
    """(sample name, rank label) -> value of ``GET url/metrics``; empty if it fails."""
    return {
        (name, dict(labels).get("rank", "")): value
        for (name, labels), value in metric_samples(url).items()
    }


def scrape(roles: Iterable[Any]) -> dict[str, dict[str, float]]:
    """``{"ffn<r>" | "attention<r>": {key: value}}`` over a deployment's role processes
    (``afd.launch`` RoleProcess: ``role``, ``health_url``, ``http_url``)."""
    out: dict[str, dict[str, float]] = {}
    for role in roles:
        kind = str(getattr(role.role, "value", role.role))
        if kind == "ffn" and role.health_url:
            samples, table, prefix = _samples(role.health_url), FFN_SAMPLES, "ffn"
        elif kind == "attention" and role.http_url:
            samples, table, prefix = _samples(role.http_url), ATTENTION_SAMPLES, "attention"
        else:
            continue
        ranks = sorted({rank for (name, rank) in samples if name == table[0][1]})
        for rank in ranks:
            out[f"{prefix}{rank}"] = {key: samples.get((name, rank), 0.0) for key, name in table}
    return out


def delta(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """``after - before`` per rank and key (ranks seen after only count from zero)."""
    return {
        rank: {
            key: round(value - before.get(rank, {}).get(key, 0.0), 6)
            for key, value in values.items()
        }
        for rank, values in sorted(after.items())
    }


def format_level(level: dict[str, dict[str, float]]) -> str:
    """One line: FFN ranks' tokens and compute, attention ranks' wait."""
    parts = []
    for rank, v in level.items():
        if rank.startswith("ffn"):
            parts.append(
                f"{rank} {v['tokens']:.0f} tok {v['received_bytes'] / 2**20:.1f} MiB in, "
                f"compute {v['compute_s']:.2f} s"
            )
        else:
            parts.append(f"{rank} waited {v['ffn_wait_s']:.2f} s for the FFN side")
    return "; ".join(parts)
