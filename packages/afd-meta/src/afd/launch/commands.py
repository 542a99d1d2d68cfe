"""The role processes of a spec, not started yet: their commands, environments, log
files and health URLs, FFN servers first, then the attention server (or the one native
baseline server); with ``[prefill]`` the prefill instance before the attention server
and the proxy after it; and the admission token they share."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from afd.launch.cpus import shares_cpus
from afd.launch.processes import RoleProcess, role_env
from afd.launch.readiness import NATIVE, PREFILL, PROXY
from afd.launch.spec import DeploymentSpec
from afd.launch.spec_prefill import kv_transfer_args
from afd_core.config import additional_config_json
from afd_core.roles import AFDRole

__all__ = ["Layout", "build_roles", "give_token", "kv_storage"]


@dataclass
class Layout:
    """Where the roles of one deployment run: ports, devices, CPUs, folders."""

    http_port: int
    connector_port: int
    ffn_health_ports: Sequence[int]
    devices: Mapping[str, str]
    cpus: Mapping[str, str]
    tmp_dir: Path
    log_dir: Path
    hosts: Mapping[str, str] = field(default_factory=dict)
    """The address each role process binds, by name (``attn``, ``ffn0``...): its Ray
    node's; default: the spec's ``host``."""
    rendezvous_host: str | None = None
    """The AFD rendezvous host (attention rank 0's address); default: the spec's ``host``."""
    base_env: Mapping[str, str] | None = None
    """The environment the roles' start from (default: this process's; see
    :func:`role_env`)."""
    pd_ports: Sequence[int] = ()
    """With ``[prefill]``: ``(attention server's HTTP port, prefill instance's)``; the
    proxy then takes ``http_port`` (the deployment's URL)."""

    def env(self, spec: DeploymentSpec, role: AFDRole, name: str) -> dict[str, str]:
        return role_env(
            spec,
            role,
            self.tmp_dir,
            self.devices.get(name),
            self.cpus.get(name),
            base=self.base_env,
            shared=shares_cpus(self.cpus, name),
        )

    def host(self, spec: DeploymentSpec, name: str) -> str:
        return self.hosts.get(name, spec.host)


def build_roles(
    spec: DeploymentSpec, at: Layout, cls: type[RoleProcess] = RoleProcess
) -> list[RoleProcess]:
    """The role processes in start order: the FFN servers, then the attention server;
    for a native spec the one plain vLLM server. ``cls``: the kind of role process
    (:class:`RoleProcess` here, a Ray actor's in :mod:`afd.launch.ray`)."""
    if spec.native:
        return [_native_role(spec, at, cls)]
    roles = [_ffn_role(spec, at, rank, cls) for rank in range(spec.num_ffn)]
    if spec.prefill is None:
        return [*roles, _attention_role(spec, at, cls)]
    prefill = _prefill_role(spec, at, cls)
    attention = _attention_role(spec, at, cls)
    assert prefill.http_url and attention.http_url
    return [
        *roles,
        prefill,
        attention,
        _proxy_role(spec, at, prefill.http_url, attention.http_url, cls),
    ]


def kv_storage(at: Layout) -> Path:
    """The KV files' folder of a ``[prefill]`` deployment (inside its TMPDIR, removed
    when it stops), unless ``kv_connector_extra_config`` names one."""
    return at.tmp_dir / "kv"


def _prefill_role(spec: DeploymentSpec, at: Layout, cls: type[RoleProcess]) -> RoleProcess:
    assert spec.prefill is not None and at.pd_ports
    port = at.pd_ports[1]
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model,
        *spec.engine_args(), *spec.prefill.vllm_args,
        *kv_transfer_args(spec.prefill, "kv_producer", kv_storage(at)),
        "--kv-cache-memory-bytes", str(spec.kv_cache_memory_bytes),
        "--host", spec.host, "--port", str(port),
    ]  # fmt: skip
    env = role_env(
        spec,
        PREFILL,
        at.tmp_dir,
        spec.prefill.devices,
        spec.prefill.cpus or _first_rank(at.cpus.get("attn")),
        base=at.base_env,
        shared=spec.prefill.cpus is None and "attn" in at.cpus,
    )
    url = f"http://{spec.host}:{port}"
    return cls("prefill0", PREFILL, 0, cmd, env, at.log_dir / "prefill0.log", http_url=url)


def _first_rank(cpus: str | None) -> str | None:
    """The first rank's CPU list of a per-rank ``VLLM_CPU_OMP_THREADS_BIND`` (``a|b``)."""
    return None if cpus is None else cpus.split("|")[0]


def _proxy_role(
    spec: DeploymentSpec, at: Layout, prefill_url: str, decode_url: str, cls: type[RoleProcess]
) -> RoleProcess:
    cmd = [
        sys.executable, "-m", "afd.launch.pd_proxy", "--prefill", prefill_url,
        "--decode", decode_url, "--host", spec.host, "--port", str(at.http_port),
    ]  # fmt: skip
    env = {**(os.environ if at.base_env is None else at.base_env), "PYTHONUNBUFFERED": "1"}
    url = f"http://{spec.host}:{at.http_port}"
    return cls("proxy", PROXY, 0, cmd, env, at.log_dir / "proxy.log", http_url=url)


def _native_role(spec: DeploymentSpec, at: Layout, cls: type[RoleProcess]) -> RoleProcess:
    port = at.http_port
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", spec.model,
        *spec.engine_args(), *spec.attention.vllm_args, *_tensor_parallel_args(spec),
        "--kv-cache-memory-bytes", str(spec.kv_cache_memory_bytes),
        "--host", spec.host, "--port", str(port),
    ]  # fmt: skip
    env = at.env(spec, AFDRole.ATTENTION, "native0")
    url = f"http://{spec.host}:{port}"
    return cls("native0", NATIVE, 0, cmd, env, at.log_dir / "native0.log", http_url=url)


def _tensor_parallel_args(spec: DeploymentSpec) -> list[str]:
    tp = spec.attention_tensor_parallel_size
    return ["--tensor-parallel-size", str(tp)] if tp > 1 else []


def _ffn_role(spec: DeploymentSpec, at: Layout, rank: int, cls: type[RoleProcess]) -> RoleProcess:
    name = f"ffn{rank}"
    afd = spec.afd_config(AFDRole.FFN, rank, port=at.connector_port, host=at.rendezvous_host)
    health_port = at.ffn_health_ports[rank]
    host = at.host(spec, name)
    cmd = [
        sys.executable, "-m", "afd.cli", "serve", "--role", AFDRole.FFN.value,
        spec.ffn.model or spec.model,
        *spec.engine_args(), *spec.ffn.vllm_args,
        "--additional-config", additional_config_json(afd),
        "--health-host", host, "--health-port", str(health_port),
    ]  # fmt: skip
    return cls(
        name,
        AFDRole.FFN,
        rank,
        cmd,
        at.env(spec, AFDRole.FFN, name),
        at.log_dir / f"{name}.log",
        health_url=f"http://{host}:{health_port}",
    )


def _attention_role(spec: DeploymentSpec, at: Layout, cls: type[RoleProcess]) -> RoleProcess:
    # All attention ranks are the data-parallel ranks of ONE vLLM server: vLLM keeps
    # DP ranks in lock step (idle ranks run dummy batches), which the FFN fan-in
    # needs; each rank's AFD rank is its DP rank. Independent servers would not step
    # together, and an FFN rank would wait forever for an idle peer.
    port = at.pd_ports[0] if spec.prefill is not None else at.http_port
    host = at.host(spec, "attn")
    # the decode side of a [prefill] deployment reads the prefill instance's KV cache
    kv = (
        kv_transfer_args(spec.prefill, "kv_consumer", kv_storage(at))
        if spec.prefill is not None
        else []
    )
    # each DP rank's AFD rank is its DP rank (rank None: the runtime's)
    afd = spec.afd_config(AFDRole.ATTENTION, None, port=at.connector_port, host=at.rendezvous_host)
    dp = ["--data-parallel-size", str(spec.num_attention)] if spec.num_attention > 1 else []
    dp += _tensor_parallel_args(spec)
    cmd = [
        sys.executable, "-m", "afd.cli", "serve", "--role", AFDRole.ATTENTION.value,
        spec.attention.model or spec.model,
        *spec.engine_args(), *spec.attention.vllm_args, *dp, *kv,
        "--kv-cache-memory-bytes", str(spec.kv_cache_memory_bytes),
        "--host", host, "--port", str(port),
        "--additional-config", additional_config_json(afd),
    ]  # fmt: skip
    return cls(
        "attn",
        AFDRole.ATTENTION,
        0,
        cmd,
        at.env(spec, AFDRole.ATTENTION, "attn"),
        at.log_dir / "attn.log",
        http_url=f"http://{host}:{port}",
    )


def give_token(spec: DeploymentSpec, roles: Sequence[RoleProcess]) -> str:
    """Admission (docs/security.md): a fresh token per deployment, handed to every
    role in its environment (``AFD_AUTH_TOKEN``: not in process lists), unless the
    spec or the environment already chose one. Returns the line to print."""
    from afd_core.admission import TOKEN_ENV, generate_token

    given = [k for k in ("auth_token", "auth_token_file") if getattr(spec.afd, k)]
    if given:
        return f"admission: token from [afd] {given[0]}"
    if all(role.env.get(TOKEN_ENV) for role in roles):
        return f"admission: token from {TOKEN_ENV} in the environment"
    token = generate_token()
    for role in roles:
        role.env[TOKEN_ENV] = token
    return f"admission: a token generated for this deployment ({TOKEN_ENV} of each role)"
