"""Role ownership of every Qwen checkpoint tensor kind, and the options rejected early."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from afd_core.errors import AFDConfigError
from afd_core.weights import WeightOwner
from afd_models_qwen.checks import reject_unsupported_options
from afd_models_qwen.weights import classify_qwen_weight

A, F, B = WeightOwner.ATTENTION, WeightOwner.FFN, WeightOwner.BOTH

#: name -> (owner with the gate on FFN, owner with the gate on Attention)
CASES = {
    # Qwen3-MoE
    "model.embed_tokens.weight": (A, A),
    "lm_head.weight": (A, A),
    "model.norm.weight": (B, B),
    "model.layers.0.self_attn.q_proj.weight": (A, A),
    "model.layers.0.self_attn.q_norm.weight": (A, A),
    "model.layers.0.input_layernorm.weight": (B, B),
    "model.layers.0.post_attention_layernorm.weight": (B, B),
    "model.layers.0.mlp.gate.weight": (F, B),
    "model.layers.0.mlp.experts.7.down_proj.weight": (F, F),
    "model.layers.1.mlp.gate_proj.weight": (F, F),  # dense (mlp_only) layer
    "model.layers.1.mlp.down_proj.weight": (F, F),
    # Qwen3.5/3.6-MoE (text-only and multimodal checkpoint prefixes)
    "model.layers.0.linear_attn.in_proj_qkv.weight": (A, A),
    "model.layers.0.linear_attn.A_log": (A, A),
    "model.layers.0.linear_attn.conv1d.weight": (A, A),
    "model.layers.0.mlp.shared_expert.gate_proj.weight": (F, F),
    "model.layers.0.mlp.shared_expert_gate.weight": (F, F),
    "model.language_model.layers.3.self_attn.o_proj.weight": (A, A),
    "model.language_model.layers.3.mlp.gate.weight": (F, B),
    "model.language_model.layers.3.mlp.experts.0.up_proj.weight": (F, F),
    "model.language_model.embed_tokens.weight": (A, A),
    "model.language_model.norm.weight": (B, B),
    "model.visual.blocks.0.attn.qkv.weight": (A, A),
    "mtp.fc.weight": (B, B),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_tensor_kind_has_the_documented_owner(name: str) -> None:
    gate_on_ffn, gate_on_attention = CASES[name]
    assert classify_qwen_weight(name, gate_on_attention=False) is gate_on_ffn
    assert classify_qwen_weight(name, gate_on_attention=True) is gate_on_attention


def _config(**over: object) -> SimpleNamespace:
    parallel = SimpleNamespace(
        enable_eplb=False, use_sequence_parallel_moe=False, all2all_backend="naive"
    )
    model = SimpleNamespace(multimodal_config=SimpleNamespace(language_model_only=True))
    cfg = SimpleNamespace(
        parallel_config=parallel, model_config=model, speculative_config=None, lora_config=None
    )
    for key, value in over.items():
        target, attr = key.split("__") if "__" in key else ("", key)
        setattr(getattr(cfg, target) if target else cfg, attr, value)
    return cfg


def test_plain_text_config_is_accepted() -> None:
    reject_unsupported_options(_config(), "M", multimodal_capable=True)


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"parallel_config__enable_eplb": True}, "EPLB is not supported"),
        ({"parallel_config__use_sequence_parallel_moe": True}, "sequence-parallel MoE"),
        ({"speculative_config": object()}, "speculative decoding"),
        ({"lora_config": object()}, "LoRA is not supported"),
        (
            {"model_config__multimodal_config": SimpleNamespace(language_model_only=False)},
            "multimodal input is not supported",
        ),
    ],
)
def test_unsupported_options_fail_with_a_message_naming_them(
    over: dict[str, object], message: str
) -> None:
    with pytest.raises(AFDConfigError, match=message):
        reject_unsupported_options(_config(**over), "M", multimodal_capable=True)


def test_multimodal_check_only_for_multimodal_architectures() -> None:
    cfg = _config(model_config__multimodal_config=SimpleNamespace(language_model_only=False))
    reject_unsupported_options(cfg, "M", multimodal_capable=False)
