"""The buffer pool's buffers are made in ``init()``, before any exchange (issue 40, item 5).

vLLM sizes the KV cache from a memory profile taken after the model (and with it the
Attention role's connectors) is built: buffers made on first use would not be counted.
These tests run the gloo connector with ``buffer_pool`` (the NCCL connector's pool, on
CPU): real processes per rank, and one process holding two FFN expert planes.
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

import pytest

from afd_connectors_gpu.p2p import P2pGlooAFDConnector
from afd_connectors_gpu.testing import ProcessHarness, free_port
from afd_core.config import AFDConfig
from afd_core.topology import AFDTopology

sys.path.insert(0, str(Path(__file__).parent))
import connectors_gpu_rank_bodies as _bodies

HIDDEN = 16
EXTRA = {"buffer_pool": True, "max_num_tokens": 48, "hidden_size": HIDDEN, "dtype": "float32"}


def test_init_reserves_the_largest_bucket_for_every_peer_before_any_exchange() -> None:
    topology = AFDTopology(2, 1)
    with ProcessHarness(
        "P2pGlooAFDConnector", config={"connector_extra_config": EXTRA, "num_micro_batches": 2}
    ) as harness:
        results = harness.run_ranks(topology, _bodies.pool_after_init)
    for (role, rank), got in results.items():
        assert not isinstance(got, BaseException), got
        me = topology.global_rank(role, rank)
        sends, recvs = ("send", "recv")
        expected = {
            (direction, peer, 64, (HIDDEN,), "float32", 0, mb)
            for peer in got["peers"]
            for direction in (sends, recvs)
            for mb in (0, 1)
        }
        assert set(got["storages"]) == expected, (role, rank, me)
        # max_num_tokens 48 -> the largest bucket has 64 rows
        assert all(shape == (64, HIDDEN) for shape, _ in got["storages"].values())
        per_buffer = 64 * HIDDEN * 4
        assert got["per_peer"] == {p: 2 * 2 * per_buffer for p in got["peers"]}
        assert got["reported"] == got["nbytes"] == len(got["peers"]) * 4 * per_buffer
        assert f"{got['nbytes']} bytes" in got["report"]


def test_each_expert_plane_reserves_its_own_and_one_line_sums_the_role(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """1A2F with FFN expert parallelism, every connector in this process: the attention
    rank's two planes each hold their buffers after init, and the last plane's INFO line
    gives both planes and their sum."""
    base = AFDConfig(
        role="attention",
        connector="P2pGlooAFDConnector",
        num_attention_ranks=1,
        num_ffn_ranks=2,
        ffn_expert_parallel=True,
        port=free_port(),
        connect_timeout_s=30,
        connector_extra_config=EXTRA,
    )
    identity = {"hidden_size": str(HIDDEN), "dtype": "float32"}
    made: dict[str, P2pGlooAFDConnector] = {}
    errors: list[BaseException] = []

    def attention() -> None:
        try:
            for f in range(2):
                conn = P2pGlooAFDConnector(base.expert_plane(f), rank=0)
                conn.identity = {**identity, "expert_shard": f"{f}/2"}
                made[f"attention/{f}"] = conn
                conn.init()
        except BaseException as exc:
            errors.append(exc)

    def ffn(f: int) -> None:
        try:
            cfg = AFDConfig.parse({**base.to_dict(), "role": "ffn", "rank": f})
            conn = P2pGlooAFDConnector(cfg.expert_plane(f), rank=0)
            conn.identity = {**identity, "expert_shard": f"{f}/2"}
            made[f"ffn/{f}"] = conn
            conn.init()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=attention)]
    threads += [threading.Thread(target=ffn, args=(f,)) for f in range(2)]
    with caplog.at_level(logging.DEBUG, logger="afd_connectors_gpu.p2p"):
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    try:
        assert not errors, errors
        per_plane = 2 * 64 * HIDDEN * 4  # send + receive, one peer, one micro-batch
        for f in range(2):
            transport = made[f"attention/{f}"].transport
            assert transport.reservation is not None
            assert transport.reservation.total == per_plane
            assert transport._pool is not None and transport._pool.nbytes() == per_plane
        lines = [
            r.getMessage()
            for r in caplog.records
            if r.levelno == logging.INFO and "(attention rank 0)" in r.getMessage()
        ]
        assert len(lines) == 1, lines
        assert "(expert plane 1/2)" in lines[0]
        assert (
            f"attention rank 0 in this process: {2 * per_plane} bytes over 2 connector(s) "
            f"(plane 0/2: {per_plane}, plane 1/2: {per_plane})"
        ) in lines[0]
    finally:
        for conn in made.values():
            conn.close()
