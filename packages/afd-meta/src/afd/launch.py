"""``afd launch``: start a whole AFD deployment (FFN + Attention servers) on one machine.

A :class:`DeploymentSpec` says what to run (checkpoint, ``num_attention`` x
``num_ffn`` servers, gate placement, dtype, KV cache, extra vLLM args, ports, env,
log directory). It is built from keyword arguments, from the ``afd launch`` flags
or from a small TOML file (:meth:`DeploymentSpec.from_toml`)::

    model = "~/.cache/afd/tiny-deepseek_v2"
    num_attention = 2
    num_ffn = 1
    [afd]
    connect_timeout_s = 120

A :class:`Deployment` (a context manager) starts the FFN server(s), then the
Attention server(s), each as ``python -m afd.cli serve --role ...`` in its own
process group with a per-deployment ``TMPDIR``; it streams every role's output with
a prefix (``[ffn0] ``, ``[attn] ``) to the console and to ``<log_dir>/<role>.log``,
waits for the FFN readiness marker and the Attention ``/health`` endpoints, and
tears everything down (SIGTERM to every process group, SIGKILL after a grace
period, then a check that no process of the groups is left). A role that exits
during start-up raises :class:`DeploymentError` with its last log lines.

``DeploymentSpec(native=True)`` runs one plain vLLM OpenAI API server with the same
engine arguments instead: the baseline for ``afd demo`` and ``afd bench``.

Devices: on a host with visible CUDA devices ``[g0, g1, ...]`` (``CUDA_VISIBLE_DEVICES``,
else ``nvidia-smi -L``; nothing is imported for it) every role process gets its own:
the attention server (its DP ranks) ``g0..g(A-1)``, FFN rank ``f`` ``g(A+f)``, the native
baseline ``g0`` (:func:`assign_devices`). Per role, ``devices`` in ``[attention]`` /
``[ffn]`` or ``CUDA_VISIBLE_DEVICES`` in the role's ``env`` overrides it. See docs/gpu.md.

Same-host defaults: every role runs on this host, so the AFD connector defaults to the
shared-memory ``P2pShmAFDConnector`` (:data:`DEFAULT_CONNECTOR`; on a host with CUDA
devices the NCCL connector; ``[afd] connector`` overrides it). On a CPU host (no CUDA
device detected) each role process gets its own cores through
``VLLM_CPU_OMP_THREADS_BIND`` (:func:`split_cpus`: the attention server
the first half of the usable CPUs, rounded up, the FFN ranks one block each of the
rest; the native baseline all of them). Per role, ``cpus`` in ``[attention]`` /
``[ffn]`` or ``VLLM_CPU_OMP_THREADS_BIND`` in the role's ``env`` overrides it;
``VLLM_CPU_OMP_THREADS_BIND`` in the spec's top-level ``env`` or the launcher's
environment turns the automatic split off. See docs/cli.md.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from afd_core.errors import AFDConfigError, AFDError, did_you_mean
from afd_core.procfs import group_members

__all__ = [
    "DEFAULT_CONNECTOR",
    "DEFAULT_CUDA_CONNECTOR",
    "DEFAULT_KV_CACHE_BYTES",
    "Deployment",
    "DeploymentError",
    "DeploymentSpec",
    "RoleOverrides",
    "RoleProcess",
    "SpecError",
    "allocate_health_ports",
    "allocate_ports",
    "assign_cpus",
    "bind_affinity",
    "assign_devices",
    "detect_cuda_devices",
    "format_cpu_list",
    "omp_bind_env",
    "parse_cpu_list",
    "parse_nvidia_smi_list",
    "parse_visible_devices",
    "prefix_lines",
    "role_env",
    "split_cpus",
    "usable_cpus",
]

DEFAULT_KV_CACHE_BYTES = 64 * 1024 * 1024
TAIL_LINES = 30
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"
# vLLM's own values of VLLM_CPU_OMP_THREADS_BIND besides CPU lists.
_CPU_BIND_KEYWORDS = ("auto", "nobind")
DEFAULT_CONNECTOR = "P2pShmAFDConnector"
"""The connector of a deployment whose ``[afd]`` table names none, on a CPU host: every
role of an ``afd launch`` deployment runs on this host, where shared memory beats gloo."""
DEFAULT_CUDA_CONNECTOR = "P2pNcclAFDConnector"
"""The default connector where CUDA devices are visible (one GPU per rank, see
docs/gpu.md)."""
_DTYPES = ("auto", "bfloat16", "float16", "float32")
# vLLM options the launcher sets itself (per role); users set them with spec fields.
_MANAGED_VLLM_OPTIONS = {
    "--model": "model",
    "--port": "http_port",
    "--host": "host",
    "--additional-config": "afd (a table of extra afd keys)",
    "--dtype": "dtype",
    "--max-model-len": "max_model_len",
    "--kv-cache-memory-bytes": "kv_cache_memory_bytes",
    "--gpu-memory-utilization": "gpu_memory_utilization",
    "--health-port": "ffn_health_port",
    "--health-host": "host",
}
# afd keys the launcher sets itself.
_MANAGED_AFD_KEYS = {
    "role": "(one per process)",
    "rank": "(one per process)",
    "port": "connector_port",
    "host": "host",
    "num_attention_ranks": "num_attention",
    "num_ffn_ranks": "num_ffn",
    "compute_gate_on_attention": "compute_gate_on_attention",
}


class SpecError(AFDConfigError):
    """An invalid deployment spec (the message names the field and what is allowed)."""


class DeploymentError(AFDError, RuntimeError):
    """A deployment failed to start (a role exited, or start-up timed out)."""


# --------------------------------------------------------------------------- spec


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
    dtype: str = "bfloat16"
    max_model_len: int = 256
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES
    gpu_memory_utilization: float = 0.1
    enforce_eager: bool = True
    vllm_args: list[str] = field(default_factory=list)
    """Extra vLLM engine/server args for every role."""
    afd: dict[str, Any] = field(default_factory=dict)
    """Extra ``additional_config["afd"]`` keys (routing_payload, timeouts, connector...)."""
    host: str = "127.0.0.1"
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

    def __post_init__(self) -> None:
        self.validate()

    # -- validation ----------------------------------------------------------------
    def validate(self) -> None:
        def fail(name: str, expected: str, value: Any) -> SpecError:
            return SpecError(f"{name}: expected {expected}, got {value!r} ({type(value).__name__})")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not isinstance(self.model, str | os.PathLike) or not str(self.model).strip():
            raise fail("model", "a checkpoint directory or model name", self.model)
        self.model = str(self.model)
        for name in ("num_attention", "num_ffn"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise fail(name, "an int >= 1", v)
        if self.num_ffn > self.num_attention:
            raise SpecError(
                f"num_ffn: {self.num_ffn} FFN servers for {self.num_attention} attention servers "
                "would leave FFN servers without peers (attention rank a talks to FFN rank "
                "a % num_ffn); use num_ffn <= num_attention"
            )
        if self.native and (self.num_attention, self.num_ffn) != (1, 1):
            raise SpecError("native: a native baseline is one server; leave num_attention/num_ffn")
        if not isinstance(self.compute_gate_on_attention, bool):
            raise fail("compute_gate_on_attention", "true or false", self.compute_gate_on_attention)
        if self.dtype not in _DTYPES:
            raise fail("dtype", "one of " + ", ".join(_DTYPES), self.dtype)
        if not is_int(self.max_model_len) or self.max_model_len < 1:
            raise fail("max_model_len", "an int >= 1", self.max_model_len)
        if not is_int(self.kv_cache_memory_bytes) or self.kv_cache_memory_bytes < 1:
            raise fail("kv_cache_memory_bytes", "an int >= 1 (bytes)", self.kv_cache_memory_bytes)
        g = self.gpu_memory_utilization
        if not isinstance(g, int | float) or isinstance(g, bool) or not 0 < g <= 1:
            raise fail("gpu_memory_utilization", "a number in (0, 1]", g)
        if not isinstance(self.enforce_eager, bool):
            raise fail("enforce_eager", "true or false", self.enforce_eager)
        if not isinstance(self.host, str) or not self.host.strip():
            raise fail("host", "a host name or IP address", self.host)
        for name in ("http_port", "connector_port", "ffn_health_port"):
            v = getattr(self, name)
            if not is_int(v) or not 0 <= v <= 65535:
                raise fail(name, "an int in 0..65535 (0 = pick a free port)", v)
        if self.http_port and self.connector_port == self.http_port:
            raise SpecError(
                f"connector_port: {self.connector_port} collides with the attention HTTP port"
            )
        t = self.startup_timeout_s
        if not isinstance(t, int | float) or isinstance(t, bool) or t <= 0:
            raise fail("startup_timeout_s", "a number of seconds > 0", t)
        if not isinstance(self.native, bool):
            raise fail("native", "true or false", self.native)
        if self.log_dir is not None:
            if not isinstance(self.log_dir, str | os.PathLike) or not str(self.log_dir):
                raise fail("log_dir", "a directory path", self.log_dir)
            self.log_dir = str(self.log_dir)
        self.vllm_args = _check_args("vllm_args", self.vllm_args)
        self.env = _check_env("env", self.env)
        for role in ("attention", "ffn"):
            ov = getattr(self, role)
            if isinstance(ov, Mapping):
                ov = _overrides_from_mapping(role, ov)
                setattr(self, role, ov)
            if not isinstance(ov, RoleOverrides):
                raise fail(role, "a table with model / vllm_args / env / devices / cpus", ov)
            if ov.model is not None and (not isinstance(ov.model, str) or not ov.model.strip()):
                raise fail(f"{role}.model", "a checkpoint directory or model name", ov.model)
            ov.vllm_args = _check_args(f"{role}.vllm_args", ov.vllm_args)
            ov.env = _check_env(f"{role}.env", ov.env)
            ranks = self.num_attention if role == "attention" else self.num_ffn
            ov.devices = _check_devices(f"{role}.devices", ov.devices, ranks)
            if ov.devices is not None and CUDA_VISIBLE_DEVICES in ov.env:
                raise SpecError(
                    f"{role}.devices and {role}.env.{CUDA_VISIBLE_DEVICES} are both set; "
                    "keep one of them"
                )
            ov.cpus = _check_cpus(f"{role}.cpus", ov.cpus, ranks, whole=role == "attention")
            if ov.cpus is not None and CPU_BIND in ov.env:
                raise SpecError(
                    f"{role}.cpus and {role}.env.{CPU_BIND} are both set; keep one of them"
                )
        if self.attention.devices and self.ffn.devices and not self.native:
            shared = sorted(set(self.attention.devices) & set(self.ffn.devices))
            if shared:
                raise SpecError(
                    f"ffn.devices: {','.join(shared)} also in attention.devices; every rank "
                    "needs its own device (NCCL refuses two ranks on one device)"
                )
        self._check_afd()

    def _check_afd(self) -> None:
        if not isinstance(self.afd, Mapping):
            raise SpecError(f"afd: expected a table of afd keys, got {self.afd!r}")
        self.afd = dict(self.afd)
        for key in self.afd:
            if key in _MANAGED_AFD_KEYS:
                raise SpecError(
                    f"afd.{key}: set by the launcher; use the spec field {_MANAGED_AFD_KEYS[key]}"
                )
        from afd_core.config import AFDConfig

        try:  # the same checks the roles will run, but now, with the spec's wording
            AFDConfig.parse(self.afd_section("attention", 0, port=1))
        except AFDConfigError as exc:
            raise SpecError(str(exc)) from None

    # -- derived -------------------------------------------------------------------
    @property
    def connector(self) -> str:
        """The AFD connector: ``[afd] connector``, else :data:`DEFAULT_CONNECTOR` on a CPU
        host and :data:`DEFAULT_CUDA_CONNECTOR` where CUDA devices are visible (the roles'
        tensors live on the GPUs there; shared memory would hand back CPU tensors)."""
        explicit = self.afd.get("connector")
        if explicit:
            return str(explicit)
        cuda = detect_cuda_devices({**os.environ, **self.env})
        return DEFAULT_CUDA_CONNECTOR if cuda else DEFAULT_CONNECTOR

    def afd_section(self, role: str, rank: int, *, port: int) -> dict[str, Any]:
        return {
            **self.afd,
            "connector": self.connector,
            "role": role,
            "rank": rank,
            "host": self.host,
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
    def from_dict(cls, data: Mapping[str, Any], *, base_dir: Path | None = None) -> DeploymentSpec:
        """Build from a mapping (a parsed TOML file); relative paths resolve against base_dir."""
        if not isinstance(data, Mapping):
            raise SpecError(f"expected a table, got {type(data).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        aliases = {"attention_servers": "num_attention", "ffn_servers": "num_ffn"}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            key = aliases.get(key, key)
            if key not in names:
                hint = did_you_mean(key, names)
                hint = f" ({hint})" if hint else ""
                raise SpecError(f"unknown key {key!r}{hint}; known keys: {', '.join(names)}")
            kwargs[key] = value
        if "model" not in kwargs:
            raise SpecError("model: missing (the checkpoint directory or model name)")
        if base_dir is not None:
            kwargs["model"] = _resolve_model(kwargs["model"], base_dir)
            if isinstance(kwargs.get("log_dir"), str):
                kwargs["log_dir"] = str(base_dir / Path(kwargs["log_dir"]).expanduser())
            for role in ("attention", "ffn"):
                table = kwargs.get(role)
                if isinstance(table, Mapping) and isinstance(table.get("model"), str):
                    kwargs[role] = {**table, "model": _resolve_model(table["model"], base_dir)}
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> DeploymentSpec:
        p = Path(path).expanduser()
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise SpecError(f"{p}: no such spec file") from None
        except tomllib.TOMLDecodeError as exc:
            raise SpecError(f"{p}: not valid TOML: {exc}") from None
        try:
            return cls.from_dict(data, base_dir=p.resolve().parent)
        except SpecError as exc:
            raise SpecError(f"{p}: {exc}") from None

    def replace(self, **changes: Any) -> DeploymentSpec:
        return dataclasses.replace(self, **changes)


def _resolve_model(model: Any, base_dir: Path) -> Any:
    if not isinstance(model, str):
        return model
    expanded = Path(model).expanduser()
    if expanded.is_absolute():
        return str(expanded)
    candidate = base_dir / expanded
    # A relative path that exists next to the spec file; otherwise a hub name.
    if candidate.exists() or model.startswith((".", "/")):
        return str(candidate)
    return model


def _check_args(name: str, args: Any) -> list[str]:
    if isinstance(args, str) or not isinstance(args, Sequence):
        raise SpecError(f"{name}: expected a list of strings, got {args!r}")
    out = []
    for a in args:
        if not isinstance(a, str | int | float) or isinstance(a, bool):
            raise SpecError(f"{name}: expected a list of strings, got item {a!r}")
        out.append(str(a))
    for a in out:
        opt = a.split("=", 1)[0]
        if opt in _MANAGED_VLLM_OPTIONS:
            raise SpecError(
                f"{name}: {opt} is set by the launcher; use the spec field "
                f"{_MANAGED_VLLM_OPTIONS[opt]}"
            )
    return out


def _check_env(name: str, env: Any) -> dict[str, str]:
    if not isinstance(env, Mapping):
        raise SpecError(f'{name}: expected a table of NAME = "value", got {env!r}')
    out = {}
    for k, v in env.items():
        if not isinstance(k, str) or not k or "=" in k:
            raise SpecError(f"{name}: invalid variable name {k!r}")
        if isinstance(v, bool) or not isinstance(v, str | int | float):
            raise SpecError(f"{name}.{k}: expected a string, got {v!r} ({type(v).__name__})")
        out[k] = str(v)
    return out


_DEVICE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_:./-]*$")


def _per_rank_entries(
    name: str, value: Any, sep: str, expected: str, entries: str
) -> list[str] | None:
    """A per-rank role setting (``devices``, ``cpus``) as strings: a ``sep``-separated
    string or a list of str / int entries; None when unset."""
    if value is None:
        return None
    if isinstance(value, str):
        items: list[Any] = value.split(sep)
    elif isinstance(value, Sequence) and not isinstance(value, bytes):
        items = list(value)
    else:
        raise SpecError(f"{name}: expected {expected}, got {value!r}")
    for item in items:
        if isinstance(item, bool) or not isinstance(item, str | int):
            raise SpecError(f"{name}: expected {entries} (str or int), got item {item!r}")
    return [str(item) for item in items]


def _check_devices(name: str, value: Any, ranks: int) -> list[str] | None:
    """``devices`` of a role: ``"0,1"`` or a list of entries, exactly one per rank."""
    items = _per_rank_entries(name, value, ",", '"0,1" or a list of device ids', "device ids")
    if items is None:
        return None
    out = []
    for item in items:
        s = item.strip()
        if not _DEVICE_ID.match(s):
            raise SpecError(
                f"{name}: {s!r} is not a device id (an index like 0 or a UUID like GPU-...)"
            )
        out.append(s)
    if len(out) != ranks:
        raise SpecError(
            f"{name}: {len(out)} device(s) {','.join(out)} for {ranks} rank(s); give exactly "
            "one device per rank"
        )
    if len(set(out)) != len(out):
        raise SpecError(f"{name}: a device is listed twice in {','.join(out)}")
    return out


_CPU_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


def parse_cpu_list(value: str) -> list[int]:
    """CPU ids of a CPU list in vLLM's format (``"0-2,4"`` -> ``[0, 1, 2, 4]``), sorted."""
    value = value.replace(" ", "")
    if not _CPU_LIST.match(value):
        raise ValueError(f"{value!r} is not a CPU list (e.g. 0, 0-3, 1,3)")
    out: set[int] = set()
    for part in value.split(","):
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if last < first:
            raise ValueError(f"{value!r}: the range {part} is empty")
        out.update(range(first, last + 1))
    return sorted(out)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The shortest CPU list in vLLM's format: ``[0, 1, 2, 4]`` -> ``"0-2,4"``."""
    ids = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def _check_cpus(name: str, value: Any, ranks: int, *, whole: bool) -> list[str] | None:
    """``cpus`` of a role: one CPU list per rank (a list, or a string with ``|`` between
    ranks), or ``"auto"`` / ``"nobind"``. ``whole``: the ranks are the DP ranks of one
    server, so a keyword stands for all of them."""
    items = _per_rank_entries(name, value, "|", '"0-1", a list of CPU lists or "auto"', "CPU lists")
    if items is None:
        return None
    out = []
    for item in items:
        s = item.replace(" ", "")
        if s not in _CPU_BIND_KEYWORDS:
            try:
                parse_cpu_list(s)
            except ValueError as exc:
                raise SpecError(f"{name}: {exc}, auto or nobind") from None
        out.append(s)
    if len(out) == 1 and out[0] in _CPU_BIND_KEYWORDS:
        return out * ranks  # one keyword for every rank
    if whole and any(s in _CPU_BIND_KEYWORDS for s in out):
        raise SpecError(
            f"{name}: {'|'.join(out)}: auto / nobind stand for the whole server; give "
            "either one of them or one CPU list per rank"
        )
    if len(out) != ranks:
        raise SpecError(
            f"{name}: {len(out)} CPU list(s) {'|'.join(out)} for {ranks} rank(s); give exactly "
            "one CPU list per rank"
        )
    return out


def _overrides_from_mapping(role: str, table: Mapping[str, Any]) -> RoleOverrides:
    names = [f.name for f in dataclasses.fields(RoleOverrides)]
    for key in table:
        if key not in names:
            hint = did_you_mean(key, names)
            hint = f" ({hint})" if hint else ""
            raise SpecError(f"{role}: unknown key {key!r}{hint}; known keys: {', '.join(names)}")
    return RoleOverrides(**dict(table))


# --------------------------------------------------------------------------- ports


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def allocate_ports(spec: DeploymentSpec, *, avoid: Iterable[int] = ()) -> tuple[list[int], int]:
    """``(http ports of the attention servers, connector port)``: all distinct.

    Fixed ports from the spec are bind-tested (a :class:`DeploymentError` names the
    one in use); 0 picks free ports from the OS, holding every test socket open until
    all are chosen so that no two roles get the same one.
    """
    n_http = 1  # one attention server; its data-parallel ranks are the attention ranks
    taken = set(avoid)
    held: list[socket.socket] = []

    def pick() -> int:
        for _ in range(100):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((spec.host, 0))
            port = s.getsockname()[1]
            held.append(s)
            if port not in taken:
                taken.add(port)
                return int(port)
        raise DeploymentError("could not find a free port")

    try:
        if spec.http_port:
            http = list(range(spec.http_port, spec.http_port + n_http))
            for i, p in enumerate(http):
                if p in taken or not _port_free(spec.host, p):
                    raise DeploymentError(
                        f"port {p} (HTTP of attention server {i}) is in use; "
                        "choose another http_port or 0 for free ports"
                    )
            taken.update(http)
        else:
            http = [pick() for _ in range(n_http)]
        if spec.native:
            return http, 0
        if spec.connector_port:
            p = spec.connector_port
            if p in taken or not _port_free(spec.host, p):
                raise DeploymentError(
                    f"port {p} (AFD connector rendezvous) is in use or taken by an HTTP port; "
                    "choose another connector_port or 0 for a free port"
                )
            conn = p
        else:
            conn = pick()
        return http, conn
    finally:
        for s in held:
            s.close()


def allocate_health_ports(spec: DeploymentSpec, *, avoid: Iterable[int] = ()) -> list[int]:
    """The ``/health`` + ``/metrics`` ports of the FFN servers, distinct from ``avoid``
    (the ports :func:`allocate_ports` gave): ``ffn_health_port + rank`` bind-tested, or
    free ports from the OS when it is 0."""
    taken = set(avoid)
    if spec.native:
        return []
    if spec.ffn_health_port:
        ports = list(range(spec.ffn_health_port, spec.ffn_health_port + spec.num_ffn))
        for rank, p in enumerate(ports):
            if p in taken or not _port_free(spec.host, p):
                raise DeploymentError(
                    f"port {p} (health/metrics of FFN server {rank}) is in use or taken by "
                    "another port of the deployment; choose another ffn_health_port or 0 "
                    "for free ports"
                )
        return ports
    held: list[socket.socket] = []
    ports = []
    try:
        while len(ports) < spec.num_ffn:
            if len(held) > 100 + spec.num_ffn:
                raise DeploymentError("could not find a free port")
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind((spec.host, 0))
            port = int(s.getsockname()[1])
            if port not in taken:
                taken.add(port)
                ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


# --------------------------------------------------------------------------- devices


def parse_visible_devices(value: str) -> list[str]:
    """The entries of a ``CUDA_VISIBLE_DEVICES`` value (CUDA stops at an invalid one;
    an empty value hides every device)."""
    out = []
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        out.append(entry)
    return out


def parse_nvidia_smi_list(output: str) -> list[str]:
    """CUDA device indices ``["0", ..., "n-1"]`` for the ``GPU i: ...`` lines of
    ``nvidia-smi -L`` (its indented MIG lines are not counted)."""
    n = len(re.findall(r"^GPU \d+:", output, flags=re.MULTILINE))
    return [str(i) for i in range(n)]


@functools.cache
def _nvidia_smi_output(cmd: tuple[str, ...], path: str | None) -> str | None:
    return _run_nvidia_smi_uncached(list(cmd))


def _run_nvidia_smi(cmd: list[str]) -> str | None:
    """``nvidia-smi`` output, run once per process and executable (the host's GPUs do
    not change while the launcher runs)."""
    return _nvidia_smi_output(tuple(cmd), shutil.which(cmd[0]))


def _run_nvidia_smi_uncached(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def detect_cuda_devices(
    environ: Mapping[str, str] | None = None,
    run: Callable[[list[str]], str | None] = _run_nvidia_smi,
) -> list[str]:
    """The host's visible CUDA devices, without importing torch or vLLM.

    ``CUDA_VISIBLE_DEVICES`` in ``environ`` (default ``os.environ``), when set, is the
    list; otherwise one index per ``GPU`` line of ``nvidia-smi -L`` (``run`` returns its
    output, or None when it is missing or fails). ``[]``: a CPU host.
    """
    env = os.environ if environ is None else environ
    if CUDA_VISIBLE_DEVICES in env:
        return parse_visible_devices(env[CUDA_VISIBLE_DEVICES])
    output = run(["nvidia-smi", "-L"])
    return parse_nvidia_smi_list(output) if output else []


def assign_devices(
    num_attention: int,
    num_ffn: int,
    visible: Sequence[str],
    *,
    attention: str | Sequence[str] | None = None,
    ffn: Sequence[str] | None = None,
) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` per role process: ``{"attn": ..., "ffn0": ..., ...}``.

    One device per rank, attention ranks first: the attention server (whose DP rank i
    vLLM places on its i-th visible device) gets ``visible[0:num_attention]``, FFN rank
    f ``visible[num_attention + f]``. ``attention`` (the server's whole value) and
    ``ffn`` (one value per FFN rank) are explicit settings; they are used as given, and
    the other role keeps its default positions. With no visible device (a CPU host) only
    explicit settings are returned. Raises :class:`DeploymentError` naming how many
    devices are needed and found when the default positions do not exist.
    """
    if ffn is not None and len(ffn) != num_ffn:
        raise ValueError(f"ffn: {len(ffn)} device values for {num_ffn} FFN ranks")
    needed = 0
    if attention is None:
        needed = num_attention
    if ffn is None and num_ffn:
        needed = num_attention + num_ffn
    if visible and len(visible) < needed:
        shape = f"{num_attention}A{num_ffn}F" if num_ffn else "one server"
        raise DeploymentError(
            f"{shape} needs {needed} CUDA devices (one per rank: attention ranks first, "
            f"then FFN ranks; NCCL refuses two ranks on one device), found {len(visible)} "
            f"({','.join(visible)}); set [attention] devices / [ffn] devices (or "
            f"{CUDA_VISIBLE_DEVICES} in a role's env) to choose the devices yourself"
        )
    out: dict[str, str] = {}
    if attention is not None:
        out["attn"] = attention if isinstance(attention, str) else ",".join(attention)
    elif visible:
        out["attn"] = ",".join(visible[:num_attention])
    for f in range(num_ffn):
        if ffn is not None:
            out[f"ffn{f}"] = ffn[f]
        elif visible:
            out[f"ffn{f}"] = visible[num_attention + f]
    return out


def _shared_devices(devices: Mapping[str, str]) -> list[str]:
    """Warnings for devices that two role processes would both use."""
    owner: dict[str, str] = {}
    out = []
    for name, value in devices.items():
        for d in parse_visible_devices(value):
            if d in owner and owner[d] != name:
                out.append(f"{owner[d]} and {name} share device {d}")
            owner.setdefault(d, name)
    return out


# --------------------------------------------------------------------------- CPUs


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (``os.sched_getaffinity``), sorted."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def _blocks(cpus: Sequence[int], n: int) -> list[list[int]]:
    """``cpus`` cut into ``n`` contiguous blocks, as even as possible (first ones larger)."""
    size, extra = divmod(len(cpus), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(list(cpus[start:end]))
        start = end
    return out


def split_cpus(cpus: Sequence[int], num_attention: int, num_ffn: int) -> dict[str, str] | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` per role process from the usable ``cpus``, or None
    when there are fewer CPUs than role processes (``num_attention + num_ffn``).

    The attention server gets the first half, rounded up (but leaving one CPU per FFN
    rank), cut into one block per DP rank (``"0|1"``, vLLM's format for the DP ranks of
    one server); the FFN ranks get the rest, one block each. Every process gets at least
    one CPU. ``num_ffn = 0`` (the native baseline): all of them. 2 CPUs, 1A1F:
    ``{"attn": "0", "ffn0": "1"}``.
    """
    cpus = sorted(set(cpus))
    n = len(cpus)
    if n < num_attention + num_ffn or n == 0:
        return None
    n_attn = n if num_ffn == 0 else max(num_attention, min((n + 1) // 2, n - num_ffn))
    out = {"attn": "|".join(format_cpu_list(b) for b in _blocks(cpus[:n_attn], num_attention))}
    for f, block in enumerate(_blocks(cpus[n_attn:], num_ffn) if num_ffn else []):
        out[f"ffn{f}"] = format_cpu_list(block)
    return out


def assign_cpus(
    num_attention: int,
    num_ffn: int,
    usable: Sequence[int],
    *,
    attention: str | None = None,
    ffn: Sequence[str] | None = None,
) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` per role process: ``{"attn": ..., "ffn0": ...}``.

    ``attention`` (the server's whole value) and ``ffn`` (one value per FFN rank) are
    explicit settings, used as given; the other processes get their share of
    :func:`split_cpus` of ``usable`` (none when ``usable`` is empty or too short).
    ``num_ffn = 0``: the native baseline (``"attn"``: all of ``usable``).
    """
    if ffn is not None and len(ffn) != num_ffn:
        raise ValueError(f"ffn: {len(ffn)} CPU values for {num_ffn} FFN ranks")
    split = (split_cpus(usable, num_attention, num_ffn) if usable else None) or {}
    out: dict[str, str] = {}
    if attention is not None:
        out["attn"] = attention
    elif "attn" in split:
        out["attn"] = split["attn"]
    for f in range(num_ffn):
        if ffn is not None:
            out[f"ffn{f}"] = ffn[f]
        elif f"ffn{f}" in split:
            out[f"ffn{f}"] = split[f"ffn{f}"]
    return out


def _cpu_warnings(cpus: Mapping[str, str], usable: Sequence[int]) -> list[str]:
    """Warnings for CPUs that two role processes would both use, or that are not usable."""
    owner: dict[int, str] = {}
    out = []
    for name, value in cpus.items():
        if value in _CPU_BIND_KEYWORDS:
            continue
        ids: set[int] = set()
        for part in value.split("|"):
            with contextlib.suppress(ValueError):
                ids.update(parse_cpu_list(part))
        for c in sorted(ids):
            if c in owner and owner[c] != name:
                out.append(f"{owner[c]} and {name} share CPU {c}")
            owner.setdefault(c, name)
        missing = sorted(ids - set(usable)) if usable else []
        if missing:
            out.append(
                f"{name}: CPU {format_cpu_list(missing)} not usable by this process "
                f"(usable: {format_cpu_list(usable)})"
            )
    return out


def bind_affinity(value: str) -> list[int] | None:
    """The CPUs a whole role process tree is confined to for its ``VLLM_CPU_OMP_THREADS_BIND``
    value: the union of its CPU lists (``"0|1"``, a DP server's ranks, -> ``[0, 1]``), or
    None for ``auto`` / ``nobind`` / anything that is not a CPU list (left to vLLM).

    vLLM binds only its worker's OpenMP threads; the API server, the engine core (which
    spins on ``sched_yield`` while it waits for the worker) and every other thread of the
    role would otherwise float onto the cores given to the other role."""
    ids: set[int] = set()
    for part in value.split("|"):
        try:
            ids.update(parse_cpu_list(part))
        except ValueError:
            return None
    return sorted(ids) or None


def omp_bind_env(cpus: str, ld_preload: str = "") -> dict[str, str]:
    """The OpenMP settings vLLM gives a worker process for the CPU list ``cpus``
    (``vllm.utils.ompmultiprocessing``): ``OMP_NUM_THREADS`` plus ``KMP_AFFINITY`` (Intel
    OpenMP preloaded), ``GOMP_CPU_AFFINITY`` (libgomp preloaded) or ``OMP_PLACES`` /
    ``OMP_PROC_BIND``."""
    ids = [str(c) for c in parse_cpu_list(cpus)]
    env = {"OMP_NUM_THREADS": str(len(ids))}
    if "libiomp" in ld_preload or "libomp" in ld_preload:
        env["KMP_AFFINITY"] = f"granularity=fine,explicit,proclist=[{','.join(ids)}]"
        env["KMP_BLOCKTIME"] = "5"
        env["KMP_TPAUSE"] = "0"
    elif "libgomp" in ld_preload:
        env["GOMP_CPU_AFFINITY"] = " ".join(ids)
    else:
        env["OMP_PLACES"] = "{" + ",".join(ids) + "}"
        env["OMP_PROC_BIND"] = "true"
    return env


# --------------------------------------------------------------------------- processes


def prefix_lines(prefix: str, text: str) -> str:
    """Every line of ``text`` with ``prefix`` in front (a trailing newline kept)."""
    if not text:
        return ""
    lines = text.splitlines(keepends=True)
    out = "".join(prefix + line for line in lines)
    return out if out.endswith("\n") else out + "\n"


def role_env(
    spec: DeploymentSpec,
    role: str,
    tmp_dir: Path,
    devices: str | None = None,
    cpus: str | None = None,
) -> dict[str, str]:
    """Environment of one role process; ``devices``: its ``CUDA_VISIBLE_DEVICES``
    (from :func:`assign_devices`), ``cpus``: its ``VLLM_CPU_OMP_THREADS_BIND`` (from
    :func:`assign_cpus`); the role's own ``env`` still wins. An FFN process bound to a
    CPU list also gets the matching OpenMP settings (:func:`omp_bind_env`)."""
    env = dict(os.environ)
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
    if role in ("attention", "ffn"):
        env.update(getattr(spec, role).env)
    bind = env.get(CPU_BIND, "")
    if role == "ffn" and _CPU_LIST.match(bind.replace(" ", "")):
        # The FFN server runs its worker in its own process (UniProcExecutor), where vLLM
        # does not apply VLLM_CPU_OMP_THREADS_BIND (only its multiprocess executor does,
        # for the worker processes it starts): set what vLLM would set there. Settings
        # given in the spec's env win.
        given = {**spec.env, **spec.ffn.env}
        with contextlib.suppress(ValueError):  # not a CPU list after all: leave it to vLLM
            for k, v in omp_bind_env(bind, env.get("LD_PRELOAD", "")).items():
                if k not in given:
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


class RoleProcess:
    """One role process: its command, output pump, log file and readiness."""

    def __init__(
        self,
        name: str,
        role: str,
        rank: int,
        cmd: list[str],
        env: dict[str, str],
        log_path: Path,
        *,
        http_url: str | None = None,
        health_url: str | None = None,
    ) -> None:
        self.name = name
        self.role = role
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
        self._pump: threading.Thread | None = None

    @property
    def prefix(self) -> str:
        return f"[{self.name}] "

    def start(self, console: IO[str] | None, lock: threading.Lock) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w", encoding="utf-8")
        log.write(f"# {' '.join(self.cmd)}\n")
        log.flush()
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

    def _pump_output(self, log: IO[str], console: IO[str] | None, lock: threading.Lock) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            for raw in iter(self.proc.stdout.readline, b""):
                line = raw.decode("utf-8", errors="replace")
                if not line.endswith("\n"):
                    line += "\n"
                self.tail.append(line)
                log.write(line)
                log.flush()
                if console is not None:
                    with lock, contextlib.suppress(Exception):
                        console.write(self.prefix + line)
                        console.flush()
        finally:
            log.close()

    def join_output(self, timeout: float = 5.0) -> None:
        if self._pump is not None:
            self._pump.join(timeout)

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def check_ready(self) -> bool:
        if self.ready:
            return True
        # The FFN server's /health turns 200 once its attention peers connected and it
        # serves; the attention server's once vLLM's engine is up.
        ok = False
        if self.health_url is not None:
            ok, self.last_health = _http_health(f"{self.health_url}/health")
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
        return bool(group_members(self.pgid))


def _http_health(url: str, timeout: float = 2.0) -> tuple[bool, str]:
    """``(status is 200, first line of the answer)``; the reason when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200, r.read(200).decode(errors="replace").strip()
    except urllib.error.HTTPError as e:
        return False, f"{e.code} {e.read(200).decode(errors='replace').strip()}".strip()
    except (urllib.error.URLError, OSError, ValueError) as e:
        return False, f"no answer ({getattr(e, 'reason', e)})"


# --------------------------------------------------------------------------- deployment


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
        self.started_at: float | None = None
        self.startup_s: float | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self.token_note = ""

    # -- info ----------------------------------------------------------------------
    @property
    def endpoints(self) -> list[str]:
        """Base URLs of the OpenAI-compatible servers (``http://host:port``)."""
        return [r.http_url for r in self.roles if r.http_url]

    @property
    def url(self) -> str:
        return self.endpoints[0]

    def say(self, msg: str) -> None:
        with self._lock, contextlib.suppress(Exception):
            self.console.write(f"[{self.name}] {msg}\n")
            self.console.flush()

    # -- devices -------------------------------------------------------------------
    def plan_devices(self) -> dict[str, str]:
        """``CUDA_VISIBLE_DEVICES`` per role process (``attn``, ``ffn0``..., ``native0``):
        the spec's ``devices`` / role ``env`` where set, else :func:`assign_devices`."""
        spec = self.spec
        if self.visible_devices is None:
            self.visible_devices = detect_cuda_devices({**os.environ, **spec.env})
        visible = self.visible_devices
        attention: str | list[str] | None = spec.attention.env.get(CUDA_VISIBLE_DEVICES)
        if attention is None and isinstance(spec.attention.devices, list):
            attention = spec.attention.devices
        if spec.native:
            planned = assign_devices(1, 0, visible, attention=attention)
            self.devices = {"native0": planned["attn"]} if "attn" in planned else {}
            return self.devices
        ffn_env = spec.ffn.env.get(CUDA_VISIBLE_DEVICES)
        ffn = [ffn_env] * spec.num_ffn if ffn_env is not None else spec.ffn.devices
        self.devices = assign_devices(
            spec.num_attention,
            spec.num_ffn,
            visible,
            attention=attention,
            ffn=ffn if isinstance(ffn, list) else None,
        )
        return self.devices

    def _say_devices(self) -> None:
        assert self.devices is not None
        visible = self.visible_devices or []
        if not self.devices:
            self.say(f"devices: no CUDA device visible; {CUDA_VISIBLE_DEVICES} left as is")
            return
        per_role = ", ".join(f"{k}={v}" for k, v in self.devices.items())
        seen = f"{len(visible)} visible: {','.join(visible)}" if visible else "none visible"
        self.say(f"devices ({CUDA_VISIBLE_DEVICES} per role): {per_role} ({seen})")
        for warning in _shared_devices(self.devices):
            self.say(f"WARNING: {warning}; NCCL refuses two ranks on one device")

    # -- CPUs ----------------------------------------------------------------------
    def plan_cpus(self) -> dict[str, str]:
        """``VLLM_CPU_OMP_THREADS_BIND`` per role process (``attn``, ``ffn0``...,
        ``native0``): the spec's ``cpus`` / role ``env`` where set; on a CPU host (no
        CUDA device) with no ``VLLM_CPU_OMP_THREADS_BIND`` in the spec's ``env`` or the
        launcher's environment, the other processes get :func:`split_cpus` of the usable
        CPUs (the native baseline all of them); nothing else is set."""
        spec = self.spec
        if self.visible_devices is None:
            self.visible_devices = detect_cuda_devices({**os.environ, **spec.env})
        if self.usable_cpus is None:
            self.usable_cpus = usable_cpus()
        usable = self.usable_cpus
        attention: str | None = spec.attention.env.get(CPU_BIND)
        if attention is None and spec.attention.cpus is not None:
            a = spec.attention.cpus
            attention = a[0] if a[0] in _CPU_BIND_KEYWORDS else "|".join(a)
        ffn_env = spec.ffn.env.get(CPU_BIND)
        num_ffn = 0 if spec.native else spec.num_ffn
        ffn = [ffn_env] * num_ffn if ffn_env is not None else spec.ffn.cpus
        if spec.native:
            ffn = None
        inherited = spec.env.get(CPU_BIND, os.environ.get(CPU_BIND))
        where = "the spec's env" if CPU_BIND in spec.env else "the environment"
        procs = 1 if spec.native else spec.num_attention + spec.num_ffn
        split = not self.visible_devices and inherited is None
        planned = assign_cpus(
            1 if spec.native else spec.num_attention,
            num_ffn,
            usable if split else [],
            attention=attention,
            ffn=ffn,
        )
        if spec.native:
            planned = {"native0": planned["attn"]} if "attn" in planned else {}
        self.cpus = planned
        lines = []
        names = ["native0"] if spec.native else ["attn"] + [f"ffn{f}" for f in range(num_ffn)]
        rest = [n for n in names if n not in planned]
        if planned:
            per_role = ", ".join(f"{k}={v}" for k, v in planned.items())
            lines.append(
                f"cpus ({CPU_BIND} per role): {per_role} "
                f"({len(usable)} usable: {format_cpu_list(usable)})"
            )
        if rest:
            left = ", ".join(rest)
            if self.visible_devices:
                why = "CUDA host"
            elif inherited is not None:
                why = f"{CPU_BIND}={inherited} from {where}"
            else:
                why = None
                lines.append(
                    f"WARNING: {len(usable)} usable CPU(s) ({format_cpu_list(usable)}) for "
                    f"{procs} role process(es): {CPU_BIND} of {left} left to vLLM "
                    "(auto: every role binds to the same first core)"
                )
            if why is not None:
                lines.append(f"cpus: {why}; {CPU_BIND} of {left} left as is")
        lines += [f"WARNING: {w}" for w in _cpu_warnings(planned, usable)]
        self._cpu_lines = lines
        return self.cpus

    # -- commands ------------------------------------------------------------------
    def _build_roles(self) -> None:
        spec = self.spec
        assert self.work_dir is not None and self.log_dir is not None
        devices = self.devices if self.devices is not None else self.plan_devices()
        cpus = self.cpus if self.cpus is not None else self.plan_cpus()
        tmp = self.tmp_dir = role_tmp_dir(self.work_dir)
        py = sys.executable
        if spec.native:
            port = self.http_ports[0]
            url = f"http://{spec.host}:{port}"
            cmd = [
                py, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model,
                *spec.engine_args(), *spec.attention.vllm_args,
                "--kv-cache-memory-bytes", str(spec.kv_cache_memory_bytes),
                "--host", spec.host, "--port", str(port),
            ]  # fmt: skip
            env = role_env(spec, "attention", tmp, devices.get("native0"), cpus.get("native0"))
            self.roles.append(
                RoleProcess(
                    "native0", "native", 0, cmd, env, self.log_dir / "native0.log", http_url=url
                )
            )
            return
        if len(self.ffn_health_ports) != spec.num_ffn:
            self.ffn_health_ports = allocate_health_ports(
                spec, avoid=[*self.http_ports, self.connector_port]
            )
        for rank in range(spec.num_ffn):
            afd = spec.afd_section("ffn", rank, port=self.connector_port)
            health_port = self.ffn_health_ports[rank]
            cmd = [
                py, "-m", "afd.cli", "serve", "--role", "ffn", spec.ffn.model or spec.model,
                *spec.engine_args(), *spec.ffn.vllm_args,
                "--additional-config", json.dumps({"afd": afd}),
                "--health-host", spec.host, "--health-port", str(health_port),
            ]  # fmt: skip
            self.roles.append(
                RoleProcess(
                    f"ffn{rank}",
                    "ffn",
                    rank,
                    cmd,
                    role_env(spec, "ffn", tmp, devices.get(f"ffn{rank}"), cpus.get(f"ffn{rank}")),
                    self.log_dir / f"ffn{rank}.log",
                    health_url=f"http://{spec.host}:{health_port}",
                )
            )
        # All attention ranks are the data-parallel ranks of ONE vLLM server: vLLM keeps
        # DP ranks in lock step (idle ranks run dummy batches), which the FFN fan-in
        # needs; each rank's AFD rank is its DP rank. Independent servers would not step
        # together, and an FFN rank would wait forever for an idle peer.
        port = self.http_ports[0]
        afd = spec.afd_section("attention", 0, port=self.connector_port)
        del afd["rank"]
        dp = ["--data-parallel-size", str(spec.num_attention)] if spec.num_attention > 1 else []
        cmd = [
            py, "-m", "afd.cli", "serve", "--role", "attention",
            spec.attention.model or spec.model,
            *spec.engine_args(), *spec.attention.vllm_args, *dp,
            "--kv-cache-memory-bytes", str(spec.kv_cache_memory_bytes),
            "--host", spec.host, "--port", str(port),
            "--additional-config", json.dumps({"afd": afd}),
        ]  # fmt: skip
        self.roles.append(
            RoleProcess(
                "attn",
                "attention",
                0,
                cmd,
                role_env(spec, "attention", tmp, devices.get("attn"), cpus.get("attn")),
                self.log_dir / "attn.log",
                http_url=f"http://{spec.host}:{port}",
            )
        )
        self.token_note = self._give_token()

    def _give_token(self) -> str:
        """Admission (docs/security.md): a fresh token per deployment, handed to every
        role in its environment (``AFD_AUTH_TOKEN``: not in process lists), unless the
        spec or the environment already chose one. Returns the line to print."""
        from afd_core.admission import TOKEN_ENV, generate_token

        given = [k for k in ("auth_token", "auth_token_file") if self.spec.afd.get(k)]
        if given:
            return f"admission: token from [afd] {given[0]}"
        if all(role.env.get(TOKEN_ENV) for role in self.roles):
            return f"admission: token from {TOKEN_ENV} in the environment"
        token = generate_token()
        for role in self.roles:
            role.env[TOKEN_ENV] = token
        return f"admission: a token generated for this deployment ({TOKEN_ENV} of each role)"

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> Deployment:
        spec = self.spec
        self.started_at = time.monotonic()
        self.plan_devices()  # a missing device fails here, before anything is started
        self.plan_cpus()
        self.work_dir = Path(tempfile.mkdtemp(prefix=f"{self.name}-launch-"))
        self.log_dir = Path(spec.log_dir).expanduser() if spec.log_dir else self.work_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.http_ports, self.connector_port = allocate_ports(spec)
        self._build_roles()
        what = "native vLLM" if spec.native else f"{spec.num_attention}A{spec.num_ffn}F"
        self.say(
            f"starting {what} deployment of {spec.model} "
            + (f"(connector port {self.connector_port}) " if not spec.native else "")
            + f"logs in {self.log_dir}"
        )
        if not spec.native:
            how = "from [afd] connector" if spec.afd.get("connector") else "same-host default"
            self.say(f"connector: {spec.connector} ({how})")
            self.say(self.token_note)
        self._say_devices()
        for line in self._cpu_lines:
            self.say(line)
        console = self.console if self.echo else None
        try:
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
            parts.append(f"{r.name} {'ready' if r.ready else 'starting'}")
        return ", ".join(parts)

    def _wait_ready(self) -> None:
        assert self.started_at is not None
        deadline = self.started_at + self.spec.startup_timeout_s
        next_progress = time.monotonic() + self.progress_every_s
        while True:
            for r in self.roles:
                rc = r.returncode()
                if rc is not None:
                    self._fail_role(r, f"exited with code {rc} during start-up")
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
        if started:
            self.say("stopping: SIGTERM to " + ", ".join(r.name for r in started))
        for r in started:
            _signal_group(r.pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(r.group_alive() for r in started):
            for r in started:  # reap our direct children
                r.returncode()
            time.sleep(0.1)
        left = [r for r in started if r.group_alive()]
        for r in left:
            self.say(f"{r.name}: still running after {grace_s:.0f} s; SIGKILL")
            _signal_group(r.pgid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(r.group_alive() for r in started):
            for r in started:
                r.returncode()
            time.sleep(0.1)
        for r in started:
            if r.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    r.proc.wait(timeout=1.0)
            r.join_output(2.0)
        survivors = {r.name: group_members(r.pgid) for r in started if r.pgid is not None}
        survivors = {k: v for k, v in survivors.items() if v}
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


def _signal_group(pgid: int | None, sig: signal.Signals) -> None:
    if pgid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


# --------------------------------------------------------------------------- CLI


class _Interrupted(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def forward_signals() -> Any:
    """Turn the first SIGINT/SIGTERM into :class:`_Interrupted` (later ones are ignored
    while the deployment is torn down)."""
    fired: list[int] = []

    def handler(signum: int, _frame: Any) -> None:
        if fired:
            return
        fired.append(signum)
        raise _Interrupted(signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def spec_from_args(args: Any) -> DeploymentSpec:
    """A spec from ``afd launch`` arguments (a TOML file and/or flags; flags win)."""
    data: dict[str, Any] = {}
    base_dir = None
    if args.spec:
        p = Path(args.spec).expanduser()
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise SpecError(f"{p}: no such spec file") from None
        except tomllib.TOMLDecodeError as exc:
            raise SpecError(f"{p}: not valid TOML: {exc}") from None
        base_dir = p.resolve().parent
    flags = {
        "model": args.model,
        "num_attention": args.attention,
        "num_ffn": args.ffn,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "http_port": args.http_port,
        "connector_port": args.connector_port,
        "ffn_health_port": getattr(args, "ffn_health_port", None),
        "log_dir": args.log_dir,
        "startup_timeout_s": args.startup_timeout,
    }
    if args.gate_on_attention:
        flags["compute_gate_on_attention"] = True
    if args.native:
        flags["native"] = True
    for k, v in flags.items():
        if v is not None:
            data[k] = v
    role_flags = (
        ("attention", "devices", args.attention_devices),
        ("ffn", "devices", args.ffn_devices),
        ("attention", "cpus", getattr(args, "attention_cpus", None)),
        ("ffn", "cpus", getattr(args, "ffn_cpus", None)),
    )
    for role, key, value in role_flags:
        if value is not None:
            table = data.get(role, {})
            data[role] = {**table, key: value} if isinstance(table, Mapping) else table
    if args.model is not None:
        data["model"] = (
            str(Path(args.model).expanduser().absolute())
            if Path(args.model).expanduser().exists()
            else args.model
        )
    if args.vllm_args:
        data["vllm_args"] = [*data.get("vllm_args", []), *shlex.split(args.vllm_args)]
    if not data.get("model"):
        raise SpecError("model: give a spec file with model = ... or --model DIR")
    if base_dir is None:
        return DeploymentSpec.from_dict(data)
    try:
        return DeploymentSpec.from_dict(data, base_dir=base_dir)
    except SpecError as exc:
        raise SpecError(f"{args.spec}: {exc}") from None


def add_cpu_arguments(ap: Any) -> None:
    """``--attention-cpus`` / ``--ffn-cpus`` (``afd launch``, ``afd demo``, ``afd bench``)."""
    ap.add_argument(
        "--attention-cpus",
        metavar="CPUS",
        help=f"{CPU_BIND} of the attention server (e.g. 0 or 0-3; DP ranks separated by |; "
        "auto = vLLM's own); default on a CPU host: the first half of the usable CPUs",
    )
    ap.add_argument(
        "--ffn-cpus",
        metavar="CPUS",
        help=f"{CPU_BIND} of the FFN servers, one CPU list per rank separated by | (e.g. 1 "
        "or 2|3); default on a CPU host: the CPUs after the attention server's, one block "
        "per rank",
    )


def add_launch_arguments(ap: Any) -> None:
    ap.add_argument("spec", nargs="?", help="deployment spec (TOML); flags override it")
    ap.add_argument("--model", help="checkpoint directory (or model name)")
    ap.add_argument("--attention", type=int, help="number of attention servers (default 1)")
    ap.add_argument("--ffn", type=int, help="number of FFN servers (default 1)")
    ap.add_argument(
        "--gate-on-attention",
        action="store_true",
        help="compute the MoE gate on the attention role",
    )
    ap.add_argument("--dtype", choices=_DTYPES)
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--kv-cache-memory-bytes", type=int)
    ap.add_argument("--http-port", type=int, help="HTTP port of attention server 0 (0 = free)")
    ap.add_argument("--connector-port", type=int, help="AFD rendezvous port (0 = free)")
    ap.add_argument(
        "--ffn-health-port",
        type=int,
        help="/health and /metrics port of FFN server 0 (server i: +i; 0 = free)",
    )
    ap.add_argument("--log-dir", help="per-role log files (default: a temporary folder)")
    ap.add_argument(
        "--attention-devices",
        metavar="IDS",
        help="CUDA devices of the attention ranks, one per rank (e.g. 0,1; default: the "
        "first visible ones)",
    )
    ap.add_argument(
        "--ffn-devices",
        metavar="IDS",
        help="CUDA devices of the FFN ranks, one per rank (e.g. 2; default: the visible "
        "ones after the attention ranks)",
    )
    add_cpu_arguments(ap)
    ap.add_argument("--startup-timeout", type=float, help="seconds (default 600)")
    ap.add_argument(
        "--native",
        action="store_true",
        help="run one plain vLLM server with the same args instead (baseline)",
    )
    ap.add_argument(
        "--quiet", action="store_true", help="role output to the log files only (not the console)"
    )
    ap.add_argument(
        "--vllm-args",
        default=None,
        metavar="'ARGS'",
        help="extra vLLM args for every role, one shell-quoted string "
        "(e.g. --vllm-args='--max-num-seqs 8')",
    )


def run_launch(args: Any) -> int:
    """``afd launch``: start the deployment, print the endpoints, run until interrupted."""
    try:
        spec = spec_from_args(args)
    except SpecError as exc:
        print(f"afd launch: invalid spec: {exc}", file=sys.stderr)
        return 2
    dep = Deployment(spec, echo=not args.quiet, console=sys.stdout)
    code = 0
    with forward_signals():
        try:
            dep.start()
            dep.say("endpoints (OpenAI-compatible API):")
            for url in dep.endpoints:
                dep.say(
                    f"  {url}/v1  (e.g. curl {url}/v1/completions -H 'Content-Type: "
                    'application/json\' -d \'{"prompt": "Hello", "max_tokens": 16}\')'
                )
                dep.say(f"  {url}/metrics  (vLLM's and the attention role's AFD metrics)")
            for role in dep.roles:
                if role.role == "ffn":
                    dep.say(f"  {role.health_url}/health, {role.health_url}/metrics  ({role.name})")
            dep.say("running; Ctrl-C or SIGTERM stops every role")
            gone = dep.wait()
            rc = gone.returncode()
            dep.say(f"{gone.name} exited with code {rc}; stopping the deployment")
            code = 1
        except _Interrupted as sig:
            dep.say(f"{sig} received")
            # SIGTERM is the normal way to stop a launcher: a clean teardown exits 0.
            code = 0 if sig.signum == signal.SIGTERM else 130
        except DeploymentError as exc:
            print(f"afd launch: {exc}", file=sys.stderr)
            code = 1
        finally:
            clean = dep.stop()
    if not clean:
        code = code or 1
    return code
