"""``afd bench``'s per-role AFD counters: read from each role's real Prometheus
endpoint format (an HTTP server here serving what afd's metric families export), the
difference over a level per rank."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from afd.tools.bench_metrics import delta, format_level, scrape


class _Served:
    """An HTTP server whose ``GET /metrics`` answers ``self.text``."""

    def __init__(self) -> None:
        self.text = ""
        served = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = served.text.encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def served() -> Iterator[tuple[_Served, _Served]]:
    ffn, attn = _Served(), _Served()
    yield ffn, attn
    ffn.server.shutdown()
    attn.server.shutdown()


def _exported(kind: str, ranks: dict[str, float]) -> str:
    """What afd's own metric families export for ``ranks`` (rank -> one value)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from afd_moe_runners.metrics import _attention_families, _ffn_families

    reg = CollectorRegistry()
    families = _ffn_families(reg) if kind == "ffn" else _attention_families(reg)
    for rank, value in ranks.items():
        for fam in families.values():
            # Families with labels beyond the rank (the per-micro-batch exchange count)
            # get one child, of micro-batch 0.
            extra = {name: "0" for name in fam._labelnames if name != "rank"}
            child = fam.labels(rank=rank, **extra)
            if hasattr(child, "inc"):
                child.inc(value)
            elif hasattr(child, "observe"):
                child.observe(value)
    return generate_latest(reg).decode()


def test_counters_per_rank_over_a_level(served: tuple[_Served, _Served]) -> None:
    ffn, attn = served
    roles = [
        SimpleNamespace(role="attention", http_url=attn.url, health_url=attn.url),
        SimpleNamespace(role="ffn", http_url=None, health_url=ffn.url),
        SimpleNamespace(role="native", http_url=attn.url, health_url=attn.url),
    ]
    ffn.text = _exported("ffn", {"1": 10.0})
    attn.text = _exported("attention", {"0": 1.0, "1": 2.0})
    before = scrape(roles)
    assert sorted(before) == ["attention0", "attention1", "ffn1"]
    ffn.text = _exported("ffn", {"1": 25.0})
    attn.text = _exported("attention", {"0": 4.0, "1": 2.0})
    level = delta(before, scrape(roles))
    assert level["ffn1"]["tokens"] == 15.0 and level["ffn1"]["compute_s"] == 15.0
    assert level["attention0"]["ffn_wait_s"] == 3.0 and level["attention1"]["ffn_wait_s"] == 0.0
    line = format_level(level)
    assert "ffn1 15 tok" in line and "attention0 waited 3.00 s" in line


def test_a_role_that_does_not_answer_counts_nothing() -> None:
    roles = [SimpleNamespace(role="ffn", http_url=None, health_url="http://127.0.0.1:9")]
    assert scrape(roles) == {}
