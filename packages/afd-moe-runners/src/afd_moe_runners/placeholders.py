"""Parameter-free stand-ins a role builds where the other role computes, and the
``FusedMoEFactory`` stand-ins that build a role's MoE layers.

The role-aware construction (:mod:`afd_moe_runners.generic`) puts these where the
native model would build a module its role does not run: the FFN role's attention
layers and LM head, the Attention role's router when the gate runs on FFN; and it
replaces the model module's ``FusedMoEFactory`` name by the role's factory (the
Attention role's AFD runner; an FFN rank's expert shard).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.utils import PPMissingLayer, extract_layer_index

from afd_core.config import AFDConfig, AFDRole
from afd_core.errors import AFDConfigError
from afd_moe_runners.deployment_plan import DeploymentPlan

__all__ = [
    "NoAttention",
    "NoGate",
    "NoLMHead",
    "attention_factory",
    "expert_shard_factory",
    "layer_index",
]


def layer_index(prefix: str) -> int:
    return int(extract_layer_index(prefix))


def attention_factory(plan: DeploymentPlan | AFDConfig, native_factory: Any) -> Any:
    """A stand-in for a model module's ``FusedMoEFactory`` name that builds the Attention
    role's AFD layer from the role's plan (see :func:`afd_moe_runners.builder.build_afd_moe`)."""
    from afd_moe_runners.builder import afd_moe_factory

    return afd_moe_factory(plan, role=AFDRole.ATTENTION, factory=native_factory)


def expert_shard_factory(afd: AFDConfig, vllm_config: VllmConfig, native_factory: Any) -> Any:
    """A stand-in for a model module's ``FusedMoEFactory`` name on an FFN rank under FFN
    expert parallelism: the native layer with this rank's routed experts only
    (:class:`afd_moe_runners.expert_shard.ExpertShardRoutedExperts`)."""
    from afd_moe_runners.expert_shard import shard_routed_experts_kwargs

    rank = afd.rank if afd.rank is not None else vllm_config.parallel_config.data_parallel_rank
    extra = shard_routed_experts_kwargs(int(rank), afd.num_ffn_ranks)

    def factory(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("routed_experts_cls") is not None:
            raise AFDConfigError(
                f"{kwargs.get('prefix', 'a MoE layer')}: the model builds its experts with its "
                f"own class {kwargs['routed_experts_cls'].__name__}, which afd cannot shard; "
                "this model cannot use afd.ffn_expert_parallel (start one FFN rank per "
                "expert set instead)"
            )
        kwargs.pop("routed_experts_cls", None)
        kwargs.pop("routed_experts_args", None)
        return native_factory(*args, **kwargs, **extra)

    return factory


class NoAttention(nn.Module):
    """FFN-role placeholder for an attention module: no parameters, no KV cache."""

    def __init__(self, *args: Any, prefix: str = "", **kwargs: Any) -> None:
        super().__init__()
        self.prefix = prefix

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError(
            f"{self.prefix}: attention does not run on the AFD FFN role; the FFN server "
            "computes FFN blocks only (use afd_ffn_blocks())"
        )


class NoLMHead(PPMissingLayer):
    """FFN-role LM head placeholder; ``tie_weights`` is a no-op (nothing to tie)."""

    def tie_weights(self, embed_tokens: nn.Module) -> NoLMHead:
        return self


class NoGate(nn.Module):
    """Attention-role stand-in for a MoE block's router when the gate runs on FFN.

    Blocks that call their gate themselves (``router_logits, _ = self.gate(x)``, then
    ``self.experts(x, router_logits)``) get the hidden states back as the placeholder
    logits, as vLLM's own blocks that hand the gate to the runner pass them; the
    Attention-role runner sends the hidden states only.
    """

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x, None
