"""Micro-batch planning and the ping-pong scheduler, without a model (vLLM imported)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.vllm


def _groups(plan: object) -> list[tuple[int, int, int, int]]:
    assert plan is not None
    return [
        (s.request_slice.start, s.request_slice.stop, s.token_slice.start, s.token_slice.stop)
        for s in plan  # type: ignore[attr-defined]
    ]


def test_plan_splits_decodes_evenly_at_request_boundaries() -> None:
    from afd_moe_runners.micro_batching import plan_micro_batches

    assert _groups(plan_micro_batches([1] * 6, 2)) == [(0, 3, 0, 3), (3, 6, 3, 6)]
    assert _groups(plan_micro_batches([1] * 7, 3)) == [(0, 2, 0, 2), (2, 5, 2, 5), (5, 7, 5, 7)]


def test_plan_never_cuts_a_request_and_balances_tokens() -> None:
    from afd_moe_runners.micro_batching import plan_micro_batches

    # a long prefill and decodes: the split lands after the prefill, not inside it
    assert _groups(plan_micro_batches([1, 1, 40, 1, 1, 1], 2)) == [(0, 3, 0, 42), (3, 6, 42, 45)]
    # every group keeps at least one request, token slices tile the step
    plan = plan_micro_batches([30, 1, 1], 3)
    assert _groups(plan) == [(0, 1, 0, 30), (1, 2, 30, 31), (2, 3, 31, 32)]


@pytest.mark.parametrize("tokens,m", [([5], 2), ([1, 1], 3), ([1, 1, 1], 1), ([], 2)])
def test_plan_falls_back_to_one_micro_batch(tokens: list[int], m: int) -> None:
    from afd_moe_runners.micro_batching import plan_micro_batches

    assert plan_micro_batches(tokens, m) is None


def test_plan_runs_steps_under_the_token_threshold_whole() -> None:
    from afd_moe_runners.micro_batching import plan_micro_batches

    # 8 decodes: split at a threshold of 8 tokens, whole at 9; a prefill counts its tokens.
    assert _groups(plan_micro_batches([1] * 8, 2, 8)) == [(0, 4, 0, 4), (4, 8, 4, 8)]
    assert plan_micro_batches([1] * 8, 2, 9) is None
    assert _groups(plan_micro_batches([1, 30], 2, 31)) == [(0, 1, 0, 1), (1, 2, 1, 31)]
    assert plan_micro_batches([1, 30], 2, 32) is None


def test_scheduler_alternates_at_yield_points_and_restores_the_context() -> None:
    import vllm.forward_context as fc

    from afd_moe_runners.micro_batching import PingPongScheduler

    contexts = ["ctx0", "ctx1", "ctx2"]
    sched = PingPongScheduler(contexts)
    log: list[tuple[int, int, str]] = []
    lock = threading.Lock()

    def body(i: int) -> object:
        def run() -> int:
            for layer in range(2):
                with lock:
                    log.append((i, layer, fc._forward_context))  # type: ignore[attr-defined]
                sched.yield_turn(layer, i)
            return i * 10

        return run

    before = fc._forward_context  # type: ignore[attr-defined]
    assert sched.run([body(0), body(1), body(2)], restore=before) == [0, 10, 20]
    # strict round robin: every micro-batch computes layer L before any computes L+1,
    # each under its own forward context
    assert log == [(i, layer, f"ctx{i}") for layer in range(2) for i in range(3)]
    assert sched.turns == [(layer, i) for layer in range(2) for i in range(3)]
    assert fc._forward_context is before  # type: ignore[attr-defined]


def test_scheduler_reraises_the_first_error_and_stops_the_others() -> None:
    from afd_moe_runners.micro_batching import PingPongScheduler

    sched = PingPongScheduler([None, None])
    reached: list[int] = []

    def failing() -> None:
        sched.yield_turn(0, 0)
        raise RuntimeError("peer lost in micro-batch 0")

    def other() -> None:
        for layer in range(5):
            reached.append(layer)
            sched.yield_turn(layer, 1)

    with pytest.raises(RuntimeError, match="peer lost in micro-batch 0"):
        sched.run([failing, other], restore=None)
    assert reached == [0]  # stopped at its next yield point


class FakeStream:
    """A fake CUDA stream: logs the streams it is made to wait for."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")


class FakeCuda:
    """Fakes of torch.cuda's device and stream getters and context managers.

    As on real CUDA, the current device and stream belong to a host thread: a new thread
    starts on device 0 and the default stream. Asking for either initializes CUDA.
    """

    def __init__(self, log: list[str], *, initialized: bool = True) -> None:
        self.default_stream = FakeStream("default", log)
        self.initialized = initialized
        self._local = threading.local()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import torch

        for name in ("is_available", "is_initialized", "current_device", "current_stream"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "device", self.device)
        monkeypatch.setattr(torch.cuda, "stream", self.stream)

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return self.initialized

    def current_device(self) -> int:
        self.initialized = True
        return int(getattr(self._local, "device", 0))

    def current_stream(self, device: Any = None) -> FakeStream:
        self.initialized = True
        stream: FakeStream = getattr(self._local, "stream", self.default_stream)
        return stream

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        before = getattr(self._local, "device", 0)
        self._local.device = index
        try:
            yield
        finally:
            self._local.device = before

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        before = getattr(self._local, "stream", self.default_stream)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = before


def test_micro_batch_threads_run_on_the_starters_cuda_device_and_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from afd_moe_runners.micro_batching import PingPongScheduler

    log: list[str] = []
    cuda = FakeCuda(log)
    cuda.install(monkeypatch)
    starters = FakeStream("starter's stream", log)
    sched = PingPongScheduler([None, None, None])
    seen: dict[int, tuple[int, str]] = {}

    def body(i: int) -> Any:
        def run() -> None:
            seen[i] = (cuda.current_device(), cuda.current_stream().name)
            sched.yield_turn(0, i)
            log.append(f"body {i} done")

        return run

    with cuda.device(3), cuda.stream(starters):
        sched.run([body(0), body(1), body(2)], restore=None)
    assert seen == {i: (3, "starter's stream") for i in range(3)}
    # the merge comes after every body's work: the starter's stream waits for the
    # stream the bodies queued their work on (the same one), after the last body ended
    assert log[-1] == "starter's stream waits for starter's stream"
    assert sorted(log[:-1]) == ["body 0 done", "body 1 done", "body 2 done"]


def test_micro_batch_threads_leave_cuda_alone_until_it_is_initialized(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from afd_moe_runners.micro_batching import PingPongScheduler

    log: list[str] = []
    cuda = FakeCuda(log, initialized=False)
    cuda.install(monkeypatch)
    sched = PingPongScheduler([None, None])
    assert sched.run([lambda: 0, lambda: 1], restore=None) == [0, 1]
    assert not cuda.initialized and log == []


def test_micro_batching_needs_the_afd_worker_and_no_speculative_decoding() -> None:
    from types import SimpleNamespace

    from afd_moe_runners.role_model import micro_batching_problem
    from afd_moe_runners.worker_table import register_micro_batch_workers

    # what the runtime's plugin registers in every vLLM process (afd.runtime.worker)
    register_micro_batch_workers({"cpu": "afd.runtime.worker.AFDCPUWorker"})

    def cfg(worker: str, spec: object = None) -> object:
        return SimpleNamespace(
            parallel_config=SimpleNamespace(worker_cls=worker), speculative_config=spec
        )

    problem = micro_batching_problem(cfg("auto"), 2)
    assert problem is not None and "--worker-cls afd.runtime.worker.AFDCPUWorker" in problem
    assert micro_batching_problem(cfg("afd.runtime.worker.AFDCPUWorker"), 2) is None
    problem = micro_batching_problem(cfg("afd.runtime.worker.AFDCPUWorker", spec=object()), 3)
    assert problem is not None and "speculative decoding" in problem
