"""Helpers for end-to-end tests: role processes, engines in subprocesses, shared flows.

A deployment a test starts is built as ``afd launch`` builds one: the test's ``afd``
section (raw, as a user passes it to ``afd serve``; aliases allowed) becomes a
:class:`afd.launch.DeploymentSpec` (:func:`deployment_spec`), and afd launch's command
builder (:func:`afd.launch.commands.build_roles`, with a :class:`~afd.launch.commands.Layout`
of free ports and the role's devices) makes each role's command and environment. A test
starts one role of it at a time (:class:`FFNServer`, :class:`Server`), so it can start
roles that do not match (the admission and fingerprint drills) or kill one. Every
process is supervised by afd launch's own stack (:mod:`afd.launch.processes`: process
group, output pump and log file, readiness, SIGTERM-then-SIGKILL teardown with a
leftover check); requests go through :mod:`afd.tools.client`. This module adds waiting
and text output on top.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from afd.launch import DeploymentSpec, assign_devices, detect_cuda_devices, role_tmp_dir
from afd.launch import role_env as launch_role_env
from afd.launch.commands import Layout, build_roles
from afd.launch.processes import RoleProcess as LaunchedRole
from afd.launch.processes import stop_groups
from afd.launch.readiness import FFN, NATIVE
from afd_core.config import AFDConfig
from afd_core.procfs import group_members
from afd_core.roles import AFDRole

_SERIAL = itertools.count()
"""Numbers the log files of the role processes a test starts (names repeat)."""

#: The context length of every engine a test starts (the spec's ``max_model_len``); the
#: rest of the engine settings are afd launch's defaults (bfloat16, 0.1 of a GPU's
#: memory, a 64 MiB KV cache), eager unless a test asks for compiled roles.
MAX_MODEL_LEN = 512

#: ``[afd]`` fields a spec takes as its own top-level fields (field -> spec keyword).
_SPEC_FIELDS = {
    "num_attention_ranks": "num_attention",
    "num_ffn_ranks": "num_ffn",
    "attention_tensor_parallel_size": "attention_tensor_parallel_size",
    "ffn_expert_parallel": "ffn_expert_parallel",
    "compute_gate_on_attention": "compute_gate_on_attention",
}
#: ``[afd]`` fields the launcher sets per role process (the command builder's).
_PER_PROCESS = ("role", "rank", "host", "port")
#: ``afd serve``'s connector where the ``afd`` section names none (afd-core's default;
#: ``afd launch`` would pick shared memory on this host instead).
SERVE_DEFAULT_CONNECTOR = str(AFDConfig.__dataclass_fields__["connector"].default)


def free_port() -> int:
    """A free loopback port outside the ephemeral range (no role's own sockets take it
    before the role that is given it binds it)."""
    from afd_core.ports import free_port as pick

    return pick("127.0.0.1")


#: Variables a test sets on purpose (``monkeypatch.setenv``) for the processes it starts.
_SET_BY_TESTS = (
    "AFD_",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CACHE_ROOT",
    "PYTHONPATH",
    "PATH",
    "PROMETHEUS_MULTIPROC_DIR",
    "TMPDIR",
    "CUDA_VISIBLE_DEVICES",
    "PYTHONUNBUFFERED",
)


def _environ_at_start() -> dict[str, str] | None:
    """This process's environment as it started (``/proc/self/environ``; None elsewhere)."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="surrogateescape")] = value.decode(errors="surrogateescape")
    return env


_START_ENV = _environ_at_start()


def child_environ() -> dict[str, str]:
    """The environment of a process a test starts: this test process's environment as it
    started, with what tests set on purpose (:data:`_SET_BY_TESTS`), and without what
    vLLM and torch wrote into ``os.environ`` while other tests ran them in this process.

    That drift is real and silent: building a DeepSeek-V3.2 config in-process (the sparse
    attention test) sets ``VLLM_USE_BREAKABLE_CUDAGRAPH=1``, and every vLLM started from
    that pytest worker afterwards runs with ``CompilationMode.NONE`` (a compiled
    deployment runs eager); vLLM's CPU platform sets ``LOCAL_WORLD_SIZE``, ``LD_PRELOAD``
    and ``VLLM_WORKER_MULTIPROC_METHOD``, inductor its cache folder and threads.
    """
    env = dict(os.environ)
    if _START_ENV is None:
        return env
    for key in set(env) | set(_START_ENV):
        if env.get(key) == _START_ENV.get(key) or key.startswith(_SET_BY_TESTS):
            continue
        if key in _START_ENV:
            env[key] = _START_ENV[key]
        else:
            del env[key]
    return env


def _base_env() -> dict[str, str]:
    """What a role's environment starts from (afd launch's :class:`Layout` ``base_env``):
    :func:`child_environ`, with vLLM's V1 model runner as ``afd serve`` sets it
    (docs/gpu.md, "Model runner: V1 only"): an Attention role started as vllm.LLM on
    CUDA would otherwise be refused (V2 there)."""
    env = child_environ()
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    return env


@functools.cache
def _plain_spec() -> DeploymentSpec:
    """A spec with no settings of its own: the environment of a process that is no
    deployment's role (``python -m afd.reference``, a helper script)."""
    return DeploymentSpec(model="-", afd={"connector": SERVE_DEFAULT_CONNECTOR})


def role_env(tmp: Path, devices: str | None = None) -> dict[str, str]:
    """A role's environment, as afd launch gives it (:func:`afd.launch.role_env`: the
    deployment's ``TMPDIR``, unbuffered output, no ``VLLM_CPU_KVCACHE_SPACE``);
    ``devices``: its ``CUDA_VISIBLE_DEVICES`` (None: unchanged)."""
    # pytest's tmp paths can be too long for vLLM's IPC socket names: role_tmp_dir.
    return launch_role_env(
        _plain_spec(), AFDRole.ATTENTION, role_tmp_dir(tmp), devices, base=_base_env()
    )


def role_devices(afd: Mapping[str, Any] | None, name: str) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` of one role process, by the rule of ``afd launch``
    (attention ranks first, then FFN ranks; see docs/gpu.md): ``name`` is ``attn`` or
    ``ffn<rank>``; ``afd=None`` is a native engine (the first device). None on a CPU host.
    Raises ``afd.launch.DeploymentError`` when the host has too few devices."""
    values = AFDConfig.canonical(afd or {})
    ranks = (1, 0) if afd is None else (
        int(values.get("num_attention_ranks", 1)), int(values.get("num_ffn_ranks", 1))
    )  # fmt: skip
    return assign_devices(*ranks, detect_cuda_devices()).get(name)


#: vLLM options a test may pass as a role's extra arguments that afd launch sets itself
#: (option -> the spec field that sets it).
_SPEC_OPTIONS = {
    "--dtype": "dtype",
    "--tensor-parallel-size": "attention_tensor_parallel_size",
    "-tp": "attention_tensor_parallel_size",
}


def _spec_fields_of(args: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """``(spec fields, the other args)``: the options of :data:`_SPEC_OPTIONS` in a
    role's extra vLLM arguments become the spec's fields (``--dtype float32``:
    ``dtype="float32"``), as afd launch wants them."""
    fields: dict[str, Any] = {}
    rest: list[str] = []
    items = iter(args)
    for arg in items:
        opt, sep, value = arg.partition("=")
        if opt not in _SPEC_OPTIONS:
            rest.append(arg)
            continue
        value = value if sep else next(items)
        field = _SPEC_OPTIONS[opt]
        fields[field] = value if field == "dtype" else int(value)
    return fields, rest


def deployment_spec(
    model: Path | str,
    afd: Mapping[str, Any] | None,
    *,
    eager: bool = True,
    native: bool = False,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> tuple[DeploymentSpec, dict[str, Any]]:
    """``(the spec, the per-process settings)`` of a test's ``afd`` section: its
    deployment fields (``num_attention_ranks``...) become the spec's top-level fields,
    its ``role`` / ``rank`` / ``host`` / ``port`` are returned apart (the command builder
    sets them per process), the rest is the spec's ``[afd]`` table, with ``afd serve``'s
    default connector where it names none. ``args``: extra vLLM arguments of the roles
    (``--dtype`` and ``--tensor-parallel-size`` become the spec's fields); ``env``:
    added to the roles' environment. A test builds one spec per role it starts, so two
    roles of one deployment may differ (the fingerprint drills)."""
    values = AFDConfig.canonical(afd or {})
    per_process = {k: values.pop(k) for k in _PER_PROCESS if k in values}
    fields = {key: values.pop(f) for f, key in _SPEC_FIELDS.items() if f in values}
    lifted, rest = _spec_fields_of(args)
    fields.update(lifted)
    if not native:
        values.setdefault("connector", SERVE_DEFAULT_CONNECTOR)
    spec = DeploymentSpec(
        model=str(model),
        afd=values,
        enforce_eager=eager,
        max_model_len=MAX_MODEL_LEN,
        native=native,
        vllm_args=rest,
        env=dict(env or {}),
        **fields,
    )
    return spec, per_process


def built_role(
    spec: DeploymentSpec,
    tmp: Path,
    name: str,
    *,
    connector_port: int = 0,
    http_port: int = 0,
    health_ports: Sequence[int] = (),
) -> LaunchedRole:
    """The role process ``name`` (``attn``, ``ffn<rank>`` or ``native0``) of ``spec`` as
    afd launch's command builder makes it (not started): its command, environment (from
    :func:`child_environ`, its devices by afd launch's rule, no CPU binding of its own)
    and URLs."""
    ranks = (1, 0) if spec.native else (spec.num_attention, spec.num_ffn)
    devices = assign_devices(*ranks, detect_cuda_devices())
    if spec.native and "attn" in devices:
        devices["native0"] = devices["attn"]
    layout = Layout(
        http_port=http_port,
        connector_port=connector_port,
        ffn_health_ports=list(health_ports) or [0] * spec.num_ffn,
        devices=devices,
        cpus={},
        tmp_dir=role_tmp_dir(tmp),
        log_dir=tmp / "logs",
        base_env=_base_env(),
    )
    roles = {r.name: r for r in build_roles(spec, layout)}
    return roles[name]


class RoleProcess(LaunchedRole):
    """One role process, supervised as ``afd launch`` supervises its roles
    (:class:`afd.launch.processes.RoleProcess`: its own process group, an output pump into
    a log file, readiness from its health endpoint, group signals), started at once; what
    tests add on top: the whole output as text, waiting and killing.

    Built from any command (``env``: added to :func:`role_env`); the AFD roles of a
    deployment are built by afd launch's command builder (:class:`FFNServer`,
    :class:`Server`)."""

    _lock = threading.Lock()

    def __init__(
        self,
        name: str,
        role: str,
        cmd: list[str],
        tmp: Path,
        devices: str | None = None,
        env: dict[str, str] | None = None,
        *,
        http_url: str | None = None,
    ) -> None:
        full = {**role_env(tmp, devices), **(env or {})}
        self._launch(LaunchedRole(name, role, 0, cmd, full, tmp, http_url=http_url), tmp)

    def _launch(self, built: LaunchedRole, tmp: Path) -> None:
        """Become ``built`` (command, environment, URLs) and start, logging to a file of
        its own (a test may start a role of the same name more than once)."""
        log = tmp / "logs" / f"{built.name}-{next(_SERIAL)}.log"
        LaunchedRole.__init__(
            self, built.name, built.role, built.rank, built.cmd, built.env, log,
            http_url=built.http_url, health_url=built.health_url,
        )  # fmt: skip
        self.start(None, self._lock)

    @property
    def output(self) -> str:
        """Everything the process wrote so far (its log file, without the command line)."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""
        return text.split("\n", 1)[1] if text.startswith("# ") else text

    def kill(self) -> None:
        """SIGKILL to the whole process group (a no-op once it is gone); reap it."""
        if self.group_alive() or self.returncode() is None:
            self.signal(signal.SIGKILL)
        self.finish(10.0)

    def wait_exit(self, timeout: float) -> int | None:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def wait_until(self, ready: Callable[[], bool], timeout: float, what: str, tail: int) -> None:
        """Until ``ready()``; AssertionError with the last ``tail`` characters of the
        output when the process exits first or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            if self.returncode() is not None:
                self.join_output(2.0)
                raise AssertionError(f"{what} exited {self.returncode()}:\n{self.output[-tail:]}")
            time.sleep(0.2)
        raise AssertionError(f"{what} not ready in {timeout} s:\n{self.output[-tail:]}")


class FFNServer(RoleProcess):
    """``afd serve --role ffn`` (headless FFN role) of rank ``afd["rank"]`` (default 0),
    as afd launch's command builder starts it."""

    def __init__(
        self,
        model: Path,
        afd: dict[str, Any],
        tmp: Path,
        *extra: str,
        env: dict[str, str] | None = None,
        eager: bool = True,
        health_port: int | None = None,
    ) -> None:
        """``extra``: vLLM arguments after the spec's; ``env``: added to its environment;
        ``eager=False``: the engine settings of a compiled deployment (the FFN role
        computes its blocks eagerly either way, but with the custom-op choices of
        vLLM's compile mode, as its compiled Attention peer and native vLLM do);
        ``health_port``: its ``/health`` and ``/metrics`` port (default: a free one)."""
        spec, own = deployment_spec(model, afd, eager=eager, args=extra, env=env)
        rank = int(own.get("rank", 0))
        self.health_port = free_port() if health_port is None else health_port
        ports = [self.health_port if f == rank else free_port() for f in range(spec.num_ffn)]
        built = built_role(
            spec, tmp, f"ffn{rank}", connector_port=int(own.get("port", 0)), health_ports=ports
        )
        self._launch(built, tmp)

    def wait_ready(self, timeout: float = 240) -> None:
        """Until the FFN server loaded its model and listens for its attention peers (it
        logs its readiness marker; its ``/health`` turns 200 only once they connected)."""
        marker = FFN.marker
        assert marker is not None

        def loaded() -> bool:
            return any(marker in ln for ln in self.last_lines(200))

        self.wait_until(loaded, timeout, "FFN server", 4000)


#: How long an engine run to its end or a server's start may take: under the 285 s
#: per-test limit (pytest-timeout, ``timeout`` in pyproject.toml), leaving the test time
#: to report; compiled runs are asked only by tests marked ``timeout(1200)``.
ENGINE_S = 240.0
COMPILED_ENGINE_S = 600.0


def offline_greedy(
    model: Path,
    out: Path,
    tmp: Path,
    llm_kwargs: dict[str, Any] | None = None,
    timeout: float = ENGINE_S,
    *,
    prompts: list[str] | None = None,
    dtype: str | None = None,
) -> dict[str, Any]:
    """``python -m afd.reference`` (vllm.LLM, eager, greedy) in a fresh process: the
    Attention role when ``llm_kwargs`` has an ``afd`` section, else native vLLM.
    ``prompts``: instead of the fixed prompts; ``dtype``: instead of bfloat16."""
    cmd = [sys.executable, "-m", "afd.reference", str(model), "--json", str(out)]
    if prompts is not None:
        prompts_file = out.with_suffix(".prompts.json")
        prompts_file.write_text(json.dumps(prompts))
        cmd += ["--prompts-file", str(prompts_file)]
    if dtype is not None:
        cmd += ["--dtype", dtype]
    if llm_kwargs:
        cmd += ["--llm-kwargs", json.dumps(llm_kwargs)]
    afd = (llm_kwargs or {}).get("additional_config", {}).get("afd")
    role = NATIVE if afd is None else "attention"
    code, log = run_to_exit(cmd, tmp, role, role_devices(afd, "attn"), timeout=timeout)
    assert code == 0, (
        f"exit code {code} (None: still running after {timeout:.0f} s):\n{log[-9000:]}"
    )
    result: dict[str, Any] = json.loads(out.read_text())
    result["log"] = log
    return result


def run_to_exit(
    cmd: list[str],
    tmp: Path,
    role: str,
    devices: str | None = None,
    env: dict[str, str] | None = None,
    *,
    timeout: float,
) -> tuple[int | None, str]:
    """Run an engine process that ends by itself (``python -m afd.reference``) as a role
    process (:class:`RoleProcess`); its exit code (None: still running after ``timeout``,
    then killed with its process group) and its output."""
    engine = RoleProcess("engine", role, cmd, tmp, devices, env)
    try:
        code = engine.wait_exit(timeout)
        engine.join_output(5.0)
        return code, engine.output
    finally:
        engine.kill()


class Server(RoleProcess):
    """An OpenAI-compatible vLLM API server (native, or ``afd serve --role attention``),
    as afd launch's command builder starts it (:meth:`native`, :meth:`afd_attention`)."""

    def __init__(self, built: LaunchedRole, port: int, tmp: Path) -> None:
        self.port = port
        self._launch(built, tmp)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def native(cls, model: Path, tmp: Path, *extra: str) -> Server:
        """afd launch's native baseline server; ``extra``: vLLM arguments after the spec's."""
        spec, _ = deployment_spec(model, None, native=True, args=extra)
        port = free_port()
        return cls(built_role(spec, tmp, "native0", http_port=port), port, tmp)

    @classmethod
    def afd_attention(cls, model: Path, afd: dict[str, Any], tmp: Path, *extra: str) -> Server:
        """afd launch's attention server (``--data-parallel-size`` for several attention
        ranks); ``extra``: vLLM arguments after the spec's."""
        spec, own = deployment_spec(model, afd, args=extra)
        port = free_port()
        built = built_role(
            spec, tmp, "attn", connector_port=int(own.get("port", 0)), http_port=port
        )
        return cls(built, port, tmp)

    def wait_ready(self, timeout: float = ENGINE_S) -> None:
        """Until its ``/health`` answers 200 (afd launch's readiness of the role)."""
        self.wait_until(self.check_ready, timeout, "server", 30000)

    def complete(self, prompt: str, max_tokens: int = 32) -> list[int]:
        """Greedy completion of one prompt; the generated token ids."""
        from afd.tools.client import complete

        return complete(
            self.url, prompt, max_tokens, model=self.served_model, timeout=300
        ).token_ids

    @property
    def served_model(self) -> str:
        from afd.tools.client import served_model

        return served_model(self.url)


def http_get(url: str, timeout: float = 10) -> tuple[int | None, str]:
    """``(status, body)`` of a GET; status None when nothing answers."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode()
    except OSError as e:
        return None, str(e)


def metric_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``GET url`` (Prometheus text format) parsed by prometheus_client's parser:
    (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http_get(url)
    assert status == 200, (status, body[-2000:])
    return {
        (s.name, tuple(sorted(s.labels.items()))): float(s.value)
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def settled_metric_samples(
    url: str, *, quiet_s: float = 0.3, timeout_s: float = 15.0
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """:func:`metric_samples` of ``url`` once two scrapes ``quiet_s`` apart agree.

    An FFN rank records a layer in its metrics just after it has sent the result back,
    so right after a completion returns the last layer may not be counted yet (by
    microseconds, or longer when the roles share CPUs and the attention side runs first).
    """
    from afd.tools.bench_metrics import settled

    return settled(lambda: metric_samples(url), quiet_s=quiet_s, timeout_s=timeout_s)


class HealthWatch(threading.Thread):
    """Polls ``GET url`` every 20 ms; records each change of (status, body); status
    None (nothing answers) with an empty body."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.changes: list[tuple[int | None, str]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            status, body = http_get(self.url, timeout=2)
            seen = (status, body.strip() if status is not None else "")
            if not self.changes or self.changes[-1] != seen:
                self.changes.append(seen)
            time.sleep(0.02)

    def wait_for(self, seen: tuple[int | None, str], timeout: float = 30.0) -> bool:
        """Whether the latest change is ``seen`` within ``timeout`` (the poller may lag
        behind the server on a busy host)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.changes and self.changes[-1] == seen:
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> list[tuple[int | None, str]]:
        self._stop_event.set()
        self.join(5)
        return self.changes

    def statuses(self) -> list[int | None]:
        """The statuses seen, in order, repeats collapsed."""
        out: list[int | None] = []
        for status, _ in self.changes:
            if not out or out[-1] != status:
                out.append(status)
        return out


def stop_roles(roles: list[RoleProcess], grace_s: float = 10.0) -> dict[str, Any]:
    """Stop the roles as ``afd launch`` stops a deployment (SIGTERM to every process
    group at once, SIGKILL after ``grace_s``: :func:`afd.launch.processes.stop_groups`);
    return {role name: exit code}, plus ``"leftovers"``: the processes still alive."""
    survivors = stop_groups(roles, grace_s, lambda _msg: None)
    codes: dict[str, Any] = {r.name: r.returncode() for r in roles}
    codes["leftovers"] = survivors
    return codes


# ---------------------------------------------------------------- shared e2e flows


def stop_cleanly(attention: RoleProcess, ffn: RoleProcess) -> None:
    """SIGTERM both roles (:func:`stop_roles`); assert no process survived and both
    exited 0."""
    codes = stop_roles([attention, ffn], grace_s=10)
    assert codes.pop("leftovers") == {}, "processes survived SIGTERM"
    assert set(codes.values()) == {0}, (codes, attention.output[-2000:], ffn.output[-2000:])


def afd_settings(gate: str, **extra: Any) -> dict[str, Any]:
    """The ``afd`` section for a gate placement: ``ffn``, ``attention-topk`` or
    ``attention-router_logits``; a fresh rendezvous port every time."""
    afd: dict[str, Any] = {"port": free_port(), "connect_timeout_s": 300, **extra}
    if gate.startswith("attention"):
        afd["compute_gate_on_attention"] = True
        afd["routing_payload"] = gate.split("-", 1)[1]
    elif gate != "ffn":
        raise ValueError(f"unknown gate placement {gate!r}")
    return afd


def run_offline_afd(
    model: Path,
    alias: str,
    afd: dict[str, Any],
    tmp: Path,
    *,
    prompts: list[str] | None = None,
    dtype: str | None = None,
    compiled: bool = False,
) -> tuple[dict[str, Any], str]:
    """1 FFN server + the Attention role as a ``vllm.LLM`` engine generating the fixed
    prompts (or ``prompts``) in one batch. Returns (result, FFN log); the FFN must leave
    on its own (0). With ``afd["num_micro_batches"]`` > 1 the Attention role gets the AFD
    worker, as ``afd serve`` gives it. ``compiled``: the Attention role in vLLM's default
    compile mode (else eager)."""
    ffn_extra = ["--dtype", dtype] if dtype else []
    ffn = FFNServer(model, {**afd, "role": "ffn"}, tmp, *ffn_extra, eager=not compiled)
    llm_kwargs: dict[str, Any] = {
        "hf_overrides": {"architectures": [alias]},
        "additional_config": {"afd": {**afd, "role": "attention"}},
    }
    if compiled:
        llm_kwargs["enforce_eager"] = False
    if int(afd.get("num_micro_batches", 1)) > 1:
        llm_kwargs["worker_cls"] = "afd.runtime.worker.AFDCPUWorker"
    try:
        ffn.wait_ready()
        try:
            timeout = COMPILED_ENGINE_S if compiled else ENGINE_S
            result = offline_greedy(
                model, tmp / "afd.json", tmp, llm_kwargs, timeout, prompts=prompts, dtype=dtype
            )
        except AssertionError as exc:
            # the Attention role's failure may come from its peer: show both
            raise AssertionError(f"{exc}{role_logs(FFN=ffn)}") from None
        assert ffn.wait_exit(timeout=30) == 0, ffn.output[-3000:]
    finally:
        ffn.kill()
    return result, ffn.output


def role_logs(tail: int = 4000, **roles: RoleProcess) -> str:
    """The end (``tail`` characters) of each role's log, headed by its name, for a
    failure message whose cause may be in a role process."""
    return "".join(
        f"\n--- {name} role's log (end) ---\n{role.output[-tail:]}" for name, role in roles.items()
    )


def _complete_or_show_logs(attention: Server, ffn: RoleProcess, prompt: str) -> list[int]:
    """``attention.complete(prompt)``; when it fails (an HTTP 500 names no cause), the
    failure carries the end of both roles' logs, where the cause is."""
    try:
        return attention.complete(prompt)
    except (RuntimeError, OSError) as exc:
        raise AssertionError(f"{exc}{role_logs(6000, Attention=attention, FFN=ffn)}") from None


def run_served_afd(
    model: Path,
    afd: dict[str, Any],
    tmp: Path,
    prompts: list[str],
    *,
    idle_s: float = 0.0,
    between: Any = None,
) -> tuple[list[list[int]], str, str]:
    """1 FFN server + ``afd serve --role attention`` (with ``--data-parallel-size`` when
    ``afd["num_attention_ranks"] > 1``); the prompts are sent one at a time (with
    ``idle_s``: the deployment sits idle that long after the first half, and both roles
    must still be running; ``between(afd)``, when given, runs there too); then SIGTERM
    must stop every process within 10 s with exit code 0 and nothing left behind.
    Returns (token ids per prompt, attention log, FFN log)."""
    ffn = FFNServer(model, {**afd, "role": "ffn"}, tmp)
    attention = Server.afd_attention(model, {**afd, "role": "attention"}, tmp)
    try:
        ffn.wait_ready()
        attention.wait_ready()
        half = len(prompts) // 2 if idle_s or between else len(prompts)
        got = [_complete_or_show_logs(attention, ffn, p) for p in prompts[:half]]
        if between is not None:
            between(afd)
        if idle_s or between:
            time.sleep(idle_s)
            for role in (ffn, attention):
                assert role.returncode() is None, (
                    f"a role exited while the deployment was idle:\n{role.output[-3000:]}"
                )
            got += [_complete_or_show_logs(attention, ffn, p) for p in prompts[half:]]
        stop_cleanly(attention, ffn)
    finally:
        attention.kill()
        ffn.kill()
    return got, attention.output, ffn.output


def rogue_join(port: int, tmp: Path, token: str | None) -> subprocess.CompletedProcess[str]:
    """Run ``afd_rogue.py`` against the rendezvous at ``port`` with ``token`` (or none)."""
    env = role_env(tmp)
    env.pop("AFD_AUTH_TOKEN", None)
    if token is not None:
        env["AFD_AUTH_TOKEN"] = token
    script = Path(__file__).with_name("afd_rogue.py")
    return subprocess.run(
        [sys.executable, str(script), str(port)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip


def assert_same_tokens(
    got: list[list[int]],
    want: list[list[int]],
    prompts: list[str],
    what: str = "native vLLM",
    *,
    min_prompts: int = 8,
    max_tokens: int = 32,
) -> None:
    assert len(prompts) >= min_prompts
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert len(w) == max_tokens
        assert g == w, f"prompt {i} ({prompts[i]!r}) diverged from {what}"


def inventory(log: str, role: str) -> dict[str, int]:
    """The last ``AFD <role> role parameter inventory`` a live process logged."""
    lines = re.findall(rf"AFD {role} role parameter inventory: ([^;]*);", log)
    assert lines, f"no {role} inventory line in the log:\n{log[-3000:]}"
    return {k: int(v) for k, v in (item.split("=") for item in lines[-1].split())}


def served_layers(ffn_log: str) -> int:
    found = re.findall(r"served (\d+) layer messages", ffn_log)
    assert found, f"no 'served N layer messages' line in the FFN log:\n{ffn_log[-3000:]}"
    return int(found[-1])


def assert_role_inventories(attention_log: str, ffn_log: str, *, gate_on_attention: bool) -> None:
    """Attention holds no expert, shared-expert or dense-MLP parameters (the gate only with
    the gate on Attention); the FFN holds no attention or embedding parameters."""
    attn = inventory(attention_log, "attention")
    for category in ("routed_experts", "shared_experts", "dense_mlp"):
        assert attn.get(category, 0) == 0, attn
    assert (attn.get("gate", 0) > 0) == gate_on_attention, attn
    assert attn.get("attention", 0) > 0, attn
    ffn = inventory(ffn_log, "ffn")
    assert ffn.get("attention", 0) == 0 and ffn.get("embedding", 0) == 0, ffn
    assert ffn.get("routed_experts", 0) > 0, ffn


# ---------------------------------------------------------------- afd launch


class Launcher(RoleProcess):
    """``afd launch SPEC [ARGS]`` (the command under test) as a subprocess in its own
    process group, supervised like a role (:class:`RoleProcess`). ``env``: added to this
    process's environment."""

    def __init__(
        self, spec: Path, tmp: Path, *args: str, env: dict[str, str] | None = None
    ) -> None:
        full = {**child_environ(), "TMPDIR": str(tmp), **(env or {})}
        full.setdefault("VLLM_CACHE_ROOT", str(Path(__file__).parents[2] / ".cache" / "vllm"))
        cmd = [sys.executable, "-m", "afd.cli", "launch", str(spec), *args]
        log = tmp / "logs" / f"launcher-{next(_SERIAL)}.log"
        LaunchedRole.__init__(self, "launcher", NATIVE, 0, cmd, full, log)
        self.start(None, self._lock)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str] | None:
        """The first match of ``pattern`` (multi-line) in the output, waiting until it
        shows, the launcher exits, or ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            exited = self.returncode() is not None
            if exited:
                self.join_output(5.0)
            m = re.search(pattern, self.output, re.M)
            if m or exited or time.monotonic() > deadline:
                return m
            time.sleep(0.5)

    def role_pgids(self) -> dict[str, int]:
        return {
            m[1]: int(m[2]) for m in re.finditer(r"^\[afd\] (\w+): pid (\d+)", self.output, re.M)
        }

    def kill_all(self) -> None:
        assert self.pgid is not None
        for pgid in [*self.role_pgids().values(), self.pgid]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        self.finish(10.0)


def group_pgid_members(pgids: list[int]) -> list[int]:
    """The live processes of the process groups ``pgids``."""
    return [pid for g in pgids for pid in group_members(g)]
