"""Sleeping on a word of shared memory until another process changes it: Linux futexes.

A waiter of :class:`~afd_connectors_gpu.shm.P2pShmAFDConnector` that has nothing to do
sleeps in the kernel on its ring's sequence counter (``FUTEX_WAIT``, shared, not
private: the ring is mapped by two processes) and the peer wakes it right after it bumps
that counter (``FUTEX_WAKE``). Compared with sleeping in growing steps, the waiter
leaves its CPU entirely (the other role's threads may run there) and still picks a
message up within one wake-up (microseconds), not up to a millisecond late.

The kernel compares the word with the value the waiter last saw before it sleeps, under
the same lock the waker takes, so a change between the waiter's last look and its sleep
is never missed. The waiter sleeps with a timeout anyway (its liveness checks run
between sleeps). Where there is no futex (not Linux, or an architecture whose syscall
number is not known here) :data:`AVAILABLE` is False and callers poll instead.

Only the low 32 bits of a 64-bit counter are watched (a futex is 32 bits): the counter
moves by one per message, so the low half changes whenever the counter does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys

__all__ = ["AVAILABLE", "low_word_address", "wait", "wake"]

# SYS_futex per architecture (asm/unistd.h).
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221,
              "ppc64": 221, "s390x": 238, "riscv64": 98, "loongarch64": 98}  # fmt: skip
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load() -> tuple[object, int] | None:
    if sys.platform != "linux" or os.environ.get("AFD_SHM_NO_FUTEX") == "1":
        return None
    nr = _SYS_FUTEX.get(platform.machine().lower())
    if nr is None:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None
    fn = libc.syscall
    fn.restype = ctypes.c_long
    return fn, nr


_LOADED = _load()
#: True where :func:`wait` and :func:`wake` work (Linux on a known architecture; the
#: environment variable ``AFD_SHM_NO_FUTEX=1`` turns them off, for comparisons).
AVAILABLE = _LOADED is not None


def low_word_address(address: int) -> int:
    """Address of the low 32 bits of the 64-bit word at ``address``."""
    return address if sys.byteorder == "little" else address + 4


def wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at ``address`` equals ``expected`` (its low 32 bits
    are compared), at most ``timeout_s``; return at once if it differs already. Spurious
    returns are possible: callers re-check their condition."""
    assert _LOADED is not None
    fn, nr = _LOADED
    timeout_s = max(timeout_s, 0.0)
    sec = int(timeout_s)
    ts = _Timespec(sec, int((timeout_s - sec) * 1e9))
    value = ctypes.c_uint32(expected & 0xFFFFFFFF).value
    fn(  # type: ignore[operator]
        ctypes.c_long(nr),
        ctypes.c_void_p(address),
        ctypes.c_int(_FUTEX_WAIT),
        ctypes.c_uint32(value),
        ctypes.byref(ts),
        None,
        ctypes.c_int(0),
    )


def wake(address: int) -> None:
    """Wake every process sleeping in :func:`wait` on ``address``."""
    assert _LOADED is not None
    fn, nr = _LOADED
    fn(  # type: ignore[operator]
        ctypes.c_long(nr),
        ctypes.c_void_p(address),
        ctypes.c_int(_FUTEX_WAKE),
        ctypes.c_int(_WAKE_ALL),
        None,
        None,
        ctypes.c_int(0),
    )
