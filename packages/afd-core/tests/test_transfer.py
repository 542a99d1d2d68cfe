"""Wire contracts: transfer headers and payload validation (no tensor library needed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from afd_core.errors import AFDTransferMismatchError
from afd_core.transfer import (
    WIRE_DTYPES,
    AttentionToFFN,
    FFNToAttention,
    PayloadKind,
    TransferHeader,
    dtype_name,
    layout_of,
    make_header,
)


@dataclass(frozen=True)
class FakeTensor:
    """Shape and dtype only: the contracts never look at values."""

    shape: tuple[int, ...]
    dtype: str = "float32"


def T(*shape: int, dtype: str = "float32") -> Any:
    return FakeTensor(shape, dtype)


@pytest.mark.parametrize("kind", list(PayloadKind))
@pytest.mark.parametrize("dtype", sorted(WIRE_DTYPES))
def test_header_encode_decode_round_trip(kind: PayloadKind, dtype: str) -> None:
    header = TransferHeader(3, 1, 17, 4096, dtype, kind, topk=8)
    values = header.encode()
    assert len(values) == TransferHeader.WIRE_LEN
    assert TransferHeader.decode(values) == header


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ([1, 2, 3], "not an afd transfer header"),
        ([0, 0, 1, 8, 1, 1, 0, 0], "not an afd transfer header"),
        ([0, 0, 1, 8, 1, 42, 0, 0xAFD0], "unknown payload kind 42"),
        ([0, 0, 1, 8, 99, 1, 0, 0xAFD0], "unknown dtype code 99"),
        ([-1, 0, 1, 8, 1, 1, 0, 0xAFD0], "layer_idx must be a non-negative int"),
    ],
)
def test_header_decode_rejects_garbage(values: list[int], match: str) -> None:
    with pytest.raises(AFDTransferMismatchError, match=match):
        TransferHeader.decode(values)


def test_header_rejects_unknown_dtype_and_kind() -> None:
    with pytest.raises(AFDTransferMismatchError, match="not a wire dtype"):
        TransferHeader(0, 0, 1, 8, "complex64", PayloadKind.HIDDEN)
    with pytest.raises(AFDTransferMismatchError, match="must be a PayloadKind"):
        TransferHeader(0, 0, 1, 8, "float32", 1234)  # type: ignore[arg-type]
    assert TransferHeader(0, 0, 1, 8, "float32", 1).kind is PayloadKind.HIDDEN  # type: ignore[arg-type]


def test_header_expect_reports_expected_and_received() -> None:
    header = TransferHeader(2, 0, 5, 16, "bfloat16", PayloadKind.OUTPUT)
    header.expect(layer_idx=2, micro_batch_idx=0, num_tokens=5, dtype="bfloat16")
    with pytest.raises(
        AFDTransferMismatchError, match="expected layer_idx=3, received layer_idx=2"
    ):
        header.expect(layer_idx=3)
    with pytest.raises(AFDTransferMismatchError, match="expected micro_batch_idx=1"):
        header.expect(micro_batch_idx=1)
    with pytest.raises(AFDTransferMismatchError, match="expected kind in"):
        header.expect(kinds=frozenset({PayloadKind.HIDDEN}))


def test_dtype_name_strips_module_prefix() -> None:
    assert dtype_name("torch.bfloat16") == "bfloat16"
    assert dtype_name("int32") == "int32"


def test_payload_kinds_follow_what_is_attached() -> None:
    assert AttentionToFFN(T(4, 8)).kind is PayloadKind.HIDDEN
    topk = AttentionToFFN(T(4, 8), topk_ids=T(4, 2, dtype="int32"), topk_weights=T(4, 2))
    assert topk.kind is PayloadKind.HIDDEN_TOPK
    assert topk.header(5, 1) == TransferHeader(5, 1, 4, 8, "float32", PayloadKind.HIDDEN_TOPK, 2)
    logits = AttentionToFFN(T(4, 8), router_logits=T(4, 64))
    assert logits.header(0).topk == 64
    assert (
        AttentionToFFN(T(4, 8), token_ids=T(4, dtype="int64")).kind is PayloadKind.HIDDEN_TOKEN_IDS
    )
    assert AttentionToFFN(T(0, 8)).num_tokens == 0
    assert FFNToAttention(T(4, 8), shared_output=T(4, 8)).kind is PayloadKind.OUTPUT_WITH_SHARED


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"topk_ids": T(4, 2, dtype="int32"), "topk_weights": T(4, 2), "router_logits": T(4, 8)},
            "only one of",
        ),
        ({"router_logits": T(4, 8), "token_ids": T(4, dtype="int64")}, "only one of"),
        ({"topk_ids": T(4, 2, dtype="int32")}, "sent together"),
        ({"topk_weights": T(4, 2)}, "sent together"),
        ({"topk_ids": T(4, 2, dtype="int64"), "topk_weights": T(4, 2)}, "topk_ids must be int32"),
        (
            {"topk_ids": T(4, 2, dtype="int32"), "topk_weights": T(4, 2, dtype="bfloat16")},
            "topk_weights must be float32",
        ),
        (
            {"topk_ids": T(3, 2, dtype="int32"), "topk_weights": T(3, 2)},
            r"must both be \[4, top_k\]",
        ),
        ({"router_logits": T(5, 8)}, r"router_logits must be \[4, num_experts\]"),
        ({"token_ids": T(4, 1, dtype="int64")}, r"token_ids must be \[4\]"),
        ({"token_ids": T(4, dtype="float32")}, "token_ids must be int32 or int64"),
    ],
)
def test_attention_payload_validation(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(AFDTransferMismatchError, match=match):
        AttentionToFFN(T(4, 8), **kwargs)


def test_payloads_must_be_two_dimensional() -> None:
    with pytest.raises(AFDTransferMismatchError, match="2-D"):
        AttentionToFFN(T(4))
    with pytest.raises(AFDTransferMismatchError, match="2-D"):
        FFNToAttention(T(2, 3, 4))
    with pytest.raises(AFDTransferMismatchError, match="shared_output shape"):
        FFNToAttention(T(4, 8), shared_output=T(3, 8))


# -- payload layouts (what transports move, without switching on the kind) -----------
_LAYOUT_CASES = [
    (AttentionToFFN(T(4, 8, dtype="bfloat16")), [((8,), "bfloat16")], None),
    (
        AttentionToFFN(
            T(4, 8, dtype="bfloat16"), topk_ids=T(4, 2, dtype="int32"), topk_weights=T(4, 2)
        ),
        [((8,), "bfloat16"), ((2,), "int32"), ((2,), "float32")],
        None,
    ),
    (
        AttentionToFFN(T(4, 8, dtype="bfloat16"), router_logits=T(4, 16, dtype="float32")),
        [((8,), "bfloat16"), ((16,), "float32")],
        "float32",
    ),
    (
        AttentionToFFN(T(4, 8, dtype="bfloat16"), token_ids=T(4, dtype="int32")),
        [((8,), "bfloat16"), ((), "int32")],
        "int32",
    ),
    (FFNToAttention(T(4, 8, dtype="float16")), [((8,), "float16")], None),
    (
        FFNToAttention(T(4, 8, dtype="float16"), shared_output=T(4, 8, dtype="float32")),
        [((8,), "float16"), ((8,), "float32")],
        "float32",
    ),
]


@pytest.mark.parametrize(("payload", "specs", "aux"), _LAYOUT_CASES)
def test_layout_moves_every_tensor_of_a_payload(payload: Any, specs: list[Any], aux: Any) -> None:
    layout = layout_of(payload.kind)
    tensors, announced = layout.tensors(payload)
    assert announced == aux
    header = payload.header(3, 1)
    assert layout.specs(header, announced) == specs
    rebuilt = layout.build(tensors)
    assert type(rebuilt) is type(payload)
    assert rebuilt == payload  # every field, None ones included
    assert rebuilt.kind is payload.kind


def test_every_kind_has_a_layout_and_aux_dtypes_default() -> None:
    assert {layout_of(k).kind for k in PayloadKind} == set(PayloadKind)
    logits = TransferHeader(0, 0, 4, 8, "bfloat16", PayloadKind.HIDDEN_ROUTER_LOGITS, 16)
    assert layout_of(logits.kind).specs(logits, None)[1] == ((16,), "bfloat16")
    ids = TransferHeader(0, 0, 4, 8, "bfloat16", PayloadKind.HIDDEN_TOKEN_IDS)
    assert layout_of(ids.kind).specs(ids, None)[1] == ((), "int64")
    assert layout_of(PayloadKind.SHUTDOWN).extras == ()


def test_headers_of_the_hot_path_are_made_once() -> None:
    payload = AttentionToFFN(T(4, 8))
    assert payload.header(2, 0) is payload.header(2, 0)
    assert payload.header(2, 0) == TransferHeader(2, 0, 4, 8, "float32", PayloadKind.HIDDEN)
    assert make_header(2, 0, 4, 8, "float32", PayloadKind.HIDDEN, 0) is payload.header(2, 0)
    with pytest.raises(AFDTransferMismatchError, match="wire dtype"):
        make_header(2, 0, 4, 8, "complex64", PayloadKind.HIDDEN)
