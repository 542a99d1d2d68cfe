"""``afd models check MODEL``: whether and how afd splits a model into Attention and FFN
roles, read off vLLM's own model class (a dry build on the ``meta`` device: nothing is
loaded, no weights are allocated; see :mod:`afd_moe_runners.split_plan`)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ModelCheck", "check_model", "main"]


@dataclass(frozen=True)
class ModelCheck:
    model: str
    architecture: str
    #: The AFD alias a role selects, and the module providing it.
    alias: str
    provider: str
    plan: Any  # afd_moe_runners.split_plan.SplitPlan

    @property
    def supported(self) -> bool:
        return bool(self.plan.supported)

    def summary(self) -> str:
        """The one-line verdict."""
        if not self.supported:
            return (
                f"{self.model}: {self.architecture} cannot be split into Attention and FFN "
                f"roles: {self.plan.problems[0]}"
            )
        moe = sum(1 for layer in self.plan.layers if layer.kind == "moe")
        dense = sum(1 for layer in self.plan.layers if layer.kind == "dense")
        return (
            f"{self.model}: {self.architecture} splits into Attention and FFN roles "
            f"({moe} MoE, {dense} dense layers) as {self.alias} ({self.provider})"
        )


def _architecture(model: str, hf_overrides: dict[str, Any]) -> str:
    archs = hf_overrides.get("architectures")
    if not archs:
        config = Path(model) / "config.json"
        if config.is_file():
            archs = json.loads(config.read_text()).get("architectures")
    if not archs:
        from transformers import AutoConfig

        archs = getattr(AutoConfig.from_pretrained(model), "architectures", None)
    if not archs:
        raise ValueError(f"{model}: the config names no architecture")
    return str(archs[0])


def check_model(
    model: str, *, hf_overrides: dict[str, Any] | None = None, **engine_kwargs: Any
) -> ModelCheck:
    """Plan the split of ``model`` (a checkpoint directory or model id vLLM can read)."""
    from afd.runtime.plugin import afd_alias_of
    from afd_moe_runners.dry_plan import dry_split_plan
    from afd_moe_runners.generic import ALIAS_PREFIX

    overrides = dict(hf_overrides or {})
    arch = _architecture(model, overrides)
    if arch.startswith(ALIAS_PREFIX):
        arch = arch[len(ALIAS_PREFIX) :]
    plan = dry_split_plan(model, arch, hf_overrides=overrides, **engine_kwargs)
    alias, provider = afd_alias_of(arch)
    return ModelCheck(model, arch, alias, provider, plan)


def main(model: str, *, hf_overrides: dict[str, Any] | None = None) -> int:
    """Print the verdict and the per-layer plan; 0 when the model splits, else 1."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    try:
        result = check_model(model, hf_overrides=hf_overrides)
    except Exception as exc:  # an unreadable model: say why, in one line
        print(f"afd models check: {model}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(result.summary())
    print(result.plan.report())
    return 0 if result.supported else 1
