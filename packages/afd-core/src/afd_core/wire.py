"""The frame that precedes every message of the exchange protocol (:mod:`afd_core.exchange`).

A frame is ``FRAME_LEN`` int64 values: the :class:`~afd_core.transfer.TransferHeader`
(``TransferHeader.encode()``, 8 values) followed by words this transport adds:

* ``[8]`` wire dtype code of the auxiliary tensor (router logits, token ids or the
  shared-expert output; 0 when there is none) — the header only names the dtype of
  the main tensor;
* ``[9]`` the sender's global rank (for error messages);
* ``[10:13]`` the main tensor's encoding when it travels in a low-precision transfer
  dtype (:mod:`afd_core.transfer_dtype`; all 0 otherwise): the wire dtype code of its
  elements, the wire dtype code of its scales and the scales per row. The header's
  ``dtype`` stays the dtype the receiver dequantizes to (the model dtype), and the scales
  ``[tokens, columns]`` follow the other tensors, in the same message;
* ``[13:16]`` reserved, 0.

The tensors follow in a fixed order that depends only on the header's kind, so a
receiver allocates every buffer from the frame alone. Empty tensors (zero-token
messages) are not put on the wire at all: both sides know their size is 0.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass, field

from afd_core.errors import AFDTransferMismatchError
from afd_core.transfer import WIRE_DTYPES, PayloadKind, TransferHeader, layout_of

__all__ = ["FRAME_LEN", "Frame", "make_frame", "wire_dtype_code", "dtype_from_code"]

FRAME_LEN = 16
_DTYPE_BY_CODE = {code: name for name, code in WIRE_DTYPES.items()}


def wire_dtype_code(name: str) -> int:
    try:
        return WIRE_DTYPES[name]
    except KeyError:
        raise AFDTransferMismatchError(
            f"dtype {name!r} cannot be sent; wire dtypes: {sorted(WIRE_DTYPES)}"
        ) from None


def dtype_from_code(code: int) -> str:
    try:
        return _DTYPE_BY_CODE[code]
    except KeyError:
        raise AFDTransferMismatchError(f"unknown wire dtype code {code} in frame") from None


@dataclass(frozen=True, slots=True)
class Frame:
    """A decoded frame: the transfer header plus this transport's extra words."""

    header: TransferHeader
    aux_dtype: str | None = None
    sender: int = -1
    encoding: tuple[str, str, int] | None = None
    """(element dtype, scale dtype, scales per row) of a quantized main tensor, or None."""
    words: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """The encoded frame (``FRAME_LEN`` ints), computed once."""
    packed: bytes = field(init=False, repr=False, compare=False)
    """``words`` as little-endian int64 bytes (how a shared-memory slot holds them)."""
    specs: tuple[tuple[tuple[int, ...], str], ...] = field(init=False, repr=False, compare=False)
    """(trailing shape, dtype) of every tensor that follows, in wire order (the header
    kind's :class:`~afd_core.transfer.PayloadLayout`), computed once."""

    def __post_init__(self) -> None:
        specs = layout_of(self.header.kind).specs(self.header, self.aux_dtype)
        encoding = self.encoding
        if encoding is not None:
            elements, scales, columns = encoding
            if columns < 1 or self.header.kind is PayloadKind.SHUTDOWN:
                raise AFDTransferMismatchError(
                    f"frame: a {self.header.kind.name} message with encoding {encoding} "
                    "(a quantized main tensor needs >= 1 scale per row and a layer's payload)"
                )
            specs[0] = (specs[0][0], elements)
            specs.append(((columns,), scales))
        object.__setattr__(self, "specs", tuple(specs))
        words = list(self.header.encode())
        words.append(0 if self.aux_dtype is None else wire_dtype_code(self.aux_dtype))
        words.append(self.sender)
        if encoding is not None:
            words += [wire_dtype_code(encoding[0]), wire_dtype_code(encoding[1]), encoding[2]]
        words.extend([0] * (FRAME_LEN - len(words)))
        object.__setattr__(self, "words", tuple(words))
        object.__setattr__(self, "packed", struct.pack(f"<{FRAME_LEN}q", *words))

    def encode(self) -> list[int]:
        return list(self.words)

    @classmethod
    def decode(cls, values: list[int]) -> Frame:
        if len(values) != FRAME_LEN:
            raise AFDTransferMismatchError(
                f"frame: expected {FRAME_LEN} int64 values, got {len(values)}"
            )
        header = TransferHeader.decode(values[: TransferHeader.WIRE_LEN])
        aux = values[TransferHeader.WIRE_LEN]
        first = TransferHeader.WIRE_LEN + 2
        elements, scales, columns = values[first : first + 3]
        encoding = None
        if elements or scales or columns:
            encoding = (dtype_from_code(elements), dtype_from_code(scales), columns)
        return cls(
            header=header,
            aux_dtype=None if aux == 0 else dtype_from_code(aux),
            sender=values[TransferHeader.WIRE_LEN + 1],
            encoding=encoding,
        )

    @classmethod
    def shutdown(cls, sender: int) -> Frame:
        header = TransferHeader(
            layer_idx=0,
            micro_batch_idx=0,
            num_tokens=0,
            hidden_size=0,
            dtype="float32",
            kind=PayloadKind.SHUTDOWN,
        )
        return cls(header=header, sender=sender)


@functools.lru_cache(maxsize=8192)
def make_frame(
    header: TransferHeader,
    aux_dtype: str | None,
    sender: int,
    encoding: tuple[str, str, int] | None = None,
) -> Frame:
    """A :class:`Frame`, shared between calls with the same values (frames are immutable
    and repeat every step), so the hot path encodes each only once."""
    return Frame(header, aux_dtype, sender, encoding)
