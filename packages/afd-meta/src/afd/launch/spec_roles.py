"""A spec's per-role tables (``[attention]`` / ``[ffn]``): :class:`RoleOverrides` and
their checks (:func:`check_overrides`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from afd.launch.checks import check_args, check_cpus, check_devices, check_env, unknown_key
from afd.launch.cpus import CPU_BIND
from afd.launch.devices import CUDA_VISIBLE_DEVICES
from afd.launch.errors import SpecError
from afd_core.roles import AFDRole

__all__ = ["RoleOverrides", "check_overrides"]


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


def _fail(name: str, expected: str, value: Any) -> SpecError:
    return SpecError(f"{name}: expected {expected}, got {value!r} ({type(value).__name__})")


def check_overrides(role: AFDRole, ov: Any, ranks: int) -> RoleOverrides:
    """The role's table (a :class:`RoleOverrides` or a mapping), checked and normalised
    for ``ranks`` vLLM workers of the role; a one-line :class:`SpecError` otherwise."""
    role = AFDRole(role)
    if isinstance(ov, Mapping):
        names = [f.name for f in dataclasses.fields(RoleOverrides)]
        for key in ov:
            if key not in names:
                raise unknown_key(f"{role}: ", key, names)
        ov = RoleOverrides(**dict(ov))
    if not isinstance(ov, RoleOverrides):
        raise _fail(role, "a table with model / vllm_args / env / devices / cpus", ov)
    if ov.model is not None and (not isinstance(ov.model, str) or not ov.model.strip()):
        raise _fail(f"{role}.model", "a checkpoint directory or model name", ov.model)
    ov.vllm_args = check_args(f"{role}.vllm_args", ov.vllm_args)
    ov.env = check_env(f"{role}.env", ov.env)
    ov.devices = check_devices(f"{role}.devices", ov.devices, ranks)
    if ov.devices is not None and CUDA_VISIBLE_DEVICES in ov.env:
        raise SpecError(
            f"{role}.devices and {role}.env.{CUDA_VISIBLE_DEVICES} are both set; keep one of them"
        )
    # The attention ranks are the DP ranks of one server: auto / nobind stand for all.
    whole = role is AFDRole.ATTENTION
    ov.cpus = check_cpus(f"{role}.cpus", ov.cpus, ranks, whole=whole)
    if ov.cpus is not None and CPU_BIND in ov.env:
        raise SpecError(f"{role}.cpus and {role}.env.{CPU_BIND} are both set; keep one of them")
    return ov
