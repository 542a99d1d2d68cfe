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


def test_preallocation_covers_every_bucket_per_peer_and_micro_batch() -> None:
    pool = _pool(limit=8)
    made = pool.preallocate((0, 1), ((2,), "float32"), num_micro_batches=2)
    assert pool.buckets() == [1, 2, 4, 8]
    assert len(pool) == 2 * 4 * 2
    assert made == 2 * 2 * (1 + 2 + 4 + 8) * 2 * 4
