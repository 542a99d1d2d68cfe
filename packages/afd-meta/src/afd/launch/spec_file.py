"""Spec files: :func:`load_toml`, the one loader of ``afd launch`` spec files, and
:func:`spec_kwargs`, a mapping (a parsed file) turned into the spec's keyword arguments.
The spec itself, and its checks, are :mod:`afd.launch.spec`."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from afd.launch.checks import resolve_model, unknown_key
from afd.launch.errors import SpecError
from afd_core.roles import AFDRole

__all__ = ["load_toml", "spec_kwargs"]


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
