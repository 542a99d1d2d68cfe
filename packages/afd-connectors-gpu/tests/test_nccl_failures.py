"""How the NCCL connector fails, with fakes at the NCCL boundary (no GPU here).

``FakeNcclWork`` / ``FakeNcclGroup`` stand in for torch's NCCL work objects and process
groups; everything else is the real connector. The error text is the one torch 2.11 /
NCCL 2.28 raised on an H200 when two ranks shared a GPU (recorded by tools/gpu_check.py).
"""

from __future__ import annotations

import threading
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


class FakeBlockingInitNcclGroup(FakeNcclPairGroup):
    """A fake NCCL process group whose first operation with a ``silent`` peer blocks in
    the call itself, as torch's lazy NCCL communicator set-up does while the peer never
    joins it (e.g. its process died after the gloo barrier). ``abort()`` ends the
    blocked set-up when ``abort_unblocks`` (NCCL's non-blocking init), else the call
    stays blocked (a blocking ``ncclCommInitRank``)."""

    def __init__(
        self, name: str, log: list[tuple[str, str, int]], silent: set[int], abort_unblocks: bool
    ) -> None:
        super().__init__(name, log, silent)
        self.abort_unblocks = abort_unblocks
        self.abort_called = threading.Event()
        self._released = threading.Event()
        self.blocked_calls = 0

    def _op(self, op: str, peer: int) -> FakeNcclWork:
        self.log.append((self.name, op, peer))
        if peer in self.silent:
            self.blocked_calls += 1
            self._released.wait(60)  # "inside NCCL's communicator set-up"
            raise RuntimeError("NCCL communicator was aborted on rank 0")
        return _DoneWork()

    def abort(self) -> None:
        super().abort()
        self.abort_called.set()
        if self.abort_unblocks:
            self._released.set()

    def release(self) -> None:
        self._released.set()


def _blocking_init_connector(
    abort_unblocks: bool, timeout: float = 0.5
) -> tuple[P2pNcclAFDConnector, dict[str, FakeBlockingInitNcclGroup]]:
    config = AFDConfig(
        role="attention",
        connector="P2pNcclAFDConnector",
        num_attention_ranks=1,
        num_ffn_ranks=1,
        transfer_timeout_s=timeout,
    )
    conn = P2pNcclAFDConnector(config, rank=0)
    log: list[tuple[str, str, int]] = []
    fakes = {d: FakeBlockingInitNcclGroup(d, log, {1}, abort_unblocks) for d in (A2F, F2A)}
    conn.transport._group = DataPlaneGroup(store=None, gloo=None, nccl=dict(fakes))
    return conn, fakes


def _warm_up_in_thread(conn: P2pNcclAFDConnector, limit: float) -> tuple[Any, float]:
    """Run the warm-up on a thread (so that the test fails instead of hanging when the
    warm-up is not bounded); returns (its exception, seconds it took)."""
    out: dict[str, Any] = {}

    def run() -> None:
        start = time.monotonic()
        try:
            conn.transport._warm_up_communicators()
        except BaseException as exc:
            out["error"] = exc
        out["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), (
        f"the warm-up is still blocked in NCCL's communicator set-up after {limit} s "
        "(transfer_timeout_s does not bound it)"
    )
    return out.get("error"), out["elapsed"]


@pytest.mark.parametrize("abort_unblocks", [True, False], ids=["nonblocking-init", "blocking-init"])
def test_an_nccl_set_up_blocked_on_a_dead_peer_times_out_and_aborts(abort_unblocks: bool) -> None:
    """The peer passed the gloo barrier and died: the first NCCL call of the pair blocks
    in the communicator set-up. init()'s warm-up must still fail within
    transfer_timeout_s (+ margin) with AFDTimeoutError and abort both communicators,
    whether or not the abort ends the blocked call."""
    conn, fakes = _blocking_init_connector(abort_unblocks, timeout=0.5)
    try:
        error, elapsed = _warm_up_in_thread(conn, limit=10.0)
        assert isinstance(error, AFDTimeoutError), error
        assert "sending to ffn rank 0" in str(error)
        assert "communicator set-up" in str(error) and "aborted" in str(error)
        assert 0.45 <= elapsed < 0.5 + 2.0
        assert all(f.abort_called.is_set() for f in fakes.values())
        assert fakes[A2F].blocked_calls == 1  # blocked in the first (A->F) call
        with pytest.raises(AFDPeerLostError, match="communicator set-up did not finish"):
            conn._check_peer(1)  # the peer is unusable now
    finally:
        for f in fakes.values():
            f.release()


def test_a_peer_seen_dead_during_the_nccl_set_up_fails_init_at_once() -> None:
    """The sentinel watcher sees the peer's process gone while the set-up is blocked:
    AFDPeerLostError well before transfer_timeout_s, communicators aborted."""
    conn, fakes = _blocking_init_connector(abort_unblocks=False, timeout=30.0)
    threading.Timer(0.2, lambda: conn.transport._lost.__setitem__(1, "Connection closed")).start()
    try:
        error, elapsed = _warm_up_in_thread(conn, limit=10.0)
        assert isinstance(error, AFDPeerLostError), error
        assert "Connection closed" in str(error) and "communicator set-up" in str(error)
        assert elapsed < 5.0
        assert all(f.abort_called.is_set() for f in fakes.values())
    finally:
        for f in fakes.values():
            f.release()
