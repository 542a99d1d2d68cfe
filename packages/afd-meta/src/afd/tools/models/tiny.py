"""Tiny MoE checkpoints generated locally (seeded random weights + a local tokenizer).

``generate_tiny_checkpoint(arch, out_dir)`` writes a Hugging Face style checkpoint
directory (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` ...) that vLLM 0.32's CPU build loads as-is. The configs are
small (3-4 layers, hidden 128, 8-16 routed experts, top-2) but keep every structural
feature the AFD split must handle:

* ``deepseek_v2``: MLA (``kv_lora_rank=512``, ``qk_rope_head_dim=64``: the only latent
  size CPU MLA supports), ``q_lora_rank=None``, layer 0 dense and layers 1-2 MoE,
  softmax greedy top-k, one shared expert.
* ``deepseek_v3``: MLA with ``q_lora_rank``, grouped top-k (``n_group=4``,
  ``topk_group=2``), ``noaux_tc`` with a non-zero random ``e_score_correction_bias``,
  sigmoid scoring, ``routed_scaling_factor=2.5``, one shared expert.
* ``qwen3_moe``: GQA attention with q/k norms, all layers MoE, ``norm_topk_prob=True``;
  variants ``no_norm_topk`` and ``dense_layers`` (``mlp_only_layers=[1]``).
* ``qwen3_5_moe_text``: the text model of Qwen3.5/3.6-MoE (``Qwen3_5MoeForCausalLM``,
  ``model_type=qwen3_5_moe_text``): hybrid layers (Gated DeltaNet linear attention
  ``linear_attention`` x3, then gated full attention), every layer MoE with a gated
  shared expert, ``norm_topk_prob=True``.
* ``mixtral``: GQA attention, every layer MoE (``block_sparse_moe``, experts ``w1/w2/w3``),
  softmax top-2 renormalised, no shared expert, no dense layer.
* ``glm4_moe``: layer 0 dense (``first_k_dense_replace=1``), then MoE with one shared
  expert, sigmoid grouped top-k (``n_group=4``, ``topk_group=2``) with a random fp32
  ``e_score_correction_bias`` buffer, ``routed_scaling_factor=2.5``; attention with q/k/v
  biases, q/k norms and partial RoPE (``partial_rotary_factor=0.5``) as GLM-4.5.
* ``ernie4_5_moe``: layer 0 dense (``moe_layer_start_index=1``), then MoE with 2 shared
  experts (one MLP of 2 x ``moe_intermediate_size``), softmax top-2 chosen with a random
  fp32 ``moe_statics.e_score_correction_bias`` (a parameter, shape ``(1, experts)``).
* ``qwen3_next``: hybrid layers like ``qwen3_5_moe_text`` (Gated DeltaNet x3, then gated
  full attention; linear key/value head size 128, what the CPU GDN kernel supports),
  every layer MoE with a sigmoid-gated shared expert.
* ``gpt_oss``: alternating sliding-window (16) / full attention with q/k/v/o biases and
  per-head sinks, head size 64, YaRN RoPE; every layer MoE with a biased router and fused
  biased experts (``experts.gate_up_proj`` stored ``(experts, in, out)``, SwiGLU-OAI).
* ``minimax_m2``: every layer MoE (``block_sparse_moe``), sigmoid top-2 with a random fp32
  ``e_score_correction_bias`` buffer (``use_routing_bias``), per-layer q/k norms over all
  heads, partial RoPE (``rotary_dim`` = half the head).
* ``olmoe``: every layer MoE, softmax top-2 without renormalisation, q/k norms over all
  heads, no shared expert.
* ``qwen2_moe``: every layer MoE with a sigmoid-gated shared expert, q/k/v biases,
  ``norm_topk_prob=False``.

All of them generate in transformers. On vLLM 0.32's CPU build (``afd.reference``) all
run greedy deterministically in bf16 and fp32 except: ``minimax_m2`` does not run (the
CPU router takes sigmoid scoring only through grouped top-k: ``AssertionError`` in
``CPURouter``); ``qwen3_5_moe_text``'s vLLM model file needs torchvision (see
afd-models-qwen's README); ``qwen3_next`` runs in bf16 only (the CPU GDN kernel asserts
bf16); ``ernie4_5_moe`` runs but the CPU router drops its correction bias (plain softmax
top-k), so its CPU tokens differ from transformers'.

``size="bench"`` (``TINY_SIZES``) gives a bench-size checkpoint of the same architecture
(``qwen3_moe``: hidden 512, 8 MoE layers, 16 experts top-4, ~57M parameters;
``deepseek_v3``: hidden 512, 1 dense + 8 MoE layers, 16 routed experts top-4 + 1 shared
expert), ``max_position_embeddings=2048``, with the same tokenizer and init. It has its own
name (``checkpoint_name(..., size="bench")``, suffix ``-bench``) and a ``size`` entry in its
stamp, so a tiny directory is never taken for a bench one or the other way round.

Weights are drawn from one ``torch.Generator`` seeded with ``seed`` (parameters visited
in name order), scaled ``1/sqrt(fan_in)`` so activations, router logits and output
logits are O(1): routing differs from token to token and greedy argmax margins are
wide. Norm weights are near 1, linear biases small (std 0.1), router correction biases
smaller (std 0.05, kept fp32). The same (arch, variant, seed) gives byte-identical
files. A stamp file, ``afd_checkpoint.json``, makes generation idempotent.

Heavy imports (torch, transformers, tokenizers) happen inside the functions that need
them, so importing this module is cheap.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = [
    "GENERATOR_VERSION",
    "STAMP_FILE",
    "TINY_ARCHS",
    "TINY_SIZES",
    "TinySpec",
    "checkpoint_name",
    "generate_tiny_checkpoint",
    "register_tiny_arch",
    "tiny_config",
    "tiny_variants",
]

#: Bump when anything that changes the generated bytes changes (configs, init, corpus).
GENERATOR_VERSION = "3"
STAMP_FILE = "afd_checkpoint.json"
#: Checkpoint sizes: "tiny" (the default, for tests) and "bench" (for benchmarks).
TINY_SIZES = ("tiny", "bench")

#: Target size of the locally trained byte-level BPE vocabulary (the model's vocab_size
#: is the tokenizer's actual size, which is this whenever the corpus allows it).
TOKENIZER_VOCAB_SIZE = 1024
#: ``<|endoftext|>`` is in the vocabulary because some tokenizer classes transformers
#: picks from a model type (Qwen3.5's) add it when it is missing, which would make the
#: tokenizer one token larger than the model's vocabulary.
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|endoftext|>")
BOS, EOS, PAD, END_OF_TEXT = SPECIAL_TOKENS
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """How to build one tiny architecture.

    ``build(variant)`` returns the transformers config keyword arguments, without the
    vocabulary and special-token ids (filled in from the tokenizer). ``bench``, when
    set, returns the overrides of the bench-size checkpoint for a variant.
    """

    arch: str
    config_cls: str
    model_cls: str
    build: Callable[[str | None], dict[str, Any]]
    variants: tuple[str, ...] = ()
    #: Router correction biases (by attribute name): persistent buffers, or parameters,
    #: that are checkpoint weights, get a small random init (``_BIAS_STD``) and stay
    #: fp32, e.g. DeepSeek-V3's ``e_score_correction_bias``.
    extra_buffers: tuple[str, ...] = ()
    bench: Callable[[str | None], dict[str, Any]] | None = None
    #: Parameters (by name suffix) stored ``(..., in, out)``, whose fan-in is
    #: ``shape[-2]``, e.g. GPT-OSS's fused ``experts.gate_up_proj``.
    transposed: tuple[str, ...] = ()


# --------------------------------------------------------------------------- configs

_MLA_COMMON: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,  # dense layers
    "moe_intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    # CPU MLA supports only a latent head size of 576 = kv_lora_rank + qk_rope_head_dim.
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "first_k_dense_replace": 1,  # layer 0 dense, later layers MoE
    "moe_layer_freq": 1,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def _deepseek_v2(variant: str | None) -> dict[str, Any]:
    _no_variants("deepseek_v2", variant)
    return {
        **_MLA_COMMON,
        "q_lora_rank": None,
        "n_routed_experts": 8,
        "topk_method": "greedy",
        "scoring_func": "softmax",
        # vLLM always builds a grouped top-k router for DeepSeek; 1 group = plain top-k.
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
    }


def _deepseek_v3(variant: str | None) -> dict[str, Any]:
    _no_variants("deepseek_v3", variant)
    return {
        **_MLA_COMMON,
        "q_lora_rank": 64,
        "n_routed_experts": 16,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 0,
    }


def _deepseek_v32(variant: str | None) -> dict[str, Any]:
    """DeepSeek-V3.2: V3's MLA and routing plus the sparse-attention indexer."""
    _no_variants("deepseek_v32", variant)
    return {
        **_deepseek_v3(None),
        "index_topk": 16,
        "index_head_dim": 64,
        "index_n_heads": 4,
    }


def _qwen3_moe(variant: str | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "hidden_size": 128,
        "intermediate_size": 256,  # dense (mlp_only) layers
        "moe_intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
    }
    if variant is None:
        return cfg
    if variant == "no_norm_topk":
        return {**cfg, "norm_topk_prob": False}
    if variant == "dense_layers":
        return {**cfg, "mlp_only_layers": [1]}
    raise ValueError(f"unknown qwen3_moe variant {variant!r}; known: no_norm_topk, dense_layers")


def _qwen3_moe_bench(variant: str | None) -> dict[str, Any]:
    """Bench size: hidden 512, 8 MoE layers, 16 experts top-4, ~57M parameters."""
    cfg = {
        "hidden_size": 512,
        "intermediate_size": 1024,  # dense (mlp_only) layers of the dense_layers variant
        "moe_intermediate_size": 256,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "max_position_embeddings": 2048,
    }
    if variant == "dense_layers":
        return {**cfg, "mlp_only_layers": [3]}
    return cfg


def _deepseek_v3_bench(variant: str | None) -> dict[str, Any]:
    """Bench size: hidden 512, 1 dense + 8 MoE layers, 16 routed experts top-4."""
    _no_variants("deepseek_v3", variant)
    return {
        "hidden_size": 512,
        "intermediate_size": 1024,
        "moe_intermediate_size": 192,
        "num_hidden_layers": 9,  # first_k_dense_replace=1: 8 MoE layers
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "q_lora_rank": 256,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "n_routed_experts": 16,  # n_group=4, topk_group=2: 8 candidates for the top-4
        "num_experts_per_tok": 4,
        "max_position_embeddings": 2048,
    }


def _qwen3_5_moe_text(variant: str | None) -> dict[str, Any]:
    _no_variants("qwen3_5_moe_text", variant)
    return {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "layer_types": [
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
        ],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,  # the CPU GDN kernel supports 128 (as real models)
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }


# Common to the GQA families below: 4 query heads of 32 (the CPU attention supports
# head sizes 32/64/128), 2 KV heads, 8 routed experts top-2.
_GQA_COMMON: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts_per_tok": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def _mixtral(variant: str | None) -> dict[str, Any]:
    _no_variants("mixtral", variant)
    return {
        **_GQA_COMMON,
        "intermediate_size": 64,  # the experts' (Mixtral has no dense layers)
        "num_local_experts": 8,
        "sliding_window": None,
    }


def _glm4_moe(variant: str | None) -> dict[str, Any]:
    _no_variants("glm4_moe", variant)
    return {
        **_GQA_COMMON,
        "intermediate_size": 256,  # layer 0 (dense)
        "moe_intermediate_size": 64,
        "first_k_dense_replace": 1,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "n_group": 4,  # grouped top-k: 4 groups of 2, the best 2 groups
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "partial_rotary_factor": 0.5,  # as GLM-4.5: RoPE on half of each head
        "attention_bias": True,
        "use_qk_norm": True,
        "num_nextn_predict_layers": 0,
    }


def _ernie4_5_moe(variant: str | None) -> dict[str, Any]:
    _no_variants("ernie4_5_moe", variant)
    return {
        **_GQA_COMMON,
        "intermediate_size": 256,  # layer 0 (dense)
        "moe_intermediate_size": 64,
        "moe_num_experts": 8,
        "moe_k": 2,
        "moe_num_shared_experts": 2,  # as ERNIE-4.5-21B-A3B: one MLP of 2 x 64
        "moe_layer_start_index": 1,
        "moe_layer_end_index": 2,
        "moe_layer_interval": 1,
        "use_bias": False,
    }


def _qwen3_next(variant: str | None) -> dict[str, Any]:
    _no_variants("qwen3_next", variant)
    return {
        **_GQA_COMMON,
        "num_hidden_layers": 4,
        "layer_types": [
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
        ],
        "intermediate_size": 256,  # mlp_only layers (none)
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,  # the CPU GDN kernel supports 128 (as real models)
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_experts": 8,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _gpt_oss(variant: str | None) -> dict[str, Any]:
    _no_variants("gpt_oss", variant)
    return {
        **_GQA_COMMON,
        "num_hidden_layers": 4,  # sliding / full attention alternate
        "head_dim": 64,  # as gpt-oss
        "intermediate_size": 64,  # the experts' (2 x 64 = hidden: gate_up is square)
        "num_local_experts": 8,
        "sliding_window": 16,  # real: 128; 16 so that the reference prompts use it
        "attention_bias": True,
        "rms_norm_eps": 1e-5,  # vLLM hard-codes 1e-5
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 128,
        },
    }


def _minimax_m2(variant: str | None) -> dict[str, Any]:
    _no_variants("minimax_m2", variant)
    return {
        **_GQA_COMMON,
        "intermediate_size": 64,  # the experts' (MiniMax-M2 has no dense layers)
        "num_local_experts": 8,
        # The fields of the released config.json that vLLM reads.
        "rotary_dim": 16,  # partial RoPE: half of each head, as MiniMax-M2 (64 of 128)
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "use_qk_norm": True,
        "qk_norm_type": "per_layer",
    }


def _olmoe(variant: str | None) -> dict[str, Any]:
    _no_variants("olmoe", variant)
    cfg = {
        **_GQA_COMMON,
        "intermediate_size": 64,  # the experts' (OLMoE has no dense layers)
        "num_experts": 8,
        "norm_topk_prob": False,
        "rms_norm_eps": 1e-5,  # vLLM hard-codes 1e-5 (as OLMoE)
    }
    del cfg["head_dim"]  # OLMoE derives it (hidden / heads = 32)
    return cfg


def _qwen2_moe(variant: str | None) -> dict[str, Any]:
    _no_variants("qwen2_moe", variant)
    cfg = {
        **_GQA_COMMON,
        "intermediate_size": 256,  # mlp_only layers (none)
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
        "num_experts": 8,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "qkv_bias": True,
        "use_sliding_window": False,
    }
    del cfg["head_dim"]  # Qwen2-MoE derives it (hidden / heads = 32)
    return cfg


def _no_variants(arch: str, variant: str | None) -> None:
    if variant is not None:
        raise ValueError(f"{arch} has no variants (got {variant!r})")


TINY_ARCHS: dict[str, TinySpec] = {}


def register_tiny_arch(spec: TinySpec) -> None:
    """Add (or replace) an architecture in the registry."""
    TINY_ARCHS[spec.arch] = spec


register_tiny_arch(
    TinySpec("deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM", _deepseek_v2)
)
register_tiny_arch(
    TinySpec(
        "deepseek_v3",
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        _deepseek_v3,
        extra_buffers=("e_score_correction_bias",),
        bench=_deepseek_v3_bench,
    )
)
register_tiny_arch(
    TinySpec(
        "qwen3_moe",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        _qwen3_moe,
        variants=("no_norm_topk", "dense_layers"),
        bench=_qwen3_moe_bench,
    )
)
register_tiny_arch(
    TinySpec("qwen3_5_moe_text", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", _qwen3_5_moe_text)
)
register_tiny_arch(
    TinySpec(
        "deepseek_v32",
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        _deepseek_v32,
        extra_buffers=("e_score_correction_bias",),
    )
)
register_tiny_arch(TinySpec("mixtral", "MixtralConfig", "MixtralForCausalLM", _mixtral))
register_tiny_arch(
    TinySpec(
        "glm4_moe",
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        _glm4_moe,
        extra_buffers=("e_score_correction_bias",),
    )
)
register_tiny_arch(
    TinySpec(
        "ernie4_5_moe",
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        _ernie4_5_moe,
        extra_buffers=("e_score_correction_bias",),  # a parameter of moe_statics
    )
)
register_tiny_arch(TinySpec("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", _qwen3_next))
register_tiny_arch(
    TinySpec(
        "gpt_oss",
        "GptOssConfig",
        "GptOssForCausalLM",
        _gpt_oss,
        transposed=("experts.gate_up_proj", "experts.down_proj"),
    )
)
register_tiny_arch(
    TinySpec(
        "minimax_m2",
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        _minimax_m2,
        extra_buffers=("e_score_correction_bias",),
    )
)
register_tiny_arch(TinySpec("olmoe", "OlmoeConfig", "OlmoeForCausalLM", _olmoe))
register_tiny_arch(TinySpec("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", _qwen2_moe))


def _spec(arch: str) -> TinySpec:
    try:
        return TINY_ARCHS[arch]
    except KeyError:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {sorted(TINY_ARCHS)}") from None


def tiny_variants(arch: str) -> tuple[str | None, ...]:
    """``(None, *named variants)`` for ``arch``."""
    return (None, *_spec(arch).variants)


def _check_size(arch: str, size: str) -> TinySpec:
    spec = _spec(arch)
    if size not in TINY_SIZES:
        raise ValueError(f"unknown checkpoint size {size!r}; known: {', '.join(TINY_SIZES)}")
    if size == "bench" and spec.bench is None:
        have = sorted(a for a, s in TINY_ARCHS.items() if s.bench is not None)
        raise ValueError(f"{arch} has no bench size; archs with one: {have}")
    return spec


def tiny_config(arch: str, variant: str | None = None, size: str = "tiny") -> dict[str, Any]:
    """The transformers config kwargs for (arch, variant, size), vocabulary ids included."""
    spec = _check_size(arch, size)
    cfg = spec.build(variant)
    if size == "bench":
        assert spec.bench is not None
        cfg = {**cfg, **spec.bench(variant)}
    vocab = _tokenizer_vocab_size()
    return {
        **cfg,
        "vocab_size": vocab,
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
    }


def checkpoint_name(
    arch: str, variant: str | None = None, seed: int = 0, size: str = "tiny"
) -> str:
    """Conventional directory name, e.g. ``qwen3_moe-no_norm_topk-s0``.

    Bench-size checkpoints end in ``-bench`` (``qwen3_moe-s0-bench``).
    """
    name = f"{arch}{'-' + variant if variant else ''}-s{seed}"
    return name if size == "tiny" else f"{name}-{size}"


# ------------------------------------------------------------------------- tokenizer

_SUBJECTS = (
    "the cat",
    "a small robot",
    "my neighbour",
    "the old river",
    "every student",
    "the attention layer",
    "an expert network",
    "the tiny model",
    "our team",
    "the weather",
    "a quiet city",
    "the yellow train",
    "this program",
    "the compiler",
)
_VERBS = (
    "runs",
    "watches",
    "computes",
    "sends",
    "receives",
    "builds",
    "reads",
    "writes",
    "jumps over",
    "talks to",
    "waits for",
    "routes",
    "predicts",
    "remembers",
)
_OBJECTS = (
    "the moon",
    "a long message",
    "seven tokens",
    "the blue house",
    "an open door",
    "the next word",
    "many experts",
    "a warm cup of tea",
    "the hidden state",
    "the last train home",
    "a list of numbers",
    "the shared memory",
    "green apples",
)
_ENDINGS = (
    ".",
    " today.",
    " every morning.",
    " in the evening.",
    " again and again.",
    " without any doubt.",
    " before the rain.",
    " on the CPU.",
    " as fast as it can.",
)
_EXTRA = """
Once upon a time there was a little village near the mountains. The people there liked
stories, music and long walks. In the morning the baker opened the shop and sold fresh
bread; in the afternoon children played in the park; at night everyone looked at stars.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many legs does a spider have? Answer: A spider has eight legs.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
import torch; x = torch.zeros(4, 8); y = x.sum(dim=-1)
{"name": "afd", "version": "0.1.0", "layers": [0, 1, 2], "experts": 8}
1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024 2048 4096
Monday Tuesday Wednesday Thursday Friday Saturday Sunday
January February March April May June July August September October November December
red orange yellow green blue indigo violet black white grey brown pink purple
Hello, world! How are you? I am fine, thank you. Good morning. Good night.
Mixture of experts models route each token to a few experts; attention layers keep the
key value cache; the feed forward network holds most of the parameters.
"""


@lru_cache(maxsize=1)
def _corpus() -> tuple[str, ...]:
    lines = []
    for i, s in enumerate(_SUBJECTS):
        for j, v in enumerate(_VERBS):
            o = _OBJECTS[(i * 5 + j * 3) % len(_OBJECTS)]
            e = _ENDINGS[(i + 2 * j) % len(_ENDINGS)]
            lines.append(f"{s[0].upper()}{s[1:]} {v} {o}{e}")
    lines.extend(line for line in _EXTRA.strip().splitlines() if line)
    return tuple(lines)


@lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    """Train the byte-level BPE tokenizer (deterministic) and return its JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_corpus()), trainer=trainer)
    return str(tok.to_str())


@lru_cache(maxsize=1)
def _tokenizer_vocab_size() -> int:
    data = json.loads(_tokenizer_json())
    ids = set(data["model"]["vocab"].values()) | {t["id"] for t in data["added_tokens"]}
    assert ids == set(range(len(ids))), "tokenizer ids must be contiguous"
    return len(ids)


def _save_tokenizer(out: Path, model_max_length: int = 512) -> None:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


# --------------------------------------------------------------------------- weights

#: Std of random router correction biases. Sigmoid scores of O(1) router logits spread
#: with std ~0.2; a 0.05 bias changes about half of the tiny V3's top-2 picks while
#: keeping every expert in use.
_BIAS_STD = 0.05
#: Std of 1-D linear biases (no existing arch before GLM-4.5 / Qwen2-MoE / GPT-OSS had
#: any): small against O(1) activations, large enough that a skipped load shows.
_LINEAR_BIAS_STD = 0.1


def _init_weights(
    model: Any, seed: int, extra_buffers: tuple[str, ...], transposed: tuple[str, ...] = ()
) -> None:
    """Seeded O(1)-scale init, independent of transformers' own init scheme."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.rsplit(".", 1)[-1] in extra_buffers:
                # A router correction bias held as a parameter (ERNIE-4.5's moe_statics).
                p.copy_(_BIAS_STD * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1 and name.endswith(".bias"):
                # Linear biases (attention q/k/v/o, GPT-OSS's router): small, non-zero.
                p.copy_(_LINEAR_BIAS_STD * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:
                # Norm weights: near 1, but not exactly (a skipped load would show).
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-2] if name.endswith(transposed) else p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
        for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name.rsplit(".", 1)[-1] in extra_buffers:
                # e.g. DeepSeek-V3's e_score_correction_bias (selection only).
                b.copy_(_BIAS_STD * torch.randn(b.shape, generator=gen))


# ------------------------------------------------------------------------ generation


def _stamp(arch: str, variant: str | None, seed: int, size: str = "tiny") -> dict[str, Any]:
    stamp = {
        # The generator's name when the stamp format was fixed (before the module moved
        # to afd.tools.models): part of every stamp's bytes, so it stays.
        "generator": "afd.models.tiny",
        "generator_version": GENERATOR_VERSION,
        "arch": arch,
        "variant": variant,
        "seed": seed,
    }
    if size != "tiny":  # tiny stamps keep their original bytes (no "size" entry)
        stamp["size"] = size
    return stamp


def _read_stamp(out_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((out_dir / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _stamp_matches(out_dir: Path, want: dict[str, Any]) -> bool:
    have = _read_stamp(out_dir)
    if have is None or any(have.get(k) != v for k, v in want.items()):
        return False
    if have.get("size", "tiny") != want.get("size", "tiny"):
        return False
    return all((out_dir / f).is_file() for f in have.get("files", {}))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pin_model_type(config_json: Path, model_type: str) -> None:
    """Write the family's ``model_type`` into a saved config. transformers writes the config
    class's ``model_type`` attribute, and vLLM's config loader reassigns that attribute in
    the process that loads a checkpoint (vllm/transformers_utils/config.py,
    ``_register_config_class``: after loading a DeepSeek-V3.2 checkpoint,
    ``DeepseekV3Config.model_type`` is ``"deepseek_v32"``), so a checkpoint generated in
    such a process would otherwise name another family."""
    config = json.loads(config_json.read_text())
    if config.get("model_type") != model_type:
        config["model_type"] = model_type
        config_json.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def generate_tiny_checkpoint(
    arch: str,
    out_dir: Path | str,
    *,
    seed: int = 0,
    variant: str | None = None,
    overwrite: bool = False,
    size: str = "tiny",
) -> Path:
    """Write a tiny (arch, variant) checkpoint to ``out_dir`` and return the path.

    ``size="bench"`` writes the bench-size checkpoint of ``arch`` instead (see the
    module docstring). Idempotent: when ``out_dir`` holds a stamp for the same arch,
    variant, seed, size and generator version (and the files it lists), nothing is
    regenerated unless ``overwrite``. The checkpoint is built in a sibling temporary
    directory and moved into place, so concurrent callers never see a half-written
    directory.
    """
    spec = _spec(arch)
    out_dir = Path(out_dir)
    want = _stamp(arch, variant, seed, size)
    cfg_kwargs = tiny_config(arch, variant, size)  # validates the variant and size early
    if not overwrite and _stamp_matches(out_dir, want):
        return out_dir

    import torch
    import transformers

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        config = getattr(transformers, spec.config_cls)(**cfg_kwargs)
        config.architectures = [spec.model_cls]
        prev_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            model = getattr(transformers, spec.model_cls)(config)
        finally:
            torch.set_default_dtype(prev_dtype)
        model.eval()
        _init_weights(model, seed, spec.extra_buffers, spec.transposed)
        # Stored in bf16 like real DeepSeek/Qwen checkpoints (fp32 and bf16 runs then
        # start from identical values); router correction biases stay fp32.
        tensors = [*model.named_buffers(), *model.named_parameters()]
        keep_fp32 = {
            n: b.detach().clone() for n, b in tensors if n.rsplit(".", 1)[-1] in spec.extra_buffers
        }
        model.to(torch.bfloat16)
        for name, b in [*model.named_buffers(), *model.named_parameters()]:
            if name in keep_fp32:
                b.data = keep_fp32[name]
        model.save_pretrained(str(tmp))
        _pin_model_type(tmp / "config.json", arch)
        _save_tokenizer(tmp, model_max_length=cfg_kwargs["max_position_embeddings"])

        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        stamp = {**want, "files": files}
        (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
        for p in tmp.iterdir():
            os.chmod(p, 0o644)
        os.chmod(tmp, 0o755)

        if out_dir.exists():
            if not overwrite and _stamp_matches(out_dir, want):  # a concurrent writer won
                shutil.rmtree(tmp, ignore_errors=True)
                return out_dir
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m afd.tools.models.tiny", description="Generate a tiny MoE checkpoint."
    )
    ap.add_argument("arch", choices=sorted(TINY_ARCHS))
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--variant", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", choices=TINY_SIZES, default="tiny")
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    path = generate_tiny_checkpoint(
        args.arch,
        args.out_dir,
        seed=args.seed,
        variant=args.variant,
        overwrite=args.overwrite,
        size=args.size,
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
