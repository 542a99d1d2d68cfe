"""The Qwen MoE block of the test kit (:mod:`afd_moe_runners.testing`): vLLM's
``Qwen3MoeSparseMoeBlock`` built from a small Qwen3-MoE config (softmax top-4 of 16
experts, ``norm_topk_prob``, no shared expert).

Found by name through the family (:func:`afd_models_qwen.family.test_blocks`): ``"qwen3"``.
transformers and vLLM are imported when a block is built.
"""

from __future__ import annotations

from typing import Any

from afd_moe_runners.testing import BlockRecipe

__all__ = ["BLOCKS", "QWEN3_BLOCK", "QWEN3_STYLE"]

#: The block's HF config fields (``Qwen3MoeConfig``).
QWEN3_STYLE: dict[str, Any] = {
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "hidden_act": "silu",
}


def _hf_config() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**QWEN3_STYLE)


def _make(module: Any, vllm_config: Any, hf: Any, prefix: str) -> Any:
    # vLLM's Qwen3-MoE block reads its HF config from the current model config (the
    # test kit's stand-in carries ``hf``), so it takes only the vLLM config.
    return module.Qwen3MoeSparseMoeBlock(vllm_config, prefix=prefix)


QWEN3_BLOCK = BlockRecipe(
    "qwen3", "Qwen3MoeForCausalLM", "vllm.model_executor.models.qwen3_moe", _hf_config, _make
)
BLOCKS: dict[str, BlockRecipe] = {QWEN3_BLOCK.name: QWEN3_BLOCK}
