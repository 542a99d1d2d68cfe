"""BufferPool: per-peer keys, bucket limits, no overwrite of a buffer still being sent."""

from __future__ import annotations

import pytest
import torch

from afd_connectors_gpu.buffers import BufferPool
from afd_core.errors import AFDTransferMismatchError


def _pool(limit: int = 64) -> BufferPool:
    return BufferPool(max_num_tokens=limit, device=torch.device("cpu"), label="test")


def test_two_peers_of_one_bucket_receive_into_different_buffers() -> None:
    pool = _pool()
    spec = ((8,), "float32")
    a, view_a = pool.receive(0, 5, spec, 0, 0)
    b, view_b = pool.receive(1, 6, spec, 0, 0)  # same bucket (8), other peer
    assert a.data_ptr() != b.data_ptr()
    assert view_a.shape == (5, 8) and view_b.shape == (6, 8)
    again, _ = pool.receive(0, 7, spec, 0, 0)  # same peer, same bucket: reused
    assert again.data_ptr() == a.data_ptr()


def test_micro_batches_and_slots_get_their_own_buffers() -> None:
    pool = _pool()
    spec = ((4,), "bfloat16")
    ptrs = {pool.receive(0, 3, spec, slot, mb)[0].data_ptr() for slot in (0, 1) for mb in (0, 1)}
    assert len(ptrs) == 4


def test_a_message_over_the_limit_is_refused_before_anything_is_staged() -> None:
    pool = _pool(limit=16)
    settled: list[object] = []
    with pytest.raises(AFDTransferMismatchError, match="max_num_tokens=16"):
        pool.stage(torch.ones(17, 4), peer=0, slot=0, mb=0, settle=settled.append)
    assert len(pool) == 0 and settled == []


def test_restaging_a_send_buffer_settles_the_send_that_read_it_first() -> None:
    pool = _pool()
    settled: list[object] = []
    buf, key = pool.stage(torch.full((3, 4), 1.0), peer=0, slot=0, mb=0, settle=settled.append)
    pool.sent(key, "work-1")
    # Another peer's answer in the same bucket: its own buffer, nothing to settle.
    other, key2 = pool.stage(torch.full((3, 4), 2.0), peer=1, slot=0, mb=0, settle=settled.append)
    pool.sent(key2, "work-2")
    assert other.data_ptr() != buf.data_ptr() and settled == []
    assert torch.equal(buf[:3], torch.full((3, 4), 1.0))
    # The same peer again: the first send must be settled before its buffer is rewritten.
    again, _ = pool.stage(torch.full((4, 4), 3.0), peer=0, slot=0, mb=0, settle=settled.append)
    assert settled == ["work-1"] and again.data_ptr() == buf.data_ptr()
    assert torch.equal(again[:4], torch.full((4, 4), 3.0))


def test_reserve_makes_the_largest_bucket_for_every_peer_micro_batch_and_tensor() -> None:
    pool = _pool(limit=64)
    plan = [("send", 0, ((8,), "bfloat16")), ("recv", 0, ((8,), "bfloat16"))]
    res = pool.reserve((3, 5), plan, num_micro_batches=2, num_tokens=20)
    assert res.rows == 32  # the bucket of 20 tokens, not of the limit (64)
    assert set(pool.buffers()) == {
        (d, p, 32, (8,), "bfloat16", 0, mb)
        for d in ("send", "recv")
        for p in (3, 5)
        for mb in (0, 1)
    }
    assert res.per_peer == {3: 2 * 2 * 32 * 8 * 2, 5: 2 * 2 * 32 * 8 * 2}
    assert res.total == pool.nbytes() == sum(b.nbytes for b in pool.buffers().values())
    # A message of the reserved bucket uses the reserved buffer: nothing is allocated.
    before = {k: b.data_ptr() for k, b in pool.buffers().items()}
    buf, _ = pool.receive(3, 17, ((8,), "bfloat16"), 0, 1)
    sent, _ = pool.stage(
        torch.ones(20, 8, dtype=torch.bfloat16), peer=5, slot=0, mb=0, settle=print
    )
    assert {k: b.data_ptr() for k, b in pool.buffers().items()} == before
    assert buf.data_ptr() == before[("recv", 3, 32, (8,), "bfloat16", 0, 1)]
    assert sent.data_ptr() == before[("send", 5, 32, (8,), "bfloat16", 0, 0)]
