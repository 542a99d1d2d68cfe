"""The A2E codec: exact round trips, mutual exclusion, refusals, and broken codecs caught."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_connectors_npu.ops import A2EMessage
from afd_connectors_npu.routing import (
    INT32_MAX,
    A2ECodec,
    A2EMeta,
    IdsChannel,
    decode_e2a,
    encode_e2a,
)
from afd_core.errors import AFDConfigError, AFDTransferMismatchError
from afd_core.transfer import AttentionToFFN, FFNToAttention, PayloadKind

CODEC = A2ECodec()


class SwappedCodec(A2ECodec):
    """Deliberately broken: puts the weights in the ids channel and the ids in the scales."""

    def _pack_topk(self, topk_ids: Any, topk_weights: Any) -> tuple[Any, Any]:
        return topk_weights, topk_ids


class DroppedWeightsCodec(A2ECodec):
    """Deliberately broken: sends zeros instead of the top-k weights."""

    def _pack_topk(self, topk_ids: Any, topk_weights: Any) -> tuple[Any, Any]:
        return topk_ids, torch.zeros_like(topk_weights)


def _topk_payload(n: int, k: int, hidden: int, seed: int) -> AttentionToFFN:
    g = torch.Generator().manual_seed(seed)
    return AttentionToFFN(
        torch.randn(n, hidden, generator=g).to(torch.bfloat16),
        topk_ids=torch.randint(0, 256, (n, k), generator=g, dtype=torch.int32),
        topk_weights=torch.rand(n, k, generator=g, dtype=torch.float32),
    )


def assert_round_trip(codec: A2ECodec, payload: AttentionToFFN, **kw: Any) -> AttentionToFFN:
    """Encode, decode, and assert every tensor comes back with its dtype, shape and values."""
    message = codec.encode(payload, layer_idx=3, micro_batch_idx=1, sender=2, **kw)
    meta, back = CODEC.decode(message)
    assert (meta.header.layer_idx, meta.header.micro_batch_idx, meta.sender) == (3, 1, 2)
    assert meta.header.kind is payload.kind
    for name in ("hidden_states", "topk_ids", "topk_weights", "token_ids", "router_logits"):
        want, got = getattr(payload, name), getattr(back, name)
        if want is None:
            assert got is None, name
            continue
        assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
        assert tuple(got.shape) == tuple(want.shape), (name, got.shape, want.shape)
        assert torch.equal(got, want), name
    return back


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 9),
    k=st.integers(1, 8),
    hidden=st.integers(1, 16),
    seed=st.integers(0, 2**16),
)
def test_topk_routing_round_trips_with_int32_ids_and_float32_weights(n, k, hidden, seed) -> None:
    payload = _topk_payload(n, k, hidden, seed)
    message = CODEC.encode(payload, layer_idx=3, micro_batch_idx=1, sender=2)
    assert message.ids.dtype == torch.int32 and message.scales.dtype == torch.float32
    assert tuple(message.ids.shape) == (n, k) == tuple(message.scales.shape)
    assert A2EMeta.decode(message.meta).ids is IdsChannel.TOPK
    assert_round_trip(CODEC, payload)


@settings(max_examples=40, deadline=None)
@given(
    ids=st.lists(st.integers(-(2**31), INT32_MAX), max_size=9),
    dtype=st.sampled_from([torch.int32, torch.int64]),
    width=st.integers(1, 8),
)
def test_token_ids_round_trip_with_their_own_dtype(ids, dtype, width) -> None:
    n = len(ids)
    payload = AttentionToFFN(torch.ones(n, 4), token_ids=torch.tensor(ids, dtype=dtype).reshape(n))
    message = CODEC.encode(payload, layer_idx=0, micro_batch_idx=0, sender=0, token_ids_width=width)
    assert message.ids.dtype == torch.int32 and tuple(message.ids.shape) == (n, width)
    assert torch.count_nonzero(message.scales) == 0
    assert_round_trip(CODEC, payload, token_ids_width=width)


def test_hidden_only_payload_leaves_the_ids_channel_empty() -> None:
    payload = AttentionToFFN(torch.randn(3, 8, dtype=torch.float16))
    message = CODEC.encode(payload, layer_idx=0, micro_batch_idx=0, sender=0)
    assert message.ids is None and message.scales is None
    assert_round_trip(CODEC, payload)


def _bypass(**fields: Any) -> AttentionToFFN:
    """An AttentionToFFN built without its own validation (as a buggy caller might)."""
    obj = object.__new__(AttentionToFFN)
    for name in ("hidden_states", "topk_ids", "topk_weights", "router_logits", "token_ids"):
        object.__setattr__(obj, name, fields.get(name))
    return obj


def test_routing_and_token_ids_together_are_rejected_even_without_payload_validation() -> None:
    good = _topk_payload(2, 2, 4, 0)
    mixed = _bypass(
        hidden_states=good.hidden_states,
        topk_ids=good.topk_ids,
        topk_weights=good.topk_weights,
        token_ids=torch.tensor([1, 2]),
    )
    with pytest.raises(AFDTransferMismatchError, match=r"both top-k routing and token_ids"):
        CODEC.encode(mixed, layer_idx=0, micro_batch_idx=0, sender=0)


def test_router_logits_are_refused_with_the_setting_to_change() -> None:
    payload = AttentionToFFN(torch.ones(2, 4), router_logits=torch.ones(2, 8))
    with pytest.raises(AFDConfigError, match=r"afd\.routing_payload='topk'"):
        CODEC.encode(payload, layer_idx=0, micro_batch_idx=0, sender=0)


@pytest.mark.parametrize(
    ("field", "bad", "match"),
    [
        ("topk_ids", torch.zeros(2, 2, dtype=torch.int64), "topk_ids must be int32"),
        ("topk_weights", torch.zeros(2, 2, dtype=torch.bfloat16), "topk_weights must be float32"),
        ("topk_weights", torch.zeros(2, 3), r"must both be \[2, top_k\]"),
        ("topk_weights", None, "without topk_weights"),
    ],
)
def test_malformed_topk_is_refused_at_the_codec(field: str, bad: Any, match: str) -> None:
    good = _topk_payload(2, 2, 4, 0)
    fields = {
        "hidden_states": good.hidden_states,
        "topk_ids": good.topk_ids,
        "topk_weights": good.topk_weights,
        field: bad,
    }
    with pytest.raises(AFDTransferMismatchError, match=match):
        CODEC.encode(_bypass(**fields), layer_idx=0, micro_batch_idx=0, sender=0)


def test_int64_token_ids_beyond_int32_are_refused_not_truncated() -> None:
    payload = AttentionToFFN(torch.ones(1, 4), token_ids=torch.tensor([2**31], dtype=torch.int64))
    with pytest.raises(AFDTransferMismatchError, match="does not fit the int32 CAM ids channel"):
        CODEC.encode(payload, layer_idx=0, micro_batch_idx=0, sender=0)


def test_decode_refuses_slots_that_disagree_with_the_meta() -> None:
    message = CODEC.encode(_topk_payload(2, 3, 4, 1), layer_idx=0, micro_batch_idx=0, sender=0)
    wrong_dtype = A2EMessage(
        message.meta, message.hidden_states, message.ids.long(), message.scales
    )
    with pytest.raises(AFDTransferMismatchError, match=r"ids slot is int64"):
        CODEC.decode(wrong_dtype)
    missing = A2EMessage(message.meta, message.hidden_states)
    with pytest.raises(AFDTransferMismatchError, match="slots are empty"):
        CODEC.decode(missing)
    with pytest.raises(AFDTransferMismatchError, match="meta must be"):
        CODEC.decode(A2EMessage(message.meta[:-1], message.hidden_states))


def test_token_id_rows_with_differing_columns_are_detected() -> None:
    payload = AttentionToFFN(torch.ones(2, 4), token_ids=torch.tensor([5, 6]))
    message = CODEC.encode(payload, layer_idx=0, micro_batch_idx=0, sender=0, token_ids_width=3)
    ids = message.ids.clone()
    ids[1, 2] = 99
    with pytest.raises(AFDTransferMismatchError, match="columns differ"):
        CODEC.decode(A2EMessage(message.meta, message.hidden_states, ids, message.scales))


@pytest.mark.parametrize("broken", [SwappedCodec(), DroppedWeightsCodec()], ids=["swap", "drop"])
def test_the_round_trip_check_catches_a_broken_codec(broken: A2ECodec) -> None:
    with pytest.raises((AssertionError, AFDTransferMismatchError)):
        assert_round_trip(broken, _topk_payload(4, 2, 8, 3))


def test_e2a_round_trip_keeps_output_and_shared_output() -> None:
    out = torch.randn(3, 8, dtype=torch.bfloat16)
    shared = torch.randn(3, 8, dtype=torch.bfloat16)
    for result in (FFNToAttention(out), FFNToAttention(out, shared_output=shared)):
        meta, back = decode_e2a(encode_e2a(result, layer_idx=4, micro_batch_idx=1, sender=0))
        assert meta.header.kind is result.kind
        assert torch.equal(back.output, out)
        if result.shared_output is None:
            assert back.shared_output is None and meta.header.kind is PayloadKind.OUTPUT
        else:
            assert torch.equal(back.shared_output, shared)
