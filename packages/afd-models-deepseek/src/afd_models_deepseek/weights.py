"""Which role owns each DeepSeek checkpoint tensor (names as in Hugging Face checkpoints)."""

from __future__ import annotations

import re

from afd_core.weights import WeightOwner

__all__ = ["classify_deepseek_weight"]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def classify_deepseek_weight(name: str, *, gate_on_attention: bool) -> WeightOwner:
    """Owner of one checkpoint tensor.

    * embeddings, lm_head, attention (incl. MLA/indexer) -> Attention;
    * routed experts, shared experts, dense MLPs -> FFN;
    * the MoE gate (weight + e_score_correction_bias) -> FFN with the gate on FFN, both
      roles with the gate on Attention (the FFN block keeps its native gate module and
      may need the correction bias to route received router logits);
    * per-layer and final norms -> both (tiny; keeps the native loaders' bookkeeping identical).
    """
    m = _LAYER.match(name)
    if m is None:
        if name.startswith("model.norm."):
            return WeightOwner.BOTH  # tiny; the FFN model keeps the native final norm module
        return WeightOwner.ATTENTION  # embed_tokens, lm_head
    rest = m.group(2)
    if rest.startswith("self_attn."):
        return WeightOwner.ATTENTION
    if rest.startswith(("input_layernorm.", "post_attention_layernorm.")):
        return WeightOwner.BOTH
    if rest.startswith("mlp.gate.") or rest == "mlp.gate.weight":
        return WeightOwner.BOTH if gate_on_attention else WeightOwner.FFN
    if rest.startswith("mlp."):
        return WeightOwner.FFN
    # Multi-token-prediction heads and anything unknown: let both native loaders see it
    # (they skip what they do not build).
    return WeightOwner.BOTH
