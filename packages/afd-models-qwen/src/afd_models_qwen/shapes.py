"""Real Qwen deployments' shapes as data (:class:`afd_moe_runners.recipes.DeploymentShape`).

The ``config.json`` fields of the released checkpoints that shape the Attention/FFN
split (generation defaults left out), and what the generic split must find in them.
``tests/test_shapes.py`` checks each against a dry build of vLLM's own model on the
``meta`` device (``afd models check`` on a directory holding only this ``config.json``).

* Qwen3-235B-A22B: 94 decoder layers, all MoE, 128 routed experts top-8, no shared
  expert; GQA attention (64 query heads, 4 KV heads of 128) with q/k norms.
* Qwen3-30B-A3B: 48 layers, all MoE, 128 routed experts top-8; 32 query heads, 4 KV heads.
"""

from __future__ import annotations

from typing import Any

from afd_moe_runners.recipes import DeploymentShape

__all__ = ["QWEN3_30B_A3B", "QWEN3_235B_A22B", "SHAPES"]

_QWEN3_MOE: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "head_dim": 128,
    "num_key_value_heads": 4,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}

QWEN3_235B_A22B = DeploymentShape(
    name="Qwen3-235B-A22B",
    source="Qwen/Qwen3-235B-A22B",
    config={
        **_QWEN3_MOE,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
    },
    moe_layers=94,
    dense_layers=0,
    routed_experts=128,
)

QWEN3_30B_A3B = DeploymentShape(
    name="Qwen3-30B-A3B",
    source="Qwen/Qwen3-30B-A3B",
    config={
        **_QWEN3_MOE,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
    },
    moe_layers=48,
    dense_layers=0,
    routed_experts=128,
)

SHAPES: tuple[DeploymentShape, ...] = (QWEN3_235B_A22B, QWEN3_30B_A3B)
