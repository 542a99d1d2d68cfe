"""Qwen's tiny recipes keep what the AFD split must handle in real Qwen MoE models
(data only: the generated checkpoints are tested in afd-meta's test_tiny_models.py)."""

from __future__ import annotations

import pytest

from afd_models_qwen.recipes import QWEN2_MOE, QWEN3_5_MOE_TEXT, QWEN3_MOE, QWEN3_NEXT
from afd_models_qwen.shapes import QWEN3_235B_A22B
from afd_moe_runners.recipes import TinyRecipe


@pytest.mark.parametrize(
    ("variant", "norm", "mlp_only"),
    [(None, True, []), ("no_norm_topk", False, []), ("dense_layers", True, [1])],
)
def test_qwen3_moe_variants(variant: str | None, norm: bool, mlp_only: list[int]) -> None:
    cfg = QWEN3_MOE.config(variant)
    assert cfg["norm_topk_prob"] is norm and cfg["mlp_only_layers"] == mlp_only
    assert cfg["num_experts"] == 8 and cfg["num_hidden_layers"] == 3


def test_qwen3_moe_unknown_variant() -> None:
    with pytest.raises(ValueError, match="known: no_norm_topk, dense_layers"):
        QWEN3_MOE.config("bogus")


def test_qwen3_moe_bench_size() -> None:
    cfg = QWEN3_MOE.config(size="bench")
    assert cfg["hidden_size"] == 512 and cfg["num_hidden_layers"] == 8
    assert cfg["num_experts"] == 16 and cfg["num_experts_per_tok"] == 4
    # dense_layers keeps one dense layer in the middle of the bench size's 8.
    assert QWEN3_MOE.config("dense_layers", "bench")["mlp_only_layers"] == [3]


def test_qwen3_moe_routes_as_the_released_ones() -> None:
    cfg, real = QWEN3_MOE.config(), QWEN3_235B_A22B.config
    for key in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "hidden_act"):
        assert cfg[key] == real[key], key


@pytest.mark.parametrize("recipe", [QWEN3_5_MOE_TEXT, QWEN3_NEXT], ids=lambda r: r.arch)
def test_hybrid_layers(recipe: TinyRecipe) -> None:
    cfg = recipe.config()
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    # The CPU Gated DeltaNet kernel supports a key/value head size of 128 only.
    assert cfg["linear_key_head_dim"] == cfg["linear_value_head_dim"] == 128
    assert cfg["shared_expert_intermediate_size"] == 64


def test_qwen2_moe() -> None:
    cfg = QWEN2_MOE.config()
    assert "head_dim" not in cfg  # Qwen2-MoE derives it from hidden / heads
    assert cfg["qkv_bias"] is True and cfg["norm_topk_prob"] is False
    assert cfg["shared_expert_intermediate_size"] == 128
