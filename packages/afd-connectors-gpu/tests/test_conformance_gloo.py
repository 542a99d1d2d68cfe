"""The afd-core conformance suite over gloo, one spawned process per rank."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from afd_connectors_gpu.testing import ProcessHarness

conformance = pytest.importorskip("afd_core.testing.conformance")

# Topology-major order: the harness keeps one process set per topology alive across
# consecutive cases, so each topology pays the process start-up once.
CASES = [
    pytest.param(s, t, id=f"{s.name}-{t.label}")
    for t in conformance.TOPOLOGIES
    for s in conformance.SCENARIOS
]


@pytest.fixture(scope="module")
def harness() -> Iterator[ProcessHarness]:
    with ProcessHarness("P2pGlooAFDConnector", run_timeout_s=60.0) as h:
        yield h


@pytest.mark.parametrize(("scenario", "topology"), CASES)
def test_gloo_connector_conforms(harness: ProcessHarness, scenario, topology) -> None:
    conformance.run_scenario(harness, scenario, topology)
