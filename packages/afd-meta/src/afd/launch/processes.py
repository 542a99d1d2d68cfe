"""The role processes of a deployment: their environment, start-up in a process group of
their own, output pump (console prefix + log file), readiness and teardown."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from afd.launch.cpus import CPU_BIND, CPU_LIST, SHARED_OMP_ENV, bind_affinity, omp_bind_env
from afd.launch.devices import CUDA_VISIBLE_DEVICES
from afd.launch.readiness import PREFILL, readiness_of
from afd.launch.spec import DeploymentSpec
from afd_core.procfs import group_members
from afd_core.roles import AFDRole

__all__ = [
    "MAX_TMPDIR_LEN",
    "RoleProcess",
    "prefix_lines",
    "role_env",
    "role_tmp_dir",
    "stop_groups",
]

TAIL_LINES = 30


def prefix_lines(prefix: str, text: str) -> str:
    """Every line of ``text`` with ``prefix`` in front (a trailing newline kept)."""
    if not text:
        return ""
    lines = text.splitlines(keepends=True)
    out = "".join(prefix + line for line in lines)
    return out if out.endswith("\n") else out + "\n"


def role_env(
    spec: DeploymentSpec,
    role: AFDRole | str,
    tmp_dir: Path,
    devices: str | None = None,
    cpus: str | None = None,
    *,
    base: Mapping[str, str] | None = None,
    shared: bool = False,
) -> dict[str, str]:
    """Environment of one role process; ``devices``: its ``CUDA_VISIBLE_DEVICES``
    (from :func:`assign_devices`), ``cpus``: its ``VLLM_CPU_OMP_THREADS_BIND`` (from
    :func:`assign_cpus`); the role's own ``env`` still wins. An FFN process bound to a
    CPU list also gets the matching OpenMP settings (:func:`omp_bind_env`). ``base``:
    the environment it starts from (default: this process's; a Ray role: only what the
    launcher adds to its node's environment). ``shared``: another role process uses
    some of these CPUs too, so OpenMP threads stop spinning soon (:data:`SHARED_OMP_ENV`,
    unless the environment or the spec sets those variables)."""
    # The prefill instance of a [prefill] spec (afd.launch.spec_prefill) is no AFD role:
    # its own table's env instead of a role's.
    prefill = str(role) == PREFILL
    own = spec.prefill.env if prefill and spec.prefill is not None else {}
    role = AFDRole.ATTENTION if prefill else AFDRole(role)
    if not prefill:
        own = spec.overrides(role).env
    env = dict(os.environ if base is None else base)
    inherited = set(env)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # whole GiB; it overrides kv_cache_memory_bytes
    env["TMPDIR"] = str(tmp_dir)
    env["PYTHONUNBUFFERED"] = "1"
    if "VLLM_TARGET_DEVICE" not in env and _is_vllm_cpu_dist():
        env["VLLM_TARGET_DEVICE"] = "cpu"
    env.update(spec.env)
    if devices is not None:
        env[CUDA_VISIBLE_DEVICES] = devices
    if cpus is not None:
        env[CPU_BIND] = cpus
    env.update(own)
    bind = env.get(CPU_BIND, "")
    if role is AFDRole.FFN and not prefill and CPU_LIST.match(bind.replace(" ", "")):
        # The FFN server runs its worker in its own process (UniProcExecutor), where vLLM
        # does not apply VLLM_CPU_OMP_THREADS_BIND (only its multiprocess executor does,
        # for the worker processes it starts): set what vLLM would set there. Settings
        # given in the spec's env win.
        given = {**spec.env, **spec.ffn.env}
        with contextlib.suppress(ValueError):  # not a CPU list after all: leave it to vLLM
            for k, v in omp_bind_env(bind, env.get("LD_PRELOAD", "")).items():
                if k not in given:
                    env[k] = v
    if shared:
        given = {**spec.env, **own}
        for k, v in SHARED_OMP_ENV.items():
            if k not in given and k not in inherited:
                env[k] = v
    return env


# vLLM binds ZMQ IPC sockets at $TMPDIR/<uuid4> (36 characters); a Unix socket path
# has at most 107 characters.
MAX_TMPDIR_LEN = 107 - 37 - 8


def role_tmp_dir(work_dir: Path) -> Path:
    """The TMPDIR of a deployment's roles: ``work_dir/tmp``, or a fresh folder in /tmp
    when that path is too long for vLLM's IPC socket names."""
    tmp = work_dir / "tmp"
    if len(str(tmp)) > MAX_TMPDIR_LEN:
        return Path(tempfile.mkdtemp(prefix="afd-", dir="/tmp"))
    tmp.mkdir(parents=True, exist_ok=True)
    return tmp


def _is_vllm_cpu_dist() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    for name, result in (("vllm", False), ("vllm-cpu", True)):
        try:
            version(name)
            return result
        except PackageNotFoundError:
            continue
    return False


#: Lines of vLLM's start-up log that open a phase the launcher reports (marker, phase).
#: The compile warm-up is the long one: about a minute per role on a tiny checkpoint the
#: first time, seconds once vLLM's compile cache (``VLLM_CACHE_ROOT``) has the graph.
START_PHASES = (
    ("Warming up model for the compilation", "compile warm-up started"),
    ("Dynamo bytecode transform time", "graph traced, inductor compiling"),
    ("Directly load AOT compilation", "compiled graph loaded from vLLM's compile cache"),
    ("Warming up done.", "compile warm-up done"),
)


class RoleProcess:
    """One role process: its command, output pump, log file and readiness."""

    def __init__(
        self,
        name: str,
        role: AFDRole | str,
        rank: int,
        cmd: list[str],
        env: dict[str, str],
        log_path: Path,
        *,
        http_url: str | None = None,
        health_url: str | None = None,
    ) -> None:
        self.name = name
        self.readiness = readiness_of(role)
        """How to tell that it is ready (per kind of role: :mod:`afd.launch.readiness`)."""
        self.role: AFDRole | str = self.readiness.role or self.readiness.name
        self.rank = rank
        self.cmd = cmd
        self.env = env
        self.log_path = log_path
        self.http_url = http_url
        self.health_url = health_url if health_url is not None else http_url
        """Base URL whose ``GET /health`` answers 200 once the role is ready."""
        self.proc: subprocess.Popen[bytes] | None = None
        self.pgid: int | None = None
        self.ready = False
        self.ready_at: float | None = None
        self.last_health = ""
        """What the role's last ``GET /health`` answered (its first line), for messages."""
        self.tail: collections.deque[str] = collections.deque(maxlen=200)
        self.phases: collections.deque[str] = collections.deque()
        """Start-up phases seen in the output (:data:`START_PHASES`) and not yet reported."""
        self.phase = ""
        """The latest start-up phase seen."""
        self._pump: threading.Thread | None = None

    @property
    def prefix(self) -> str:
        return f"[{self.name}] "

    def start(self, console: IO[str] | None, lock: threading.Lock) -> None:
        log = self.open_log()
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: signals reach all its children
        )
        self.pgid = self.proc.pid
        affinity = bind_affinity(self.env.get(CPU_BIND, ""))
        if affinity is not None:
            # Set before the interpreter has started a thread or a child (it is still
            # importing), so every process and thread of the role inherits it.
            with contextlib.suppress(OSError):  # a CPU the host lacks: vLLM reports it
                os.sched_setaffinity(self.proc.pid, affinity)
        self._pump = threading.Thread(
            target=self._pump_output,
            args=(log, console, lock),
            name=f"afd-log-{self.name}",
            daemon=True,
        )
        self._pump.start()

    def open_log(self) -> IO[str]:
        """The role's log file, opened for writing, its first line the command."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w", encoding="utf-8")
        log.write(f"# {' '.join(self.cmd)}\n")
        log.flush()
        return log

    def emit(self, line: str, log: IO[str], console: IO[str] | None, lock: threading.Lock) -> None:
        """One line of the role's output: to its tail, its log file and (prefixed) the
        console."""
        if not line.endswith("\n"):
            line += "\n"
        self.tail.append(line)
        for marker, phase in START_PHASES:
            if marker in line:
                self.phase = phase
                self.phases.append(phase)
        log.write(line)
        log.flush()
        if console is not None:
            with lock, contextlib.suppress(Exception):
                console.write(self.prefix + line)
                console.flush()

    def _pump_output(self, log: IO[str], console: IO[str] | None, lock: threading.Lock) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            for raw in iter(self.proc.stdout.readline, b""):
                self.emit(raw.decode("utf-8", errors="replace"), log, console, lock)
        finally:
            log.close()

    def join_output(self, timeout: float = 5.0) -> None:
        if self._pump is not None:
            self._pump.join(timeout)

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def exit_description(self) -> str:
        """How the role ended, for messages (``exited with code 1``)."""
        return f"exited with code {self.returncode()}"

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to every process of the role (its process group)."""
        signal_group(self.pgid, sig)

    def finish(self, timeout: float) -> None:
        """Reap the role's process and let its output pump drain (after a stop)."""
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        self.join_output(2.0)

    def leftovers(self) -> list[int]:
        """The role's processes still alive (none: ``[]``)."""
        return [] if self.pgid is None else group_members(self.pgid)

    def check_ready(self) -> bool:
        if self.ready:
            return True
        ok = False
        if self.health_url is not None:
            ok, self.last_health = self.readiness.probe(self.health_url)
        if ok:
            self.ready = True
            self.ready_at = time.monotonic()
        return ok

    def last_lines(self, n: int = TAIL_LINES) -> list[str]:
        return list(self.tail)[-n:]

    def group_alive(self) -> bool:
        """Whether any (non-zombie) process of this role's process group is left."""
        if self.pgid is None:
            return False
        return bool(self.leftovers())


def signal_group(pgid: int | None, sig: signal.Signals) -> None:
    if pgid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_groups(
    started: Sequence[RoleProcess], grace_s: float, say: Callable[[str], None]
) -> dict[str, list[int]]:
    """SIGTERM the process group of every started role, SIGKILL those left after
    ``grace_s``; the processes still left after that, per role (none: ``{}``)."""
    if started:
        say("stopping: SIGTERM to " + ", ".join(r.name for r in started))
    for r in started:
        r.signal(signal.SIGTERM)
    _reap_until(started, time.monotonic() + grace_s)
    for r in [r for r in started if r.group_alive()]:
        say(f"{r.name}: still running after {grace_s:.0f} s; SIGKILL")
        r.signal(signal.SIGKILL)
    _reap_until(started, time.monotonic() + 5.0)
    for r in started:
        r.finish(1.0)
    survivors = {r.name: r.leftovers() for r in started}
    return {k: v for k, v in survivors.items() if v}


def _reap_until(roles: Sequence[RoleProcess], deadline: float) -> None:
    """Reap our direct children until no process of the roles' groups is left, or
    ``deadline``."""
    while time.monotonic() < deadline and any(r.group_alive() for r in roles):
        for r in roles:
            r.returncode()
        time.sleep(0.1)
