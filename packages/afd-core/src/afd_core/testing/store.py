"""An in-process rendezvous store, for transports whose ranks are threads of one process.

:class:`MemoryRendezvous` is a :class:`~afd_core.connect.RendezvousBackend` over one
:class:`MemoryStore` (a dict behind a lock with the ``set`` / ``get`` / ``check`` /
``add`` of a ``torch.distributed.TCPStore``): every rank of a thread harness opens the
same store, so :func:`afd_core.connect.connect_phase` (admission included) runs as it
does over TCP. The fake CAM world of afd-connectors-npu brings one; imports no torch.
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["MemoryRendezvous", "MemoryStore", "ScopedStore"]


class MemoryStore:
    """A thread-safe key-value store with a TCPStore's key operations (values are bytes)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: str | bytes) -> None:
        with self._cond:
            self._data[key] = value.encode() if isinstance(value, str) else bytes(value)
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        with self._cond:
            if key not in self._data:
                raise KeyError(f"memory store: no key {key!r}")
            return self._data[key]

    def check(self, keys: list[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def add(self, key: str, value: int) -> int:
        with self._cond:
            n = int(self._data.get(key, b"0")) + value
            self._data[key] = str(n).encode()
            self._cond.notify_all()
            return n

    def delete_key(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None

    def wait(self, keys: list[str], timeout_s: float) -> None:
        """Block until every key exists; ``TimeoutError`` after ``timeout_s``."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while not all(k in self._data for k in keys):
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"memory store: {keys} not set within {timeout_s:g} s")
                self._cond.wait(left)

    def keys(self) -> list[str]:
        with self._cond:
            return sorted(self._data)


class ScopedStore:
    """``store`` seen through ``prefix``: every key is ``prefix + key``."""

    def __init__(self, store: MemoryStore, prefix: str) -> None:
        self.store = store
        self.prefix = prefix

    def set(self, key: str, value: str | bytes) -> None:
        self.store.set(self.prefix + key, value)

    def get(self, key: str) -> bytes:
        return self.store.get(self.prefix + key)

    def check(self, keys: list[str]) -> bool:
        return self.store.check([self.prefix + k for k in keys])

    def add(self, key: str, value: int) -> int:
        return self.store.add(self.prefix + key, value)

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(self.prefix + key)

    def wait(self, keys: list[str], timeout_s: float) -> None:
        self.store.wait([self.prefix + k for k in keys], timeout_s)


class MemoryRendezvous:
    """One :class:`MemoryStore` that the host opens and every other rank joins."""

    def __init__(self) -> None:
        self.store = MemoryStore()

    def open(self, *, host: bool, deadline: float) -> MemoryStore:
        return self.store

    def scoped(self, store: Any, prefix: str) -> ScopedStore:
        if isinstance(store, ScopedStore):
            return ScopedStore(store.store, store.prefix + prefix)
        return ScopedStore(store, prefix)
