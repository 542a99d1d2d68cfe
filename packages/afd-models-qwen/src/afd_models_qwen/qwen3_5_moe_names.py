"""The vLLM names the Qwen3.5/3.6-MoE wrappers replace (importable without vLLM).

Kept apart from :mod:`afd_models_qwen.qwen3_5_moe` so drift tests can check the
``qwen3_next`` half even where vLLM's ``qwen3_5`` file cannot be imported.
"""

from __future__ import annotations

from afd_core.config import AFDRole

__all__ = ["QWEN3_5", "QWEN3_NEXT", "SUBSTITUTED_NAMES"]

QWEN3_5 = "vllm.model_executor.models.qwen3_5"
QWEN3_NEXT = "vllm.model_executor.models.qwen3_next"

#: role -> {vLLM module -> names replaced while the native constructors run}.
SUBSTITUTED_NAMES: dict[AFDRole, dict[str, tuple[str, ...]]] = {
    AFDRole.ATTENTION: {QWEN3_NEXT: ("FusedMoEFactory",)},
    AFDRole.FFN: {
        QWEN3_5: (
            "QwenGatedDeltaNetAttention",
            "Qwen3NextAttention",
            "VocabParallelEmbedding",
            "ParallelLMHead",
        ),
    },
}
