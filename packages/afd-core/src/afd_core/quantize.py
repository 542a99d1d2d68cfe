"""Low-precision activation transfer: the formats and their codecs (issue 44).

The exchange carries every MoE layer's hidden states twice per step; in a low-precision
*transfer dtype* a sender quantizes a ``[tokens, hidden]`` tensor into 8-bit elements
plus scales, and the receiver dequantizes them back to the model dtype. Formats:

=========  ===============  ==================================  =========================
name       elements         scales                              bytes per token (hidden H)
=========  ===============  ==================================  =========================
``model``  the model dtype  none                                ``H x itemsize``
``fp8``    float8_e4m3fn    one float32 per token: amax / 448   ``H + 4``
``mxfp8``  float8_e4m3fn    one E8M0 (uint8) per 32 elements    ``H + ceil(H / 32)``
``int8``   int8, symmetric  one float32 per token: amax / 127   ``H + 4``
=========  ===============  ==================================  =========================

``mxfp8`` is the OCP Microscaling (MX) layout: blocks of 32 consecutive elements of a row
share a power-of-two scale ``2**e`` stored as E8M0 (the byte ``e + 127``; 255 is NaN), with
``e = floor(log2(amax)) - 8`` (8 = the exponent of float8_e4m3fn's largest normal, 448 =
1.75 x 2**8), clamped to [-127, 127]; the elements are ``x / 2**e`` cast to float8_e4m3fn
with saturation at +-448 (a block whose amax rounds up past 448 after the division
saturates, as the MX spec allows). A row whose length is not a multiple of 32 has a last,
shorter block.

Special rows and blocks, all formats: an all-zero row (block) gets the neutral scale (1.0,
or E8M0 127) and comes back as zeros; a row (block) with an inf or NaN comes back all NaN
(scale NaN, E8M0 255): the receiver never sees a finite value made from a non-finite one.
Rounding is round-to-nearest-even (torch's casts; int8 ``torch.round``).

Error bounds of a round trip (``tests/test_quantize.py`` checks each against an
element-by-element reference): float8_e4m3fn keeps 3 mantissa bits, so an element whose
scaled value is a normal (>= 2**-6) is off by at most 2**-4 of itself, a subnormal by at
most 2**-10 x scale; int8 by at most half a scale (amax / 254). ``mxfp8`` adds the OCP
rule's saturation: a scaled value in [448, 512) becomes 448, off by at most 1/8 of itself
(``fp8`` and ``int8`` scale each row by its own amax and never saturate).

The formats (names, element and scale dtypes, block) are the wire contract
:mod:`afd_core.transfer_dtype`, re-exported here. The codecs live in afd-core because the
exchange protocol (:class:`afd_core.exchange.ExchangeConnector`) applies them to every
transport, below the runners' tensor- and expert-parallel wrappers: torch is imported
inside the functions only (as :mod:`afd_core.tcp_store` does), which only a connector
moving tensors calls, so importing afd-core still imports no torch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from afd_core.transfer_dtype import (
    MX_BLOCK,
    TRANSFER_DTYPES,
    TransferFormat,
    format_of_wire,
    scale_columns,
    transfer_format,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "TRANSFER_DTYPES",
    "MX_BLOCK",
    "FP8_E4M3_MAX",
    "E8M0_BIAS",
    "E8M0_NAN",
    "TransferFormat",
    "transfer_format",
    "format_of_wire",
    "scale_columns",
    "bytes_per_token",
    "quantize",
    "dequantize",
    "encode_message",
    "decode_message",
]

FP8_E4M3_MAX = 448.0
"""The largest finite float8_e4m3fn value."""
_FP8_E4M3_EMAX = 8
"""Exponent of :data:`FP8_E4M3_MAX` (1.75 x 2**8)."""
_INT8_MAX = 127.0
E8M0_BIAS = 127
"""E8M0 stores the exponent ``e`` of ``2**e`` as the byte ``e + 127``."""
E8M0_NAN = 255
"""The E8M0 byte that means NaN."""


_SCALE_BYTES = {"float32": 4, "uint8": 1}


def bytes_per_token(fmt: TransferFormat, hidden: int, model_itemsize: int) -> int:
    """Payload bytes of one row of ``hidden`` elements (elements and scales)."""
    if not fmt.quantized:
        return hidden * model_itemsize
    assert fmt.scale_dtype is not None
    return hidden + scale_columns(fmt, hidden) * _SCALE_BYTES[fmt.scale_dtype]


def quantize(x: torch.Tensor, fmt: TransferFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (``[tokens, hidden]``, any float dtype) as ``fmt``'s elements and scales:
    ``([tokens, hidden]`` element dtype, ``[tokens, scale_columns]`` scale dtype)."""
    import torch

    if not fmt.quantized:
        raise ValueError("transfer dtype 'model' is not quantized")
    if x.dim() != 2:
        raise ValueError(f"quantize takes a [tokens, hidden] tensor, got shape {tuple(x.shape)}")
    x32 = x.float()
    if fmt.block is None:
        amax = x32.abs().amax(dim=1, keepdim=True)
        top = FP8_E4M3_MAX if fmt.element_dtype == "float8_e4m3fn" else _INT8_MAX
        finite = torch.isfinite(amax)
        scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
        scale = torch.where(finite, scale, torch.full_like(amax, math.nan))
        scaled = x32 / scale
        if fmt.element_dtype == "int8":
            q = torch.round(torch.nan_to_num(scaled, nan=0.0)).clamp_(-_INT8_MAX, _INT8_MAX)
            return q.to(torch.int8), scale
        return scaled.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scale
    tokens, hidden = x32.shape
    blocks = math.ceil(hidden / fmt.block)
    padded = torch.nn.functional.pad(x32, (0, blocks * fmt.block - hidden))
    grouped = padded.view(tokens, blocks, fmt.block)
    amax = grouped.abs().amax(dim=2)
    # floor(log2(amax)) exactly: amax = mantissa x 2**e with mantissa in [0.5, 1).
    _, exponent = torch.frexp(amax)
    shared = (exponent - 1 - _FP8_E4M3_EMAX).clamp_(-E8M0_BIAS, E8M0_BIAS)
    shared = torch.where(amax > 0, shared, torch.zeros_like(shared))  # zeros: 2**0
    codes = (shared + E8M0_BIAS).to(torch.int32)
    codes = torch.where(torch.isfinite(amax), codes, torch.full_like(codes, E8M0_NAN))
    scaled = torch.ldexp(grouped, (-shared).unsqueeze(2).to(torch.float32))
    scaled = scaled.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    elements = scaled.view(tokens, blocks * fmt.block)[:, :hidden].contiguous()
    return elements, codes.to(torch.uint8)


def _e8m0_values(codes: torch.Tensor) -> torch.Tensor:
    import torch

    exponent = codes.to(torch.float32) - E8M0_BIAS
    values = torch.exp2(exponent)
    return torch.where(codes == E8M0_NAN, torch.full_like(values, math.nan), values)


def dequantize(
    elements: torch.Tensor, scales: torch.Tensor, fmt: TransferFormat, dtype: torch.dtype
) -> torch.Tensor:
    """The ``[tokens, hidden]`` tensor in ``dtype`` that ``quantize`` encoded."""
    import torch

    if not fmt.quantized:
        raise ValueError("transfer dtype 'model' is not quantized")
    values = elements.to(torch.float32)
    if fmt.block is None:
        return (values * scales.to(torch.float32)).to(dtype)
    hidden = values.shape[1]
    blocks = scales.shape[1]
    factors = _e8m0_values(scales).repeat_interleave(fmt.block, dim=1)[:, :hidden]
    if blocks * fmt.block < hidden:
        raise ValueError(f"mxfp8: {blocks} scales per row cannot cover {hidden} elements")
    return (values * factors).to(dtype)


def encode_message(
    tensors: list[Any], fmt: TransferFormat
) -> tuple[list[Any], tuple[str, str, int]]:
    """A message's tensors (main tensor first, in wire order) with the main tensor in
    ``fmt``: ``[elements, *extras, scales]``, and the frame's encoding words (element
    dtype, scale dtype, scale columns). The extras travel as they are."""
    from afd_core.transfer import dtype_name

    elements, scales = quantize(tensors[0], fmt)
    encoding = (dtype_name(elements.dtype), dtype_name(scales.dtype), int(scales.shape[1]))
    return [elements, *tensors[1:], scales], encoding


def decode_message(tensors: list[Any], fmt: TransferFormat, dtype: str) -> list[Any]:
    """Inverse of :func:`encode_message`: the main tensor dequantized to ``dtype`` (the
    header's, i.e. the model dtype), the scales dropped."""
    import torch

    return [dequantize(tensors[0], tensors[-1], fmt, getattr(torch, dtype)), *tensors[1:-1]]
