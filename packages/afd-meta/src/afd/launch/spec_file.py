"""Spec files: :func:`load_toml`, the one loader of ``afd launch`` spec files,
:func:`spec_kwargs`, a mapping (a parsed file) turned into the spec's keyword arguments,
and the way back: :func:`spec_mapping` (a spec as a file's mapping) and
:func:`dump_toml` (a mapping as TOML). The spec itself, and its checks, are
:mod:`afd.launch.spec`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from afd.launch.checks import resolve_model, unknown_key
from afd.launch.errors import SpecError
from afd_core.roles import AFDRole

__all__ = ["dump_toml", "load_toml", "spec_kwargs", "spec_mapping"]


def spec_kwargs(data: Mapping[str, Any], names: list[str], base_dir: Path | None) -> dict[str, Any]:
    """The :class:`~afd.launch.spec.DeploymentSpec` keyword arguments of a mapping (a
    parsed spec file): spec field names (``names``) checked, the aliases
    ``attention_servers`` / ``ffn_servers`` resolved, relative paths (models, log_dir)
    resolved against ``base_dir``."""
    if not isinstance(data, Mapping):
        raise SpecError(f"expected a table, got {type(data).__name__}")
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
    return kwargs


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


def _plain(value: Any) -> Any:
    """A spec value as a file holds it: a table (dataclass) as the mapping of its fields
    that differ from their defaults."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return value
    defaults = type(value)()
    out = {}
    for f in dataclasses.fields(value):
        v, d = _plain(getattr(value, f.name)), _plain(getattr(defaults, f.name))
        if v != d and v not in ({}, None):
            out[f.name] = v
    return out


def spec_mapping(spec: Any, defaults: Any, afd_fields: Mapping[str, str]) -> dict[str, Any]:
    """``spec`` (a :class:`~afd.launch.spec.DeploymentSpec`) as a spec file's mapping:
    the keys that differ from ``defaults`` (a spec of the same model), the top-level AFD
    keys (``afd_fields``: spec key -> AFDConfig field) under the spec's names, and
    ``[afd]`` with the other settings that differ from afd-core's defaults (the
    connector only where the spec named one)."""
    out: dict[str, Any] = {"model": spec.model}
    for key in afd_fields:
        if getattr(spec, key) != getattr(defaults, key):
            out[key] = getattr(spec, key)
    for f in dataclasses.fields(spec):
        if f.name in ("model", "afd", "connector_auto"):
            continue
        value = _plain(getattr(spec, f.name))
        if f.name == "prefill" and value == {} and spec.prefill is not None:
            value = {"kv_connector": spec.prefill.kv_connector}  # an all-default table
        if value != _plain(getattr(defaults, f.name)) and value not in ({}, None):
            out[f.name] = value
    afd = spec.afd.to_section()
    for key in ("role", "connector", *afd_fields.values()):
        afd.pop(key, None)
    if not spec.connector_auto:
        afd["connector"] = spec.afd.connector
    if afd:
        out["afd"] = afd
    return out


def _toml_value(where: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(where, v) for v in value) + "]"
    raise SpecError(f"{where}: cannot write {value!r} ({type(value).__name__}) as TOML")


def dump_toml(data: Mapping[str, Any], _prefix: str = "") -> str:
    """``data`` (str keys; values: str, int, float, bool, lists of them, tables) as TOML
    text: :func:`load_toml` of it gives ``data`` back."""
    lines: list[str] = []
    tables: list[tuple[str, Mapping[str, Any]]] = []
    for key, value in data.items():
        name = key if key.replace("_", "").replace("-", "").isalnum() else json.dumps(key)
        if isinstance(value, Mapping):
            tables.append((f"{_prefix}{name}", value))
        elif value is not None:
            lines.append(f"{name} = {_toml_value(_prefix + key, value)}")
    for name, table in tables:
        lines += ["", f"[{name}]", dump_toml(table, f"{name}.").rstrip("\n")]
    return "\n".join(lines).strip("\n") + "\n"
