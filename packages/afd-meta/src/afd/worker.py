"""Compatibility alias of :mod:`afd.runtime.worker` (the AFD workers moved into the
runtime room): ``--worker-cls afd.worker.AFDCPUWorker`` keeps working for commands and
scripts written before the move. New code names ``afd.runtime.worker``."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    from afd.runtime import worker

    return getattr(worker, name)
