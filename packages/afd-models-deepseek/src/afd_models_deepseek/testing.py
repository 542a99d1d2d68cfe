"""The DeepSeek MoE block of the test kit (:mod:`afd_moe_runners.testing`): vLLM's
``DeepseekV2MoE`` built from a small V3-style config (grouped top-k, sigmoid scores with
an ``e_score_correction_bias``, ``routed_scaling_factor`` 2.5, one shared expert).

Two recipes, found by name through the family (:func:`afd_models_deepseek.family.test_blocks`):
``"deepseek"`` and ``"deepseek_scale_on_output"`` (the same block with
``apply_routed_scale_to_output``: the scale applied to the routed output, not inside the
fused experts). transformers and vLLM are imported when a block is built.
"""

from __future__ import annotations

from typing import Any

from afd_moe_runners.testing import BlockRecipe

__all__ = ["BLOCKS", "DEEPSEEK_V3_BLOCK", "DEEPSEEK_V3_SCALE_ON_OUTPUT_BLOCK", "DEEPSEEK_V3_STYLE"]

#: The block's HF config fields (``DeepseekV3Config``): 16 routed experts in 4 groups,
#: top-4 of the best 2 groups.
DEEPSEEK_V3_STYLE: dict[str, Any] = {
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "hidden_act": "silu",
}


def _hf_config() -> Any:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**DEEPSEEK_V3_STYLE)


def _maker(scale_on_output: bool) -> Any:
    def make(module: Any, vllm_config: Any, hf: Any, prefix: str) -> Any:
        return module.DeepseekV2MoE(
            hf,
            vllm_config.parallel_config,
            prefix=prefix,
            apply_routed_scale_to_output=scale_on_output,
        )

    return make


_MODULE = "vllm.model_executor.models.deepseek_v2"
_ARCH = "DeepseekV3ForCausalLM"
DEEPSEEK_V3_BLOCK = BlockRecipe("deepseek", _ARCH, _MODULE, _hf_config, _maker(False))
DEEPSEEK_V3_SCALE_ON_OUTPUT_BLOCK = BlockRecipe(
    "deepseek_scale_on_output", _ARCH, _MODULE, _hf_config, _maker(True)
)
BLOCKS: dict[str, BlockRecipe] = {
    b.name: b for b in (DEEPSEEK_V3_BLOCK, DEEPSEEK_V3_SCALE_ON_OUTPUT_BLOCK)
}
