"""Micro-batch planning and the ping-pong scheduler, without a model (vLLM imported)."""

from __future__ import annotations

import threading

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


def test_micro_batching_needs_the_afd_worker_and_no_speculative_decoding() -> None:
    from types import SimpleNamespace

    from afd_moe_runners.role_model import micro_batching_problem

    def cfg(worker: str, spec: object = None) -> object:
        return SimpleNamespace(
            parallel_config=SimpleNamespace(worker_cls=worker), speculative_config=spec
        )

    problem = micro_batching_problem(cfg("auto"), 2)
    assert problem is not None and "--worker-cls afd.worker.AFDCPUWorker" in problem
    assert micro_batching_problem(cfg("afd.worker.AFDCPUWorker"), 2) is None
    problem = micro_batching_problem(cfg("afd.worker.AFDCPUWorker", spec=object()), 3)
    assert problem is not None and "speculative decoding" in problem
