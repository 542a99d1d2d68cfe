"""Transfer dtypes: the formats hidden states may travel in (``afd.transfer_dtype``,
``afd.transfer_dtype_return``), as wire data.

A transfer dtype other than ``model`` sends a ``[tokens, hidden]`` tensor as 8-bit
elements plus scales, both in one message (:class:`~afd_core.wire.Frame` words 10-11
name the scales; ``docs/architecture.md``, "Payload layout"). This module is the
contract both roles agree on (names, element and scale dtypes, block size) and imports
no tensor library; the codecs are :mod:`afd_core.quantize`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "MX_BLOCK",
    "TRANSFER_DTYPES",
    "TransferFormat",
    "format_of_wire",
    "scale_columns",
    "transfer_format",
]

MX_BLOCK = 32
"""Elements per shared scale of ``mxfp8`` (the OCP MX block size)."""


@dataclass(frozen=True, slots=True)
class TransferFormat:
    """A transfer dtype's layout on the wire."""

    name: str
    element_dtype: str | None
    """Wire dtype name of the elements (``None``: the model dtype, not quantized)."""
    scale_dtype: str | None
    """Wire dtype name of the scales (``None``: no scales)."""
    block: int | None
    """Elements per scale along the row (``None``: one scale per row)."""

    @property
    def quantized(self) -> bool:
        return self.element_dtype is not None


_FORMATS = {
    "model": TransferFormat("model", None, None, None),
    "fp8": TransferFormat("fp8", "float8_e4m3fn", "float32", None),
    "mxfp8": TransferFormat("mxfp8", "float8_e4m3fn", "uint8", MX_BLOCK),
    "int8": TransferFormat("int8", "int8", "float32", None),
}
TRANSFER_DTYPES: tuple[str, ...] = tuple(_FORMATS)
"""The accepted values of ``afd.transfer_dtype`` / ``afd.transfer_dtype_return``."""


def transfer_format(name: str) -> TransferFormat:
    """The format called ``name``; a ValueError naming the accepted values otherwise."""
    try:
        return _FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"transfer dtype {name!r} is not one of {', '.join(TRANSFER_DTYPES)}"
        ) from None


def scale_columns(fmt: TransferFormat, hidden: int) -> int:
    """Scales per row of a ``[tokens, hidden]`` tensor in ``fmt`` (0: not quantized)."""
    if not fmt.quantized:
        return 0
    return 1 if fmt.block is None else math.ceil(hidden / fmt.block)


_BY_WIRE = {(f.element_dtype, f.scale_dtype): f for f in _FORMATS.values() if f.quantized}


def format_of_wire(
    element_dtype: str, scale_dtype: str, columns: int, hidden: int
) -> TransferFormat:
    """The quantized format of a received tensor (element dtype, scale dtype, scale
    columns per row of ``hidden`` elements); ValueError when no format has that layout."""
    fmt = _BY_WIRE.get((element_dtype, scale_dtype))
    if fmt is None or scale_columns(fmt, hidden) != columns:
        raise ValueError(
            f"no transfer dtype sends {element_dtype} elements with {columns} {scale_dtype} "
            f"scales per row of {hidden}; formats: "
            + ", ".join(
                f"{f.name} ({f.element_dtype} + {scale_columns(f, hidden)} {f.scale_dtype})"
                for f in _BY_WIRE.values()
            )
        )
    return fmt
