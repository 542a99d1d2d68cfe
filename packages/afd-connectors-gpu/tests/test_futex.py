"""Futex waits of the shared-memory connector: the primitive, and that a waiting receiver
sleeps in the kernel on its ring's counter (it leaves its CPU to the other role)."""

from __future__ import annotations

import ctypes
import os
import threading
import time

import pytest

from afd_connectors_gpu import futex
from afd_connectors_gpu.shm import _WRITE_W
from afd_connectors_gpu.testing import shm_pair

pytestmark = pytest.mark.skipif(not futex.AVAILABLE, reason="no futex on this platform")


def _word(value: int) -> tuple[ctypes.c_int64, int]:
    word = ctypes.c_int64(value)
    return word, futex.low_word_address(ctypes.addressof(word))


def test_wait_returns_at_once_when_the_word_changed_already() -> None:
    word, address = _word(7)
    t0 = time.monotonic()
    futex.wait(address, 6, timeout_s=5.0)  # the waiter last saw 6; it is 7 now
    assert time.monotonic() - t0 < 1.0
    assert word.value == 7


def test_wait_sleeps_until_its_timeout_when_nobody_wakes_it() -> None:
    _, address = _word(3)
    t0 = time.monotonic()
    futex.wait(address, 3, timeout_s=0.2)
    assert 0.15 <= time.monotonic() - t0 < 3.0


def test_wake_after_a_change_ends_the_wait_of_another_thread() -> None:
    word, address = _word(0)
    done = threading.Event()

    def waiter() -> None:
        while word.value == 0:
            futex.wait(address, 0, timeout_s=30.0)
        done.set()

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    time.sleep(0.1)
    assert not done.is_set()
    word.value = 1
    futex.wake(address)
    assert done.wait(5.0), "the waiter was not woken"


def _syscall_of(tid: int) -> list[str] | None:
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            return f.read().split()
    except OSError:
        return None


def test_a_waiting_shm_receiver_sleeps_on_its_rings_counter() -> None:
    """With ``spin_us = 0`` the FFN side, waiting for the next message, is inside the futex
    syscall on the write counter of its ring from the attention rank (not spinning or
    polling), and the message that follows reaches it."""
    import torch

    from afd_core.transfer import AttentionToFFN

    if _syscall_of(threading.get_native_id()) is None:
        pytest.skip("/proc/<tid>/syscall is not readable here")
    attn, ffn = shm_pair(slot_bytes=1 << 20, spin_us=0)
    try:
        (ring,) = ffn.transport._in.values()
        address = ring.futex_of[_WRITE_W]
        got: list[object] = []
        tid: list[int] = []

        def receive() -> None:
            tid.append(threading.get_native_id())
            got.append(ffn.recv_from_attention())

        t = threading.Thread(target=receive, daemon=True)
        t.start()
        deadline = time.monotonic() + 10.0
        seen: list[str] | None = None
        while time.monotonic() < deadline:
            seen = _syscall_of(tid[0]) if tid else None
            if seen and len(seen) > 1 and int(seen[1], 16) == address:
                break
            time.sleep(0.01)
        assert seen and int(seen[0]) == futex._SYS_FUTEX[os.uname().machine.lower()], seen
        assert int(seen[1], 16) == address, (seen, hex(address))
        x = torch.ones(3, 4, dtype=torch.bfloat16)
        attn.send_to_ffn(AttentionToFFN(x), layer_idx=0)
        t.join(10.0)
        assert got and torch.equal(got[0].payload.hidden_states, x)  # type: ignore[attr-defined]
    finally:
        attn.close()
        ffn.close()
