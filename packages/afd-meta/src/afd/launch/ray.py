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

Ray is imported only here (and in :mod:`afd.launch.ray_role`, which holds the actor and
the launcher's handle of one role process), and only when a deployment is started:
``pip install 'afd[ray]'``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from afd.launch.commands import Layout
from afd.launch.deployment import Deployment
from afd.launch.errors import DeploymentError
from afd.launch.placement import NodeInfo, RayPlan, plan_node_cpus, plan_ray
from afd.launch.processes import stop_groups
from afd.launch.ray_role import (
    ACTOR_GONE,
    CALL_TIMEOUT_S,
    GRACE_S,
    RAY_INSTALL_HINT,
    RayRoleProcess,
    RoleActor,
    _remote_actor_class,
    _why,
    import_ray,
)

__all__ = [
    "ACTOR_GONE",
    "RAY_INSTALL_HINT",
    "RayDeployment",
    "RayRoleProcess",
    "RoleActor",
    "import_ray",
]


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
        if not self.spec.connector_auto:
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
