"""Token-major <-> expert-major layout helpers: exact round trip and weighted combine."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_connectors_npu.layout import combine_expert_major, from_expert_major, to_expert_major
from afd_core.errors import AFDTransferMismatchError


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(0, 12), k=st.integers(1, 6), experts=st.integers(1, 9), seed=st.integers(0, 999)
)
def test_expert_major_layout_round_trips_exactly(n: int, k: int, experts: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, 5, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, experts, (n, k), generator=g, dtype=torch.int32)
    batch = to_expert_major(hidden, ids, experts)
    assert torch.equal(batch.expert_ids, torch.sort(ids.reshape(-1)).values)
    assert batch.tokens_per_expert.tolist() == [int((ids == e).sum()) for e in range(experts)]
    back = from_expert_major(batch.hidden_states, batch)
    assert back.dtype == hidden.dtype
    assert torch.equal(back, hidden.unsqueeze(1).expand(n, k, 5))


def test_combine_applies_each_weight_once_per_slot() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 3, generator=g)
    ids = torch.tensor([[0, 2], [1, 1], [2, 0], [1, 2]], dtype=torch.int32)
    weights = torch.rand(4, 2, generator=g)
    batch = to_expert_major(hidden, ids, 3)
    rows = batch.hidden_states * (batch.expert_ids.float() + 1).unsqueeze(1)  # expert e: x*(e+1)
    got = combine_expert_major(rows, batch, weights)
    want = torch.stack(
        [sum(weights[t, s] * hidden[t] * (ids[t, s] + 1) for s in range(2)) for t in range(4)]
    )
    torch.testing.assert_close(got, want)


def test_out_of_range_expert_ids_are_refused() -> None:
    with pytest.raises(AFDTransferMismatchError, match=r"outside experts 0\.\.3"):
        to_expert_major(torch.ones(1, 2), torch.tensor([[4]], dtype=torch.int32), 4)
