"""``afd launch --ray``, one role process on Ray: :class:`RoleActor`, the Ray actor that
runs it on its node (reports the node, reserves its ports, runs the role's command in a
process group of its own under a guard, keeps its output for the launcher), and
:class:`RayRoleProcess`, the launcher's handle of it (started, read, signalled and
checked through the actor). The deployment (placement group, ports, layout, teardown)
is :mod:`afd.launch.ray`."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from afd.launch.cpus import CPU_BIND, bind_affinity, usable_cpus
from afd.launch.errors import DeploymentError
from afd.launch.placement import NodeInfo
from afd.launch.ports import reserve_ports
from afd.launch.processes import RoleProcess, role_tmp_dir
from afd_core.procfs import group_members, process_start

__all__ = ["ACTOR_GONE", "RAY_INSTALL_HINT", "RayRoleProcess", "RoleActor", "import_ray"]

RAY_INSTALL_HINT = "pip install 'afd[ray]'"
ACTOR_GONE = -1
"""The exit code reported for a role whose Ray actor died (its process is then stopped
by its guard on its node)."""
GRACE_S = 10.0
POLL_S = 0.2
CALL_TIMEOUT_S = 30.0
# What Ray puts in its workers' environment that the role processes must not inherit:
# its cluster token, and OMP_NUM_THREADS (1 for an actor with fractional CPUs; vLLM sizes
# its threads itself, from VLLM_CPU_OMP_THREADS_BIND). The spec's env may set them.
_NODE_ENV_DROPPED = ("RAY_AUTH_TOKEN", "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE")


def _why(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:300]


def import_ray() -> Any:
    """The ``ray`` module, or a :class:`DeploymentError` naming the extra to install."""
    try:
        import ray
    except ImportError as exc:
        raise DeploymentError(
            f"afd launch --ray (or a [ray] table) needs Ray: {RAY_INSTALL_HINT} "
            f"({type(exc).__name__}: {exc}); without Ray, `afd launch --no-ray` runs the "
            "same spec on this host"
        ) from None
    return ray


# ----------------------------------------------------------------- on the node


class RoleActor:
    """One role process on a Ray node (wrapped by ``ray.remote`` when a deployment
    starts; a threaded actor, so that reads and signals do not wait for each other)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.pgid: int | None = None
        self.tmp_root: str | None = None
        self._lines: list[str] = []
        self._first = 0  # the index of _lines[0] in the role's output
        self._lock = threading.Lock()
        self._pump: threading.Thread | None = None

    def node(self) -> dict[str, Any]:
        """Where this actor runs (the fields of :class:`NodeInfo`)."""
        import ray

        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "cpus": tuple(usable_cpus()),
            "gpus": tuple(str(g) for g in ray.get_gpu_ids()),
            "cpu_bind": os.environ.get(CPU_BIND),
        }

    def reserve_ports(
        self, host: str, wanted: list[tuple[str, int, str]], avoid: list[int]
    ) -> list[int]:
        return reserve_ports(host, wanted, avoid=avoid)

    def start(self, cmd: list[str], env: dict[str, str], grace_s: float) -> int:
        """Start the role's command (with this node's Python) in a process group of its
        own, its guard, and the output pump; the role's pid (= its process group)."""
        self.tmp_root = tempfile.mkdtemp(prefix=f"afd-ray-{self.name}-")
        tmp = role_tmp_dir(Path(self.tmp_root))
        full = {k: v for k, v in os.environ.items() if k not in _NODE_ENV_DROPPED}
        full.update(env)
        full["TMPDIR"] = str(tmp)
        self.proc = subprocess.Popen(
            [sys.executable, *cmd[1:]],
            env=full,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.pgid = self.proc.pid
        affinity = bind_affinity(full.get(CPU_BIND, ""))
        if affinity is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(self.proc.pid, affinity)
        me = os.getpid()
        guard = subprocess.Popen(
            [sys.executable, "-m", "afd.launch.guard", str(me), process_start(me) or "",
             str(self.pgid), str(grace_s)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        guard.wait(timeout=60)  # it detaches at once; its child watches
        self._pump = threading.Thread(target=self._read_output, daemon=True)
        self._pump.start()
        return self.pgid

    def _read_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            with self._lock:
                self._lines.append(raw.decode("utf-8", errors="replace"))

    def read(self, cursor: int, limit: int = 2000) -> tuple[list[str], int, int | None]:
        """``(output lines from cursor on, the next cursor, exit code)``: the exit code
        once the role has exited and every line of it was read, else None. Lines before
        ``cursor`` (read already) are dropped."""
        with self._lock:
            drop = max(0, min(cursor - self._first, len(self._lines)))
            del self._lines[:drop]
            self._first += drop
            lines = self._lines[:limit]
            done = not (self._pump is not None and self._pump.is_alive())
            rc = self.proc.poll() if self.proc is not None and done else None
            if len(lines) < len(self._lines):
                rc = None
        return lines, self._first + len(lines), rc

    def signal(self, sig: int) -> None:
        if self.pgid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, sig)

    def leftovers(self) -> list[int]:
        if self.proc is not None:
            self.proc.poll()  # reap it
        return [] if self.pgid is None else group_members(self.pgid)

    def cleanup(self) -> None:
        if self.tmp_root is not None:
            shutil.rmtree(self.tmp_root, ignore_errors=True)


@functools.cache
def _remote_actor_class() -> Any:
    return import_ray().remote(max_concurrency=4, max_restarts=0)(RoleActor)


# ----------------------------------------------------------------- the launcher side


class RayRoleProcess(RoleProcess):
    """A role process run by a :class:`RoleActor`: started, read, signalled and checked
    through the actor."""

    actor: Any = None
    node: NodeInfo | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rc: int | None = None
        self.actor_gone: str | None = None
        """Why the actor is gone (its error), once it is."""

    def _ray(self) -> Any:
        return import_ray()

    def _call(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        ray = self._ray()
        return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)

    def start(self, console: IO[str] | None, lock: threading.Lock) -> None:
        log = self.open_log()
        try:
            self.pgid = self._call("start", self.cmd, self.env, GRACE_S, timeout=120.0)
        except Exception as exc:
            log.close()
            where = f" on {self.node.label}" if self.node else ""
            raise DeploymentError(
                f"{self.name}: its Ray actor could not start the role{where}: {_why(exc)}"
            ) from None
        except BaseException:
            log.close()
            raise
        self._pump = threading.Thread(
            target=self._poll_output,
            args=(log, console, lock),
            name=f"afd-log-{self.name}",
            daemon=True,
        )
        self._pump.start()

    def _poll_output(self, log: IO[str], console: IO[str] | None, lock: threading.Lock) -> None:
        ray = self._ray()
        cursor = 0
        try:
            while True:
                try:
                    lines, cursor, rc = self._call("read", cursor)
                except ray.exceptions.GetTimeoutError:
                    continue
                except ray.exceptions.RayError as exc:
                    self.actor_gone = _why(exc)
                    return
                for line in lines:
                    self.emit(line, log, console, lock)
                if rc is not None:
                    self._rc = rc
                    return
                if not lines:
                    time.sleep(POLL_S)
        finally:
            log.close()

    def returncode(self) -> int | None:
        if self._rc is not None:
            return self._rc
        return ACTOR_GONE if self.actor_gone is not None else None

    def exit_description(self) -> str:
        if self._rc is None and self.actor_gone is not None:
            where = f" on {self.node.label}" if self.node else ""
            return f"lost its Ray actor{where} ({self.actor_gone})"
        return f"exited with code {self._rc}"

    def signal(self, sig: signal.Signals) -> None:
        if self.actor_gone is None:
            with contextlib.suppress(Exception):
                self._call("signal", int(sig), timeout=10.0)

    def leftovers(self) -> list[int]:
        if self.actor_gone is not None:
            return []  # its guard stops what is left (see exit_description)
        try:
            return list(self._call("leftovers", timeout=10.0))
        except self._ray().exceptions.RayError as exc:
            self.actor_gone = self.actor_gone or _why(exc)
            return []

    def finish(self, timeout: float) -> None:
        self.join_output(max(timeout, 2.0))
