"""The afd-core conformance suite over every connector, one spawned process per rank.

gloo and shared memory run on any machine; NCCL is ``@pytest.mark.gpu`` and skipped
without CUDA or with fewer CUDA devices than the topology has ranks. ``gloo-pool`` is
the gloo connector moving tensors through the NCCL connector's per-peer buffer pool
(``buffer_pool``): every code path of the NCCL connector but NCCL itself, on the
topologies where one FFN rank serves several attention ranks (buffers per peer).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from afd_connectors_gpu.testing import ProcessHarness

conformance = pytest.importorskip("afd_core.testing.conformance")

# connector id -> (connector name, ProcessHarness keyword arguments, marks)
CONNECTORS: dict[str, tuple[str, dict[str, Any], tuple[Any, ...]]] = {
    "gloo": ("P2pGlooAFDConnector", {"run_timeout_s": 60.0}, ()),
    "gloo-pool": (
        "P2pGlooAFDConnector",
        {
            "run_timeout_s": 60.0,
            "config": {"connector_extra_config": {"buffer_pool": True, "max_num_tokens": 64}},
        },
        (),
    ),
    "shm": ("P2pShmAFDConnector", {"run_timeout_s": 60.0}, ()),
    "nccl": (
        "P2pNcclAFDConnector",
        {"run_timeout_s": 120.0, "device_per_rank": True},
        (pytest.mark.gpu,),
    ),
}

# Connector-major, then topology-major order: the harness keeps one process set per
# topology alive across consecutive cases, so each topology pays the start-up once.
# connector id -> topology labels it runs on (default: every topology of the suite)
TOPOLOGY_FILTER = {"gloo-pool": {"2A1F", "3A2F"}}

# connector id -> topologies of the default run; the others run in `nox -s tests-matrix`
# (CI runs both). 2A1F (fan-in, per-peer split) for every CPU connector, and 1A1F for the
# shared-memory connector that same-host deployments use by default.
DEFAULT_TOPOLOGIES = {"gloo": {"2A1F"}, "gloo-pool": {"2A1F"}, "shm": {"1A1F", "2A1F"}}


def _marks(connector: str, topology: str) -> tuple[Any, ...]:
    marks = CONNECTORS[connector][2]
    default = DEFAULT_TOPOLOGIES.get(connector)
    if default is not None and topology not in default:
        marks = (*marks, pytest.mark.matrix)
    return marks


CASES = [
    pytest.param(c, s, t, id=f"{c}-{s.name}-{t.label}", marks=_marks(c, t.label))
    for c in CONNECTORS
    for t in conformance.TOPOLOGIES
    if t.label in TOPOLOGY_FILTER.get(c, {t.label})
    for s in conformance.SCENARIOS
]


@pytest.fixture(scope="module")
def harnesses() -> Iterator[dict[str, ProcessHarness]]:
    """One harness per connector id for the whole module, so consecutive cases of one
    (connector, topology) reuse its process set (a module-scoped fixture parametrized
    per case would be set up and torn down for every case: a spawn per case)."""
    made: dict[str, ProcessHarness] = {}
    try:
        yield made
    finally:
        for h in made.values():
            h.close()


def _harness(harnesses: dict[str, ProcessHarness], connector: str) -> ProcessHarness:
    if connector == "nccl":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            need = ", ".join(f"{t.label} {t.world_size}" for t in conformance.TOPOLOGIES)
            pytest.skip(
                "requires CUDA (torch.cuda.is_available() is False); NCCL needs one CUDA "
                f"device per rank: {need}"
            )
    if connector not in harnesses:
        # one live process set at a time: the previous connector's is done
        for other in harnesses.values():
            other.close()
        name, kwargs, _ = CONNECTORS[connector]
        harnesses[connector] = ProcessHarness(name, **kwargs)
    return harnesses[connector]


@pytest.mark.parametrize(("connector", "scenario", "topology"), CASES)
def test_connector_conforms(
    harnesses: dict[str, ProcessHarness], connector: str, scenario, topology
) -> None:
    harness = _harness(harnesses, connector)
    if harness.device_per_rank:  # NCCL: _harness checked that torch has CUDA
        import torch

        needed = topology.world_size
        if torch.cuda.device_count() < needed:
            pytest.skip(
                f"requires {needed} CUDA devices for {topology.label} (NCCL needs one device "
                f"per rank), found {torch.cuda.device_count()}"
            )
    conformance.run_scenario(harness, scenario, topology)
