"""The deployment: start the role processes of a spec, wait until every one is ready,
watch them and tear them down."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from afd.launch.commands import Layout, build_roles, give_token
from afd.launch.cpus import usable_cpus
from afd.launch.devices import detect_cuda_devices
from afd.launch.errors import DeploymentError
from afd.launch.placement import device_lines, plan_cpus, plan_devices
from afd.launch.ports import allocate_health_ports, allocate_ports, reserve_ports
from afd.launch.processes import RoleProcess, role_tmp_dir, stop_groups
from afd.launch.readiness import PROXY
from afd.launch.spec import DeploymentSpec

__all__ = ["Deployment"]


class Deployment:
    """Start, watch and stop the processes of one :class:`DeploymentSpec`.

    ``with Deployment(spec) as dep:`` starts every role and waits until all are ready
    (or raises :class:`DeploymentError`); leaving the block stops them.
    ``echo=False`` keeps role output in the log files only (progress is still shown).
    ``visible_devices``: the host's CUDA devices (default: :func:`detect_cuda_devices`
    on the roles' environment, so ``CUDA_VISIBLE_DEVICES`` in the spec's ``env`` is the
    list to assign from); ``[]`` assigns none. ``usable_cpus``: the CPUs to split
    between the roles on a CPU host (default: :func:`usable_cpus`).
    """

    def __init__(
        self,
        spec: DeploymentSpec,
        *,
        console: IO[str] | None = None,
        echo: bool = True,
        progress_every_s: float = 15.0,
        name: str = "afd",
        visible_devices: Sequence[str] | None = None,
        usable_cpus: Sequence[int] | None = None,
    ) -> None:
        self.spec = spec
        self.visible_devices = None if visible_devices is None else list(visible_devices)
        self.devices: dict[str, str] | None = None
        """``CUDA_VISIBLE_DEVICES`` per role process name (see :meth:`plan_devices`)."""
        self.usable_cpus = None if usable_cpus is None else sorted(set(usable_cpus))
        self.cpus: dict[str, str] | None = None
        """``VLLM_CPU_OMP_THREADS_BIND`` per role process name (see :meth:`plan_cpus`)."""
        self._cpu_lines: list[str] = []
        self.console = console if console is not None else sys.stderr
        self.echo = echo
        self.progress_every_s = progress_every_s
        self.name = name
        self.roles: list[RoleProcess] = []
        self.work_dir: Path | None = None
        self.tmp_dir: Path | None = None
        self.log_dir: Path | None = None
        self.http_ports: list[int] = []
        self.connector_port = 0
        self.ffn_health_ports: list[int] = []
        self.pd_ports: list[int] = []
        """With ``[prefill]``: the attention server's and the prefill instance's HTTP ports."""
        self.started_at: float | None = None
        self.startup_s: float | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self.token_note = ""

    # -- info ----------------------------------------------------------------------
    @property
    def endpoints(self) -> list[str]:
        """Base URLs of the OpenAI-compatible servers (``http://host:port``); with
        ``[prefill]``, the proxy's only (the servers behind it are not the API)."""
        proxy = [r.http_url for r in self.roles if r.http_url and r.role == PROXY]
        return proxy or [r.http_url for r in self.roles if r.http_url]

    @property
    def url(self) -> str:
        return self.endpoints[0]

    def say(self, msg: str) -> None:
        with self._lock, contextlib.suppress(Exception):
            self.console.write(f"[{self.name}] {msg}\n")
            self.console.flush()

    # -- placement -----------------------------------------------------------------
    def _visible(self) -> list[str]:
        if self.visible_devices is None:
            self.visible_devices = detect_cuda_devices({**os.environ, **self.spec.env})
        return self.visible_devices

    def plan_devices(self) -> dict[str, str]:
        """``CUDA_VISIBLE_DEVICES`` per role process (``attn``, ``ffn0``..., ``native0``):
        the spec's ``devices`` / role ``env`` where set, else :func:`assign_devices`."""
        self.devices = plan_devices(self.spec, self._visible())
        return self.devices

    def plan_cpus(self) -> dict[str, str]:
        """``VLLM_CPU_OMP_THREADS_BIND`` per role process (``attn``, ``ffn0``...,
        ``native0``): see :func:`afd.launch.placement.plan_cpus`."""
        visible = self._visible()
        if self.usable_cpus is None:
            self.usable_cpus = usable_cpus()
        self.cpus, self._cpu_lines = plan_cpus(self.spec, visible, self.usable_cpus)
        return self.cpus

    # -- commands ------------------------------------------------------------------
    role_class: type[RoleProcess] = RoleProcess
    """The kind of role process (a Ray deployment's run in Ray actors)."""

    def _layout(self) -> Layout:
        spec = self.spec
        assert self.work_dir is not None and self.log_dir is not None
        devices = self.devices if self.devices is not None else self.plan_devices()
        cpus = self.cpus if self.cpus is not None else self.plan_cpus()
        self.tmp_dir = role_tmp_dir(self.work_dir)
        if not spec.native and len(self.ffn_health_ports) != spec.num_ffn:
            self.ffn_health_ports = allocate_health_ports(
                spec, avoid=[*self.http_ports, self.connector_port, *self.pd_ports]
            )
        return Layout(
            http_port=self.http_ports[0],
            connector_port=self.connector_port,
            ffn_health_ports=self.ffn_health_ports,
            devices=devices,
            cpus=cpus,
            tmp_dir=self.tmp_dir,
            log_dir=self.log_dir,
            pd_ports=self.pd_ports,
        )

    def _build_roles(self) -> None:
        self.roles.extend(build_roles(self.spec, self._layout(), self.role_class))
        if not self.spec.native:
            self.token_note = give_token(self.spec, self.roles)

    # -- lifecycle -----------------------------------------------------------------
    def _place(self) -> None:
        """Decide where the roles run, before anything is started (a missing device
        fails here)."""
        self.plan_devices()
        self.plan_cpus()

    def _allocate_ports(self) -> None:
        self.http_ports, self.connector_port = allocate_ports(self.spec)
        if self.spec.prefill is not None and not self.spec.native:
            # the proxy takes the deployment's HTTP port; these are the servers behind it
            wanted = [("attention server HTTP", 0, "http_port"), ("prefill HTTP", 0, "http_port")]
            avoid = [*self.http_ports, self.connector_port]
            self.pd_ports = reserve_ports(self.spec.host, wanted, avoid=avoid)

    def _connector_origin(self) -> str:
        return "same-host default" if self.spec.connector_auto else "from [afd] connector"

    def _placement_lines(self) -> list[str]:
        """What is printed about where the roles run (devices, CPUs)."""
        assert self.devices is not None
        return [*device_lines(self.devices, self.visible_devices or []), *self._cpu_lines]

    def start(self) -> Deployment:
        spec = self.spec
        self.started_at = time.monotonic()
        try:
            self._place()
            self.work_dir = Path(tempfile.mkdtemp(prefix=f"{self.name}-launch-"))
            self.log_dir = (
                Path(spec.log_dir).expanduser() if spec.log_dir else self.work_dir / "logs"
            )
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._allocate_ports()
            self._build_roles()
            what = "native vLLM" if spec.native else f"{spec.num_attention}A{spec.num_ffn}F"
            if spec.prefill is not None and not spec.native:
                what += f" (decode) + prefill ({spec.prefill.kv_connector})"
            self.say(
                f"starting {what} deployment of {spec.model} "
                + (f"(connector port {self.connector_port}) " if not spec.native else "")
                + f"logs in {self.log_dir}"
            )
            if spec.native and spec.prefill is not None:
                self.say("native: [prefill] not used (the baseline is one plain vLLM server)")
            if not spec.native:
                self.say(f"connector: {spec.connector} ({self._connector_origin()})")
                self.say(self.token_note)
            for line in self._placement_lines():
                self.say(line)
            console = self.console if self.echo else None
            for role in self.roles:  # FFN servers first, then the attention servers
                role.start(console, self._lock)
                self.say(
                    f"{role.name}: pid {role.pgid}"
                    + (f", {role.health_url}" if role.health_url else "")
                )
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - self.started_at
        return self

    def _status_line(self) -> str:
        parts = []
        for r in self.roles:
            state = "ready" if r.ready else "starting"
            if not r.ready and r.phase:
                state += f" ({r.phase})"
            parts.append(f"{r.name} {state}")
        return ", ".join(parts)

    def _wait_ready(self) -> None:
        assert self.started_at is not None
        deadline = self.started_at + self.spec.startup_timeout_s
        next_progress = time.monotonic() + self.progress_every_s
        while True:
            for r in self.roles:
                while r.phases:
                    phase = r.phases.popleft()
                    self.say(f"{r.name}: {phase} ({time.monotonic() - self.started_at:.0f} s)")
                if r.returncode() is not None:
                    self._fail_role(r, f"{r.exit_description()} during start-up")
                if not r.ready and r.check_ready():
                    self.say(
                        f"{r.name} ready after {r.ready_at - self.started_at:.1f} s"
                        if r.ready_at
                        else f"{r.name} ready"
                    )
            if all(r.ready for r in self.roles):
                elapsed = time.monotonic() - self.started_at
                self.say(f"all roles ready in {elapsed:.1f} s")
                return
            now = time.monotonic()
            if now >= deadline:
                pending = [r for r in self.roles if not r.ready]
                health = pending[0].last_health.splitlines()[0] if pending[0].last_health else ""
                self._fail_role(
                    pending[0],
                    f"not ready after {self.spec.startup_timeout_s:.0f} s (startup_timeout_s)"
                    + (f"; its /health: {health}" if health else ""),
                )
            if now >= next_progress:
                self.say(f"{now - self.started_at:.0f} s: {self._status_line()}")
                next_progress = now + self.progress_every_s
            time.sleep(0.5)

    def _fail_role(self, role: RoleProcess, what: str) -> None:
        role.join_output(2.0)
        lines = role.last_lines()
        msg = f"{role.name} {what}; last {len(lines)} log lines ({role.log_path}):"
        self.say(msg)
        with self._lock, contextlib.suppress(Exception):
            for line in lines:
                self.console.write(role.prefix + line)
            self.console.flush()
        raise DeploymentError(f"{role.name} {what} (log: {role.log_path})")

    def poll(self) -> RoleProcess | None:
        """The first role whose process has exited, if any."""
        for r in self.roles:
            if r.returncode() is not None:
                return r
        return None

    def wait(self, poll_s: float = 0.5) -> RoleProcess:
        """Block until a role exits; return it (interrupt with a signal to stop)."""
        while True:
            r = self.poll()
            if r is not None:
                return r
            time.sleep(poll_s)

    def stop(self, grace_s: float = 10.0) -> bool:
        """SIGTERM every process group, SIGKILL after ``grace_s``; True if none is left."""
        if self._stopped:
            return True
        self._stopped = True
        started = [r for r in self.roles if r.pgid is not None]
        survivors = stop_groups(started, grace_s, self.say)
        if survivors:
            self.say(f"WARNING: processes left after teardown: {survivors}")
        elif started:
            self.say("stopped; no process left")
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
        return not survivors

    def exit_codes(self) -> dict[str, int | None]:
        return {r.name: r.returncode() for r in self.roles}

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
