"""Which AFD role owns each Qwen checkpoint tensor (names as in Hugging Face checkpoints).

Covers Qwen3-MoE (``model.layers.N...``) and Qwen3.5/3.6-MoE, whose checkpoints name
the text model either ``model.layers.N...`` (text-only ``*ForCausalLM``) or
``model.language_model.layers.N...`` (the multimodal ``*ForConditionalGeneration``).
"""

from __future__ import annotations

import re

from afd_core.weights import WeightOwner

__all__ = ["classify_qwen_weight"]

_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.(.*)$")
_ATTENTION_PARTS = ("self_attn.", "linear_attn.")
_NORMS = ("input_layernorm.", "post_attention_layernorm.")


def classify_qwen_weight(name: str, *, gate_on_attention: bool) -> WeightOwner:
    """Owner of one checkpoint tensor.

    * token embedding, LM head, vision tower -> Attention;
    * attention (full ``self_attn`` and Gated DeltaNet ``linear_attn``, q/k norms,
      conv and state parameters included) -> Attention;
    * routed experts, shared expert, shared-expert gate, dense MLPs -> FFN;
    * the router (``mlp.gate.weight``) -> FFN with the gate on FFN; both roles with the
      gate on Attention (the FFN role keeps vLLM's native block, gate module included);
    * per-layer and final norms -> both (tiny; the native loaders' bookkeeping stays
      identical);
    * anything else (e.g. multi-token-prediction ``mtp.*``) -> both: each native loader
      skips what it does not build.
    """
    m = _LAYER.match(name)
    if m is None:
        if name.startswith(("model.norm.", "model.language_model.norm.")):
            return WeightOwner.BOTH
        if name.startswith(
            (
                "model.embed_tokens.",
                "model.language_model.embed_tokens.",
                "lm_head.",
                "model.visual.",
                "visual.",
            )
        ):
            return WeightOwner.ATTENTION
        return WeightOwner.BOTH
    rest = m.group(2)
    if rest.startswith(_ATTENTION_PARTS):
        return WeightOwner.ATTENTION
    if rest.startswith(_NORMS):
        return WeightOwner.BOTH
    if rest.startswith("mlp.gate."):
        return WeightOwner.BOTH if gate_on_attention else WeightOwner.FFN
    if rest.startswith("mlp."):
        return WeightOwner.FFN  # experts, shared_expert(_gate), dense gate/up/down_proj
    return WeightOwner.BOTH
