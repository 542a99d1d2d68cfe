"""The ``[ray]`` table of a deployment spec (``afd launch --ray``): where Ray places the
roles and what each rank asks it for, checked when the spec is built
(:func:`check_ray_spec`). The deployment itself is :mod:`afd.launch.ray`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from afd.launch.checks import unknown_key
from afd.launch.connectors import same_host_only
from afd.launch.errors import SpecError
from afd_core.roles import AFDRole

__all__ = [
    "RAY_PLACEMENTS",
    "RayResources",
    "RaySpec",
    "check_ray_deployment",
    "check_ray_spec",
]

RAY_PLACEMENTS = ("strict_pack", "pack", "spread", "strict_spread")
"""Ray placement group strategies (``[ray] placement``), lower case."""


def _fail(name: str, expected: str, value: Any) -> SpecError:
    return SpecError(f"{name}: expected {expected}, got {value!r} ({type(value).__name__})")


@dataclass
class RayResources:
    """What one rank of a role asks Ray for (TOML tables ``[ray.attention]`` /
    ``[ray.ffn]``). The attention server holds every attention rank (its DP ranks), so
    its actor asks for ``num_attention`` times this; each FFN server for this once."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per rank, e.g. ``{NPU = 1}`` (declared by ``ray start
    --resources``)."""

    def bundle(self, ranks: int) -> dict[str, float]:
        """The Ray resources of a role process holding ``ranks`` ranks (zeros left out)."""
        out = {"CPU": self.num_cpus * ranks, "GPU": self.num_gpus * ranks}
        out.update({k: v * ranks for k, v in self.resources.items()})
        return {k: float(v) for k, v in out.items() if v}


@dataclass
class RaySpec:
    """Where Ray places the roles (TOML table ``[ray]``; ``afd launch --ray [ADDRESS]``).

    A spec with a ``[ray]`` table (or ``--ray``) runs every role process as a Ray actor
    (:mod:`afd.launch.ray`); without it (or with ``--no-ray``) the same spec runs on this
    host."""

    address: str | None = None
    """The cluster: ``"auto"``, ``"HOST:6379"``, ``"ray://HOST:10001"``; None: Ray's
    default (``RAY_ADDRESS``, else the cluster ``ray start`` runs on this host, else a
    one-host cluster for the launcher's lifetime)."""
    placement: str | None = None
    """Placement group strategy: ``strict_pack`` (one node), ``pack``, ``spread``,
    ``strict_spread``. Default: ``strict_pack`` with the shared-memory connector, else
    ``spread``."""
    namespace: str = "afd"
    """Ray namespace of the deployment's named actors (``afd-<id>-<role>``)."""
    placement_timeout_s: float = 120.0
    """How long to wait for the cluster to grant the placement group."""
    attention: RayResources = field(default_factory=RayResources)
    ffn: RayResources = field(default_factory=RayResources)

    def resources(self, role: AFDRole) -> RayResources:
        return self.attention if AFDRole(role) is AFDRole.ATTENTION else self.ffn

    @property
    def uses_gpus(self) -> bool:
        return bool(self.attention.num_gpus or self.ffn.num_gpus)


def check_ray_spec(ray: RaySpec | Mapping[str, Any]) -> RaySpec:
    """The ``[ray]`` table, checked and normalised (placement lower case, resource tables
    as :class:`RayResources`); what it says about the rest of the spec is checked there."""
    if isinstance(ray, Mapping):
        ray = _ray_from_mapping(ray)
    if not isinstance(ray, RaySpec):
        raise _fail("ray", "a table with address / placement / attention / ffn ...", ray)
    if ray.address is not None and (not isinstance(ray.address, str) or not ray.address):
        raise _fail("ray.address", '"auto", "HOST:PORT" or "ray://HOST:PORT"', ray.address)
    if ray.placement is not None:
        if not isinstance(ray.placement, str) or ray.placement.lower() not in RAY_PLACEMENTS:
            raise _fail("ray.placement", "one of " + ", ".join(RAY_PLACEMENTS), ray.placement)
        ray.placement = ray.placement.lower()
    if not isinstance(ray.namespace, str) or not ray.namespace.strip():
        raise _fail("ray.namespace", "a Ray namespace name", ray.namespace)
    t = ray.placement_timeout_s
    if not isinstance(t, int | float) or isinstance(t, bool) or t <= 0:
        raise _fail("ray.placement_timeout_s", "a number of seconds > 0", t)
    for role in AFDRole:
        res = getattr(ray, role)
        if isinstance(res, Mapping):
            names = [f.name for f in dataclasses.fields(RayResources)]
            for key in res:
                if key not in names:
                    raise unknown_key(f"ray.{role}: ", key, names)
            res = RayResources(**dict(res))
            setattr(ray, role, res)
        if not isinstance(res, RayResources):
            raise _fail(f"ray.{role}", "a table with num_cpus / num_gpus / resources", res)
        for name in ("num_cpus", "num_gpus"):
            v = getattr(res, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or v < 0:
                raise _fail(f"ray.{role}.{name}", "a number >= 0 (per rank)", v)
        if not isinstance(res.resources, Mapping):
            raise _fail(f"ray.{role}.resources", "a table of NAME = amount", res.resources)
        res.resources = dict(res.resources)
        for k, v in res.resources.items():
            if not isinstance(k, str) or not k:
                raise SpecError(f"ray.{role}.resources: invalid resource name {k!r}")
            if k.upper() in ("CPU", "GPU"):
                raise SpecError(
                    f"ray.{role}.resources.{k}: use ray.{role}.num_{k.lower()}s instead"
                )
            if not isinstance(v, int | float) or isinstance(v, bool) or v < 0:
                raise _fail(f"ray.{role}.resources.{k}", "a number >= 0 (per rank)", v)
        if not res.bundle(1):
            raise SpecError(
                f"ray.{role}: asks Ray for nothing; a role needs num_cpus, num_gpus or a "
                "resource > 0 to be placed"
            )
    return ray


def _ray_from_mapping(table: Mapping[str, Any]) -> RaySpec:
    names = [f.name for f in dataclasses.fields(RaySpec)]
    for key in table:
        if key not in names:
            raise unknown_key("ray: ", key, names)
    return RaySpec(**dict(table))


def check_ray_deployment(spec: Any, default_host: str, suggest: tuple[str, ...]) -> None:
    """What a spec with a ``[ray]`` table (``spec.ray``, checked) may not combine it with:
    the native baseline, a fixed ``host``, per-role devices, and a placement that may
    split the roles across hosts with a connector whose ranks must share one (its
    declared ``same_host_only``). ``suggest``: network connectors to name instead."""
    ray = spec.ray
    if spec.native:
        raise SpecError("native: the native baseline runs on this host; drop [ray] / --ray")
    if spec.host != default_host:
        raise SpecError(
            f"host: {spec.host!r} with [ray]: every role binds its Ray node's address "
            "(the attention node's is the rendezvous host); leave host unset"
        )
    for role in AFDRole:
        if spec.overrides(role).devices is not None:
            raise SpecError(
                f"{role}.devices with [ray]: Ray assigns the GPUs of each actor; use "
                f"ray.{role}.num_gpus instead"
            )
    explicit = None if spec.connector_auto else spec.connector
    if (
        explicit is not None
        and same_host_only(explicit)
        and ray.placement not in (None, "strict_pack")
    ):
        raise SpecError(
            f"ray.placement: {ray.placement!r} with the shared-memory connector "
            f"{explicit}: its ranks must share one host; use placement = "
            f'"strict_pack" or a network connector ({", ".join(suggest)})'
        )
