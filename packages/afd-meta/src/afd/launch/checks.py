"""Checks of single spec values (lists of args, env tables, per-rank devices / CPUs,
unknown keys): each returns the value normalised or raises :class:`SpecError` naming the
field and what is allowed."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from afd.launch.cpus import CPU_BIND_KEYWORDS, parse_cpu_list
from afd.launch.errors import SpecError
from afd_core.errors import did_you_mean

# vLLM options the launcher sets itself (per role); users set them with spec fields.
MANAGED_VLLM_OPTIONS = {
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
    "--tensor-parallel-size": "attention_tensor_parallel_size",
    "-tp": "attention_tensor_parallel_size",
    "--data-parallel-size": "num_attention",
    "-dp": "num_attention",
}


def unknown_key(where: str, key: str, names: Sequence[str]) -> SpecError:
    """The error for a key that is none of ``names`` (``where``: ``"ffn: "``, or ``""``
    at the top level), with afd-core's did-you-mean hint."""
    hint = did_you_mean(key, names)
    hint = f" ({hint})" if hint else ""
    return SpecError(f"{where}unknown key {key!r}{hint}; known keys: {', '.join(names)}")


def resolve_model(model: Any, base_dir: Path) -> Any:
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


def check_args(name: str, args: Any) -> list[str]:
    if isinstance(args, str) or not isinstance(args, Sequence):
        raise SpecError(f"{name}: expected a list of strings, got {args!r}")
    out = []
    for a in args:
        if not isinstance(a, str | int | float) or isinstance(a, bool):
            raise SpecError(f"{name}: expected a list of strings, got item {a!r}")
        out.append(str(a))
    for a in out:
        opt = a.split("=", 1)[0]
        if opt in MANAGED_VLLM_OPTIONS:
            raise SpecError(
                f"{name}: {opt} is set by the launcher; use the spec field "
                f"{MANAGED_VLLM_OPTIONS[opt]}"
            )
    return out


def check_env(name: str, env: Any) -> dict[str, str]:
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


def check_devices(name: str, value: Any, ranks: int) -> list[str] | None:
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


def check_cpus(name: str, value: Any, ranks: int, *, whole: bool) -> list[str] | None:
    """``cpus`` of a role: one CPU list per rank (a list, or a string with ``|`` between
    ranks), or ``"auto"`` / ``"nobind"``. ``whole``: the ranks are the DP ranks of one
    server, so a keyword stands for all of them."""
    items = _per_rank_entries(name, value, "|", '"0-1", a list of CPU lists or "auto"', "CPU lists")
    if items is None:
        return None
    out = []
    for item in items:
        s = item.replace(" ", "")
        if s not in CPU_BIND_KEYWORDS:
            try:
                parse_cpu_list(s)
            except ValueError as exc:
                raise SpecError(f"{name}: {exc}, auto or nobind") from None
        out.append(s)
    if len(out) == 1 and out[0] in CPU_BIND_KEYWORDS:
        return out * ranks  # one keyword for every rank
    if whole and any(s in CPU_BIND_KEYWORDS for s in out):
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


def _fail(name: str, expected: str, value: Any) -> SpecError:
    return SpecError(f"{name}: expected {expected}, got {value!r} ({type(value).__name__})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_launch_fields(spec: Any, dtypes: Sequence[str]) -> None:
    """The launch-only fields of a :class:`~afd.launch.spec.DeploymentSpec` (``spec``),
    checked and normalised in place (its AFD settings are afd-core's to check)."""
    if not isinstance(spec.model, str | os.PathLike) or not str(spec.model).strip():
        raise _fail("model", "a checkpoint directory or model name", spec.model)
    spec.model = str(spec.model)
    if spec.dtype not in dtypes:
        raise _fail("dtype", "one of " + ", ".join(dtypes), spec.dtype)
    if not _is_int(spec.max_model_len) or spec.max_model_len < 1:
        raise _fail("max_model_len", "an int >= 1", spec.max_model_len)
    if not _is_int(spec.kv_cache_memory_bytes) or spec.kv_cache_memory_bytes < 1:
        raise _fail("kv_cache_memory_bytes", "an int >= 1 (bytes)", spec.kv_cache_memory_bytes)
    g = spec.gpu_memory_utilization
    if not isinstance(g, int | float) or isinstance(g, bool) or not 0 < g <= 1:
        raise _fail("gpu_memory_utilization", "a number in (0, 1]", g)
    if not isinstance(spec.enforce_eager, bool):
        raise _fail("enforce_eager", "true or false", spec.enforce_eager)
    if not isinstance(spec.host, str) or not spec.host.strip():
        raise _fail("host", "a host name or IP address", spec.host)
    for name in ("http_port", "connector_port", "ffn_health_port"):
        v = getattr(spec, name)
        if not _is_int(v) or not 0 <= v <= 65535:
            raise _fail(name, "an int in 0..65535 (0 = pick a free port)", v)
    if spec.http_port and spec.connector_port == spec.http_port:
        raise SpecError(
            f"connector_port: {spec.connector_port} collides with the attention HTTP port"
        )
    t = spec.startup_timeout_s
    if not isinstance(t, int | float) or isinstance(t, bool) or t <= 0:
        raise _fail("startup_timeout_s", "a number of seconds > 0", t)
    if not isinstance(spec.native, bool):
        raise _fail("native", "true or false", spec.native)
    if spec.log_dir is not None:
        if not isinstance(spec.log_dir, str | os.PathLike) or not str(spec.log_dir):
            raise _fail("log_dir", "a directory path", spec.log_dir)
        spec.log_dir = str(spec.log_dir)
    spec.vllm_args = check_args("vllm_args", spec.vllm_args)
    spec.env = check_env("env", spec.env)


def check_speculation(spec: Any) -> None:
    """Speculative decoding asked in the Attention role's vLLM args of an AFD ``spec``:
    refused here, in one line, when the roles would refuse it at start
    (:mod:`afd_moe_runners.speculation`)."""
    from afd_moe_runners.speculation import (
        micro_batched_speculation_problem,
        speculative_method,
        speculative_problem,
        speculative_settings,
    )

    where = "attention.vllm_args" if spec.attention.vllm_args else "vllm_args"
    try:
        settings = speculative_settings([*spec.vllm_args, *spec.attention.vllm_args])
    except ValueError as exc:
        raise SpecError(f"{where}: {exc}") from None
    if settings is None:
        return
    method = speculative_method(settings)
    problem = speculative_problem(method, where, num_attention_ranks=spec.num_attention)
    if problem is None and spec.afd.num_micro_batches > 1:
        problem = f"{where}: {micro_batched_speculation_problem(spec.afd.num_micro_batches)}"
    if problem is not None:
        raise SpecError(problem)
