"""FFN expert parallelism, FFN side: a MoE layer that allocates only its rank's experts.

Under ``afd.ffn_expert_parallel`` FFN rank f of nF holds the routed experts
:func:`afd_core.topology.expert_shard` ``(E, nF, f)``. vLLM's own expert parallelism
cannot give it that: a ``FusedMoEFactory`` layer derives its EP rank and size from
vLLM's process groups (``make_parallel_config`` reads the TP / DP groups of the
process), and every AFD FFN rank is an engine of world size 1; vLLM CPU's expert
parallel path also crashes (VLLM_CPU_FACTS.md). So the FFN role passes the factory
:class:`ExpertShardRoutedExperts` through its public ``routed_experts_cls`` seam
(:func:`shard_routed_experts_kwargs`):

* construction: the layer's ``FusedMoEConfig`` says ``num_local_experts = len(shard)``,
  so the quantization method creates ``w13`` / ``w2`` (and scales, biases) for the
  shard only; vLLM's expert-parallel settings stay off (no all-to-all, no EP kernels);
* loading: a checkpoint expert outside the shard maps to local id -1 and is skipped by
  vLLM's own loader (per-expert and fused checkpoints alike);
* forward: the top-k ids arrive global (from the Attention role's gate, or the FFN
  rank's own replicated router); ids outside the shard are sent to local expert 0 with
  weight 0 and the others shifted to local ids, so the kernel computes exactly this
  rank's experts' weighted sum (a zero-weight term adds an exact 0). Kernels that route
  internally (monolithic) are refused.

The Attention role sums the FFN ranks' partial answers
(:mod:`afd_moe_runners.expert_parallel`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

from afd_core.errors import AFDConfigError
from afd_core.topology import expert_shard

__all__ = ["ExpertShardRoutedExperts", "held_experts", "shard_routed_experts_kwargs"]


class ExpertShardRoutedExperts(RoutedExperts):
    """``routed_experts_cls`` of an FFN rank under FFN expert parallelism: the experts of
    ``expert_shard(E, ep_size, ep_rank)`` only (see the module docstring)."""

    def __init__(
        self,
        layer_name: str,
        params_dtype: torch.dtype,
        moe_config: Any,
        quant_config: Any,
        *,
        afd_ep_rank: int,
        afd_ep_size: int,
        **kwargs: Any,
    ) -> None:
        where = f"{layer_name} (afd.ffn_expert_parallel, FFN rank {afd_ep_rank})"
        manager = kwargs.get("expert_map_manager")
        if moe_config.moe_parallel_config.use_ep:
            raise AFDConfigError(
                f"{where}: vLLM's own expert parallelism is on for this FFN rank; AFD shards "
                "the experts over its FFN ranks itself: drop --enable-expert-parallel"
            )
        fused_shared = int(getattr(manager, "num_fused_shared_experts", 0) or 0)
        if moe_config.num_experts != moe_config.num_logical_experts or fused_shared:
            raise AFDConfigError(
                f"{where}: redundant or fused shared experts ({moe_config.num_experts} "
                f"physical for {moe_config.num_logical_experts} logical, {fused_shared} fused "
                "shared) cannot be sharded by afd"
            )
        shard = expert_shard(int(moe_config.num_experts), afd_ep_size, afd_ep_rank)
        moe_config = dataclasses.replace(moe_config, num_local_experts=len(shard))
        super().__init__(layer_name, params_dtype, moe_config, quant_config, **kwargs)
        self.afd_shard = shard
        self.local_num_experts = len(shard)
        if self.quant_method.is_monolithic:
            raise AFDConfigError(
                f"{where}: the expert kernel {type(self.quant_method).__name__} routes "
                "internally and cannot run a shard of the experts; this model or "
                "quantization cannot use afd.ffn_expert_parallel"
            )

    def _map_global_expert_id_to_local_expert_id(self, expert_id: int) -> int:
        # Private in vLLM 0.32 (see _vllm_compat): the loader skips an expert mapped to -1.
        shard: range = self.afd_shard
        return expert_id - shard.start if expert_id in shard else -1

    def forward_modular(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> Any:
        ids, weights = self.local_routing(topk_ids, topk_weights)
        return super().forward_modular(
            x,
            weights,
            ids,
            shared_experts=shared_experts,
            shared_experts_input=shared_experts_input,
        )

    def local_routing(
        self, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Global top-k ``(ids, weights)`` -> this shard's local ids, with the weights of
        experts outside the shard zero (their ids point at local expert 0)."""
        shard: range = self.afd_shard
        local = topk_ids.to(torch.int64) - shard.start
        mine = (local >= 0) & (local < len(shard))
        ids = torch.where(mine, local, torch.zeros_like(local)).to(topk_ids.dtype)
        weights = torch.where(mine, topk_weights, torch.zeros_like(topk_weights))
        return ids, weights


def shard_routed_experts_kwargs(ep_rank: int, ep_size: int) -> dict[str, Any]:
    """The extra ``FusedMoEFactory`` arguments of FFN rank ``ep_rank`` of ``ep_size``."""
    return {
        "routed_experts_cls": ExpertShardRoutedExperts,
        "routed_experts_args": {"afd_ep_rank": ep_rank, "afd_ep_size": ep_size},
    }


def held_experts(blocks: dict[int, torch.nn.Module]) -> dict[str, int]:
    """What the FFN rank's MoE layers actually allocated, read from the modules:
    ``{"routed_experts_held": ..., "routed_experts_absent": ...}`` summed over layers
    (``w13_weight`` rows, so a layer built without the shard would count all)."""
    held = absent = 0
    for block in blocks.values():
        for module in block.modules():
            if not isinstance(module, RoutedExperts):
                continue
            w13 = getattr(module, "w13_weight", None)
            rows = int(w13.shape[0]) if isinstance(w13, torch.Tensor) else 0
            held += rows
            absent += int(module.global_num_experts) - rows
    return {"routed_experts_held": held, "routed_experts_absent": absent}
