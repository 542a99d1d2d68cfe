"""The afd-core conformance suite over the shared-memory connector, one process per rank."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from afd_connectors_gpu.testing import ProcessHarness

conformance = pytest.importorskip("afd_core.testing.conformance")

# Topology-major order: one process set per topology, reused by consecutive cases.
CASES = [
    pytest.param(s, t, id=f"{s.name}-{t.label}")
    for t in conformance.TOPOLOGIES
    for s in conformance.SCENARIOS
]


@pytest.fixture(scope="module")
def harness() -> Iterator[ProcessHarness]:
    with ProcessHarness("P2pShmAFDConnector", run_timeout_s=60.0) as h:
        yield h


@pytest.mark.parametrize(("scenario", "topology"), CASES)
def test_shm_connector_conforms(harness: ProcessHarness, scenario, topology) -> None:
    conformance.run_scenario(harness, scenario, topology)
