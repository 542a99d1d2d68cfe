"""The deployment spec: what ``afd launch`` runs, from keyword arguments, a mapping or a
TOML file (:func:`load_toml`, the one loader of spec files), validated when built."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afd.launch.checks import (
    check_args,
    check_cpus,
    check_devices,
    check_env,
    resolve_model,
    unknown_key,
)
from afd.launch.cpus import CPU_BIND
from afd.launch.devices import CUDA_VISIBLE_DEVICES, detect_cuda_devices
from afd.launch.errors import SpecError
from afd_core.config import CONFIG_ALIASES, AFDConfig
from afd_core.errors import AFDConfigError
from afd_core.roles import AFDRole

__all__ = [
    "DEFAULT_CONNECTOR",
    "DEFAULT_CUDA_CONNECTOR",
    "DEFAULT_KV_CACHE_BYTES",
    "DEFAULT_NETWORK_CONNECTOR",
    "DTYPES",
    "RAY_PLACEMENTS",
    "DeploymentSpec",
    "RayResources",
    "RaySpec",
    "RoleOverrides",
    "load_toml",
]

DEFAULT_KV_CACHE_BYTES = 64 * 1024 * 1024
DEFAULT_CONNECTOR = "P2pShmAFDConnector"
"""The connector of a deployment whose ``[afd]`` table names none, on a CPU host: every
role of an ``afd launch`` deployment runs on this host, where shared memory beats gloo."""
DEFAULT_CUDA_CONNECTOR = "P2pNcclAFDConnector"
"""The default connector where CUDA devices are visible (one GPU per rank, see
docs/gpu.md)."""
DEFAULT_NETWORK_CONNECTOR = "P2pGlooAFDConnector"
"""The default connector of a Ray deployment whose roles may run on different CPU hosts
(any ``[ray] placement`` but ``strict_pack``): shared memory needs one host."""
SHM_CONNECTORS = frozenset({"P2pShmAFDConnector"})
"""Connectors whose ranks must share one host (a Ray deployment packs them on one node)."""
DTYPES = ("auto", "bfloat16", "float16", "float32")
RAY_PLACEMENTS = ("strict_pack", "pack", "spread", "strict_spread")
"""Ray placement group strategies (``[ray] placement``), lower case."""
DEFAULT_HOST = "127.0.0.1"
# afd keys the launcher sets itself.
MANAGED_AFD_KEYS = {
    "role": "(one per process)",
    "rank": "(one per process)",
    "port": "connector_port",
    "host": "host",
    "num_attention_ranks": "num_attention",
    "num_ffn_ranks": "num_ffn",
    "compute_gate_on_attention": "compute_gate_on_attention",
    "attention_tensor_parallel_size": "attention_tensor_parallel_size",
    "ffn_expert_parallel": "ffn_expert_parallel",
}


def _fail(name: str, expected: str, value: Any) -> SpecError:
    return SpecError(f"{name}: expected {expected}, got {value!r} ({type(value).__name__})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class RoleOverrides:
    """Per-role settings (TOML tables ``[attention]`` / ``[ffn]``)."""

    model: str | None = None
    """Checkpoint for this role only (default: the spec's ``model``)."""
    vllm_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    devices: str | list[str] | None = None
    """CUDA devices, one per rank of the role (``"0,1"`` or ``["0", "1"]``; entries as in
    ``CUDA_VISIBLE_DEVICES``): the attention server gets all of them (DP rank i on the
    i-th), FFN rank f the f-th. Default (None): assigned from the visible devices."""
    cpus: str | list[str] | None = None
    """CPUs (``VLLM_CPU_OMP_THREADS_BIND`` values such as ``"0"``, ``"0-3"``, ``"1,3"``),
    one CPU list per rank: a list, or one string with ``|`` between ranks (vLLM's format
    for the DP ranks of one server). ``"auto"`` / ``"nobind"``: vLLM's own modes.
    Default (None): a share of the usable CPUs on a CPU host (:func:`split_cpus`)."""


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


@dataclass
class DeploymentSpec:
    """What to deploy. All fields but ``model`` have defaults sized for tiny CPU models."""

    model: str
    num_attention: int = 1
    num_ffn: int = 1
    compute_gate_on_attention: bool = False
    ffn_expert_parallel: bool = False
    """The ``num_ffn`` FFN servers share one expert set (expert parallelism, EP size
    ``num_ffn``): each holds about 1/num_ffn of the routed experts, every attention rank
    exchanges with every FFN server (rendezvous ports ``connector_port + f``)."""
    attention_tensor_parallel_size: int = 1
    """vLLM tensor-parallel size of each attention rank (``--tensor-parallel-size`` of the
    attention server; it then has ``num_attention`` x this many workers). TP worker 0 of
    each rank exchanges with the FFN role and broadcasts the answer to the others."""
    dtype: str = "bfloat16"
    max_model_len: int = 256
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES
    gpu_memory_utilization: float = 0.1
    enforce_eager: bool = False
    """vLLM's ``--enforce-eager`` for every role (default: vLLM's default compile mode)."""
    vllm_args: list[str] = field(default_factory=list)
    """Extra vLLM engine/server args for every role."""
    afd: dict[str, Any] = field(default_factory=dict)
    """Extra ``additional_config["afd"]`` keys (routing_payload, timeouts, connector...)."""
    host: str = DEFAULT_HOST
    http_port: int = 0
    """HTTP port of attention server 0 (server i gets http_port + i); 0 = free ports."""
    connector_port: int = 0
    """The AFD connector's rendezvous port; 0 = a free port."""
    ffn_health_port: int = 0
    """``/health`` and ``/metrics`` port of FFN server 0 (server i gets ffn_health_port +
    i); 0 = free ports."""
    env: dict[str, str] = field(default_factory=dict)
    log_dir: str | None = None
    """Per-role log files; default: a ``logs`` folder in the deployment's work dir."""
    startup_timeout_s: float = 600.0
    attention: RoleOverrides = field(default_factory=RoleOverrides)
    ffn: RoleOverrides = field(default_factory=RoleOverrides)
    native: bool = False
    """Run one plain vLLM API server (no AFD) with the same engine args: the baseline."""
    ray: RaySpec | None = None
    """Place the role processes as Ray actors (``[ray]``); None: on this host."""

    def __post_init__(self) -> None:
        self.validate()

    # -- validation ----------------------------------------------------------------
    def validate(self) -> None:
        if not isinstance(self.model, str | os.PathLike) or not str(self.model).strip():
            raise _fail("model", "a checkpoint directory or model name", self.model)
        self.model = str(self.model)
        for name in ("num_attention", "num_ffn"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise _fail(name, "an int >= 1", v)
        tp = self.attention_tensor_parallel_size
        if not _is_int(tp) or tp < 1:
            raise _fail("attention_tensor_parallel_size", "an int >= 1", tp)
        if not isinstance(self.ffn_expert_parallel, bool):
            raise _fail("ffn_expert_parallel", "true or false", self.ffn_expert_parallel)
        if self.num_ffn > self.num_attention and not self.ffn_expert_parallel:
            raise SpecError(
                f"num_ffn: {self.num_ffn} FFN servers for {self.num_attention} attention servers "
                "would leave FFN servers without peers (attention rank a talks to FFN rank "
                "a % num_ffn); use num_ffn <= num_attention, or ffn_expert_parallel = true "
                "(every attention rank talks to every FFN server)"
            )
        if self.native and (self.num_attention, self.num_ffn) != (1, 1):
            raise SpecError("native: a native baseline is one server; leave num_attention/num_ffn")
        if not isinstance(self.compute_gate_on_attention, bool):
            gate = self.compute_gate_on_attention
            raise _fail("compute_gate_on_attention", "true or false", gate)
        if self.dtype not in DTYPES:
            raise _fail("dtype", "one of " + ", ".join(DTYPES), self.dtype)
        if not _is_int(self.max_model_len) or self.max_model_len < 1:
            raise _fail("max_model_len", "an int >= 1", self.max_model_len)
        if not _is_int(self.kv_cache_memory_bytes) or self.kv_cache_memory_bytes < 1:
            raise _fail("kv_cache_memory_bytes", "an int >= 1 (bytes)", self.kv_cache_memory_bytes)
        g = self.gpu_memory_utilization
        if not isinstance(g, int | float) or isinstance(g, bool) or not 0 < g <= 1:
            raise _fail("gpu_memory_utilization", "a number in (0, 1]", g)
        if not isinstance(self.enforce_eager, bool):
            raise _fail("enforce_eager", "true or false", self.enforce_eager)
        if not isinstance(self.host, str) or not self.host.strip():
            raise _fail("host", "a host name or IP address", self.host)
        for name in ("http_port", "connector_port", "ffn_health_port"):
            v = getattr(self, name)
            if not _is_int(v) or not 0 <= v <= 65535:
                raise _fail(name, "an int in 0..65535 (0 = pick a free port)", v)
        if self.http_port and self.connector_port == self.http_port:
            raise SpecError(
                f"connector_port: {self.connector_port} collides with the attention HTTP port"
            )
        t = self.startup_timeout_s
        if not isinstance(t, int | float) or isinstance(t, bool) or t <= 0:
            raise _fail("startup_timeout_s", "a number of seconds > 0", t)
        if not isinstance(self.native, bool):
            raise _fail("native", "true or false", self.native)
        if self.log_dir is not None:
            if not isinstance(self.log_dir, str | os.PathLike) or not str(self.log_dir):
                raise _fail("log_dir", "a directory path", self.log_dir)
            self.log_dir = str(self.log_dir)
        self.vllm_args = check_args("vllm_args", self.vllm_args)
        self.env = check_env("env", self.env)
        for role in AFDRole:
            self._check_role(role)
        if self.attention.devices and self.ffn.devices and not self.native:
            shared = sorted(set(self.attention.devices) & set(self.ffn.devices))
            if shared:
                raise SpecError(
                    f"ffn.devices: {','.join(shared)} also in attention.devices; every rank "
                    "needs its own device (NCCL refuses two ranks on one device)"
                )
        self._canonical_afd()
        self._check_ray()
        self._check_afd()

    def _check_ray(self) -> None:
        if self.ray is None:
            return
        if isinstance(self.ray, Mapping):
            self.ray = _ray_from_mapping(self.ray)
        if not isinstance(self.ray, RaySpec):
            raise _fail("ray", "a table with address / placement / attention / ffn ...", self.ray)
        ray = self.ray
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
        if self.native:
            raise SpecError("native: the native baseline runs on this host; drop [ray] / --ray")
        if self.host != DEFAULT_HOST:
            raise SpecError(
                f"host: {self.host!r} with [ray]: every role binds its Ray node's address "
                "(the attention node's is the rendezvous host); leave host unset"
            )
        for role in AFDRole:
            if self.overrides(role).devices is not None:
                raise SpecError(
                    f"{role}.devices with [ray]: Ray assigns the GPUs of each actor; use "
                    f"ray.{role}.num_gpus instead"
                )
        explicit = self.afd.get("connector") if isinstance(self.afd, Mapping) else None
        if explicit in SHM_CONNECTORS and ray.placement not in (None, "strict_pack"):
            raise SpecError(
                f"ray.placement: {ray.placement!r} with the shared-memory connector "
                f"{explicit}: its ranks must share one host; use placement = "
                f'"strict_pack" or a network connector ({DEFAULT_NETWORK_CONNECTOR}, '
                f"{DEFAULT_CUDA_CONNECTOR})"
            )

    def _check_role(self, role: AFDRole) -> None:
        ov = getattr(self, role)
        if isinstance(ov, Mapping):
            ov = _overrides_from_mapping(role, ov)
            setattr(self, role, ov)
        if not isinstance(ov, RoleOverrides):
            raise _fail(role, "a table with model / vllm_args / env / devices / cpus", ov)
        if ov.model is not None and (not isinstance(ov.model, str) or not ov.model.strip()):
            raise _fail(f"{role}.model", "a checkpoint directory or model name", ov.model)
        ov.vllm_args = check_args(f"{role}.vllm_args", ov.vllm_args)
        ov.env = check_env(f"{role}.env", ov.env)
        ranks = self.num_workers(role)
        ov.devices = check_devices(f"{role}.devices", ov.devices, ranks)
        if ov.devices is not None and CUDA_VISIBLE_DEVICES in ov.env:
            raise SpecError(
                f"{role}.devices and {role}.env.{CUDA_VISIBLE_DEVICES} are both set; "
                "keep one of them"
            )
        # The attention ranks are the DP ranks of one server: auto / nobind stand for all.
        whole = role is AFDRole.ATTENTION
        ov.cpus = check_cpus(f"{role}.cpus", ov.cpus, ranks, whole=whole)
        if ov.cpus is not None and CPU_BIND in ov.env:
            raise SpecError(f"{role}.cpus and {role}.env.{CPU_BIND} are both set; keep one of them")

    def _canonical_afd(self) -> None:
        """``[afd]`` under canonical names: upstream aliases (``afd_connector``,
        ``num_afd_stages``...) are resolved here, once, so everything that reads the
        spec (connector choice, placement, bench) sees one name per setting."""
        if not isinstance(self.afd, Mapping):
            raise SpecError(f"afd: expected a table of afd keys, got {self.afd!r}")
        canonical: dict[str, Any] = {}
        given_as: dict[str, str] = {}
        for key, value in self.afd.items():
            name = CONFIG_ALIASES.get(key, key) if isinstance(key, str) else key
            managed = MANAGED_AFD_KEYS.get(name)  # afd_port: port
            if managed is not None:
                raise SpecError(f"afd.{key}: set by the launcher; use the spec field {managed}")
            if name in canonical:
                raise SpecError(
                    f"afd.{name}: given twice, as {given_as[name]!r} and {key!r}; "
                    f"keep only {name!r}"
                )
            canonical[name], given_as[name] = value, key
        self.afd = canonical

    def _check_afd(self) -> None:
        try:  # afd-core's checks, the ones the roles will run, but now
            AFDConfig.parse(self.afd_section(AFDRole.ATTENTION, 0, port=1))
        except AFDConfigError as exc:
            raise SpecError(str(exc)) from None

    # -- derived -------------------------------------------------------------------
    def overrides(self, role: AFDRole) -> RoleOverrides:
        """The role's own settings (``[attention]`` / ``[ffn]``)."""
        return self.attention if AFDRole(role) is AFDRole.ATTENTION else self.ffn

    def num_ranks(self, role: AFDRole) -> int:
        return self.num_attention if AFDRole(role) is AFDRole.ATTENTION else self.num_ffn

    def num_workers(self, role: AFDRole) -> int:
        """vLLM worker processes of the role (each needs its device / CPU list): an
        attention rank has ``attention_tensor_parallel_size`` of them, in vLLM's [DP, TP]
        order."""
        if AFDRole(role) is AFDRole.ATTENTION:
            return self.num_attention * self.attention_tensor_parallel_size
        return self.num_ffn

    @property
    def connector(self) -> str:
        """The AFD connector: ``[afd] connector``, else :data:`DEFAULT_CONNECTOR` on a CPU
        host and :data:`DEFAULT_CUDA_CONNECTOR` where CUDA devices are visible (the roles'
        tensors live on the GPUs there; shared memory would hand back CPU tensors)."""
        explicit = self.afd.get("connector")
        if explicit:
            return str(explicit)
        if self.ray is not None:
            # The roles' hosts are Ray nodes: GPUs are what the roles ask Ray for, and
            # shared memory only when the placement keeps every role on one node.
            if self.ray.uses_gpus:
                return DEFAULT_CUDA_CONNECTOR
            if self.ray.placement in (None, "strict_pack"):
                return DEFAULT_CONNECTOR
            return DEFAULT_NETWORK_CONNECTOR
        cuda = detect_cuda_devices({**os.environ, **self.env})
        return DEFAULT_CUDA_CONNECTOR if cuda else DEFAULT_CONNECTOR

    @property
    def ray_placement(self) -> str:
        """The Ray placement strategy (lower case): ``[ray] placement``, else
        ``strict_pack`` for a shared-memory connector (its ranks must share one host)
        and ``spread`` for the others."""
        if self.ray is not None and self.ray.placement:
            return self.ray.placement
        return "strict_pack" if self.connector in SHM_CONNECTORS else "spread"

    def afd_section(
        self, role: AFDRole, rank: int, *, port: int, host: str | None = None
    ) -> dict[str, Any]:
        """``additional_config["afd"]`` of one role process; ``host``: the rendezvous
        host (attention rank 0's address; default: the spec's ``host``)."""
        tp = self.attention_tensor_parallel_size
        return {
            **self.afd,
            **({"attention_tensor_parallel_size": tp} if tp > 1 else {}),
            **({"ffn_expert_parallel": True} if self.ffn_expert_parallel else {}),
            "connector": self.connector,
            "role": AFDRole(role).value,
            "rank": rank,
            "host": self.host if host is None else host,
            "port": port,
            "num_attention_ranks": self.num_attention,
            "num_ffn_ranks": self.num_ffn,
            "compute_gate_on_attention": self.compute_gate_on_attention,
        }

    def engine_args(self) -> list[str]:
        """vLLM engine args shared by every role (and by the native baseline)."""
        args = [
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--gpu-memory-utilization", str(self.gpu_memory_utilization),
        ]  # fmt: skip
        if self.enforce_eager:
            args.append("--enforce-eager")
        return args + list(self.vllm_args)

    # -- loading -------------------------------------------------------------------
    @classmethod
    def from_dict(
        cls,
        data: Mapping[str, Any],
        *,
        base_dir: Path | None = None,
        source: str | os.PathLike[str] | None = None,
    ) -> DeploymentSpec:
        """Build from a mapping (a parsed TOML file); relative paths resolve against
        base_dir; ``source`` (the spec file) is named in front of every error."""
        try:
            return cls._from_dict(data, base_dir)
        except SpecError as exc:
            if not source:
                raise
            raise SpecError(f"{source}: {exc}") from None

    @classmethod
    def _from_dict(cls, data: Mapping[str, Any], base_dir: Path | None) -> DeploymentSpec:
        if not isinstance(data, Mapping):
            raise SpecError(f"expected a table, got {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        aliases = {"attention_servers": "num_attention", "ffn_servers": "num_ffn"}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            key = aliases.get(key, key)
            if key not in names:
                raise unknown_key("", key, names)
            kwargs[key] = value
        if "model" not in kwargs:
            raise SpecError("model: missing (the checkpoint directory or model name)")
        if base_dir is not None:
            kwargs["model"] = resolve_model(kwargs["model"], base_dir)
            if isinstance(kwargs.get("log_dir"), str):
                kwargs["log_dir"] = str(base_dir / Path(kwargs["log_dir"]).expanduser())
            for role in AFDRole:
                table = kwargs.get(role)
                if isinstance(table, Mapping) and isinstance(table.get("model"), str):
                    kwargs[role] = {**table, "model": resolve_model(table["model"], base_dir)}
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> DeploymentSpec:
        data, base_dir = load_toml(path)
        return cls.from_dict(data, base_dir=base_dir, source=Path(path).expanduser())

    def replace(self, **changes: Any) -> DeploymentSpec:
        return dataclasses.replace(self, **changes)


def _overrides_from_mapping(role: AFDRole, table: Mapping[str, Any]) -> RoleOverrides:
    names = [f.name for f in dataclasses.fields(RoleOverrides)]
    for key in table:
        if key not in names:
            raise unknown_key(f"{role}: ", key, names)
    return RoleOverrides(**dict(table))


def _ray_from_mapping(table: Mapping[str, Any]) -> RaySpec:
    names = [f.name for f in dataclasses.fields(RaySpec)]
    for key in table:
        if key not in names:
            raise unknown_key("ray: ", key, names)
    return RaySpec(**dict(table))


def load_toml(path: str | os.PathLike[str]) -> tuple[dict[str, Any], Path]:
    """``(the parsed spec file, its folder)``: the folder is where relative paths in it
    resolve. A missing or malformed file raises :class:`SpecError` naming it."""
    p = Path(path).expanduser()
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise SpecError(f"{p}: no such spec file") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{p}: not valid TOML: {exc}") from None
    return data, p.resolve().parent
