"""A multi-process harness for the afd-core conformance suite (and other rank-level tests).

:class:`ProcessHarness` runs one spawned process per (role, rank). Processes are
kept per topology and reused for several runs (spawning one costs about a second
of imports); every run uses a fresh free port, so runs never see each other.
A run has a hard deadline: if any rank is still busy when it expires, every
process of that topology is killed and the missing ranks get an
:class:`~afd_core.errors.AFDTimeoutError` as their result, so a hang fails the
test instead of blocking CI. A process that dies mid-run (e.g. a test SIGKILLs
it) gets an :class:`~afd_core.errors.AFDPeerLostError` result and its process
set is replaced before the next run. ``close()`` (or the context manager) reaps
every child.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from afd_core import ports
from afd_core.config import AFDRole
from afd_core.errors import AFDPeerLostError, AFDTimeoutError
from afd_core.topology import AFDTopology

__all__ = ["ProcessHarness", "free_port", "rank_config", "shm_pair"]

RankBody = Callable[[Any, Any], Any]
"""``body(connector, RankContext) -> picklable``; must be a module-level function."""


def rank_config(topology: AFDTopology, global_rank: int, **values: Any) -> Any:
    """The :class:`~afd_core.config.AFDConfig` of ``global_rank`` in ``topology`` (role,
    rank and rank counts filled in; ``values`` for the rest)."""
    from afd_core.config import AFDConfig

    role, rank = topology.role_rank_of(global_rank)
    return AFDConfig(
        role=role,
        num_attention_ranks=topology.num_attention_ranks,
        num_ffn_ranks=topology.num_ffn_ranks,
        rank=rank,
        **values,
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A free port outside the ephemeral range (:func:`afd_core.ports.free_port`)."""
    return ports.free_port(host)


def shm_pair(**extra: Any) -> tuple[Any, Any]:
    """``(attention, ffn)``: two joined :class:`~afd_connectors_gpu.shm.P2pShmAFDConnector`
    of one 1A1F deployment in this process (its rings need no second process), with
    ``extra`` as their ``connector_extra_config``. Close both when done."""
    import threading

    from afd_connectors_gpu.shm import P2pShmAFDConnector
    from afd_core.config import AFDConfig

    port = free_port()
    made: dict[str, P2pShmAFDConnector] = {}
    errors: list[BaseException] = []

    def join(role: str) -> None:
        try:
            config = AFDConfig(
                role=role, connector="P2pShmAFDConnector", port=port, connect_timeout_s=30,
                connector_extra_config=extra,
            )  # fmt: skip
            conn = P2pShmAFDConnector(config, rank=0)
            conn.init()
            made[role] = conn
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(r,)) for r in ("attention", "ffn")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors or len(made) != 2:
        for conn in made.values():
            conn.close()
        raise RuntimeError(f"shm_pair: the connectors did not join: {errors}")
    return made["attention"], made["ffn"]


class _UnpicklableResult(Exception):
    """A rank returned (or raised) something that could not be pickled."""


def _dumps(value: Any) -> bytes:
    try:
        return pickle.dumps(value)
    except Exception as exc:
        return pickle.dumps(_UnpicklableResult(f"{type(value).__name__}: {value!r} ({exc})"))


def _worker_main(
    role_value: str,
    rank: int,
    tasks: Any,
    results: Any,
    env: Mapping[str, str],
) -> None:
    os.environ.update(env)
    from afd_core.config import AFDConfig
    from afd_core.registry import get_connector_class
    from afd_core.testing.conformance import RankContext

    role = AFDRole(role_value)
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # the test process died: do not linger as an orphan
                os._exit(1)
            continue
        if task is None:
            return
        run_id, config_values, body, topo = task
        topology = AFDTopology(*topo)
        try:
            config = AFDConfig(**config_values)
            connector = get_connector_class(config.connector)(config, rank=rank)
            try:
                connector.init()
                value: Any = body(connector, RankContext(role, rank, topology))
            finally:
                connector.close()
        except BaseException as exc:  # returned, not raised (harness contract)
            value = exc
        results.put((run_id, role_value, rank, _dumps(value)))


@dataclass
class _ProcessSet:
    topology: AFDTopology
    procs: dict[tuple[str, int], Any] = field(default_factory=dict)
    tasks: dict[tuple[str, int], Any] = field(default_factory=dict)
    results: Any = None

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs.values())


class ProcessHarness:
    """Runs connectors in one spawned process per rank (see the module docstring).

    ``connector`` is a registered connector name. ``config`` values are passed to
    every rank's :class:`~afd_core.config.AFDConfig` (a scenario's overrides win).
    ``device_per_rank`` sets ``connector_extra_config["device"]`` to each rank's global
    rank (NCCL needs one device per rank).
    """

    def __init__(
        self,
        connector: str = "P2pGlooAFDConnector",
        *,
        host: str = "127.0.0.1",
        run_timeout_s: float = 60.0,
        config: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        device_per_rank: bool = False,
    ) -> None:
        self.connector_name = connector
        self.host = host
        self.run_timeout_s = run_timeout_s
        self.config = {"connect_timeout_s": 30.0, **(config or {})}
        #: give every rank its own accelerator: connector_extra_config["device"] = global rank
        self.device_per_rank = device_per_rank
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        self._env = dict(env or {})
        self._ctx = mp.get_context("spawn")
        self._set: _ProcessSet | None = None
        self._run_ids = itertools.count()

    # -- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> ProcessHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop and reap every child process."""
        self._drop_set()
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def pids(self) -> dict[tuple[str, int], int]:
        """Process ids of the current process set (for tests that kill a rank)."""
        if self._set is None:
            return {}
        return {k: p.pid for k, p in self._set.procs.items()}

    def _drop_set(self) -> None:
        pset, self._set = self._set, None
        if pset is None:
            return
        for key, q in pset.tasks.items():
            if pset.procs[key].is_alive():
                with contextlib.suppress(Exception):
                    q.put(None)
        deadline = time.monotonic() + 3.0
        for proc in pset.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in pset.procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for q in [*pset.tasks.values(), pset.results]:
            q.close()
            q.join_thread()

    def _process_set(self, topology: AFDTopology) -> _ProcessSet:
        if self._set is not None and (self._set.topology != topology or not self._set.alive()):
            self._drop_set()
        if self._set is not None:
            return self._set
        if self._tmpdir is None:
            self._tmpdir = tempfile.TemporaryDirectory(prefix="afd-harness-")
        env = {"TMPDIR": self._tmpdir.name, **self._env}
        pset = _ProcessSet(topology, results=self._ctx.Queue())
        for role in AFDRole:
            for rank in range(topology.size_of(role)):
                key = (role.value, rank)
                pset.tasks[key] = self._ctx.Queue()
                proc = self._ctx.Process(
                    target=_worker_main,
                    args=(role.value, rank, pset.tasks[key], pset.results, env),
                    name=f"afd-{role.value}-{rank}",
                    daemon=True,
                )
                proc.start()
                pset.procs[key] = proc
        self._set = pset
        return pset

    # -- running -----------------------------------------------------------------------
    def run(self, scenario: Any, topology: AFDTopology) -> dict[tuple[str, int], Any]:
        """The :class:`afd_core.testing.conformance.ConnectorHarness` entry point."""
        return self.run_ranks(topology, scenario.run_rank, scenario.config_overrides)

    def run_ranks(
        self,
        topology: AFDTopology,
        body: RankBody,
        overrides: Mapping[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> dict[tuple[str, int], Any]:
        """Run ``body(connector, RankContext)`` on every rank; results by (role, rank)."""
        pset = self._process_set(topology)
        run_id = next(self._run_ids)
        port = free_port(self.host)
        for (role_value, rank), q in pset.tasks.items():
            values = {
                "role": role_value,
                "connector": self.connector_name,
                "host": self.host,
                "port": port,
                "num_attention_ranks": topology.num_attention_ranks,
                "num_ffn_ranks": topology.num_ffn_ranks,
                "rank": rank,
                **self.config,
                **dict(overrides or {}),
            }
            if self.device_per_rank:
                extra = dict(values.get("connector_extra_config") or {})
                extra["device"] = topology.global_rank(role_value, rank)
                values["connector_extra_config"] = extra
            q.put((run_id, values, body, (topology.num_attention_ranks, topology.num_ffn_ranks)))
        limit = self.run_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        results: dict[tuple[str, int], Any] = {}
        dead: dict[tuple[str, int], int | None] = {}
        while len(results) + len(dead) < len(pset.procs):
            try:
                rid, role_value, rank, blob = pset.results.get(timeout=0.1)
            except queue.Empty:
                for key, proc in pset.procs.items():
                    if key not in results and key not in dead and not proc.is_alive():
                        dead[key] = proc.exitcode
                if time.monotonic() > deadline:
                    break
                continue
            if rid == run_id:
                results[(role_value, rank)] = pickle.loads(blob)
        for key, code in dead.items():
            results.setdefault(
                key,
                AFDPeerLostError(f"{key[0]} rank {key[1]}: process exited with code {code}"),
            )
        hung = [k for k in pset.procs if k not in results]
        for key in hung:
            results[key] = AFDTimeoutError(
                f"{key[0]} rank {key[1]} did not finish within {limit:g} s (harness deadline); "
                "its process set was killed"
            )
        if hung or dead:
            self._drop_set()
        return results
