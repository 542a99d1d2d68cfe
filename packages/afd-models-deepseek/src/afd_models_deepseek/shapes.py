"""Real DeepSeek deployments' shapes as data (:class:`afd_moe_runners.recipes.DeploymentShape`).

The ``config.json`` fields of the released checkpoints that shape the Attention/FFN
split (quantization and generation defaults left out: the bf16 shapes), and what the
generic split must find in them. ``tests/test_shapes.py`` checks each against a dry
build of vLLM's own model on the ``meta`` device (``afd models check`` on a directory
holding only this ``config.json``).

* DeepSeek-V3 (671B total, 37B active; DeepSeek-R1 and V3.1 share the shape): 61 decoder
  layers, the first 3 dense, 58 MoE layers of 256 routed experts (top-8 in 8 groups,
  best 4 groups) plus one shared expert; MLA attention, 128 heads.
* DeepSeek-V2-Lite (16B total, 2.4B active): 27 layers, 1 dense, 26 MoE layers of 64
  routed experts (top-6) plus 2 shared experts; MLA without a query LoRA.
"""

from __future__ import annotations

from afd_moe_runners.recipes import DeploymentShape

__all__ = ["DEEPSEEK_V2_LITE", "DEEPSEEK_V3", "SHAPES"]

DEEPSEEK_V3 = DeploymentShape(
    name="DeepSeek-V3",
    source="deepseek-ai/DeepSeek-V3",
    config={
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc",
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    },
    moe_layers=58,
    dense_layers=3,
    routed_experts=256,
)

DEEPSEEK_V2_LITE = DeploymentShape(
    name="DeepSeek-V2-Lite",
    source="deepseek-ai/DeepSeek-V2-Lite",
    config={
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "n_shared_experts": 2,
        "n_routed_experts": 64,
        "routed_scaling_factor": 1.0,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 6,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "tie_word_embeddings": False,
        "bos_token_id": 100000,
        "eos_token_id": 100001,
        "torch_dtype": "bfloat16",
    },
    moe_layers=26,
    dense_layers=1,
    routed_experts=64,
)

SHAPES: tuple[DeploymentShape, ...] = (DEEPSEEK_V3, DEEPSEEK_V2_LITE)
