"""Run one body per rank of a deployment, each in its own thread (in-process harnesses).

Shared by the in-process conformance harnesses (afd-core's loopback one, the CAM
connectors' fake-operator one): build each rank's connector, ``init()`` it, run the
body, close it; an exception is returned as that rank's result (the
``ConnectorHarness`` contract), a rank still running at the deadline gets an
:class:`~afd_core.errors.AFDTimeoutError` after every connector was closed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from afd_core.config import AFDRole
from afd_core.connector import AFDConnector
from afd_core.errors import AFDTimeoutError

__all__ = ["run_rank_threads"]

RankKey = tuple[AFDRole, int]


def run_rank_threads(
    ranks: Iterable[RankKey],
    make_connector: Callable[[RankKey], AFDConnector],
    body: Callable[[AFDConnector, AFDRole, int], Any],
    *,
    run_timeout_s: float,
    barrier_after_init: bool = False,
    thread_prefix: str = "afd",
) -> dict[tuple[str, int], Any]:
    """``{(role, rank): body's result or exception}`` for every rank of ``ranks``.

    ``make_connector`` runs in the rank's thread. ``barrier_after_init``: no body starts
    before every rank's ``init()`` returned (for connectors whose ``init()`` is not
    collective).
    """
    keys = list(ranks)
    results: dict[tuple[str, int], Any] = {}
    connectors: dict[RankKey, AFDConnector] = {}
    lock = threading.Lock()
    barrier = threading.Barrier(len(keys)) if barrier_after_init else None

    def worker(key: RankKey) -> None:
        role, rank = key
        conn: AFDConnector | None = None
        try:
            conn = make_connector(key)
            with lock:
                connectors[key] = conn
            conn.init()
            if barrier is not None:
                barrier.wait(timeout=run_timeout_s)
            value: Any = body(conn, role, rank)
        except BaseException as exc:  # returned, not raised (harness contract)
            if barrier is not None:
                barrier.abort()
            value = exc
        finally:
            if conn is not None:
                conn.close()
        results[(role.value, rank)] = value

    threads = [
        threading.Thread(
            target=worker, args=(key,), name=f"{thread_prefix}-{key[0].value}-{key[1]}", daemon=True
        )
        for key in keys
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + run_timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        with lock:
            stuck = list(connectors.values())
        for conn in stuck:
            conn.close()
        grace = time.monotonic() + 5.0
        for t in threads:
            t.join(max(0.0, grace - time.monotonic()))
    for role, rank in keys:
        results.setdefault(
            (role.value, rank),
            AFDTimeoutError(f"{role.value} rank {rank} did not finish within {run_timeout_s:g} s"),
        )
    return results
