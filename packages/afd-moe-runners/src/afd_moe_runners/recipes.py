"""Model recipes as data: tiny test checkpoints and real deployment shapes.

Torch-free and vLLM-free, so the model packages (``afd_models_deepseek``,
``afd_models_qwen``) can hold their families' recipes and the tiny-checkpoint generator
in ``afd.tools.models`` (a higher layer) can read them.

* :class:`TinyRecipe`: how ``afd models tiny`` builds one small seeded checkpoint of an
  architecture: the transformers config and model class names, the config keyword
  arguments (without the vocabulary size and special-token ids, which come from the
  generated tokenizer), named variants and the bench size as overrides, and the
  tensors the weight init treats specially. Changing a recipe changes the generated
  bytes: bump ``afd.tools.models.tiny.GENERATOR_VERSION`` with it.
* :class:`DeploymentShape`: the ``config.json`` fields of a released model (e.g.
  DeepSeek-V3 671B, Qwen3-235B-A22B) that shape its Attention/FFN split, and what the
  generic split (:mod:`afd_moe_runners.split_plan`) must find in it. Each model package
  tests its shapes against a dry build of vLLM's model on the ``meta`` device.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DeploymentShape", "TinyRecipe"]


@dataclass(frozen=True)
class TinyRecipe:
    """One tiny architecture: ``config(variant, size)`` is the transformers config kwargs."""

    #: The family's ``model_type`` (pinned in the saved ``config.json``).
    arch: str
    #: transformers class names (``getattr(transformers, name)``).
    config_cls: str
    model_cls: str
    #: Config keyword arguments of the tiny size, without vocabulary ids.
    base: Mapping[str, Any]
    #: Named variants: overrides of ``base``.
    variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: Overrides of the bench size (None: no bench size), applied after the variant's.
    bench: Mapping[str, Any] | None = None
    #: Per variant, bench-size overrides applied after ``bench``.
    bench_variants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: Router correction biases (by attribute name): persistent buffers, or parameters,
    #: that are checkpoint weights, get a small random init and stay fp32, e.g.
    #: DeepSeek-V3's ``e_score_correction_bias``.
    extra_buffers: tuple[str, ...] = ()
    #: Parameters (by name suffix) stored ``(..., in, out)``, whose fan-in is
    #: ``shape[-2]``, e.g. GPT-OSS's fused ``experts.gate_up_proj``.
    transposed: tuple[str, ...] = ()

    def config(self, variant: str | None = None, size: str = "tiny") -> dict[str, Any]:
        """The config kwargs of (variant, size); a fresh copy each call."""
        if variant is not None and variant not in self.variants:
            if not self.variants:
                raise ValueError(f"{self.arch} has no variants (got {variant!r})")
            known = ", ".join(self.variants)
            raise ValueError(f"unknown {self.arch} variant {variant!r}; known: {known}")
        cfg = {**self.base, **(self.variants[variant] if variant else {})}
        if size == "bench":
            if self.bench is None:
                raise ValueError(f"{self.arch} has no bench size")
            cfg = {**cfg, **self.bench, **self.bench_variants.get(variant or "", {})}
        return copy.deepcopy(cfg)


@dataclass(frozen=True)
class DeploymentShape:
    """A released model's shape: its ``config.json`` fields that matter to the split."""

    #: e.g. ``"DeepSeek-V3"``; ``source``: where the config comes from (a hub id).
    name: str
    source: str
    #: ``config.json`` as released, minus what does not shape the model (quantization,
    #: generation defaults); with ``architectures`` and ``model_type``.
    config: Mapping[str, Any]
    #: What the generic split must find: decoder layers with a routed-expert MoE block,
    #: decoder layers with a dense MLP, and the routed experts per MoE layer.
    moe_layers: int
    dense_layers: int
    routed_experts: int

    @property
    def architecture(self) -> str:
        return str(self.config["architectures"][0])

    def config_json(self) -> dict[str, Any]:
        """A ``config.json`` body (a fresh copy)."""
        return copy.deepcopy(dict(self.config))

    def ffn_ranks(self, max_ranks: int = 64) -> tuple[int, ...]:
        """FFN expert-parallel sizes up to ``max_ranks`` that split the routed experts
        evenly (each FFN rank holds ``routed_experts / n`` experts of every MoE layer)."""
        return tuple(n for n in range(1, max_ranks + 1) if self.routed_experts % n == 0)
