"""How the NCCL connector fails, with fakes at the NCCL boundary (no GPU here).

``FakeNcclWork`` / ``FakeNcclGroup`` stand in for torch's NCCL work objects and process
groups; everything else is the real connector. The error text is the one torch 2.11 /
NCCL 2.28 raised on an H200 when two ranks shared a GPU (recorded by tools/gpu_check.py).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from afd_connectors_gpu.p2p import P2pNcclAFDConnector
from afd_connectors_gpu.rendezvous import A2F, F2A, DataPlaneGroup
from afd_core.config import AFDConfig
from afd_core.errors import AFDPeerLostError, AFDTimeoutError
from afd_core.exchange import TransferContext

NCCL_DUPLICATE_GPU = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, invalid usage "
    "(run with NCCL_DEBUG=WARN for details), NCCL version 2.28.9\n"
    "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
    "Last error:\n"
    "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 60"
)


class FakeNcclWork:
    """A fake NCCL work: never completes, or raises ``error`` on wait()."""

    def __init__(self, error: str | None = None) -> None:
        self.error = error

    def is_completed(self) -> bool:
        return self.error is not None

    def wait(self, *args: Any) -> None:
        if self.error is not None:
            raise RuntimeError(self.error)


class FakeNcclGroup:
    """A fake NCCL process group that records abort()."""

    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


def _connector(timeout: float = 0.3) -> tuple[P2pNcclAFDConnector, dict[str, FakeNcclGroup]]:
    config = AFDConfig(
        role="ffn",
        connector="P2pNcclAFDConnector",
        num_attention_ranks=1,
        num_ffn_ranks=1,
        transfer_timeout_s=timeout,
    )
    conn = P2pNcclAFDConnector(config, rank=0)
    fakes = {A2F: FakeNcclGroup(), F2A: FakeNcclGroup()}
    conn.transport._group = DataPlaneGroup(store=None, gloo=None, nccl=dict(fakes))
    return conn, fakes


def test_an_nccl_error_aborts_both_communicators_and_gives_nccls_reason() -> None:
    conn, fakes = _connector()
    deadline = time.monotonic() + 5
    with pytest.raises(AFDPeerLostError) as err:
        conn.transport._wait_data(
            FakeNcclWork(NCCL_DUPLICATE_GPU),
            TransferContext(conn, 0, deadline, 5.0, "receiving from"),
        )
    text = str(err.value)
    assert "NCCL failed while receiving from attention rank 0" in text
    assert "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 60" in text
    assert "is gone" not in text
    assert all(g.aborted for g in fakes.values())
    with pytest.raises(AFDPeerLostError, match="create a new connector"):
        conn._check_peer(0)


def test_a_late_nccl_operation_times_out_and_aborts_the_communicators() -> None:
    conn, fakes = _connector(timeout=0.3)
    start = time.monotonic()
    with pytest.raises(AFDTimeoutError, match="NCCL communicators were aborted"):
        conn.transport._wait_data(
            FakeNcclWork(), TransferContext(conn, 0, start + 0.3, 0.3, "receiving from")
        )
    assert 0.25 <= time.monotonic() - start < 2.0
    assert all(g.aborted for g in fakes.values())


def test_a_dead_peer_seen_by_the_watcher_ends_an_nccl_wait() -> None:
    conn, fakes = _connector(timeout=30.0)
    conn.transport._lost[0] = "Connection closed by peer"
    start = time.monotonic()
    with pytest.raises(AFDPeerLostError, match="Connection closed by peer"):
        conn.transport._wait_data(
            FakeNcclWork(), TransferContext(conn, 0, start + 30, 30.0, "receiving from")
        )
    assert time.monotonic() - start < 1.0
    assert all(g.aborted for g in fakes.values())


def test_a_late_nccl_send_times_out_and_aborts_both_communicators_as_a_receive_does() -> None:
    import torch

    conn, fakes = _connector(timeout=0.3)
    answer = torch.ones(4, 8)
    _, key = conn.transport._stage(answer, 0, 0, 0)
    assert conn.transport._pool is not None
    conn.transport._pool.sent(key, FakeNcclWork())  # the NCCL send of that buffer never completes
    start = time.monotonic()
    # The next answer in the same buffer must first settle the send that read it.
    with pytest.raises(AFDTimeoutError, match="NCCL communicators were aborted") as err:
        conn.transport._stage(answer, 0, 0, 0)
    assert "sending to attention rank 0" in str(err.value)
    assert 0.25 <= time.monotonic() - start < 2.0
    assert all(g.aborted for g in fakes.values())


class FakeNcclPairGroup(FakeNcclGroup):
    """A fake NCCL process group of one direction that records its point-to-point
    operations; their works complete at once (or never, for ``silent`` peers)."""

    def __init__(self, name: str, log: list[tuple[str, str, int]], silent: set[int]) -> None:
        super().__init__()
        self.name, self.log, self.silent = name, log, silent

    def _op(self, op: str, peer: int) -> FakeNcclWork:
        self.log.append((self.name, op, peer))
        return FakeNcclWork() if peer in self.silent else _DoneWork()

    def send(self, tensors: Any, peer: int, tag: int) -> FakeNcclWork:
        return self._op("send", peer)

    def recv(self, tensors: Any, peer: int, tag: int) -> FakeNcclWork:
        return self._op("recv", peer)


class _DoneWork(FakeNcclWork):
    def is_completed(self) -> bool:
        return True


def _warm_connector(
    role: str,
    rank: int,
    silent: set[int] = frozenset(),  # type: ignore[assignment]
) -> tuple[P2pNcclAFDConnector, list[tuple[str, str, int]], dict[str, FakeNcclPairGroup]]:
    config = AFDConfig(
        role=role,
        connector="P2pNcclAFDConnector",
        num_attention_ranks=2,
        num_ffn_ranks=1,
        transfer_timeout_s=0.3,
    )
    conn = P2pNcclAFDConnector(config, rank=rank)
    log: list[tuple[str, str, int]] = []
    fakes = {d: FakeNcclPairGroup(d, log, set(silent)) for d in (A2F, F2A)}
    conn.transport._group = DataPlaneGroup(store=None, gloo=None, nccl=dict(fakes))
    return conn, log, fakes


@pytest.mark.parametrize(("role", "rank"), [("attention", 0), ("attention", 1), ("ffn", 0)])
def test_init_sets_up_every_pairs_communicators_in_one_global_order(role: str, rank: int) -> None:
    """Each (peer, direction) pair exchanges one message in init(), A->F before F->A, in
    ascending (attention rank, FFN rank) order on every rank, so no two ranks can wait
    for each other's communicator set-up in opposite orders."""
    conn, log, _ = _warm_connector(role, rank)  # 2 attention ranks, 1 FFN rank
    conn.transport._warm_up_communicators()
    me = rank if role == "attention" else 2 + rank
    peers = [2] if role == "attention" else [0, 1]
    send, recv = ("send", "recv") if role == "attention" else ("recv", "send")
    assert log == [op for p in peers for op in ((A2F, send, p), (F2A, recv, p))]
    keys = [(min(me, p), max(me, p), d) for d, _, p in log]
    assert keys == sorted(keys)


def test_a_peer_that_never_answers_the_warm_up_fails_init_and_aborts_nccl() -> None:
    conn, log, fakes = _warm_connector("ffn", 0, silent={1})
    start = time.monotonic()
    with pytest.raises(AFDTimeoutError, match="receiving from attention rank 1"):
        conn.transport._warm_up_communicators()
    assert time.monotonic() - start < 5
    assert all(f.aborted for f in fakes.values())
    assert log[-1] == (A2F, "recv", 1)
