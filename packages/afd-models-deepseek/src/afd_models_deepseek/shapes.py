"""Real DeepSeek deployments' shapes as data (:class:`afd_moe_runners.recipes.DeploymentShape`).

The ``config.json`` fields of the released checkpoints that shape the Attention/FFN
split (quantization and generation defaults left out: the bf16 shapes; the fields are
in ``shape_configs/*.json``), and what the generic split must find in them.
``tests/test_shapes.py`` checks each against a dry build of vLLM's own model on the
``meta`` device (``afd models check`` on a directory holding only this ``config.json``).

* DeepSeek-V3 (671B total, 37B active; DeepSeek-R1 and V3.1 share the shape): 61 decoder
  layers, the first 3 dense, 58 MoE layers of 256 routed experts (top-8 in 8 groups,
  best 4 groups) plus one shared expert; MLA attention, 128 heads.
* DeepSeek-V2-Lite (16B total, 2.4B active): 27 layers, 1 dense, 26 MoE layers of 64
  routed experts (top-6) plus 2 shared experts; MLA without a query LoRA.
"""

from __future__ import annotations

import json
from importlib.resources import files
from typing import Any

from afd_moe_runners.recipes import DeploymentShape

__all__ = ["DEEPSEEK_V2_LITE", "DEEPSEEK_V3", "SHAPES"]


def _config(name: str) -> dict[str, Any]:
    """A release's ``config.json`` fields, kept as JSON in ``shape_configs/``."""
    text = files(__package__).joinpath("shape_configs", name).read_text(encoding="utf-8")
    config: dict[str, Any] = json.loads(text)
    return config


DEEPSEEK_V3 = DeploymentShape(
    name="DeepSeek-V3",
    source="deepseek-ai/DeepSeek-V3",
    config=_config("deepseek-v3.json"),
    moe_layers=58,
    dense_layers=3,
    routed_experts=256,
)

DEEPSEEK_V2_LITE = DeploymentShape(
    name="DeepSeek-V2-Lite",
    source="deepseek-ai/DeepSeek-V2-Lite",
    config=_config("deepseek-v2-lite.json"),
    moe_layers=26,
    dense_layers=1,
    routed_experts=64,
)

SHAPES: tuple[DeploymentShape, ...] = (DEEPSEEK_V3, DEEPSEEK_V2_LITE)
