"""Failure behaviour of the gloo connector with real processes."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from afd_connectors_gpu.testing import ProcessHarness
from afd_core.errors import AFDConnectorClosedError, AFDPeerLostError
from afd_core.topology import AFDTopology

# Rank bodies must be importable by name in the spawned processes, which inherit sys.path.
sys.path.insert(0, str(Path(__file__).parent))
import connectors_gpu_rank_bodies as _bodies


@pytest.fixture(scope="module")
def harness() -> Iterator[ProcessHarness]:
    with ProcessHarness("P2pGlooAFDConnector", run_timeout_s=60.0) as h:
        yield h


def test_sigkilled_ffn_makes_waiting_attention_raise_peer_lost_within_10s(
    harness: ProcessHarness,
) -> None:
    results = harness.run_ranks(AFDTopology(1, 1), _bodies.ffn_dies_mid_exchange)
    attention = results[("attention", 0)]
    assert not isinstance(attention, BaseException), attention
    assert attention["first_ok"]
    assert isinstance(attention["error"], AFDPeerLostError), attention["error"]
    assert "ffn rank 0" in str(attention["error"])
    assert attention["elapsed"] < 10.0
    assert isinstance(results[("ffn", 0)], AFDPeerLostError)  # the harness saw it die


@pytest.mark.parametrize("topology", [AFDTopology(1, 1), AFDTopology(3, 2)], ids=["1A1F", "3A2F"])
def test_close_from_another_thread_unblocks_receiver_within_2s(
    harness: ProcessHarness, topology: AFDTopology
) -> None:
    results = harness.run_ranks(topology, _bodies.close_from_other_thread)
    for key, got in results.items():
        assert not isinstance(got, BaseException), (key, got)
        if got is None:
            continue
        assert isinstance(got["error"], AFDConnectorClosedError | AFDPeerLostError), (key, got)
        assert got["elapsed"] < 0.5 + 2.0, (key, got)
        assert got["close_s"] < 2.0, (key, got)
        assert isinstance(got["after_close"], AFDConnectorClosedError), (key, got)


def test_graceful_attention_close_tells_ffn_which_rank_left(harness: ProcessHarness) -> None:
    results = harness.run_ranks(AFDTopology(1, 1), _bodies.attention_closes_gracefully)
    ffn = results[("ffn", 0)]
    assert isinstance(ffn["error"], AFDPeerLostError), ffn
    assert "attention rank 0" in str(ffn["error"]) and "closed" in str(ffn["error"])
    assert ffn["elapsed"] < 5.0


def test_bfloat16_hidden_states_survive_gloo_bit_exact(harness: ProcessHarness) -> None:
    results = harness.run_ranks(AFDTopology(1, 1), _bodies.bf16_round_trip)
    assert results[("attention", 0)] is True


def test_harness_deadline_kills_a_hung_run() -> None:
    with ProcessHarness("P2pGlooAFDConnector", run_timeout_s=3.0) as h:
        results = h.run_ranks(AFDTopology(1, 1), _bodies.hang_forever)
        pids = h.pids()
    assert pids == {}  # the process set was torn down
    assert all(type(v).__name__ == "AFDTimeoutError" for v in results.values()), results
