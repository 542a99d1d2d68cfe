"""Wire contracts between the Attention role and the FFN role.

One layer of one micro-batch moves as one message each way:

* Attention -> FFN: :class:`AttentionToFFN` (hidden states, plus the routing when
  the gate runs on Attention, or token ids for hash-routed models);
* FFN -> Attention: :class:`FFNToAttention` (the layer output, optionally the
  shared-expert output kept separate).

Every message carries a :class:`TransferHeader` so that a receiver can tell which
layer, micro-batch and shape it got and fail loudly on a mismatch instead of
silently computing the wrong layer. This module imports no tensor library:
tensors are described structurally by :class:`TensorLike`.

Over 400 lines on purpose: every wire contract of both messages (kinds, layouts,
headers, validation) in one place, so a receiver checks against the definitions a sender
builds from.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from afd_core.errors import AFDTransferMismatchError

__all__ = [
    "TensorLike",
    "PayloadKind",
    "WIRE_DTYPES",
    "TransferHeader",
    "AttentionToFFN",
    "FFNToAttention",
    "dtype_name",
    "TensorSlot",
    "PayloadLayout",
    "layout_of",
    "make_header",
]


@runtime_checkable
class TensorLike(Protocol):
    """The part of a tensor the contracts look at (``torch.Tensor`` satisfies it)."""

    @property
    def shape(self) -> Any: ...

    @property
    def dtype(self) -> Any: ...


class PayloadKind(enum.IntEnum):
    """What a message carries besides its main tensor. Stable wire values."""

    HIDDEN = 1
    """A->F: hidden states only (gate on FFN)."""
    HIDDEN_TOPK = 2
    """A->F: hidden states + top-k ids (int32) + top-k weights (float32)."""
    HIDDEN_ROUTER_LOGITS = 3
    """A->F: hidden states + router logits [tokens, num_experts]."""
    HIDDEN_TOKEN_IDS = 4
    """A->F: hidden states + token ids (int64), for hash-routed layers."""
    OUTPUT = 16
    """F->A: final layer output."""
    OUTPUT_WITH_SHARED = 17
    """F->A: routed output + separate shared-expert output."""
    SHUTDOWN = 99
    """Either way: the sender is closing; no tensors follow."""

    @property
    def is_attention_to_ffn(self) -> bool:
        return self in _A2F_KINDS

    @property
    def is_ffn_to_attention(self) -> bool:
        return self in _F2A_KINDS


_A2F_KINDS = frozenset(
    {
        PayloadKind.HIDDEN,
        PayloadKind.HIDDEN_TOPK,
        PayloadKind.HIDDEN_ROUTER_LOGITS,
        PayloadKind.HIDDEN_TOKEN_IDS,
    }
)
_F2A_KINDS = frozenset({PayloadKind.OUTPUT, PayloadKind.OUTPUT_WITH_SHARED})

# Wire codes of the dtypes a message may carry (stable; never renumber).
WIRE_DTYPES: dict[str, int] = {
    "float32": 1,
    "bfloat16": 2,
    "float16": 3,
    "int32": 4,
    "int64": 5,
    "float8_e4m3fn": 6,
    "int8": 7,
    "uint8": 8,
}
_DTYPE_BY_CODE = {code: name for name, code in WIRE_DTYPES.items()}


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; strings pass through."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = str(dtype).rsplit(".", 1)[-1]
        if len(_DTYPE_NAMES) < 64:  # dtype objects are few and immortal
            _DTYPE_NAMES[dtype] = name
    return name


_DTYPE_NAMES: dict[Any, str] = {}


@dataclass(frozen=True, slots=True)
class TransferHeader:
    """Identifies one message: which layer, which micro-batch, what shape."""

    layer_idx: int
    micro_batch_idx: int
    num_tokens: int
    hidden_size: int
    dtype: str
    kind: PayloadKind
    topk: int = 0
    """Top-k (HIDDEN_TOPK) or number of experts (HIDDEN_ROUTER_LOGITS); 0 otherwise."""
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    WIRE_LEN = 8

    def __hash__(self) -> int:
        return self._hash  # computed once: headers key the hot path's caches

    def __post_init__(self) -> None:
        for name in ("layer_idx", "micro_batch_idx", "num_tokens", "hidden_size", "topk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise AFDTransferMismatchError(
                    f"TransferHeader.{name} must be a non-negative int, got {value!r}"
                )
        if self.dtype not in WIRE_DTYPES:
            raise AFDTransferMismatchError(
                f"TransferHeader.dtype {self.dtype!r} is not a wire dtype; "
                f"allowed: {sorted(WIRE_DTYPES)}"
            )
        kind: Any = self.kind
        if not isinstance(kind, PayloadKind):
            try:
                object.__setattr__(self, "kind", PayloadKind(kind))
            except (ValueError, TypeError):
                raise AFDTransferMismatchError(
                    f"TransferHeader.kind must be a PayloadKind, got {kind!r}"
                ) from None
        values = (self.layer_idx, self.micro_batch_idx, self.num_tokens, self.hidden_size)
        object.__setattr__(self, "_hash", hash((*values, self.dtype, self.kind, self.topk)))

    def encode(self) -> list[int]:
        """Fixed-length integer vector (``WIRE_LEN`` int64 values) for the wire."""
        return [
            self.layer_idx,
            self.micro_batch_idx,
            self.num_tokens,
            self.hidden_size,
            WIRE_DTYPES[self.dtype],
            int(self.kind),
            self.topk,
            _MAGIC,
        ]

    @classmethod
    def decode(cls, values: Any) -> TransferHeader:
        """Inverse of :meth:`encode`; accepts any sequence of ints."""
        ints = [int(v) for v in values]
        if len(ints) != cls.WIRE_LEN or ints[-1] != _MAGIC:
            raise AFDTransferMismatchError(
                f"not an afd transfer header: expected {cls.WIRE_LEN} ints ending in "
                f"{_MAGIC}, got {ints!r} (peers running different afd versions?)"
            )
        try:
            kind = PayloadKind(ints[5])
        except ValueError:
            raise AFDTransferMismatchError(f"unknown payload kind {ints[5]} in header") from None
        if ints[4] not in _DTYPE_BY_CODE:
            raise AFDTransferMismatchError(f"unknown dtype code {ints[4]} in header")
        return cls(
            layer_idx=ints[0],
            micro_batch_idx=ints[1],
            num_tokens=ints[2],
            hidden_size=ints[3],
            dtype=_DTYPE_BY_CODE[ints[4]],
            kind=kind,
            topk=ints[6],
        )

    def with_tokens(self, num_tokens: int) -> TransferHeader:
        return replace(self, num_tokens=num_tokens)

    def expect(
        self,
        *,
        layer_idx: int | None = None,
        micro_batch_idx: int | None = None,
        hidden_size: int | None = None,
        dtype: str | None = None,
        kinds: frozenset[PayloadKind] | None = None,
        num_tokens: int | None = None,
    ) -> None:
        """Raise :class:`AFDTransferMismatchError` if this header differs from what is given."""
        wanted: dict[str, Any] = {
            "layer_idx": layer_idx,
            "micro_batch_idx": micro_batch_idx,
            "hidden_size": hidden_size,
            "dtype": dtype,
            "num_tokens": num_tokens,
        }
        for name, value in wanted.items():
            if value is not None and getattr(self, name) != value:
                raise AFDTransferMismatchError(
                    f"transfer header mismatch: expected {name}={value!r}, "
                    f"received {name}={getattr(self, name)!r} in {self}"
                )
        if kinds is not None and self.kind not in kinds:
            raise AFDTransferMismatchError(
                f"transfer header mismatch: expected kind in "
                f"{sorted(k.name for k in kinds)}, received {self.kind.name} in {self}"
            )


_MAGIC = 0xAFD0


def _shape(t: TensorLike) -> tuple[int, ...]:
    shape = t.shape
    if type(shape) in _INT_SHAPE_TYPES:
        return tuple(shape)
    if type(shape).__name__ == "Size" and type(shape).__module__ == "torch":
        _INT_SHAPE_TYPES.add(type(shape))  # torch.Size: a tuple of ints
        return tuple(shape)
    return tuple(int(s) for s in shape)


_INT_SHAPE_TYPES: set[type] = set()


@dataclass(frozen=True, slots=True)
class AttentionToFFN:
    """A->F payload of one layer: hidden states and, optionally, routing or token ids.

    Exactly one of (``topk_ids`` + ``topk_weights``), ``router_logits`` and
    ``token_ids`` may be set.
    """

    hidden_states: TensorLike
    topk_ids: TensorLike | None = None
    topk_weights: TensorLike | None = None
    router_logits: TensorLike | None = None
    token_ids: TensorLike | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> PayloadKind:
        if self.topk_ids is not None:
            return PayloadKind.HIDDEN_TOPK
        if self.router_logits is not None:
            return PayloadKind.HIDDEN_ROUTER_LOGITS
        if self.token_ids is not None:
            return PayloadKind.HIDDEN_TOKEN_IDS
        return PayloadKind.HIDDEN

    @property
    def num_tokens(self) -> int:
        return _shape(self.hidden_states)[0]

    def validate(self) -> None:
        hs = _shape(self.hidden_states)
        if len(hs) != 2:
            raise AFDTransferMismatchError(
                f"hidden_states must be 2-D [tokens, hidden], got shape {hs}"
            )
        n = hs[0]
        has_topk = self.topk_ids is not None or self.topk_weights is not None
        present = [
            name
            for name, flag in (
                ("topk_ids/topk_weights", has_topk),
                ("router_logits", self.router_logits is not None),
                ("token_ids", self.token_ids is not None),
            )
            if flag
        ]
        if len(present) > 1:
            raise AFDTransferMismatchError(
                f"A->F payload may carry only one of topk_ids/topk_weights, router_logits, "
                f"token_ids; got {' and '.join(present)}"
            )
        if has_topk:
            if self.topk_ids is None or self.topk_weights is None:
                raise AFDTransferMismatchError(
                    "topk_ids and topk_weights must be sent together; got only "
                    + ("topk_ids" if self.topk_ids is not None else "topk_weights")
                )
            ids, weights = _shape(self.topk_ids), _shape(self.topk_weights)
            if len(ids) != 2 or ids[0] != n or ids != weights:
                raise AFDTransferMismatchError(
                    f"topk_ids {ids} and topk_weights {weights} must both be [{n}, top_k]"
                )
            if dtype_name(self.topk_ids.dtype) != "int32":
                raise AFDTransferMismatchError(
                    f"topk_ids must be int32, got {dtype_name(self.topk_ids.dtype)}"
                )
            if dtype_name(self.topk_weights.dtype) != "float32":
                raise AFDTransferMismatchError(
                    f"topk_weights must be float32, got {dtype_name(self.topk_weights.dtype)}"
                )
        if self.router_logits is not None:
            rl = _shape(self.router_logits)
            if len(rl) != 2 or rl[0] != n:
                raise AFDTransferMismatchError(
                    f"router_logits must be [{n}, num_experts], got {rl}"
                )
        if self.token_ids is not None:
            ti = _shape(self.token_ids)
            if ti != (n,):
                raise AFDTransferMismatchError(f"token_ids must be [{n}], got {ti}")
            if dtype_name(self.token_ids.dtype) not in ("int32", "int64"):
                raise AFDTransferMismatchError(
                    f"token_ids must be int32 or int64, got {dtype_name(self.token_ids.dtype)}"
                )

    def header(self, layer_idx: int, micro_batch_idx: int = 0) -> TransferHeader:
        hs = _shape(self.hidden_states)
        topk = 0
        if self.topk_ids is not None:
            topk = _shape(self.topk_ids)[1]
        elif self.router_logits is not None:
            topk = _shape(self.router_logits)[1]
        return make_header(
            layer_idx, micro_batch_idx, hs[0], hs[1], dtype_name(self.hidden_states.dtype),
            self.kind, topk,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class FFNToAttention:
    """F->A payload of one layer: the output, optionally with a separate shared-expert output."""

    output: TensorLike
    shared_output: TensorLike | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> PayloadKind:
        return PayloadKind.OUTPUT if self.shared_output is None else PayloadKind.OUTPUT_WITH_SHARED

    @property
    def num_tokens(self) -> int:
        return _shape(self.output)[0]

    def validate(self) -> None:
        out = _shape(self.output)
        if len(out) != 2:
            raise AFDTransferMismatchError(f"output must be 2-D [tokens, hidden], got {out}")
        if self.shared_output is not None and _shape(self.shared_output) != out:
            raise AFDTransferMismatchError(
                f"shared_output shape {_shape(self.shared_output)} must equal output shape {out}"
            )

    def header(self, layer_idx: int, micro_batch_idx: int = 0) -> TransferHeader:
        out = _shape(self.output)
        return make_header(
            layer_idx, micro_batch_idx, out[0], out[1], dtype_name(self.output.dtype), self.kind
        )


@functools.lru_cache(maxsize=8192)
def make_header(
    layer_idx: int,
    micro_batch_idx: int,
    num_tokens: int,
    hidden_size: int,
    dtype: str,
    kind: PayloadKind,
    topk: int = 0,
) -> TransferHeader:
    """A :class:`TransferHeader`, shared between calls with the same values.

    Headers are immutable and the same few repeat every step (one per layer, micro-batch
    and batch size), so the hot path validates each only once.
    """
    return TransferHeader(layer_idx, micro_batch_idx, num_tokens, hidden_size, dtype, kind, topk)


# -- payload layouts ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TensorSlot:
    """A tensor that follows a message's main tensor (see :class:`PayloadLayout`)."""

    field: str
    """The payload attribute that holds it."""
    width: str
    """Its trailing shape: ``"hidden"`` ([tokens, hidden]), ``"topk"`` ([tokens, topk])
    or ``"none"`` ([tokens])."""
    dtype: str | None
    """Its dtype when fixed by the contract; ``None``: chosen by the sender and carried
    next to the header (the *aux dtype*), defaulting to :attr:`default_dtype`."""
    default_dtype: str | None = None
    """The aux dtype when the sender names none; ``None``: the main tensor's dtype."""

    def trailing(self, header: TransferHeader) -> tuple[int, ...]:
        if self.width == "hidden":
            return (header.hidden_size,)
        if self.width == "topk":
            return (header.topk,)
        return ()

    def dtype_in(self, header: TransferHeader, aux_dtype: str | None) -> str:
        if self.dtype is not None:
            return self.dtype
        return aux_dtype or self.default_dtype or header.dtype


@dataclass(frozen=True, slots=True)
class PayloadLayout:
    """Which tensors a message of one :class:`PayloadKind` carries, in wire order.

    The main tensor ([tokens, hidden] of the header's dtype) comes first, then
    ``extras``. Transports move the tensors this describes and never switch on the
    kind themselves; at most one extra has a sender-chosen (aux) dtype.
    """

    kind: PayloadKind
    extras: tuple[TensorSlot, ...] = ()
    fields: tuple[str, ...] = field(init=False)
    """Payload attribute of every tensor, in wire order."""

    def __post_init__(self) -> None:
        main = "output" if self.kind.is_ffn_to_attention else "hidden_states"
        object.__setattr__(self, "fields", (main, *(slot.field for slot in self.extras)))

    @property
    def aux_slot(self) -> TensorSlot | None:
        for slot in self.extras:
            if slot.dtype is None:
                return slot
        return None

    def specs(
        self, header: TransferHeader, aux_dtype: str | None
    ) -> list[tuple[tuple[int, ...], str]]:
        """(trailing shape, dtype name) of every tensor, main tensor first."""
        specs: list[tuple[tuple[int, ...], str]] = [((header.hidden_size,), header.dtype)]
        for slot in self.extras:
            specs.append((slot.trailing(header), slot.dtype_in(header, aux_dtype)))
        return specs

    def tensors(self, payload: AttentionToFFN | FFNToAttention) -> tuple[list[Any], str | None]:
        """The payload's tensors in wire order, and the aux dtype to announce (or None)."""
        main = payload.hidden_states if isinstance(payload, AttentionToFFN) else payload.output
        tensors = [main]
        aux: str | None = None
        for slot in self.extras:
            t = getattr(payload, slot.field)
            tensors.append(t)
            if slot.dtype is None:
                aux = dtype_name(t.dtype)
        return tensors, aux

    def build(self, tensors: list[Any]) -> AttentionToFFN | FFNToAttention:
        """The payload from received tensors (shapes already checked against the header:
        not validated again)."""
        if len(tensors) != len(self.fields):
            raise AFDTransferMismatchError(
                f"{self.kind.name} carries {len(self.fields)} tensors, got {len(tensors)}"
            )
        cls: type[AttentionToFFN] | type[FFNToAttention] = (
            FFNToAttention if self.kind.is_ffn_to_attention else AttentionToFFN
        )
        obj = object.__new__(cls)
        for name, index in _SLOTS[cls, self.fields]:
            object.__setattr__(obj, name, None if index < 0 else tensors[index])
        return obj


_LAYOUTS: dict[PayloadKind, PayloadLayout] = {
    PayloadKind.HIDDEN: PayloadLayout(PayloadKind.HIDDEN),
    PayloadKind.HIDDEN_TOPK: PayloadLayout(
        PayloadKind.HIDDEN_TOPK,
        (TensorSlot("topk_ids", "topk", "int32"), TensorSlot("topk_weights", "topk", "float32")),
    ),
    PayloadKind.HIDDEN_ROUTER_LOGITS: PayloadLayout(
        PayloadKind.HIDDEN_ROUTER_LOGITS, (TensorSlot("router_logits", "topk", None),)
    ),
    PayloadKind.HIDDEN_TOKEN_IDS: PayloadLayout(
        PayloadKind.HIDDEN_TOKEN_IDS, (TensorSlot("token_ids", "none", None, "int64"),)
    ),
    PayloadKind.OUTPUT: PayloadLayout(PayloadKind.OUTPUT),
    PayloadKind.OUTPUT_WITH_SHARED: PayloadLayout(
        PayloadKind.OUTPUT_WITH_SHARED, (TensorSlot("shared_output", "hidden", None),)
    ),
    PayloadKind.SHUTDOWN: PayloadLayout(PayloadKind.SHUTDOWN),
}


# (payload class, layout fields) -> (field name, index in the layout's tensors or -1)
_SLOTS: dict[tuple[type, tuple[str, ...]], tuple[tuple[str, int], ...]] = {
    (cls, layout.fields): tuple(
        (name, layout.fields.index(name) if name in layout.fields else -1)
        for name in cls.__dataclass_fields__
    )
    for layout in _LAYOUTS.values()
    for cls in (AttentionToFFN, FFNToAttention)
}


def layout_of(kind: PayloadKind) -> PayloadLayout:
    """The :class:`PayloadLayout` of ``kind`` (every kind has one)."""
    return _LAYOUTS[kind]
