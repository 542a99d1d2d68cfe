"""Failure behaviour and limits of the gloo and shared-memory connectors with real processes.

Scenarios both connectors share run over both (``harness`` is parametrised by
connector); the rest name the one connector they are about.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from afd_connectors_gpu.shm import P2pShmAFDConnector
from afd_connectors_gpu.testing import ProcessHarness, free_port
from afd_core.config import AFDConfig
from afd_core.errors import (
    AFDConnectorClosedError,
    AFDPeerLostError,
    AFDTimeoutError,
    AFDTransferMismatchError,
)
from afd_core.topology import AFDTopology

# Rank bodies must be importable by name in the spawned processes, which inherit sys.path.
sys.path.insert(0, str(Path(__file__).parent))
import connectors_gpu_rank_bodies as _bodies

GLOO = "P2pGlooAFDConnector"
SHM = "P2pShmAFDConnector"
only_shm = pytest.mark.parametrize("harness", [SHM], indirect=True)


@pytest.fixture(scope="module")
def harnesses() -> Iterator[Callable[[str], ProcessHarness]]:
    """One harness per connector for the whole module, started on first use."""
    with ExitStack() as stack:
        started: dict[str, ProcessHarness] = {}

        def get(name: str) -> ProcessHarness:
            if name not in started:
                started[name] = stack.enter_context(ProcessHarness(name, run_timeout_s=60.0))
            return started[name]

        yield get


@pytest.fixture(params=[GLOO, SHM])
def harness(request: pytest.FixtureRequest, harnesses) -> ProcessHarness:
    return harnesses(request.param)


def _leftover_segments(pids: dict[tuple[str, int], int]) -> list[str]:
    """Shared-memory segments of these processes still in /dev/shm (none for gloo)."""
    if not os.path.isdir("/dev/shm"):
        return []
    wanted = {f"afd-shm-{pid}-" for pid in pids.values()}
    return [n for n in os.listdir("/dev/shm") if any(n.startswith(w) for w in wanted)]


def test_sigkilled_ffn_makes_waiting_attention_raise_peer_lost_within_10s(
    harness: ProcessHarness,
) -> None:
    results = harness.run_ranks(AFDTopology(1, 1), _bodies.ffn_dies_mid_exchange)
    attention = results[("attention", 0)]
    assert not isinstance(attention, BaseException), attention
    assert attention["first_ok"]
    assert isinstance(attention["error"], AFDPeerLostError), attention["error"]
    assert "ffn rank 0" in str(attention["error"])
    assert attention["error"].goodbye is False  # it vanished, it did not close
    assert attention["elapsed"] < 10.0
    assert isinstance(results[("ffn", 0)], AFDPeerLostError)  # the harness saw it die


@only_shm
def test_sigkilled_attention_makes_waiting_ffn_raise_peer_lost_within_10s(
    harness: ProcessHarness,
) -> None:
    results = harness.run_ranks(AFDTopology(1, 1), _bodies.attention_dies_mid_exchange)
    ffn = results[("ffn", 0)]
    assert not isinstance(ffn, BaseException), ffn
    assert isinstance(ffn["error"], AFDPeerLostError), ffn["error"]
    assert "attention rank 0" in str(ffn["error"])
    assert ffn["error"].goodbye is False
    assert ffn["elapsed"] < 10.0


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
    assert _leftover_segments(harness.pids()) == []


def test_graceful_attention_close_tells_ffn_which_rank_left(harness: ProcessHarness) -> None:
    results = harness.run_ranks(AFDTopology(1, 1), _bodies.attention_closes_gracefully)
    ffn = results[("ffn", 0)]
    assert isinstance(ffn["error"], AFDPeerLostError), ffn
    assert "attention rank 0" in str(ffn["error"]) and "closed" in str(ffn["error"])
    assert ffn["error"].goodbye is True  # a stopped deployment, not a lost peer
    assert ffn["elapsed"] < 5.0


def test_bfloat16_hidden_states_survive_bit_exact(harness: ProcessHarness) -> None:
    results = harness.run_ranks(AFDTopology(1, 1), _bodies.bf16_round_trip)
    assert results[("attention", 0)] is True
    assert _leftover_segments(harness.pids()) == []


@only_shm
def test_more_messages_in_flight_than_slots(harness: ProcessHarness) -> None:
    results = harness.run_ranks(
        AFDTopology(1, 1),
        _bodies.many_layers_in_flight,
        {"connector_extra_config": {"num_slots": 2}},
    )
    assert results[("attention", 0)] is True, results
    assert results[("ffn", 0)] is None, results


@only_shm
def test_message_larger_than_a_slot_is_refused(harness: ProcessHarness) -> None:
    results = harness.run_ranks(
        AFDTopology(1, 1),
        _bodies.oversized_message_then_normal,
        {"connector_extra_config": {"slot_bytes": 4096}},
    )
    attention = results[("attention", 0)]
    assert not isinstance(attention, BaseException), attention
    assert isinstance(attention["refused"], AFDTransferMismatchError)
    assert "slot_bytes" in str(attention["refused"])
    assert attention["ok"]


def test_harness_deadline_kills_a_hung_run() -> None:
    with ProcessHarness(GLOO, run_timeout_s=3.0) as h:
        results = h.run_ranks(AFDTopology(1, 1), _bodies.hang_forever)
        pids = h.pids()
    assert pids == {}  # the process set was torn down
    assert all(type(v).__name__ == "AFDTimeoutError" for v in results.values()), results


def test_shm_connect_timeout_names_the_missing_peer() -> None:
    config = AFDConfig(
        role="attention",
        connector=SHM,
        port=free_port(),
        num_ffn_ranks=2,
        connect_timeout_s=1.0,
    )
    conn = P2pShmAFDConnector(config, rank=0)
    with pytest.raises(AFDTimeoutError, match=r"still missing: ffn rank 0, ffn rank 1 of 1A2F"):
        conn.init()
    conn.close()


def test_shm_close_unblocks_a_receive_in_the_same_process_and_is_idempotent() -> None:
    """1A1F in two threads of this process: close() on the FFN side while it waits."""
    port = free_port()
    common = {"connector": SHM, "port": port, "connect_timeout_s": 20.0}
    att = P2pShmAFDConnector(AFDConfig(role="attention", **common), rank=0)
    ffn = P2pShmAFDConnector(AFDConfig(role="ffn", **common), rank=0)
    t = threading.Thread(target=att.init)
    t.start()
    ffn.init()
    t.join()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            ffn.recv_from_attention(timeout_s=30.0)
        except BaseException as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    threading.Event().wait(0.2)
    ffn.close()
    waiter.join(2.0)
    assert not waiter.is_alive()
    assert isinstance(errors[0], AFDConnectorClosedError), errors
    ffn.close()
    att.close()
    att.close()
    assert not att.is_initialized and not ffn.is_initialized
