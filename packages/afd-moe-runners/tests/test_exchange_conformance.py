"""afd-core's conformance suite over the two wrapping exchanges of afd-moe-runners.

Both wrappers are Attention-side :class:`~afd_core.connector.AFDConnector` s around real
connectors (afd-core's in-process loopback connector here; every transport behind them
passes the suite itself), so the suite's FFN side runs on plain connectors and its
Attention side on the wrapper:

* :class:`~afd_moe_runners.tensor_parallel.TensorParallelExchange` (attention tensor
  parallelism): every attention rank is a TP group of two workers (threads with a real
  gloo process group each, as vLLM's TP group would be); the leader (TP rank 0) wraps
  the rank's connector, the follower none and takes the broadcast answer. The scenario
  runs on both workers; its check runs over the leaders' results, then again with each
  follower's result in place of its leader's (a follower must see what the leader saw).
* :class:`~afd_moe_runners.expert_parallel.ExpertParallelExchange` (FFN expert
  parallelism): every attention rank exchanges with every FFN rank through one plane
  connector each (``AFDConfig.expert_plane``) and sums the partial answers.

Which scenarios apply (:data:`NOT_APPLICABLE` says why any other would not): a
follower's receive with no send before it, or one its leader's connector fails (times
out, is closed), raises what the leader raised: the leader broadcasts the failure.

================================  ====  ====
scenario                          TP    EP
================================  ====  ====
message_ordering                  yes   yes
shapes_and_dtypes                 yes   yes
routing_topk                      yes   yes
routing_router_logits             yes   yes
routing_token_ids                 yes   yes
fan_in_split                      yes   yes
shared_output                     yes   yes
header_mismatch                   yes   yes
receive_timeout_attention         yes   yes
receive_timeout_ffn               yes   yes
ffn_idle_wait                     yes   yes
started_step_is_bounded           yes   yes
close_unblocks_receive            yes   yes
================================  ====  ====

on every suite topology for TP, on those with one FFN rank for EP (:data:`EP_TOPOLOGIES`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import pytest
import torch

from afd_core.config import AFDConfig, AFDRole
from afd_core.connector import AFDConnector
from afd_core.errors import AFDTimeoutError
from afd_core.testing.loopback import LoopbackAFDConnector
from afd_core.topology import AFDTopology
from afd_moe_runners.expert_parallel import ExpertParallelExchange
from afd_moe_runners.tensor_parallel import TensorParallelExchange

conformance = pytest.importorskip("afd_core.testing.conformance")

NOT_APPLICABLE: dict[str, dict[str, str]] = {
    "tp": {},
    "ep": {},
}
"""Scenario -> why it does not apply to the wrapper (the others run)."""

EP_TOPOLOGIES = frozenset({"1A1F", "2A1F"})
"""With several FFN ranks an attention rank's answer under expert parallelism is the sum
of every FFN rank's partial answer, each FFN rank serving every attention rank; the
suite's FFN side computes the whole function ``2 * hidden + layer`` on each of its
ranks and checks the topology's fan-in partition, which expert parallelism replaces.
With one FFN rank the plane is the whole exchange and every check holds."""

NUM_EXPERTS = 16  # the suite's top-k ids are in 0..15
TP_SIZE = 2
_ports = itertools.count(43000, 8)  # room for the EP planes' ports


def _configs(
    topology: AFDTopology, overrides: Mapping[str, Any], **extra: Any
) -> dict[tuple[AFDRole, int], AFDConfig]:
    port = next(_ports)
    return {
        (role, rank): AFDConfig(
            role=role,
            connector=LoopbackAFDConnector.name,
            host="wrapper-conformance",
            port=port,
            num_attention_ranks=topology.num_attention_ranks,
            num_ffn_ranks=topology.num_ffn_ranks,
            rank=rank,
            **extra,
            **dict(overrides),
        )
        for role in AFDRole
        for rank in range(topology.size_of(role))
    }


def _gloo_broadcast(store: Any, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
    pg = torch.distributed.ProcessGroupGloo(store, rank, TP_SIZE, timedelta(seconds=30))

    def broadcast(tensor: torch.Tensor) -> torch.Tensor:
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        pg.broadcast([tensor], opts).wait()
        return tensor

    return broadcast


# A worker: (result key, builds its connector in its thread, the rank's role and rank).
Worker = tuple[Any, Callable[[], AFDConnector], AFDRole, int]


def _run_workers(
    workers: list[Worker], body: Callable[[AFDConnector, AFDRole, int], Any], timeout_s: float
) -> dict[Any, Any]:
    """Build, init, run and close every worker's connector, one thread each; no body
    starts before every init returned (the loopback connector's init is not collective).
    Exceptions are results."""
    results: dict[Any, Any] = {}
    made: list[AFDConnector] = []
    lock = threading.Lock()
    barrier = threading.Barrier(len(workers))

    def run(key: Any, make: Callable[[], AFDConnector], role: AFDRole, rank: int) -> None:
        conn: AFDConnector | None = None
        try:
            conn = make()
            with lock:
                made.append(conn)
            conn.init()
            barrier.wait(timeout=timeout_s)
            value: Any = body(conn, role, rank)
        except BaseException as exc:
            barrier.abort()
            value = exc
        finally:
            if conn is not None:
                conn.close()
        results[key] = value

    threads = [threading.Thread(target=run, args=w, daemon=True) for w in workers]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        with lock:
            for conn in made:
                conn.close()
        for t in threads:
            t.join(5.0)
    for key, *_ in workers:
        results.setdefault(key, AFDTimeoutError(f"{key} did not finish within {timeout_s:g} s"))
    return results


class TensorParallelHarness:
    """Every attention rank a TP group of :data:`TP_SIZE` workers (see the module docstring)."""

    run_timeout_s = 60.0

    def run(self, scenario: Any, topology: AFDTopology) -> dict[tuple[str, int], Any]:
        configs = _configs(
            topology, scenario.config_overrides, attention_tensor_parallel_size=TP_SIZE
        )
        workers: list[Worker] = []
        for (role, rank), config in configs.items():
            if role is AFDRole.FFN:

                def make_ffn(c: AFDConfig = config, r: int = rank) -> AFDConnector:
                    return LoopbackAFDConnector(c, rank=r)

                workers.append(((role.value, rank, 0), make_ffn, role, rank))
                continue
            store = torch.distributed.HashStore()
            for tp_rank in range(TP_SIZE):

                def make(c: AFDConfig = config, r: int = rank, t: int = tp_rank, s: Any = store):
                    inner = LoopbackAFDConnector(c, rank=r) if t == 0 else None
                    return TensorParallelExchange(
                        c,
                        rank=r,
                        tp_rank=t,
                        tp_size=TP_SIZE,
                        inner=inner,
                        broadcast=_gloo_broadcast(s, t),
                    )

                workers.append(((role.value, rank, tp_rank), make, role, rank))
        results = _run_workers(
            workers,
            lambda conn, role, rank: scenario.run_rank(
                conn, conformance.RankContext(role, rank, topology)
            ),
            self.run_timeout_s,
        )
        self.followers = {
            (role, rank): value for (role, rank, tp), value in results.items() if tp > 0
        }
        self.last_results = {
            (role, rank): value for (role, rank, tp), value in results.items() if tp == 0
        }
        return self.last_results


class ExpertParallelHarness:
    """Every attention rank an :class:`ExpertParallelExchange` over one plane per FFN rank."""

    run_timeout_s = 60.0

    def run(self, scenario: Any, topology: AFDTopology) -> dict[tuple[str, int], Any]:
        configs = _configs(topology, scenario.config_overrides, ffn_expert_parallel=True)
        workers: list[Worker] = []
        for (role, rank), config in configs.items():
            if role is AFDRole.FFN:

                def make_ffn(c: AFDConfig = config, r: int = rank) -> AFDConnector:
                    return LoopbackAFDConnector(c.expert_plane(r), rank=0)

                workers.append(((role.value, rank), make_ffn, role, rank))
                continue

            def make(c: AFDConfig = config, r: int = rank) -> AFDConnector:
                planes = [
                    LoopbackAFDConnector(c.expert_plane(f), rank=r) for f in range(c.num_ffn_ranks)
                ]
                return ExpertParallelExchange(
                    c, rank=r, planes=planes, num_experts=NUM_EXPERTS, rank0_gets_every_row=False
                )

            workers.append(((role.value, rank), make, role, rank))
        return _run_workers(
            workers,
            lambda conn, role, rank: scenario.run_rank(
                conn, conformance.RankContext(role, rank, topology)
            ),
            self.run_timeout_s,
        )


CASES = [
    pytest.param(w, s, t, id=f"{w}-{s.name}-{t.label}")
    for w in ("tp", "ep")
    for t in conformance.TOPOLOGIES
    if w == "tp" or t.label in EP_TOPOLOGIES
    for s in conformance.SCENARIOS
]


@pytest.mark.parametrize(("wrapper", "scenario", "topology"), CASES)
def test_wrapper_conforms(wrapper: str, scenario: Any, topology: AFDTopology) -> None:
    reason = NOT_APPLICABLE[wrapper].get(scenario.name)
    if reason is not None:
        pytest.skip(reason)
    if wrapper == "ep":
        conformance.run_scenario(ExpertParallelHarness(), scenario, topology)
        return
    harness = TensorParallelHarness()
    conformance.run_scenario(harness, scenario, topology)
    if not scenario.supports(topology):
        return
    # Each follower's result in place of its leader's: the same checks must hold.
    for key, value in harness.followers.items():
        swapped = dict(harness.last_results)
        swapped[key] = value
        scenario.check(swapped, topology)


def test_every_entry_names_an_existing_scenario() -> None:
    names = {s.name for s in conformance.SCENARIOS}
    for table in NOT_APPLICABLE.values():
        assert set(table) <= names
