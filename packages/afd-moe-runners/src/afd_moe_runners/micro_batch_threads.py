"""Micro-batch threads run their CUDA work on the device and stream of their starter.

CUDA's current device and current stream belong to a host thread: a new thread starts on
device 0 and the default stream, whatever the thread that started it uses. A micro-batch
body on a thread of its own would then queue its kernels on another device, or on a
stream unordered with the one body 0 and the merge of the outputs use. So the scheduler
(:class:`afd_moe_runners.micro_batching.PingPongScheduler`) captures its starter's
device and stream (:func:`starter_placement`), starts each thread on them
(:func:`start_thread`; vLLM's own ubatch threads also set both in each thread), and
before the merge makes the starter's stream wait for the threads' work
(:func:`wait_for_threads`).

torch only (no vLLM): ``tools/gpu_check.py`` runs it on a GPU host without vLLM. On CPU,
and before CUDA is initialized, nothing here touches CUDA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["CudaPlacement", "start_thread", "starter_placement", "wait_for_threads"]


@dataclasses.dataclass(frozen=True)
class CudaPlacement:
    """A CUDA device index and a stream (``torch.cuda.Stream``) on it."""

    device: int
    stream: Any


def starter_placement() -> CudaPlacement | None:
    """The calling thread's current CUDA device and stream.

    None on CPU and while CUDA is not initialized (asking would initialize it; the AFD
    worker initialized it long before a step runs).
    """
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return CudaPlacement(torch.cuda.current_device(), torch.cuda.current_stream())


@contextlib.contextmanager
def _placed(placement: CudaPlacement | None) -> Iterator[None]:
    if placement is None:
        yield
        return
    with torch.cuda.device(placement.device), torch.cuda.stream(placement.stream):
        yield


def start_thread(
    target: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    name: str,
    placement: CudaPlacement | None,
) -> threading.Thread:
    """Start a daemon thread that runs ``target(*args)`` on ``placement`` (None: as is)."""

    def run() -> None:
        with _placed(placement):
            target(*args)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def wait_for_threads(placement: CudaPlacement | None) -> None:
    """Order the caller's next CUDA work after all work queued on ``placement``'s stream.

    Called by the starter once every thread has ended, before it merges their outputs.
    The threads queued on the starter's own stream, so this is an event recorded there
    and waited for on the GPU (``wait_stream``): the host never blocks (no synchronize,
    which would also stall the CPU's run-ahead and is illegal while a CUDA graph is
    captured), and the merge is still ordered after the threads' work should the
    starter's current stream have changed meanwhile.
    """
    if placement is not None:
        torch.cuda.current_stream().wait_stream(placement.stream)
