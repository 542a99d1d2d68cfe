"""``afd launch --ray``: the role processes of a spec placed on a Ray cluster.

The same spec, commands, readiness and teardown as on one host
(:class:`~afd.launch.deployment.Deployment`); only where the role processes run differs.
Each role process (every FFN server, the attention server) runs in a Ray actor of its own
(:class:`RoleActor`), which asks Ray for its role's resources (``[ray.attention]`` /
``[ray.ffn]``: CPUs, GPUs, custom resources such as ``NPU``) as one bundle of the
deployment's placement group (:func:`~afd.launch.placement.plan_ray`: ``STRICT_PACK``
for the shared-memory connector, whose ranks must share a host, else the spec's
``[ray] placement``). On its node the actor:

* reports where it is (:class:`~afd.launch.placement.NodeInfo`: the node's IP from
  ``ray.util.get_node_ip_address()``, its CPUs, the GPUs Ray gave it);
* reserves its ports there (:func:`~afd.launch.ports.reserve_ports`): the attention
  server's HTTP port and the AFD rendezvous port (attention rank 0 hosts the rendezvous,
  so every process gets the attention node's IP as ``afd.host``), each FFN server's
  health port;
* runs the role's command (:func:`~afd.launch.commands.build_roles`, with the launcher's
  environment additions, the admission token among them, on top of the node's
  environment) in a process group of its own with a per-role ``TMPDIR``, started with a
  guard (:mod:`afd.launch.guard`) that stops the group if the actor dies;
* keeps its output for the launcher, which polls it and streams it with the role's
  prefix, to the console and ``<log_dir>/<role>.log`` on the launcher's host.

The launcher checks readiness over HTTP as locally (FFN ``/health`` 200, attention
``/health``), at the node addresses. Stopping (Ctrl-C, SIGTERM, a role that exits or an
actor that dies) signals every role through its actor (SIGTERM, SIGKILL after the grace
period), checks that no process of any role is left, kills the actors, removes the
placement group and checks that none of the deployment's actors is left in the cluster.

Ray is imported only here, and only when a deployment is started: ``pip install
'afd[ray]'``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from afd.launch.commands import Layout
from afd.launch.cpus import CPU_BIND, bind_affinity, usable_cpus
from afd.launch.deployment import Deployment
from afd.launch.errors import DeploymentError
from afd.launch.placement import NodeInfo, RayPlan, plan_node_cpus, plan_ray
from afd.launch.ports import reserve_ports
from afd.launch.processes import RoleProcess, role_tmp_dir, stop_groups
from afd_core.procfs import group_members, process_start

__all__ = [
    "ACTOR_GONE",
    "RAY_INSTALL_HINT",
    "RayDeployment",
    "RayRoleProcess",
    "RoleActor",
    "import_ray",
]

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


def _why(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:300]


class RayDeployment(Deployment):
    """A :class:`Deployment` whose role processes run in Ray actors (see the module)."""

    role_class = RayRoleProcess

    def __init__(self, spec: Any, **kwargs: Any) -> None:
        if spec.ray is None:
            raise ValueError("RayDeployment: the spec has no [ray] table")
        super().__init__(spec, **kwargs)
        self.id = secrets.token_hex(4)
        """Names this deployment's actors (``afd-<id>-<role>``) and placement group."""
        self.plan: RayPlan | None = None
        self.placement_group: Any = None
        self.actors: dict[str, Any] = {}
        self.nodes: dict[str, NodeInfo] = {}
        self._connected_here = False
        self._ray_lines: list[str] = []
        self.cluster_clean: bool | None = None
        """After :meth:`stop`: whether none of the deployment's actors is left."""

    def actor_name(self, role: str) -> str:
        return f"afd-{self.id}-{role}"

    # -- placement -----------------------------------------------------------------
    def _connect(self) -> Any:
        ray = import_ray()
        if ray.is_initialized():
            return ray
        assert self.spec.ray is not None
        # ray.init makes SIGTERM exit the process at once: keep the launcher's handler,
        # which stops the deployment first.
        handler = signal.getsignal(signal.SIGTERM)
        try:
            ray.init(
                address=self.spec.ray.address,
                namespace=self.spec.ray.namespace,
                log_to_driver=False,
                configure_logging=False,
            )
        except Exception as exc:
            where = self.spec.ray.address or "RAY_ADDRESS / the local cluster"
            raise DeploymentError(f"ray: could not connect to {where}: {_why(exc)}") from None
        finally:
            if threading.current_thread() is threading.main_thread() and handler is not None:
                signal.signal(signal.SIGTERM, handler)
        self._connected_here = True
        return ray

    def _place(self) -> None:
        spec = self.spec
        assert spec.ray is not None
        self.plan = plan = plan_ray(spec)
        ray = self._connect()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        total = {k: v for k, v in ray.cluster_resources().items() if not k.startswith("node:")}
        self._ray_lines = [
            f"ray: cluster {ray.get_runtime_context().gcs_address} ({_resources(total)}), "
            f"namespace {spec.ray.namespace}, actors {self.actor_name('*')}",
            plan.describe(),
        ]
        self.placement_group = placement_group(
            [b.resources for b in plan.bundles],
            strategy=plan.strategy,
            name=self.actor_name("pg"),
        )
        ready, _ = ray.wait([self.placement_group.ready()], timeout=spec.ray.placement_timeout_s)
        if not ready:
            free = {k: v for k, v in ray.available_resources().items() if not k.startswith("node:")}
            raise DeploymentError(
                f"ray: the cluster did not grant the placement group within "
                f"{spec.ray.placement_timeout_s:g} s ([ray] placement_timeout_s): "
                f"{plan.describe()}; available now: {_resources(free)} on "
                f"{len([n for n in ray.nodes() if n.get('Alive')])} node(s)"
            )
        cls = _remote_actor_class()
        for index, bundle in enumerate(plan.bundles):
            res = dict(bundle.resources)
            self.actors[bundle.name] = cls.options(
                name=self.actor_name(bundle.name),
                namespace=spec.ray.namespace,
                num_cpus=res.pop("CPU", 0),
                num_gpus=res.pop("GPU", 0),
                resources=res,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group,
                    placement_group_bundle_index=index,
                ),
            ).remote(bundle.name)
        names = list(self.actors)
        try:
            infos = ray.get(
                [self.actors[n].node.remote() for n in names], timeout=spec.ray.placement_timeout_s
            )
        except Exception as exc:
            raise DeploymentError(f"ray: the role actors did not start: {_why(exc)}") from None
        self.nodes = {n: NodeInfo(**info) for n, info in zip(names, infos, strict=True)}
        for n in names:
            self._ray_lines.append(f"{n}: actor {self.actor_name(n)} on {self.nodes[n].label}")
        self.devices = {}
        self.cpus, self._cpu_lines = plan_node_cpus(spec, self.nodes)

    def _allocate_ports(self) -> None:
        spec = self.spec
        ray = import_ray()
        taken: dict[str, list[int]] = {}

        def reserve(name: str, wanted: list[tuple[str, int, str]]) -> list[int]:
            node = self.nodes[name]
            try:
                got = ray.get(
                    self.actors[name].reserve_ports.remote(
                        node.ip, wanted, taken.get(node.node_id, [])
                    ),
                    timeout=CALL_TIMEOUT_S,
                )
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if isinstance(exc.cause, Exception) else exc
                raise DeploymentError(str(cause).strip().splitlines()[-1]) from None
            taken.setdefault(node.node_id, []).extend(got)
            return list(got)

        http, conn = reserve(
            "attn",
            [
                ("HTTP of the attention server", spec.http_port, "http_port"),
                ("AFD connector rendezvous", spec.connector_port, "connector_port"),
            ],
        )
        planes = spec.num_ffn if spec.ffn_expert_parallel else 1
        for attempt in range(20):
            # FFN expert parallelism: FFN rank f rendezvous on connector_port + f, on
            # attention rank 0's node; a free base whose next ports are taken is replaced.
            try:
                reserve("attn", [
                    (f"AFD connector rendezvous of expert plane {f}", conn + f, "connector_port")
                    for f in range(1, planes)
                ])  # fmt: skip
                break
            except DeploymentError:
                if spec.connector_port or attempt == 19:
                    raise
                (conn,) = reserve("attn", [("AFD connector rendezvous", 0, "connector_port")])
        self.http_ports, self.connector_port = [http], conn
        self.ffn_health_ports = []
        for rank in range(spec.num_ffn):
            fixed = spec.ffn_health_port + rank if spec.ffn_health_port else 0
            what = f"health/metrics of FFN server {rank}"
            self.ffn_health_ports += reserve(f"ffn{rank}", [(what, fixed, "ffn_health_port")])
        rendezvous = self.nodes["attn"].ip
        last = self.connector_port + planes - 1
        where = f"{self.connector_port}" + (f"-{last}" if planes > 1 else "")
        self._ray_lines.append(
            f"rendezvous: {rendezvous}:{where} (attention rank 0's node; open "
            f"{'these ports' if planes > 1 else 'this port'} to the FFN nodes)"
        )

    def _layout(self) -> Layout:
        from afd_core.admission import TOKEN_ENV

        assert self.work_dir is not None and self.log_dir is not None
        # The roles start from their node's environment (the actor adds it); the launcher
        # adds the spec's env, the CPU binding and the admission token (this process's
        # AFD_AUTH_TOKEN, if any, is the deployment's).
        base = {TOKEN_ENV: os.environ[TOKEN_ENV]} if os.environ.get(TOKEN_ENV) else {}
        return Layout(
            http_port=self.http_ports[0],
            connector_port=self.connector_port,
            ffn_health_ports=self.ffn_health_ports,
            devices={},
            cpus=self.cpus or {},
            tmp_dir=Path(tempfile.gettempdir()),  # each actor sets its own TMPDIR
            log_dir=self.log_dir,
            hosts={name: node.ip for name, node in self.nodes.items()},
            rendezvous_host=self.nodes["attn"].ip,
            base_env=base,
        )

    def _build_roles(self) -> None:
        super()._build_roles()
        for role in self.roles:
            assert isinstance(role, RayRoleProcess)
            role.actor = self.actors[role.name]
            role.node = self.nodes[role.name]

    def _connector_origin(self) -> str:
        if self.spec.afd.get("connector"):
            return "from [afd] connector"
        return f"Ray default for placement {self.spec.ray_placement}"

    def _placement_lines(self) -> list[str]:
        gpus = [f"{n}={','.join(node.gpus)}" for n, node in self.nodes.items() if node.gpus]
        devices = [f"devices: GPUs given by Ray: {', '.join(gpus)}"] if gpus else []
        return [*self._ray_lines, *devices, *self._cpu_lines]

    # -- teardown ------------------------------------------------------------------
    def stop(self, grace_s: float = GRACE_S) -> bool:
        """Stop every role through its actor (SIGTERM, SIGKILL after ``grace_s``), then
        kill the actors and remove the placement group; True when no process of a role
        and none of the deployment's actors is left."""
        if self._stopped:
            return True
        self._stopped = True
        started = [r for r in self.roles if r.pgid is not None]
        survivors = stop_groups(started, grace_s, self.say)
        for r in started:
            if isinstance(r, RayRoleProcess) and r.actor_gone is not None:
                self.say(
                    f"{r.name}: its Ray actor is gone ({r.actor_gone}); its guard on "
                    f"{r.node.label if r.node else 'its node'} stops what is left of it"
                )
        if survivors:
            self.say(f"WARNING: processes left after teardown: {survivors}")
        elif started:
            self.say("stopped; no process left")
        self.cluster_clean = self._release()
        return not survivors and self.cluster_clean

    def _release(self) -> bool:
        """Kill the actors, remove the placement group, check that nothing of the
        deployment is left in the cluster; disconnect."""
        if not self._connected_here and not self.actors and self.placement_group is None:
            return True
        ray = import_ray()
        for actor in self.actors.values():
            with contextlib.suppress(Exception):
                ray.get(actor.cleanup.remote(), timeout=10.0)
        for actor in self.actors.values():
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.placement_group)
        left = self._left_in_cluster(ray)
        if left:
            self.say(f"WARNING: left in the Ray cluster: {', '.join(left)}")
        elif self.actors or self.placement_group is not None:
            self.say(
                f"ray: {len(self.actors)} actor(s) and the placement group removed; "
                f"nothing of afd-{self.id} left in the cluster"
            )
        if self._connected_here:
            with contextlib.suppress(Exception):
                ray.shutdown()
        return not left

    def _left_in_cluster(self, ray: Any, wait_s: float = 10.0) -> list[str]:
        from ray.util.placement_group import placement_group_table

        prefix = self.actor_name("")
        deadline = time.monotonic() + wait_s
        while True:
            left = []
            with contextlib.suppress(Exception):
                left = [
                    f"actor {a['name']}"
                    for a in ray.util.list_named_actors(all_namespaces=True)
                    if str(a.get("name", "")).startswith(prefix)
                ]
            if self.placement_group is not None:
                with contextlib.suppress(Exception):
                    state = placement_group_table(self.placement_group).get("state")
                    if state not in (None, "REMOVED"):
                        left.append(f"placement group {self.actor_name('pg')} ({state})")
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.2)


def _resources(res: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(res.items()) if "memory" not in k) or "none"
