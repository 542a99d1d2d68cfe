"""Token layout around a CAM call for a tensor-parallel Attention role.

Under plain tensor parallelism every TP rank of the Attention role holds the same
token rows. Sending all of them from every rank would dispatch each token ``tp_size``
times, so at the CAM boundary the rows are padded to a multiple of ``tp_size`` and
each rank sends only its contiguous slice (a sequence-parallel split). After the CAM
receive, the slices are all-gathered in rank order and the padding is dropped, which
restores the model's original rows.

Padding rows are zeros in the hidden states; in the routing they point at a safe
expert id with weight 0, so they contribute nothing to any real token's output.

The all-gather is injected (:data:`RowGather`) so the layout runs on CPU without a
process group; :func:`process_group_row_gather` builds the ``torch.distributed`` one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "CamTokenLayout",
    "CamLocalInputs",
    "RowGather",
    "pad_rows",
    "pad_routing",
    "prepare_cam_inputs",
    "process_group_row_gather",
    "restore_rows",
    "shard_rows",
]

RowGather = Callable[[torch.Tensor], torch.Tensor]
"""Takes this rank's rows; returns every TP rank's rows concatenated in rank order."""


@dataclass(frozen=True)
class CamTokenLayout:
    """Where this TP rank's CAM rows sit in the model's token rows.

    ``num_tokens`` is the model's row count before padding; the padded count is the
    next multiple of ``tp_size`` and rank ``r`` owns padded rows
    ``[r * local_tokens, (r + 1) * local_tokens)``.
    """

    num_tokens: int
    tp_size: int
    tp_rank: int

    def __post_init__(self) -> None:
        for name in ("num_tokens", "tp_size", "tp_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"CamTokenLayout.{name}: expected an int, got {value!r}")
        if self.num_tokens < 0:
            raise ValueError(f"CamTokenLayout.num_tokens: expected >= 0, got {self.num_tokens}")
        if self.tp_size < 1:
            raise ValueError(f"CamTokenLayout.tp_size: expected >= 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(
                f"CamTokenLayout.tp_rank: expected 0 <= tp_rank < tp_size={self.tp_size}, "
                f"got {self.tp_rank}"
            )

    @property
    def local_tokens(self) -> int:
        """Rows each rank sends (equal on every rank)."""
        return -(-self.num_tokens // self.tp_size)

    @property
    def padded_tokens(self) -> int:
        """``num_tokens`` rounded up to a multiple of ``tp_size``."""
        return self.local_tokens * self.tp_size

    @property
    def padding(self) -> int:
        """Rows appended after the real ones (always ``< tp_size``)."""
        return self.padded_tokens - self.num_tokens

    @property
    def local_slice(self) -> slice:
        """This rank's rows within the padded rows."""
        start = self.tp_rank * self.local_tokens
        return slice(start, start + self.local_tokens)

    @property
    def local_real_tokens(self) -> int:
        """How many of this rank's rows are real (the rest are padding)."""
        start = self.tp_rank * self.local_tokens
        return max(0, min(self.num_tokens - start, self.local_tokens))


@dataclass(frozen=True)
class CamLocalInputs:
    """This rank's CAM inputs and the layout that restores its output."""

    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    layout: CamTokenLayout


def pad_rows(x: torch.Tensor, layout: CamTokenLayout, fill: float | int = 0) -> torch.Tensor:
    """``x`` with ``layout.padding`` rows of ``fill`` appended (``x`` itself if none)."""
    _require_rows(x, layout.num_tokens, "x")
    if layout.padding == 0:
        return x
    pad = x.new_full((layout.padding, *x.shape[1:]), fill)
    return torch.cat((x, pad), dim=0)


def shard_rows(x: torch.Tensor, layout: CamTokenLayout, fill: float | int = 0) -> torch.Tensor:
    """This rank's rows of ``x`` after padding (a view when no padding was needed)."""
    return pad_rows(x, layout, fill)[layout.local_slice]


def pad_routing(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    layout: CamTokenLayout,
    *,
    safe_expert_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing as CAM takes it (ids int32, weights float32), padded to the layout.

    Padding rows route every slot to ``safe_expert_id`` (any valid expert; it only has
    to exist) with weight 0, so they add nothing to the combined output.
    """
    if isinstance(safe_expert_id, bool) or not isinstance(safe_expert_id, int):
        raise TypeError(f"safe_expert_id: expected an int, got {safe_expert_id!r}")
    if safe_expert_id < 0:
        raise ValueError(f"safe_expert_id: expected a valid expert id >= 0, got {safe_expert_id}")
    _require_rows(topk_ids, layout.num_tokens, "topk_ids")
    _require_rows(topk_weights, layout.num_tokens, "topk_weights")
    if topk_ids.shape != topk_weights.shape:
        raise ValueError(
            f"topk_weights.shape: expected {tuple(topk_ids.shape)} (as topk_ids), "
            f"got {tuple(topk_weights.shape)}"
        )
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex:
        raise ValueError(f"topk_ids.dtype: expected an integer dtype, got {topk_ids.dtype}")
    ids = pad_rows(topk_ids.to(torch.int32), layout, safe_expert_id)
    weights = pad_rows(topk_weights.to(torch.float32), layout, 0.0)
    return ids, weights


def prepare_cam_inputs(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    tp_size: int,
    tp_rank: int,
    safe_expert_id: int = 0,
) -> CamLocalInputs:
    """Pad hidden states and routing to ``tp_size`` and take rank ``tp_rank``'s rows."""
    layout = CamTokenLayout(int(hidden_states.shape[0]), tp_size, tp_rank)
    ids, weights = pad_routing(topk_ids, topk_weights, layout, safe_expert_id=safe_expert_id)
    return CamLocalInputs(
        hidden_states=shard_rows(hidden_states, layout),
        topk_ids=ids[layout.local_slice],
        topk_weights=weights[layout.local_slice],
        layout=layout,
    )


def restore_rows(
    local_output: torch.Tensor,
    layout: CamTokenLayout,
    *,
    gather: RowGather | None = None,
    group: Any = None,
) -> torch.Tensor:
    """Gather every rank's CAM output rows and drop the padding.

    ``gather`` is used when given; otherwise ``group`` (a ``torch.distributed`` process
    group) builds one with :func:`process_group_row_gather`. Neither is needed when
    ``tp_size`` is 1. The result has ``layout.num_tokens`` rows in the original order.
    """
    _require_rows(local_output, layout.local_tokens, "local_output")
    if layout.tp_size == 1:
        return local_output[: layout.num_tokens]
    if gather is None:
        if group is None:
            raise ValueError(
                f"restore_rows: tp_size={layout.tp_size} needs a gather function or a "
                "process group, got neither"
            )
        gather = process_group_row_gather(group)
    gathered = gather(local_output)
    _require_rows(gathered, layout.padded_tokens, "gathered output")
    if tuple(gathered.shape[1:]) != tuple(local_output.shape[1:]):
        raise ValueError(
            f"gathered output: expected row shape {tuple(local_output.shape[1:])}, "
            f"got {tuple(gathered.shape[1:])}"
        )
    return gathered[: layout.num_tokens]


def process_group_row_gather(group: Any) -> RowGather:
    """A :data:`RowGather` that all-gathers along dim 0 over ``group``."""
    import torch.distributed as dist

    def gather(local: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size(group)
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    return gather


def _require_rows(x: torch.Tensor, rows: int, name: str) -> None:
    if x.dim() == 0 or int(x.shape[0]) != rows:
        got = "a 0-d tensor" if x.dim() == 0 else f"{int(x.shape[0])} rows"
        raise ValueError(f"{name}: expected {rows} rows, got {got}")
