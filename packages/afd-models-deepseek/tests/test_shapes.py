"""The real DeepSeek shapes split as the generic path plans them: a dry build of vLLM's
own model on the ``meta`` device from the shape's ``config.json`` alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from afd_models_deepseek.shapes import DEEPSEEK_V3, SHAPES
from afd_moe_runners.recipes import DeploymentShape


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_shape_data(shape: DeploymentShape) -> None:
    cfg = shape.config
    assert cfg["n_routed_experts"] == shape.routed_experts
    assert cfg["first_k_dense_replace"] == shape.dense_layers
    assert shape.moe_layers + shape.dense_layers == cfg["num_hidden_layers"]
    assert cfg["n_routed_experts"] % cfg["n_group"] == 0


def test_v3_ffn_expert_parallel_sizes() -> None:
    # 256 experts: every power of two up to 64 FFN ranks holds a whole share.
    assert DEEPSEEK_V3.ffn_ranks() == (1, 2, 4, 8, 16, 32, 64)


@pytest.mark.vllm
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_shape_splits_as_planned(shape: DeploymentShape, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from afd_moe_runners.dry_plan import plan_deployment_shape

    plan = plan_deployment_shape(shape, tmp_path)
    assert plan.supported, plan.problems
    kinds = [layer.kind for layer in plan.layers]
    assert len(kinds) == shape.config["num_hidden_layers"]
    # The first first_k_dense_replace layers are dense, every later one MoE.
    assert kinds == ["dense"] * shape.dense_layers + ["moe"] * shape.moe_layers
    assert "shared_experts" in plan.moe_extra_modules
