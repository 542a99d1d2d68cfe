"""CAM token layout for a TP Attention role: pad, split per rank, gather, restore."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_moe_runners.npu.cam_layout import (
    CamTokenLayout,
    RowGather,
    pad_routing,
    prepare_cam_inputs,
    process_group_row_gather,
    restore_rows,
    shard_rows,
)

Restore = Callable[..., torch.Tensor]
PadRouting = Callable[..., tuple[torch.Tensor, torch.Tensor]]
DTYPES = (torch.float32, torch.bfloat16, torch.int64)


def rows_tensor(num_tokens: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows that are all different, so a misplaced or dropped row is visible."""
    values = torch.arange(num_tokens * width, dtype=torch.float32).reshape(num_tokens, width) + 1
    return values.to(dtype)


def rank_gather(shards: list[torch.Tensor], rank: int) -> RowGather:
    """The all-gather rank ``rank`` would see, given every rank's shard."""

    def gather(local: torch.Tensor) -> torch.Tensor:
        assert torch.equal(local, shards[rank]), "gather got rows that are not this rank's"
        return torch.cat(shards, dim=0)

    return gather


def check_round_trip(
    num_tokens: int, tp_size: int, width: int, dtype: torch.dtype, restore: Restore
) -> None:
    x = rows_tensor(num_tokens, width, dtype)
    layouts = [CamTokenLayout(num_tokens, tp_size, rank) for rank in range(tp_size)]
    shards = [shard_rows(x, layout) for layout in layouts]
    assert {s.shape[0] for s in shards} == {layouts[0].local_tokens}
    for rank, layout in enumerate(layouts):
        restored = restore(shards[rank], layout, gather=rank_gather(shards, rank))
        assert torch.equal(restored, x), (num_tokens, tp_size, rank)


# -- layout bookkeeping --------------------------------------------------------------
@given(num_tokens=st.integers(0, 200), tp_size=st.integers(1, 8))
def test_layout_pads_to_a_tp_multiple_and_slices_cover_every_row_once(
    num_tokens: int, tp_size: int
) -> None:
    layouts = [CamTokenLayout(num_tokens, tp_size, rank) for rank in range(tp_size)]
    first = layouts[0]
    assert first.padded_tokens % tp_size == 0
    assert 0 <= first.padding < tp_size
    assert first.padded_tokens == num_tokens + first.padding
    covered = [row for layout in layouts for row in range(first.padded_tokens)[layout.local_slice]]
    assert covered == list(range(first.padded_tokens))
    assert sum(layout.local_real_tokens for layout in layouts) == num_tokens


@pytest.mark.parametrize(
    ("num_tokens", "tp_size", "padded", "local", "padding"),
    [(0, 4, 0, 0, 0), (1, 1, 1, 1, 0), (1, 8, 8, 1, 7), (9, 4, 12, 3, 3), (16, 8, 16, 2, 0)],
)
def test_layout_counts(
    num_tokens: int, tp_size: int, padded: int, local: int, padding: int
) -> None:
    layout = CamTokenLayout(num_tokens, tp_size, tp_size - 1)
    assert (layout.padded_tokens, layout.local_tokens, layout.padding) == (padded, local, padding)
    assert layout.local_slice == slice(padded - local, padded)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"num_tokens": -1, "tp_size": 2, "tp_rank": 0}, "num_tokens: expected >= 0, got -1"),
        ({"num_tokens": 4, "tp_size": 0, "tp_rank": 0}, "tp_size: expected >= 1, got 0"),
        ({"num_tokens": 4, "tp_size": 2, "tp_rank": 2}, "tp_rank: expected 0 <= tp_rank < "),
        ({"num_tokens": 4, "tp_size": 2, "tp_rank": -1}, "tp_rank: expected 0 <= tp_rank < "),
    ],
)
def test_invalid_layout_is_rejected_naming_the_field(kwargs: dict[str, int], fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        CamTokenLayout(**kwargs)


def test_non_int_layout_field_is_rejected() -> None:
    with pytest.raises(TypeError, match=re.escape("num_tokens: expected an int, got 4.0")):
        CamTokenLayout(4.0, 2, 0)  # type: ignore[arg-type]


# -- round trips ---------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(
    num_tokens=st.integers(0, 130),
    tp_size=st.integers(1, 8),
    width=st.integers(1, 6),
    dtype=st.sampled_from(DTYPES),
)
def test_pad_split_gather_restore_returns_the_input_exactly(
    num_tokens: int, tp_size: int, width: int, dtype: torch.dtype
) -> None:
    check_round_trip(num_tokens, tp_size, width, dtype, restore_rows)


@pytest.mark.parametrize("tp_size", range(1, 9))
def test_round_trip_for_every_small_row_count(tp_size: int) -> None:
    for num_tokens in range(0, 3 * tp_size + 2):
        check_round_trip(num_tokens, tp_size, 3, torch.bfloat16, restore_rows)


def test_round_trip_keeps_trailing_dimensions() -> None:
    x = torch.randn(7, 2, 3, generator=torch.Generator().manual_seed(0))
    layouts = [CamTokenLayout(7, 3, rank) for rank in range(3)]
    shards = [shard_rows(x, layout) for layout in layouts]
    assert shards[2].shape == (3, 2, 3)
    assert torch.equal(shards[2][1:], torch.zeros(2, 2, 3))  # padding rows are zeros
    assert torch.equal(restore_rows(shards[1], layouts[1], gather=rank_gather(shards, 1)), x)


def test_shard_is_a_view_when_no_padding_is_needed() -> None:
    x = torch.arange(12.0).reshape(6, 2)
    shard = shard_rows(x, CamTokenLayout(6, 3, 1))
    assert shard.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert torch.equal(shard, x[2:4])


def test_tp1_restores_without_a_gather_or_group() -> None:
    x = rows_tensor(5, 2, torch.float32)
    layout = CamTokenLayout(5, 1, 0)
    assert torch.equal(restore_rows(shard_rows(x, layout), layout), x)


def test_cam_call_on_rank_slices_equals_the_call_on_all_rows() -> None:
    # Stand-in for CAM: a row-wise function of hidden states and routing.
    def cam(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return hidden * 2 + (weights * ids.to(torch.float32)).sum(-1, keepdim=True)

    gen = torch.Generator().manual_seed(3)
    num_tokens, tp_size, topk = 11, 4, 3
    hidden = torch.randn(num_tokens, 8, generator=gen)
    ids = torch.randint(0, 16, (num_tokens, topk), generator=gen)
    weights = torch.rand(num_tokens, topk, generator=gen, dtype=torch.float64)
    per_rank = [
        prepare_cam_inputs(hidden, ids, weights, tp_size=tp_size, tp_rank=rank, safe_expert_id=5)
        for rank in range(tp_size)
    ]
    outputs = [cam(p.hidden_states, p.topk_ids, p.topk_weights) for p in per_rank]
    expected = cam(hidden, ids.to(torch.int32), weights.to(torch.float32))
    for rank, inputs in enumerate(per_rank):
        assert inputs.topk_ids.dtype == torch.int32
        assert inputs.topk_weights.dtype == torch.float32
        restored = restore_rows(outputs[rank], inputs.layout, gather=rank_gather(outputs, rank))
        assert torch.equal(restored, expected)


# -- routing padding -----------------------------------------------------------------
def check_padded_routing(
    pad: PadRouting, num_tokens: int, tp_size: int, topk: int, safe_expert_id: int
) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.randint(0, 256, (num_tokens, topk), generator=gen)
    weights = torch.rand(num_tokens, topk, generator=gen, dtype=torch.bfloat16) + 0.5
    layout = CamTokenLayout(num_tokens, tp_size, 0)
    padded_ids, padded_weights = pad(ids, weights, layout, safe_expert_id=safe_expert_id)
    assert padded_ids.dtype == torch.int32 and padded_weights.dtype == torch.float32
    assert padded_ids.shape == padded_weights.shape == (layout.padded_tokens, topk)
    assert torch.equal(padded_ids[:num_tokens], ids.to(torch.int32))
    assert torch.equal(padded_weights[:num_tokens], weights.to(torch.float32))
    assert bool((padded_ids[num_tokens:] == safe_expert_id).all()), "padding ids not safe"
    assert bool((padded_weights[num_tokens:] == 0).all()), "padding weights not zero"


@given(
    num_tokens=st.integers(0, 40),
    tp_size=st.integers(1, 8),
    topk=st.integers(1, 8),
    safe_expert_id=st.integers(0, 255),
)
def test_padding_rows_route_to_the_safe_expert_with_zero_weight(
    num_tokens: int, tp_size: int, topk: int, safe_expert_id: int
) -> None:
    check_padded_routing(pad_routing, num_tokens, tp_size, topk, safe_expert_id)


def test_padding_rows_contribute_nothing_to_a_weighted_expert_combine() -> None:
    gen = torch.Generator().manual_seed(1)
    num_experts, topk, width = 6, 2, 4
    experts = torch.randn(num_experts, width, width, generator=gen)
    hidden = torch.randn(5, width, generator=gen)
    ids = torch.randint(0, num_experts, (5, topk), generator=gen)
    weights = torch.rand(5, topk, generator=gen)
    layout = CamTokenLayout(5, 4, 0)
    padded_ids, padded_weights = pad_routing(ids, weights, layout, safe_expert_id=num_experts - 1)
    # Non-zero padding hidden rows: only the zero routing weight may silence them.
    padded_hidden = torch.cat((hidden, torch.full((layout.padding, width), 7.0)))
    per_slot = torch.einsum("tw,tkwv->tkv", padded_hidden, experts[padded_ids.long()])
    combined = (per_slot * padded_weights.unsqueeze(-1)).sum(1)
    assert torch.equal(combined[5:], torch.zeros(layout.padding, width))
    reference = (torch.einsum("tw,tkwv->tkv", hidden, experts[ids]) * weights.unsqueeze(-1)).sum(1)
    assert torch.equal(combined[:5], reference)


@pytest.mark.parametrize(
    ("ids", "weights", "safe", "error", "fragment"),
    [
        (
            torch.zeros(4, 2, dtype=torch.int64),
            torch.zeros(4, 3),
            0,
            ValueError,
            "topk_weights.shape",
        ),
        (torch.zeros(4, 2), torch.zeros(4, 2), 0, ValueError, "topk_ids.dtype"),
        (
            torch.zeros(3, 2, dtype=torch.int64),
            torch.zeros(3, 2),
            0,
            ValueError,
            "topk_ids: expected 4 rows",
        ),
        (torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2), -1, ValueError, "safe_expert_id"),
        (torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2), 1.0, TypeError, "safe_expert_id"),
    ],
)
def test_invalid_routing_is_rejected_naming_the_field(
    ids: torch.Tensor, weights: torch.Tensor, safe: int, error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=fragment):
        pad_routing(ids, weights, CamTokenLayout(4, 2, 0), safe_expert_id=safe)


# -- restore errors ------------------------------------------------------------------
def test_restore_rejects_a_local_output_of_the_wrong_row_count() -> None:
    layout = CamTokenLayout(9, 4, 1)
    with pytest.raises(ValueError, match="local_output: expected 3 rows, got 2 rows"):
        restore_rows(torch.zeros(2, 4), layout, gather=lambda t: t)


def test_restore_rejects_a_gather_that_returns_the_wrong_row_count() -> None:
    layout = CamTokenLayout(9, 4, 1)
    with pytest.raises(ValueError, match="gathered output: expected 12 rows, got 3 rows"):
        restore_rows(torch.zeros(3, 4), layout, gather=lambda t: t)


def test_restore_rejects_a_gather_that_changes_the_row_shape() -> None:
    layout = CamTokenLayout(4, 2, 0)
    with pytest.raises(ValueError, match=r"expected row shape \(4,\), got \(2,\)"):
        restore_rows(torch.zeros(2, 4), layout, gather=lambda t: torch.zeros(4, 2))


def test_restore_with_tp_above_1_needs_a_gather_or_a_group() -> None:
    with pytest.raises(ValueError, match="tp_size=2 needs a gather function or a process group"):
        restore_rows(torch.zeros(1, 4), CamTokenLayout(2, 2, 0))


# -- torch.distributed default -------------------------------------------------------
_GLOO_RANK = """
import sys
import torch
import torch.distributed as dist
from afd_moe_runners.npu.cam_layout import CamTokenLayout, restore_rows, shard_rows

rank, world, init_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
try:
    x = torch.arange(21.0).reshape(7, 3) + 1
    layout = CamTokenLayout(7, world, rank)
    torch.save(restore_rows(shard_rows(x, layout), layout, group=dist.group.WORLD), out)
finally:
    dist.destroy_process_group()
"""


def test_process_group_gather_restores_rows_across_two_gloo_ranks() -> None:
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        outputs = [os.path.join(tmp, f"{rank}.pt") for rank in range(world)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _GLOO_RANK, str(rank), str(world), init_file, outputs[rank]]
            )
            for rank in range(world)
        ]
        try:
            codes = [proc.wait(timeout=120) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        assert codes == [0] * world
        expected = torch.arange(21.0).reshape(7, 3) + 1
        for path in outputs:
            assert torch.equal(torch.load(path), expected)


def test_process_group_row_gather_is_only_built_on_demand() -> None:
    # Building the gather touches no process group; only calling it does.
    assert callable(process_group_row_gather(object()))


# -- the checks above catch broken helpers -------------------------------------------
def _restore_dropping_leading_rows(
    local_output: torch.Tensor, layout: CamTokenLayout, *, gather: RowGather
) -> torch.Tensor:
    # Bug: drops the padding from the front instead of the back.
    return gather(local_output)[layout.padding :]


def _restore_keeping_padding(
    local_output: torch.Tensor, layout: CamTokenLayout, *, gather: RowGather
) -> torch.Tensor:
    # Bug: trusts the gathered rows to be exactly num_tokens (no padding removal).
    return gather(local_output)


@pytest.mark.parametrize("broken", [_restore_dropping_leading_rows, _restore_keeping_padding])
def test_a_broken_restore_fails_the_round_trip_check(broken: Restore) -> None:
    failures = 0
    for num_tokens in range(0, 20):
        for tp_size in range(1, 9):
            try:
                check_round_trip(num_tokens, tp_size, 2, torch.float32, broken)
            except AssertionError:
                failures += 1
    assert failures > 0


def _pad_routing_repeating_last_row(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    layout: CamTokenLayout,
    *,
    safe_expert_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Bug: pads the weights by repeating the last real row instead of zeros.
    ids, _ = pad_routing(topk_ids, topk_weights, layout, safe_expert_id=safe_expert_id)
    weights = topk_weights.to(torch.float32)
    repeated = weights[-1:].expand(layout.padding, weights.shape[1])
    return ids, torch.cat((weights, repeated))


def test_a_routing_pad_with_nonzero_padding_weights_fails_the_routing_check() -> None:
    with pytest.raises(AssertionError, match="padding weights not zero"):
        check_padded_routing(_pad_routing_repeating_last_row, 5, 4, 2, 0)
