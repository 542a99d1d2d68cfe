"""Fixtures: CAM connectors of one deployment over a fresh fake fabric, initialised together."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from afd_connectors_npu.exchange import CAMConnector
from afd_connectors_npu.testing import FakeCAMFabric
from afd_core.config import AFDConfig, AFDRole
from afd_core.topology import AFDTopology

Ranks = dict[tuple[str, int], CAMConnector]


def _init_all(
    connectors: list[CAMConnector], timeout_s: float = 10.0
) -> list[BaseException | None]:
    """Run the collective ``init()`` of every connector concurrently; the errors, in order."""
    errors: list[BaseException | None] = [None] * len(connectors)

    def run(i: int, conn: CAMConnector) -> None:
        try:
            conn.init()
        except BaseException as exc:
            errors[i] = exc

    threads = [
        threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(connectors)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "init() hung"
    return errors


@pytest.fixture
def init_all() -> Callable[..., list[BaseException | None]]:
    """Run the collective ``init()`` of several connectors concurrently; returns the errors."""
    return _init_all


@pytest.fixture
def cam_deployment() -> Iterator[Callable[..., tuple[FakeCAMFabric, Ranks]]]:
    """``make(cls, topology, overrides_by_role=None, **common)`` -> (fabric, initialised ranks)."""
    made: list[CAMConnector] = []

    def make(
        cls: type[CAMConnector],
        topology: AFDTopology | None = None,
        per_role: dict[str, dict[str, Any]] | None = None,
        *,
        fabric: FakeCAMFabric | None = None,
        **common: Any,
    ) -> tuple[FakeCAMFabric, Ranks]:
        fabric = fabric or FakeCAMFabric()
        topology = topology or AFDTopology(1, 1)
        ranks: Ranks = {}
        for role in AFDRole:
            for rank in range(topology.size_of(role)):
                values = {
                    "role": role,
                    "connector": cls.name,
                    "num_attention_ranks": topology.num_attention_ranks,
                    "num_ffn_ranks": topology.num_ffn_ranks,
                    "connect_timeout_s": 5.0,
                    "transfer_timeout_s": 5.0,
                    **common,
                    **(per_role or {}).get(role.value, {}),
                }
                conn = cls(AFDConfig(**values), rank=rank, ops_factory=fabric.ops_factory)
                ranks[(role.value, rank)] = conn
                made.append(conn)
        errors = _init_all(list(ranks.values()))
        failed = [e for e in errors if e is not None]
        if failed:
            raise failed[0]
        return fabric, ranks

    yield make
    for conn in made:
        conn.close()
