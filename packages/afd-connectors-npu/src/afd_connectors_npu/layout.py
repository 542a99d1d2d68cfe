"""Token-major <-> expert-major layout of a CAMAsync batch (pure torch, any device).

The FFN role of CAMAsync gets a token-major batch (``hidden [tokens, hidden]``, top-k
ids and weights ``[tokens, top_k]``). Grouped expert kernels want the dispatched,
expert-major layout: one row per (token, slot), rows grouped by expert.
:func:`to_expert_major` builds it; :func:`from_expert_major` is its exact inverse
(``[tokens, top_k, hidden]``); :func:`combine_expert_major` applies the top-k weights
and sums the slots, which is the weighted, combined output CAMAsync returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from afd_core.errors import AFDTransferMismatchError

if TYPE_CHECKING:
    import torch

__all__ = ["ExpertMajorBatch", "to_expert_major", "from_expert_major", "combine_expert_major"]


@dataclass(frozen=True, slots=True)
class ExpertMajorBatch:
    """Rows of ``hidden_states`` grouped by expert (ascending; stable within an expert)."""

    hidden_states: torch.Tensor
    """``[tokens * top_k, hidden]``."""
    expert_ids: torch.Tensor
    """``[tokens * top_k]`` int32, ascending."""
    tokens_per_expert: torch.Tensor
    """``[num_experts]`` int64; sums to ``tokens * top_k``."""
    order: torch.Tensor
    """``[tokens * top_k]`` int64: row ``i`` is flattened (token, slot) ``order[i]``."""
    num_tokens: int
    top_k: int


def to_expert_major(
    hidden_states: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
) -> ExpertMajorBatch:
    """Dispatch layout of a token-major batch (no weights applied)."""
    import torch

    n, k = (int(s) for s in topk_ids.shape)
    if hidden_states.dim() != 2 or int(hidden_states.shape[0]) != n:
        raise AFDTransferMismatchError(
            f"hidden_states {tuple(hidden_states.shape)} must be [{n}, hidden] for topk_ids "
            f"{tuple(topk_ids.shape)}"
        )
    flat = topk_ids.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise AFDTransferMismatchError(
            f"topk_ids range [{int(flat.min())}, {int(flat.max())}] is outside experts "
            f"0..{num_experts - 1}"
        )
    order = torch.argsort(flat, stable=True)
    return ExpertMajorBatch(
        hidden_states=hidden_states.index_select(0, torch.div(order, k, rounding_mode="floor")),
        expert_ids=flat[order].to(torch.int32),
        tokens_per_expert=torch.bincount(flat, minlength=num_experts),
        order=order,
        num_tokens=n,
        top_k=k,
    )


def from_expert_major(expert_rows: torch.Tensor, batch: ExpertMajorBatch) -> torch.Tensor:
    """Put expert-major rows back in token-major order: ``[tokens, top_k, hidden]``."""
    import torch

    slots = torch.empty_like(expert_rows)
    slots[batch.order] = expert_rows
    return slots.reshape(batch.num_tokens, batch.top_k, int(expert_rows.shape[-1]))


def combine_expert_major(
    expert_rows: torch.Tensor, batch: ExpertMajorBatch, topk_weights: torch.Tensor
) -> torch.Tensor:
    """Weighted sum over the top-k slots: ``[tokens, hidden]`` in ``expert_rows``' dtype.

    Accumulates in float32 (the weights' dtype), then casts once.
    """
    per_slot = from_expert_major(expert_rows, batch).float()
    combined = (per_slot * topk_weights.float().unsqueeze(-1)).sum(dim=1)
    return combined.to(expert_rows.dtype)
