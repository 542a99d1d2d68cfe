"""The conformance suite over NCCL (one spawned process per rank, one GPU per rank)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from afd_connectors_gpu.testing import ProcessHarness

torch = pytest.importorskip("torch")
conformance = pytest.importorskip("afd_core.testing.conformance")

CASES = [
    pytest.param(s, t, id=f"{s.name}-{t.label}")
    for t in conformance.TOPOLOGIES
    for s in conformance.SCENARIOS
]


@pytest.fixture(scope="module")
def nccl_harness() -> Iterator[ProcessHarness]:
    if not torch.cuda.is_available():
        pytest.skip("requires CUDA (torch.cuda.is_available() is False)")
    with ProcessHarness("P2pNcclAFDConnector", run_timeout_s=120.0, device_per_rank=True) as h:
        yield h


@pytest.mark.gpu
@pytest.mark.parametrize(("scenario", "topology"), CASES)
def test_nccl_connector_conforms(nccl_harness: ProcessHarness, scenario, topology) -> None:
    needed = topology.world_size
    if torch.cuda.device_count() < needed:
        pytest.skip(
            f"requires {needed} CUDA devices for {topology.label} (NCCL needs one device per "
            f"rank), found {torch.cuda.device_count()}"
        )
    conformance.run_scenario(nccl_harness, scenario, topology)
