"""The deployment fingerprint of a loaded role model (see :mod:`afd_core.identity`).

Both roles compute it the same way from what they built: the engine's model config, the
text config's MoE and routing settings, which decoder layers have a MoE block, where the
shared experts run, and the checkpoint's content identity. Nothing here depends on the
model family: the config attributes are read by the names vLLM's MoE families use.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from afd_core.admission import config_fields
from afd_core.config import AFDConfig, AFDRole
from afd_core.identity import checkpoint_identity, format_layers

__all__ = ["deployment_identity", "moe_layer_indices"]

# Config attribute names per fingerprint field, first present wins (DeepSeek, Qwen,
# Mixtral, ... spell them differently).
_CONFIG_NAMES: dict[str, tuple[str, ...]] = {
    "num_experts": ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts"),
    "top_k": ("num_experts_per_tok", "moe_topk", "moe_top_k"),
    "scoring_func": ("scoring_func",),
    "n_group": ("n_group",),
    "topk_group": ("topk_group",),
    "routed_scaling_factor": ("routed_scaling_factor",),
    "norm_topk_prob": ("norm_topk_prob",),
}


def _has_moe(block: nn.Module) -> bool:
    # vLLM 0.32's FusedMoEFactory returns a MoE runner (AFD's runners subclass it).
    from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import (
        MoERunnerInterface,
    )

    return any(isinstance(m, MoERunnerInterface) for m in block.modules())


def moe_layer_indices(blocks: dict[int, nn.Module]) -> list[int]:
    """Decoder-layer indices whose FFN block holds a fused MoE layer (either role)."""
    return [i for i, block in sorted(blocks.items()) if _has_moe(block)]


def _text(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _config_values(text_config: Any) -> Iterable[tuple[str, str]]:
    for field, names in _CONFIG_NAMES.items():
        for name in names:
            value = getattr(text_config, name, None)
            if value is not None:
                yield field, _text(value)
                break


def deployment_identity(
    model: Any, vllm_config: Any, afd: AFDConfig, *, shared_experts_on_attention: bool
) -> dict[str, str]:
    """The fingerprint fields of this role: ``model`` is the role-aware model (an
    :class:`~afd_moe_runners.role_model.AFDRoleModel`), built (weights need not be
    loaded)."""
    mc = vllm_config.model_config
    text = mc.hf_text_config
    fields = config_fields(afd)
    # The Attention role's TP size is its engine's; the FFN role states the size it was
    # started for (afd.attention_tensor_parallel_size): a disagreement refuses the join.
    if afd.role is AFDRole.ATTENTION:
        fields["attention_tp"] = str(vllm_config.parallel_config.tensor_parallel_size)
    else:
        fields["attention_tp"] = str(afd.attention_tensor_parallel_size)
    fields["architecture"] = type(model).__name__
    fields["model_type"] = str(getattr(text, "model_type", "?"))
    fields["dtype"] = str(mc.dtype).removeprefix("torch.")
    fields["quantization"] = str(mc.quantization or "none")
    fields["hidden_size"] = str(getattr(text, "hidden_size", "?"))
    fields["num_layers"] = str(getattr(text, "num_hidden_layers", "?"))
    fields["moe_layers"] = format_layers(moe_layer_indices(model.afd_ffn_blocks()))
    fields.update(_config_values(text))
    fields["shared_experts"] = "attention" if shared_experts_on_attention else "ffn"
    fields["checkpoint"] = checkpoint_identity(mc.model)
    return fields
