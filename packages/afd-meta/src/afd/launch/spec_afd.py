"""A launch spec's AFD settings, parsed once into the typed
:class:`~afd_core.config.AFDConfig` the spec holds (:attr:`DeploymentSpec.afd
<afd.launch.spec.DeploymentSpec.afd>`): the spec's edge.

A spec sets them in two places (docs/cli.md): the ``[afd]`` table (afd-core's keys and
the upstream aliases, resolved by :meth:`AFDConfig.canonical`) and a few top-level keys
that shape the deployment (:data:`SPEC_AFD_FIELDS`, e.g. ``num_attention``). Everything
after this module reads the typed fields; the role processes get the config per process
(:meth:`DeploymentSpec.afd_config <afd.launch.spec.DeploymentSpec.afd_config>`),
serialised by :func:`afd_core.config.additional_config_json`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from afd.launch.errors import SpecError
from afd_core.config import ASYNC_KEYS, AFDConfig
from afd_core.errors import AFDConfigError
from afd_core.roles import AFDRole

__all__ = ["PER_PROCESS", "SPEC_AFD_FIELDS", "deployment_afd"]

SPEC_AFD_FIELDS: Mapping[str, str] = MappingProxyType(
    {
        "num_attention": "num_attention_ranks",
        "num_ffn": "num_ffn_ranks",
        "attention_tensor_parallel_size": "attention_tensor_parallel_size",
        "ffn_expert_parallel": "ffn_expert_parallel",
        "compute_gate_on_attention": "compute_gate_on_attention",
    }
)
"""Top-level spec keys that are :class:`AFDConfig` fields (spec key -> field): the spec
file's layout; ``[afd]`` refuses these fields."""

PER_PROCESS: Mapping[str, str] = MappingProxyType(
    {
        "role": "(one per process)",
        "rank": "(one per process)",
        "host": "host",
        "port": "connector_port",
    }
)
"""AFDConfig fields the launcher sets per role process (field -> the spec field that
chooses it): the spec's config keeps their defaults."""

_SPEC_KEY_OF = {field: key for key, field in SPEC_AFD_FIELDS.items()}
_TEMPLATE = AFDConfig(role=AFDRole.ATTENTION)


def _spec_error(exc: AFDConfigError) -> SpecError:
    """afd-core's one-line error, naming the key as the spec names it."""
    text = str(exc)
    for field, key in _SPEC_KEY_OF.items():
        if text.startswith(f"afd.{field}:"):
            return SpecError(key + text[len(f"afd.{field}") :])
    return SpecError(text)


def _from_table(table: Any) -> tuple[dict[str, Any], bool]:
    """``(AFDConfig values, whether a connector is named)`` of an ``[afd]`` table."""
    if not isinstance(table, Mapping):
        raise SpecError(f"afd: expected a table of afd keys, got {table!r}")
    try:  # afd-core resolves the aliases (and refuses unknown keys, a key given twice)
        values = AFDConfig.canonical(table)
        names = {  # afd-plugin's async keys name no field (afd_core.config.ASYNC_KEYS)
            key: next(iter(AFDConfig.canonical({key: None})))
            for key in table
            if key not in ASYNC_KEYS
        }
    except AFDConfigError as exc:
        raise SpecError(str(exc)) from None
    for key, name in names.items():  # afd_port: port
        use = PER_PROCESS.get(name) or _SPEC_KEY_OF.get(name)
        if use is not None:
            raise SpecError(f"afd.{key}: set by the launcher; use the spec field {use}")
    return values, "connector" in values


def _from_config(config: AFDConfig) -> dict[str, Any]:
    """The values of an :class:`AFDConfig` given as a spec's ``afd``: its per-process
    fields must be unset (the launcher sets them)."""
    for name, use in PER_PROCESS.items():
        if name != "role" and getattr(config, name) != getattr(_TEMPLATE, name):
            raise SpecError(f"afd.{name}: set by the launcher; use the spec field {use}")
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if f.name not in PER_PROCESS
    }


def deployment_afd(
    afd: Mapping[str, Any] | AFDConfig | None,
    fields: Mapping[str, Any],
    default_connector: Callable[[], str],
    *,
    connector_auto: bool = False,
) -> tuple[AFDConfig, bool]:
    """``(the deployment's AFDConfig, whether its connector is the launcher's default)``.

    ``afd``: the ``[afd]`` table (aliases allowed) or an :class:`AFDConfig`; ``fields``:
    the top-level keys of :data:`SPEC_AFD_FIELDS` that were given (they win over an
    AFDConfig's); ``default_connector``: the connector where none is named (asked only
    then). ``connector_auto``: True chooses the default even if ``afd`` names one (a copy
    of a spec whose connector was chosen so, see :meth:`DeploymentSpec.replace`); else
    the default only where ``afd`` names none (a table without ``connector``, nothing).
    Bad values raise a one-line :class:`SpecError` naming the key as the spec names it.
    The config's role is attention and its ``rank`` / ``host`` / ``port`` unset: the
    launcher sets them per process."""
    if afd is None:
        values: dict[str, Any] = {}
        named = False
    elif isinstance(afd, AFDConfig):
        values, named = _from_config(afd), True
    else:
        values, named = _from_table(afd)
    for key, value in fields.items():
        values[SPEC_AFD_FIELDS[key]] = value
    auto = connector_auto or not named
    if auto:
        values["connector"] = default_connector()
    try:
        return AFDConfig(role=AFDRole.ATTENTION, **values), auto
    except AFDConfigError as exc:
        raise _spec_error(exc) from None
