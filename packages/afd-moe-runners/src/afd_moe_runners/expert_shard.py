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
  rank's own replicated router). Foreign experts are never computed: vLLM CPU's fused
  MoE kernel takes no expert map and no -1 ids (it counts tokens per expert by indexing
  with the id), so the top-k is *compacted* (:func:`compact_routing`): every (token,
  slot) pair whose expert is in the shard becomes one row of top-k 1 (the token's hidden
  state, the local id, the slot's weight), the foreign pairs are dropped, and the kernel
  runs once on those rows; the rank sums each token's rows in float32 and rounds once to
  the model dtype (a token without a local expert answers 0). The kernel's cost here is
  mostly streaming the weights of the experts it touches (once per call, so one call),
  plus the rows: the foreign slots used to add their rows to local expert 0 and made
  ``0 * inf = NaN`` of every token when that expert overflowed. In float32 a pair's
  row is the kernel's own product, so a token's answer differs from the fused kernel's
  only in the order (and fusing) of its sum; in bfloat16 the kernel rounds each pair's
  weighted output to bfloat16 (it writes its output in the activation dtype), one more
  rounding for tokens with two or more local experts (see docs/architecture.md, FFN
  expert parallelism). Kernels that route internally (monolithic) are refused.

The Attention role sums the FFN ranks' partial answers
(:mod:`afd_moe_runners.expert_parallel`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder

from afd_core.errors import AFDConfigError
from afd_core.topology import expert_shard

__all__ = [
    "ExpertShardRoutedExperts",
    "LocalSlots",
    "compact_routing",
    "held_experts",
    "shard_routed_experts_kwargs",
]


@dataclasses.dataclass(frozen=True)
class LocalSlots:
    """The (token, slot) pairs of a global top-k whose expert is in one shard, as rows of
    top-k 1, in token order then top-k order."""

    rows: torch.Tensor
    """[pairs] the token (row of the layer input) of each pair, int64, ascending."""
    topk_ids: torch.Tensor
    """[pairs, 1] its local expert id (the input ids' dtype)."""
    topk_weights: torch.Tensor
    """[pairs, 1] its weight."""


def compact_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, shard: range) -> LocalSlots:
    """Global top-k ``(ids, weights)`` -> this shard's (token, slot) pairs only, ids
    shifted to local ids; the pairs of experts outside ``shard`` are dropped."""
    local = topk_ids.to(torch.int64) - shard.start
    mine = (local >= 0) & (local < len(shard))
    rows, slots = mine.nonzero(as_tuple=True)
    return LocalSlots(
        rows,
        local[rows, slots].to(topk_ids.dtype).unsqueeze(1),
        topk_weights[rows, slots].unsqueeze(1),
    )


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
        """The kernel on this shard's (token, slot) pairs only (:func:`compact_routing`),
        one call; each token's pairs summed in float32, rounded once to ``x``'s dtype."""
        shard: range = self.afd_shard
        if len(shard) == self.global_num_experts:  # one FFN rank holds every expert
            return super().forward_modular(
                x,
                topk_weights,
                topk_ids,
                shared_experts=shared_experts,
                shared_experts_input=shared_experts_input,
            )
        if shared_experts is not None:
            # What the kernel would do inside (a no-op unless the shared experts overlap
            # with the kernel's finalize); the call below runs without them.
            assert shared_experts_input is not None
            shared_experts(shared_experts_input, SharedExpertsOrder.MK_INTERNAL_OVERLAPPED)
        pairs = compact_routing(topk_ids, topk_weights, shard)
        if pairs.rows.numel() == 0:
            return x.new_zeros(x.shape)
        part = super().forward_modular(
            x.index_select(0, pairs.rows), pairs.topk_weights, pairs.topk_ids
        )
        if not isinstance(part, torch.Tensor):
            raise AFDConfigError(
                f"{self.layer_name} (afd.ffn_expert_parallel): the expert kernel returned a "
                f"deferred output ({type(part).__name__}); the shard sums its rows itself "
                "and needs them finalized"
            )
        total = torch.zeros(
            x.shape, dtype=torch.promote_types(part.dtype, torch.float32), device=x.device
        )
        total.index_add_(0, pairs.rows, part.to(total.dtype))
        return total.to(x.dtype)


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
