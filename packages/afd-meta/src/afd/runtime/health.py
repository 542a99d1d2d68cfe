"""``GET /health`` and ``GET /metrics`` of a process that has no HTTP server of its own
(the FFN server), and the Prometheus multiprocess folder both roles need.

The AFD exchange runs in vLLM's worker processes, so its metrics are recorded with
prometheus_client's multiprocess mode (:mod:`afd_moe_runners.metrics`): each process
writes memory-mapped files into ``PROMETHEUS_MULTIPROC_DIR``, and the process that serves
``/metrics`` aggregates them. prometheus_client picks its mode when it is first imported,
so the folder must be in the environment before anything imports it: :func:`multiproc_dir`
is used by ``afd serve`` before vLLM is imported (FFN role) or before vLLM's API server
is started (Attention role, whose own ``/metrics`` then aggregates every process).

The status server is stdlib ``http.server`` (a ``ThreadingHTTPServer`` in a daemon
thread): no dependency, and a scrape never blocks the serving loop, which runs in another
thread (or process).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger("afd.runtime.health")

__all__ = [
    "MULTIPROC_DIR_ENV",
    "HealthCheck",
    "StatusServer",
    "gauge_total",
    "metrics_registry",
    "multiproc_dir",
]

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

HealthCheck = Callable[[], tuple[bool, str]]
"""``() -> (healthy, reason)``: 200 with the reason when healthy, else 503."""


@contextlib.contextmanager
def multiproc_dir(prefix: str, *, keep_given: bool) -> Iterator[str]:
    """Set ``PROMETHEUS_MULTIPROC_DIR`` to a fresh folder for the ``with`` block and
    remove it afterwards (stale files of an earlier run would be summed in).

    ``keep_given``: a folder already named by the environment is used as it is (and
    left in place); else it is replaced by a fresh one (the FFN server's metrics are its
    own, whatever an inherited variable meant for another server).
    """
    given = os.environ.get(MULTIPROC_DIR_ENV)
    if given and keep_given:
        yield given
        return
    path = tempfile.mkdtemp(prefix=prefix)
    os.environ[MULTIPROC_DIR_ENV] = path
    values = sys.modules.get("prometheus_client.values")
    value_class = None if values is None else values.ValueClass
    if values is not None:
        # Imported before the variable was set: metrics made from now on must still
        # write to the folder (prometheus_client picks the value class at import).
        values.ValueClass = values.get_value_class()
    try:
        yield path
    finally:
        if given is None:
            os.environ.pop(MULTIPROC_DIR_ENV, None)
        else:
            os.environ[MULTIPROC_DIR_ENV] = given
        if values is not None:
            values.ValueClass = value_class
        shutil.rmtree(path, ignore_errors=True)


def metrics_registry() -> Any:
    """The registry to expose: every process's values when ``PROMETHEUS_MULTIPROC_DIR``
    is set (as vLLM's ``/metrics`` does), else this process's global registry."""
    from prometheus_client import REGISTRY, CollectorRegistry, multiprocess

    if os.environ.get(MULTIPROC_DIR_ENV):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return registry
    return REGISTRY


def gauge_total(registry: Any, name: str) -> float:
    """The sum of the samples of gauge ``name`` in ``registry`` (0 when it has none)."""
    total = 0.0
    for family in registry.collect():
        if family.name == name:
            total += sum(s.value for s in family.samples if s.name == name)
    return total


class StatusServer:
    """``GET /health`` (200 or 503 with a one-line reason) and ``GET /metrics``
    (Prometheus text format) on ``host:port`` (port 0: one picked by the OS, see
    :attr:`port`), served from a daemon thread until :meth:`close`. ``registry``:
    what ``/metrics`` exposes (default: :func:`metrics_registry`)."""

    def __init__(self, host: str, port: int, health: HealthCheck, registry: Any = None) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if registry is None:
            registry = metrics_registry()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0].rstrip("/")
                if path == "/health":
                    try:
                        ok, reason = health()
                    except Exception as exc:  # a broken check is unhealthy, not a 500
                        ok, reason = False, f"health check failed: {exc}"
                    self._reply(200 if ok else 503, (reason + "\n").encode(), "text/plain")
                elif path == "/metrics":
                    self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                else:
                    self._reply(404, b"not found: try /health or /metrics\n", "text/plain")

            def _reply(self, code: int, body: bytes, content_type: str) -> None:
                # A prober that gave up (its timeout passed on a busy host) has closed
                # the connection: nothing to answer, and no traceback for the log.
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.send_response(code)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # a scrape every few seconds would flood the server's log

        try:
            self._httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise OSError(f"cannot serve /health and /metrics on {host}:{port}: {exc}") from exc
        self._httpd.daemon_threads = True
        self.host = host
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="afd-status-http", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
