"""Attention tensor parallelism: TP worker 0 exchanges for its attention rank, the other
workers take the answer from a broadcast (afd_moe_runners.tensor_parallel).

Two TP workers are two threads with a real gloo process group each (one store); the
FFN role is an in-process loopback connector in a third thread that answers
``2 * hidden + layer`` (plus a shared output when asked).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from afd_core.config import AFDConfig
from afd_core.errors import AFDConfigError, AFDTimeoutError, AFDTransferMismatchError
from afd_core.testing.loopback import LoopbackAFDConnector
from afd_core.transfer import AttentionToFFN, FFNToAttention
from afd_moe_runners.tensor_parallel import TensorParallelExchange

HIDDEN = 8
_port = iter(range(41000, 42000))


def _gloo_broadcasts(size: int) -> list[Any]:
    store = torch.distributed.HashStore()
    groups: list[Any] = [None] * size

    def make(rank: int) -> None:
        groups[rank] = torch.distributed.ProcessGroupGloo(store, rank, size, timedelta(seconds=20))

    threads = [threading.Thread(target=make, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    def broadcast_of(pg: Any) -> Any:
        def broadcast(tensor: torch.Tensor) -> torch.Tensor:
            opts = torch.distributed.BroadcastOptions()
            opts.rootRank = 0
            pg.broadcast([tensor], opts).wait()
            return tensor

        return broadcast

    return [broadcast_of(pg) for pg in groups]


def _configs(**extra: Any) -> tuple[AFDConfig, AFDConfig]:
    common = {"connector": "LoopbackAFDConnector", "host": "tp-test", "port": next(_port)}
    return (
        AFDConfig(role="attention", rank=0, attention_tensor_parallel_size=2, **common, **extra),
        AFDConfig(role="ffn", rank=0, attention_tensor_parallel_size=2, **common, **extra),
    )


def _serve(ffn: LoopbackAFDConnector, layers: int, shared: bool, served: list[int]) -> None:
    for _ in range(layers):
        batch = ffn.recv_from_attention(timeout_s=20)
        hidden = batch.payload.hidden_states
        served.append(int(hidden.shape[0]))
        out = 2 * hidden + batch.layer_idx
        ffn.send_to_attention(batch, FFNToAttention(out, shared_output=-out if shared else None))


@pytest.mark.parametrize("shared", [False, True], ids=["output", "output+shared"])
def test_only_tp_rank_0_exchanges_and_every_worker_gets_the_answer(shared: bool) -> None:
    attn_cfg, ffn_cfg = _configs()
    ffn = LoopbackAFDConnector(ffn_cfg, rank=0)
    leader_inner = LoopbackAFDConnector(attn_cfg, rank=0)
    broadcasts = _gloo_broadcasts(2)
    workers = [
        TensorParallelExchange(
            attn_cfg,
            rank=0,
            tp_rank=r,
            tp_size=2,
            inner=leader_inner if r == 0 else None,
            broadcast=broadcasts[r],
        )
        for r in range(2)
    ]
    ffn.init()
    layers = 3
    served: list[int] = []
    server = threading.Thread(target=_serve, args=(ffn, layers, shared, served))
    server.start()
    results: dict[int, list[FFNToAttention]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            conn = workers[r]
            conn.init()
            for layer in range(layers):
                # The TP workers hold the same (replicated) hidden states.
                x = torch.arange(5 * HIDDEN, dtype=torch.float32).reshape(5, HIDDEN) + layer
                conn.send_to_ffn(AttentionToFFN(x), layer_idx=layer)
                results[r].append(conn.recv_from_ffn(layer_idx=layer))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    server.join(30)
    assert not errors, errors
    # One message per layer reached the FFN role, not one per TP worker.
    assert served == [5] * layers
    for layer in range(layers):
        x = torch.arange(5 * HIDDEN, dtype=torch.float32).reshape(5, HIDDEN) + layer
        want = 2 * x + layer
        for r in range(2):
            got = results[r][layer]
            assert torch.equal(got.output, want)
            if shared:
                assert torch.equal(got.shared_output, -want)
            else:
                assert got.shared_output is None
    assert workers[0].records_exchanges and not workers[1].records_exchanges
    for conn in (*workers, ffn):
        conn.close()


def test_a_follower_that_ran_another_batch_fails_loudly() -> None:
    attn_cfg, ffn_cfg = _configs()
    ffn = LoopbackAFDConnector(ffn_cfg, rank=0)
    leader_inner = LoopbackAFDConnector(attn_cfg, rank=0)
    broadcasts = _gloo_broadcasts(2)
    leader = TensorParallelExchange(
        attn_cfg, rank=0, tp_rank=0, tp_size=2, inner=leader_inner, broadcast=broadcasts[0]
    )
    follower = TensorParallelExchange(
        attn_cfg, rank=0, tp_rank=1, tp_size=2, inner=None, broadcast=broadcasts[1]
    )
    ffn.init()
    server = threading.Thread(target=_serve, args=(ffn, 1, False, []))
    server.start()
    leader.init()
    caught: list[BaseException] = []

    def run_follower() -> None:
        follower.send_to_ffn(AttentionToFFN(torch.zeros(3, HIDDEN)), layer_idx=0)
        try:
            follower.recv_from_ffn(layer_idx=0)
        except AFDTransferMismatchError as exc:
            caught.append(exc)

    t = threading.Thread(target=run_follower)
    t.start()
    leader.send_to_ffn(AttentionToFFN(torch.zeros(4, HIDDEN)), layer_idx=0)
    leader.recv_from_ffn(layer_idx=0)
    t.join(30)
    server.join(30)
    assert len(caught) == 1
    assert "TP rank 0 received 4 rows from the FFN role, this worker sent 3" in str(caught[0])
    for conn in (leader, follower, ffn):
        conn.close()


def test_a_leader_timeout_reaches_the_follower_as_a_timeout() -> None:
    """The FFN role never answers: the leader's receive times out, and its follower,
    waiting in the header's broadcast, raises the same error at once (it used to wait
    in a broadcast the leader never joined, until the TP group's own timeout)."""
    attn_cfg, ffn_cfg = _configs()
    ffn = LoopbackAFDConnector(ffn_cfg, rank=0)
    broadcasts = _gloo_broadcasts(2)
    leader = TensorParallelExchange(
        attn_cfg,
        rank=0,
        tp_rank=0,
        tp_size=2,
        inner=LoopbackAFDConnector(attn_cfg, rank=0),
        broadcast=broadcasts[0],
    )
    follower = TensorParallelExchange(
        attn_cfg, rank=0, tp_rank=1, tp_size=2, inner=None, broadcast=broadcasts[1]
    )
    ffn.init()
    leader.init()
    caught: dict[str, BaseException] = {}
    elapsed: dict[str, float] = {}

    def run(name: str, conn: TensorParallelExchange) -> None:
        conn.send_to_ffn(AttentionToFFN(torch.zeros(3, HIDDEN)), layer_idx=0)
        start = time.monotonic()
        try:
            conn.recv_from_ffn(layer_idx=0, timeout_s=0.5)
        except BaseException as exc:
            caught[name] = exc
        elapsed[name] = time.monotonic() - start

    threads = [
        threading.Thread(target=run, args=("leader", leader)),
        threading.Thread(target=run, args=("follower", follower)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert isinstance(caught.get("leader"), AFDTimeoutError), caught
    assert isinstance(caught.get("follower"), AFDTimeoutError), caught
    assert "TP rank 0's exchange with the FFN role failed with AFDTimeoutError" in str(
        caught["follower"]
    )
    assert elapsed["follower"] < 5.0, elapsed
    for conn in (leader, follower, ffn):
        conn.close()


def test_only_tp_rank_0_holds_the_connector() -> None:
    attn_cfg, _ = _configs()
    inner = LoopbackAFDConnector(attn_cfg, rank=0)
    with pytest.raises(AFDConfigError, match="TP rank 0 \\(and only it\\)"):
        TensorParallelExchange(attn_cfg, rank=0, tp_rank=1, tp_size=2, inner=inner)
    with pytest.raises(AFDConfigError, match="TP rank 0 \\(and only it\\)"):
        TensorParallelExchange(attn_cfg, rank=0, tp_rank=0, tp_size=2, inner=None)
    with pytest.raises(AFDConfigError, match="tp_size >= 2"):
        TensorParallelExchange(attn_cfg, rank=0, tp_rank=0, tp_size=1, inner=inner)
