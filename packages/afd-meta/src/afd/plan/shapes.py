"""Model shapes of ``afd plan``: sizes, FLOPs and KV bytes from a ``config.json``.

:func:`load_shape` takes a checkpoint directory (its ``config.json``) or the name of a
real-deployment shape of the installed model families
(:func:`afd.model_families.family_shapes`; today DeepSeek-V3, DeepSeek-V2-Lite,
Qwen3-235B-A22B, Qwen3-30B-A3B). Counts are per layer unless named otherwise; parameters, not bytes
(:attr:`ModelShape.weight_bytes` says how many bytes one takes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ModelShape", "load_shape", "recipe_names", "shape_from_config"]


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    #: Decoder layers with a routed-expert MoE block, and with a dense MLP.
    moe_layers: int
    dense_layers: int
    experts: int
    top_k: int
    #: Parameters of one routed expert, of the shared expert(s) of a MoE layer, of one
    #: dense layer's MLP, of the router.
    expert_params: int
    shared_params: int
    dense_mlp_params: int
    router_params: int
    #: Attention parameters of one layer (projections, norms).
    attention_params: int
    #: Embedding + LM head parameters.
    vocab_params: int
    vocab: int
    #: Query heads (the TP limit), KV elements cached per token and layer, whether the
    #: cache is a latent shared by all heads (MLA: replicated on every TP worker).
    heads: int
    #: KV heads a TP group can split the cache by (1 for MLA's latent).
    kv_heads: int
    kv_elems_per_token: int
    kv_latent: bool
    #: Attention-score FLOPs per token of context and per query token (QK^T + PV).
    score_flops_per_ctx: int
    #: Bytes per weight (2 for bf16, 1 for fp8) and per activation of the exchange.
    weight_bytes: float = 2.0
    act_bytes: float = 2.0

    @property
    def attention_bytes_total(self) -> float:
        """Weights the attention role holds: every layer's attention, embedding, head."""
        return (self.layers * self.attention_params + self.vocab_params) * self.weight_bytes

    def ffn_bytes_total(self, experts_held: int, rank0: bool = True) -> float:
        """Weights one FFN rank holds: ``experts_held`` routed experts of every MoE
        layer, the routers; rank 0 also the shared experts and the dense MLPs."""
        per_moe = experts_held * self.expert_params + self.router_params
        if rank0:
            per_moe += self.shared_params
        dense = self.dense_layers * self.dense_mlp_params if rank0 else 0
        return (self.moe_layers * per_moe + dense) * self.weight_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        """KV cache bytes of one token over all layers (bf16 cache)."""
        return self.layers * self.kv_elems_per_token * 2.0

    def attention_flops_per_token(self, context: float) -> float:
        """FLOPs of one layer's attention for one decode token with ``context`` cached
        tokens: 2 x projection parameters + the scores over the context."""
        return 2.0 * self.attention_params + self.score_flops_per_ctx * context


def _get(cfg: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    if default is None:
        raise ValueError(f"config.json has none of {', '.join(names)}")
    return default


def shape_from_config(cfg: Mapping[str, Any], name: str = "model") -> ModelShape:
    """A :class:`ModelShape` from ``config.json`` fields (DeepSeek MLA or GQA MoE models;
    a nested ``text_config`` is read when present)."""
    if isinstance(cfg.get("text_config"), Mapping):
        cfg = {**cfg, **cfg["text_config"]}
    h = int(_get(cfg, "hidden_size"))
    layers = int(_get(cfg, "num_hidden_layers"))
    experts = int(_get(cfg, "n_routed_experts", "num_experts", "num_local_experts"))
    top_k = int(_get(cfg, "num_experts_per_tok", "moe_topk"))
    moe_inter = int(_get(cfg, "moe_intermediate_size", "intermediate_size"))
    dense_inter = int(_get(cfg, "intermediate_size", default=moe_inter))
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    only_dense = list(cfg.get("mlp_only_layers") or [])
    dense_layers = len(set(range(first_dense)) | {int(i) for i in only_dense})
    moe_layers = layers - dense_layers
    shared = int(cfg.get("n_shared_experts") or 0) * moe_inter
    shared += int(cfg.get("shared_expert_intermediate_size") or 0)
    heads = int(_get(cfg, "num_attention_heads"))
    vocab = int(_get(cfg, "vocab_size"))
    if cfg.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3)
        kv_rank = int(cfg["kv_lora_rank"])
        rope = int(cfg.get("qk_rope_head_dim") or 64)
        nope = int(cfg.get("qk_nope_head_dim") or 128)
        v_dim = int(cfg.get("v_head_dim") or 128)
        q_rank = cfg.get("q_lora_rank")
        q_proj = (
            h * int(q_rank) + int(q_rank) * heads * (nope + rope)
            if q_rank
            else h * heads * (nope + rope)
        )
        kv_proj = h * (kv_rank + rope) + kv_rank * heads * (nope + v_dim)
        attention_params = q_proj + kv_proj + heads * v_dim * h
        kv_elems = kv_rank + rope
        # Absorbed MLA decode: scores and values against the latent for every head.
        score = 2 * heads * (kv_rank + rope) + 2 * heads * kv_rank
        latent = True
        kv_heads = 1
    else:  # GQA / MHA
        head_dim = int(cfg.get("head_dim") or h // heads)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        attention_params = h * head_dim * (heads + 2 * kv_heads) + heads * head_dim * h
        kv_elems = 2 * kv_heads * head_dim
        score = 4 * heads * head_dim
        latent = False
    tie = bool(cfg.get("tie_word_embeddings"))
    quant = cfg.get("quantization_config") or {}
    weight_bytes = 1.0 if str(quant.get("quant_method", "")).lower() == "fp8" else 2.0
    return ModelShape(
        name=name,
        hidden=h,
        layers=layers,
        moe_layers=moe_layers,
        dense_layers=dense_layers,
        experts=experts,
        top_k=top_k,
        expert_params=3 * h * moe_inter,
        shared_params=3 * h * shared,
        dense_mlp_params=3 * h * dense_inter,
        router_params=h * experts,
        attention_params=attention_params,
        vocab_params=vocab * h * (1 if tie else 2),
        vocab=vocab,
        heads=heads,
        kv_heads=kv_heads,
        kv_elems_per_token=kv_elems,
        kv_latent=latent,
        score_flops_per_ctx=score,
        weight_bytes=weight_bytes,
    )


def _recipes() -> dict[str, Any]:
    from afd.model_families import family_shapes

    return {s.name.lower(): s for s in family_shapes()}


def recipe_names() -> list[str]:
    return [s.name for s in _recipes().values()]


#: How the named recipes are deployed when nothing else is said: DeepSeek-V3 is
#: released and served in fp8 (block-scaled weights), the others in bf16.
RECIPE_WEIGHT_BYTES = {"deepseek-v3": 1.0}


def load_shape(model: str, weight_bytes: float | None = None) -> ModelShape:
    """The shape of a checkpoint directory or of a named recipe (case-insensitive)."""
    recipe = _recipes().get(model.lower())
    if recipe is not None:
        shape = shape_from_config(recipe.config_json(), recipe.name)
        wb = weight_bytes or RECIPE_WEIGHT_BYTES.get(model.lower(), shape.weight_bytes)
    else:
        path = Path(model).expanduser()
        config = path / "config.json" if path.is_dir() else path
        if not config.is_file():
            raise ValueError(
                f"model {model!r}: no config.json there and no recipe of that name "
                f"({', '.join(recipe_names())})"
            )
        shape = shape_from_config(json.loads(config.read_text(encoding="utf-8")), path.name)
        wb = weight_bytes or shape.weight_bytes
    from dataclasses import replace

    return replace(shape, weight_bytes=wb)
