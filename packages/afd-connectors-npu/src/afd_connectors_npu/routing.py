"""How afd-core's payloads map onto CAM messages (the ids channel and the scales slot).

The CAM A2E operator moves three tensors: the hidden states, an int32 *ids channel*
``[tokens, width]`` and a float32 *scales* slot ``[tokens, width]``. The ids channel
carries one of two things, never both:

* top-k routing (``PayloadKind.HIDDEN_TOPK``, the Attention-side gate of CAMP2p with
  ``compute_gate_on_attention=true``, and every CAMAsync dispatch): ``topk_ids`` int32
  ``[tokens, top_k]`` go to the ids channel and ``topk_weights`` float32
  ``[tokens, top_k]`` to the scales slot, unchanged;
* token ids (``PayloadKind.HIDDEN_TOKEN_IDS``, hash-routed layers): each id repeated
  across ``width`` columns, the scales slot zero; the receiver takes column 0 and
  restores the sender's dtype (int32 or int64).

Router logits are not carried by CAM. ``meta`` (see :mod:`afd_connectors_npu.ops`) is
the 8-word :class:`~afd_core.transfer.TransferHeader` followed by, for A2E, the ids
channel mode, the token-id dtype code, the width and the sender rank; for E2A, the
dtype code of the second tensor and the sender rank. Torch is imported only by the
functions that build tensors.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from afd_connectors_npu.ops import A2EMessage, E2AMessage
from afd_core.errors import AFDConfigError, AFDTransferMismatchError
from afd_core.transfer import (
    WIRE_DTYPES,
    AttentionToFFN,
    FFNToAttention,
    PayloadKind,
    TransferHeader,
    dtype_name,
)

__all__ = [
    "IdsChannel",
    "A2EMeta",
    "E2AMeta",
    "A2ECodec",
    "encode_e2a",
    "decode_e2a",
    "INT32_MIN",
    "INT32_MAX",
    "A2E_META_LEN",
    "E2A_META_LEN",
]

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
_DTYPE_BY_CODE = {code: name for name, code in WIRE_DTYPES.items()}
_A2E_META_LEN = TransferHeader.WIRE_LEN + 4
_E2A_META_LEN = TransferHeader.WIRE_LEN + 2
A2E_META_LEN = _A2E_META_LEN
"""Words of an A2E meta (a message in a low-precision transfer dtype appends 3, see
``afd_connectors_npu.exchange``)."""
E2A_META_LEN = _E2A_META_LEN


class IdsChannel(enum.IntEnum):
    """What the A2E ids channel carries. Stable wire values."""

    NONE = 0
    TOKEN_IDS = 1
    TOPK = 2


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def _dtype_code(name: str) -> int:
    try:
        return WIRE_DTYPES[name]
    except KeyError:
        raise AFDTransferMismatchError(
            f"dtype {name!r} cannot travel over CAM; wire dtypes: {sorted(WIRE_DTYPES)}"
        ) from None


def _dtype_of_code(code: int, what: str) -> str:
    try:
        return _DTYPE_BY_CODE[code]
    except KeyError:
        raise AFDTransferMismatchError(f"unknown {what} dtype code {code} in CAM meta") from None


@dataclass(frozen=True, slots=True)
class A2EMeta:
    """Decoded ``meta`` of an :class:`A2EMessage`."""

    header: TransferHeader
    ids: IdsChannel
    token_ids_dtype: str | None
    width: int
    sender: int

    def encode(self) -> tuple[int, ...]:
        code = 0 if self.token_ids_dtype is None else _dtype_code(self.token_ids_dtype)
        return (*self.header.encode(), int(self.ids), code, self.width, self.sender)

    @classmethod
    def decode(cls, meta: tuple[int, ...]) -> A2EMeta:
        if len(meta) != _A2E_META_LEN:
            raise AFDTransferMismatchError(
                f"CAM A2E meta must be {_A2E_META_LEN} ints, got {len(meta)} "
                "(peers running different afd-connectors-npu versions?)"
            )
        header = TransferHeader.decode(meta[: TransferHeader.WIRE_LEN])
        mode_word, code, width, sender = meta[TransferHeader.WIRE_LEN :]
        try:
            mode = IdsChannel(mode_word)
        except ValueError:
            raise AFDTransferMismatchError(
                f"unknown ids channel mode {mode_word} in CAM meta"
            ) from None
        dtype = _dtype_of_code(code, "token id") if mode is IdsChannel.TOKEN_IDS else None
        return cls(header, mode, dtype, width, sender)


@dataclass(frozen=True, slots=True)
class E2AMeta:
    """Decoded ``meta`` of an :class:`E2AMessage`."""

    header: TransferHeader
    extra_dtype: str | None
    sender: int

    def encode(self) -> tuple[int, ...]:
        code = 0 if self.extra_dtype is None else _dtype_code(self.extra_dtype)
        return (*self.header.encode(), code, self.sender)

    @classmethod
    def decode(cls, meta: tuple[int, ...]) -> E2AMeta:
        if len(meta) != _E2A_META_LEN:
            raise AFDTransferMismatchError(
                f"CAM E2A meta must be {_E2A_META_LEN} ints, got {len(meta)} "
                "(peers running different afd-connectors-npu versions?)"
            )
        header = TransferHeader.decode(meta[: TransferHeader.WIRE_LEN])
        code, sender = meta[TransferHeader.WIRE_LEN :]
        return cls(header, _dtype_of_code(code, "extra") if code else None, sender)


class A2ECodec:
    """Encodes an :class:`AttentionToFFN` into an :class:`A2EMessage` and back.

    Validates at this boundary even if ``payload`` skipped its own checks: routing and
    token ids together, router logits, wrong dtypes or shapes are refused here.
    """

    def encode(
        self,
        payload: AttentionToFFN,
        *,
        layer_idx: int,
        micro_batch_idx: int,
        sender: int,
        token_ids_width: int = 1,
    ) -> A2EMessage:
        hidden = payload.hidden_states
        hs = _shape(hidden)
        if len(hs) != 2:
            raise AFDTransferMismatchError(f"hidden_states must be 2-D [tokens, hidden], got {hs}")
        n = hs[0]
        topk_ids, topk_weights = payload.topk_ids, payload.topk_weights
        token_ids = payload.token_ids
        if payload.router_logits is not None:
            raise AFDConfigError(
                "CAM connectors do not carry router_logits; set afd.routing_payload='topk' "
                "(the Attention role then sends top-k ids and weights)"
            )
        has_topk = topk_ids is not None or topk_weights is not None
        if has_topk and token_ids is not None:
            raise AFDTransferMismatchError(
                "A->F payload carries both top-k routing and token_ids; the CAM ids channel "
                "carries one of them: send token_ids only for hash-routed layers, top-k otherwise"
            )
        kind = PayloadKind.HIDDEN
        topk = 0
        ids: Any = None
        scales: Any = None
        mode = IdsChannel.NONE
        token_dtype: str | None = None
        width = 0
        if has_topk:
            if topk_ids is None or topk_weights is None:
                missing = "topk_weights" if topk_weights is None else "topk_ids"
                raise AFDTransferMismatchError(f"top-k routing without {missing}; send both")
            ids_shape, w_shape = _shape(topk_ids), _shape(topk_weights)
            if len(ids_shape) != 2 or ids_shape[0] != n or ids_shape != w_shape:
                raise AFDTransferMismatchError(
                    f"topk_ids {ids_shape} and topk_weights {w_shape} must both be [{n}, top_k]"
                )
            for name, t, want in (
                ("topk_ids", topk_ids, "int32"),
                ("topk_weights", topk_weights, "float32"),
            ):
                if dtype_name(t.dtype) != want:
                    raise AFDTransferMismatchError(
                        f"{name} must be {want} for the CAM ids/scales slots, "
                        f"got {dtype_name(t.dtype)}"
                    )
            kind, topk, mode, width = (
                PayloadKind.HIDDEN_TOPK,
                ids_shape[1],
                IdsChannel.TOPK,
                ids_shape[1],
            )
            ids, scales = self._pack_topk(topk_ids, topk_weights)
        elif token_ids is not None:
            if _shape(token_ids) != (n,):
                raise AFDTransferMismatchError(f"token_ids must be [{n}], got {_shape(token_ids)}")
            token_dtype = dtype_name(token_ids.dtype)
            if token_dtype not in ("int32", "int64"):
                raise AFDTransferMismatchError(
                    f"token_ids must be int32 or int64, got {token_dtype}"
                )
            kind, mode, width = PayloadKind.HIDDEN_TOKEN_IDS, IdsChannel.TOKEN_IDS, token_ids_width
            ids, scales = self._pack_token_ids(token_ids, token_ids_width)
        header = TransferHeader(
            layer_idx=layer_idx,
            micro_batch_idx=micro_batch_idx,
            num_tokens=n,
            hidden_size=hs[1],
            dtype=dtype_name(hidden.dtype),
            kind=kind,
            topk=topk,
        )
        meta = A2EMeta(header, mode, token_dtype, width, sender).encode()
        return A2EMessage(meta, hidden, ids, scales)

    def decode(self, message: A2EMessage) -> tuple[A2EMeta, AttentionToFFN]:
        meta = A2EMeta.decode(message.meta)
        h = meta.header
        hidden = message.hidden_states
        if _shape(hidden) != (h.num_tokens, h.hidden_size) or dtype_name(hidden.dtype) != h.dtype:
            raise AFDTransferMismatchError(
                f"CAM A2E hidden states are {dtype_name(hidden.dtype)} {_shape(hidden)}, the meta "
                f"announced {h.dtype} ({h.num_tokens}, {h.hidden_size})"
            )
        if meta.ids is IdsChannel.NONE:
            return meta, AttentionToFFN(hidden)
        ids, scales = message.ids, message.scales
        if ids is None or scales is None:
            raise AFDTransferMismatchError(
                f"CAM A2E meta announces {meta.ids.name} but the ids/scales slots are empty"
            )
        want = (h.num_tokens, meta.width)
        for name, t, dtype in (("ids", ids, "int32"), ("scales", scales, "float32")):
            if _shape(t) != want or dtype_name(t.dtype) != dtype:
                raise AFDTransferMismatchError(
                    f"CAM A2E {name} slot is {dtype_name(t.dtype)} {_shape(t)}, expected "
                    f"{dtype} {want} for {meta.ids.name}"
                )
        if meta.ids is IdsChannel.TOPK:
            topk_ids, topk_weights = self._unpack_topk(ids, scales)
            return meta, AttentionToFFN(hidden, topk_ids=topk_ids, topk_weights=topk_weights)
        assert meta.token_ids_dtype is not None
        return meta, AttentionToFFN(
            hidden, token_ids=self._unpack_token_ids(ids, meta.token_ids_dtype)
        )

    # -- the slot mappings (overridable, e.g. by a deliberately broken test codec) ---------
    def _pack_topk(self, topk_ids: Any, topk_weights: Any) -> tuple[Any, Any]:
        return topk_ids, topk_weights

    def _unpack_topk(self, ids: Any, scales: Any) -> tuple[Any, Any]:
        return ids, scales

    def _pack_token_ids(self, token_ids: Any, width: int) -> tuple[Any, Any]:
        import torch

        n = int(token_ids.shape[0])
        if n and token_ids.dtype == torch.int64:
            low, high = int(token_ids.min()), int(token_ids.max())
            if low < INT32_MIN or high > INT32_MAX:
                raise AFDTransferMismatchError(
                    f"token_ids range [{low}, {high}] does not fit the int32 CAM ids channel"
                )
        ids = token_ids.to(torch.int32).reshape(n, 1).expand(n, width).contiguous()
        scales = torch.zeros((n, width), dtype=torch.float32, device=token_ids.device)
        return ids, scales

    def _unpack_token_ids(self, ids: Any, dtype: str) -> Any:
        import torch

        if ids.shape[1] > 1 and not torch.equal(ids, ids[:, :1].expand_as(ids)):
            raise AFDTransferMismatchError(
                "CAM ids channel in token-id mode has rows whose columns differ (corrupted ids)"
            )
        return ids[:, 0].to(getattr(torch, dtype)).contiguous()


def encode_e2a(
    result: FFNToAttention, *, layer_idx: int, micro_batch_idx: int, sender: int
) -> E2AMessage:
    """The E2A message of ``result`` (``shared_output`` travels as the second tensor)."""
    result.validate()
    extra = result.shared_output
    header = result.header(layer_idx, micro_batch_idx)
    meta = E2AMeta(header, None if extra is None else dtype_name(extra.dtype), sender)
    return E2AMessage(meta.encode(), result.output, extra)


def decode_e2a(message: E2AMessage) -> tuple[E2AMeta, FFNToAttention]:
    meta = E2AMeta.decode(message.meta)
    h = meta.header
    out = message.output
    if _shape(out) != (h.num_tokens, h.hidden_size) or dtype_name(out.dtype) != h.dtype:
        raise AFDTransferMismatchError(
            f"CAM E2A output is {dtype_name(out.dtype)} {_shape(out)}, the meta announced "
            f"{h.dtype} ({h.num_tokens}, {h.hidden_size})"
        )
    if (h.kind is PayloadKind.OUTPUT_WITH_SHARED) != (message.extra is not None):
        raise AFDTransferMismatchError(
            f"CAM E2A meta says {h.kind.name} but the second tensor is "
            f"{'absent' if message.extra is None else 'present'}"
        )
    return meta, FFNToAttention(out, shared_output=message.extra)
