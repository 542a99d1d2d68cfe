"""DeepSeek's tiny recipes keep what the AFD split must handle in real DeepSeek models
(data only: the generated checkpoints are tested in afd-meta's test_tiny_models.py)."""

from __future__ import annotations

from afd_models_deepseek.recipes import DEEPSEEK_V2, DEEPSEEK_V3, DEEPSEEK_V32, TINY_RECIPES
from afd_models_deepseek.shapes import DEEPSEEK_V3 as V3_SHAPE


def test_every_recipe_is_mla_with_a_dense_first_layer() -> None:
    for recipe in TINY_RECIPES:
        cfg = recipe.config()
        # vLLM's CPU MLA supports one latent head size: 576 = 512 + 64.
        assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576, recipe.arch
        assert cfg["first_k_dense_replace"] == 1 < cfg["num_hidden_layers"], recipe.arch
        assert cfg["n_shared_experts"] == 1, recipe.arch
        assert recipe.model_cls.startswith("Deepseek"), recipe.arch


def test_v2_is_plain_softmax_top_k() -> None:
    cfg = DEEPSEEK_V2.config()
    assert cfg["q_lora_rank"] is None
    assert cfg["topk_method"] == "greedy" and cfg["scoring_func"] == "softmax"
    assert cfg["n_group"] == cfg["topk_group"] == 1  # vLLM's grouped router, one group
    assert DEEPSEEK_V2.extra_buffers == () and DEEPSEEK_V2.bench is None


def test_v3_routes_as_the_released_v3() -> None:
    cfg = DEEPSEEK_V3.config()
    real = V3_SHAPE.config
    for key in ("topk_method", "scoring_func", "routed_scaling_factor", "norm_topk_prob"):
        assert cfg[key] == real[key], key
    assert cfg["n_group"] > 1 and 1 < cfg["topk_group"] < cfg["n_group"]
    assert cfg["n_routed_experts"] % cfg["n_group"] == 0
    assert DEEPSEEK_V3.extra_buffers == ("e_score_correction_bias",)


def test_v3_bench_size() -> None:
    cfg = DEEPSEEK_V3.config(size="bench")
    assert cfg["hidden_size"] == 512 and cfg["num_hidden_layers"] == 9
    assert cfg["num_experts_per_tok"] == 4 and cfg["n_routed_experts"] == 16
    assert cfg["max_position_embeddings"] == 2048
    assert cfg["topk_method"] == "noaux_tc"  # the tiny size's routing is kept


def test_v32_is_v3_plus_the_indexer() -> None:
    v3, v32 = DEEPSEEK_V3.config(), DEEPSEEK_V32.config()
    assert {k: v for k, v in v32.items() if not k.startswith("index_")} == v3
    assert {k for k in v32 if k.startswith("index_")} == {
        "index_topk",
        "index_head_dim",
        "index_n_heads",
    }
