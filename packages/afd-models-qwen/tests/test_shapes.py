"""The real Qwen3-MoE shapes split as the generic path plans them: a dry build of vLLM's
own model on the ``meta`` device from the shape's ``config.json`` alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from afd_models_qwen.shapes import QWEN3_235B_A22B, SHAPES
from afd_moe_runners.recipes import DeploymentShape


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_shape_data(shape: DeploymentShape) -> None:
    cfg = shape.config
    assert cfg["num_experts"] == shape.routed_experts
    assert shape.dense_layers == len(cfg["mlp_only_layers"]) == 0
    assert shape.moe_layers == cfg["num_hidden_layers"]


def test_235b_ffn_expert_parallel_sizes() -> None:
    assert QWEN3_235B_A22B.ffn_ranks(16) == (1, 2, 4, 8, 16)


@pytest.mark.vllm
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_shape_splits_as_planned(shape: DeploymentShape, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from afd_moe_runners.dry_plan import plan_deployment_shape

    plan = plan_deployment_shape(shape, tmp_path)
    assert plan.supported, plan.problems
    kinds = [layer.kind for layer in plan.layers]
    assert kinds == ["moe"] * shape.moe_layers  # every layer MoE, none dense
    assert not plan.moe_extra_modules  # no shared expert
