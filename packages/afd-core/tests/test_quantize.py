"""afd_core.quantize against an element-by-element reference written from the formats'
definitions (not from the codecs): float8_e4m3fn values enumerated from their bits and
rounded to nearest-even by hand, the E8M0 exponent from ``math.frexp``, int8 by
``round``/clamp in Python floats. Round trips within each format's bound; zero, inf and
NaN rows and blocks; the byte counts."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from afd_core.quantize import (  # noqa: E402
    E8M0_BIAS,
    E8M0_NAN,
    FP8_E4M3_MAX,
    MX_BLOCK,
    TRANSFER_DTYPES,
    bytes_per_token,
    dequantize,
    quantize,
    scale_columns,
    transfer_format,
)


def _e4m3fn_values() -> list[tuple[float, int]]:
    """Every finite float8_e4m3fn value with its byte, decoded from the bit layout (1 sign,
    4 exponent bits of bias 7, 3 mantissa bits; exponent 15 with mantissa 7 is NaN)."""
    out = []
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
        if exponent == 0xF and mantissa == 0x7:
            continue  # NaN
        if exponent == 0:
            value = mantissa / 8 * 2.0**-6
        else:
            value = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
        out.append((sign * value, byte))
    return out


_E4M3 = _e4m3fn_values()


def _round_e4m3(value: float) -> float:
    """Nearest float8_e4m3fn value (ties: the one whose mantissa is even), saturating."""
    if math.isnan(value):
        return math.nan
    value = max(-FP8_E4M3_MAX, min(FP8_E4M3_MAX, value))
    best = min(_E4M3, key=lambda vb: (abs(vb[0] - value), vb[1] & 1))
    return 0.0 if best[0] == 0 else best[0]


def _reference(row: list[float], name: str) -> tuple[list[float], list[float]]:
    """(dequantized row, scales) of one row, by the definitions."""
    if name in ("fp8", "int8"):
        amax = max(abs(v) for v in row)
        if not math.isfinite(amax):
            return [math.nan] * len(row), [math.nan]
        top = FP8_E4M3_MAX if name == "fp8" else 127.0
        scale = amax / top if amax > 0 else 1.0
        scale = float(torch.tensor(scale, dtype=torch.float32))  # stored as float32
        if name == "fp8":
            q = [_round_e4m3(float(torch.tensor(v / scale, dtype=torch.float32))) for v in row]
        else:
            q = [max(-127.0, min(127.0, float(round(v / scale)))) for v in row]
        return [v * scale for v in q], [scale]
    out: list[float] = []
    scales: list[float] = []
    for start in range(0, len(row), MX_BLOCK):
        block = row[start : start + MX_BLOCK]
        amax = max(abs(v) for v in block)
        if not math.isfinite(amax):
            out += [math.nan] * len(block)
            scales.append(E8M0_NAN)
            continue
        e = math.frexp(amax)[1] - 1 - 8 if amax > 0 else 0
        e = max(-127, min(127, e))
        scales.append(e + E8M0_BIAS)
        out += [_round_e4m3(v / 2.0**e) * 2.0**e for v in block]
    return out, scales


def _rows(hidden: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(6, hidden, generator=g) * torch.logspace(-3, 3, 6).unsqueeze(1)
    x[1, ::7] = 0.0  # zeros inside a row
    x[2] = 0.0  # an all-zero row
    x[3, 5] = 1e-30  # a value far below the row's scale (subnormal after scaling)
    return x


@pytest.mark.parametrize("name", ["fp8", "mxfp8", "int8"])
@pytest.mark.parametrize("hidden", [64, 72, 33])
def test_codec_equals_the_reference(name: str, hidden: int) -> None:
    fmt = transfer_format(name)
    x = _rows(hidden)
    elements, scales = quantize(x, fmt)
    assert elements.shape == x.shape
    assert scales.shape == (x.shape[0], scale_columns(fmt, hidden))
    assert str(elements.dtype).removeprefix("torch.") == fmt.element_dtype
    assert str(scales.dtype).removeprefix("torch.") == fmt.scale_dtype
    got = dequantize(elements, scales, fmt, torch.float32)
    for r in range(x.shape[0]):
        want, want_scales = _reference([float(v) for v in x[r]], name)
        assert scales[r].tolist() == pytest.approx(want_scales, rel=0, abs=0), (r, name)
        assert got[r].tolist() == pytest.approx(want, rel=1e-6, abs=0), (r, name)


@pytest.mark.parametrize("name", ["fp8", "mxfp8", "int8"])
def test_round_trip_error_bounds(name: str) -> None:
    fmt = transfer_format(name)
    x = _rows(256)
    elements, scales = quantize(x, fmt)
    back = dequantize(elements, scales, fmt, torch.float32)
    err = (back - x).abs()
    if name == "int8":
        bound = x.abs().amax(dim=1, keepdim=True) / 254 * (1 + 1e-6)
    else:
        # 3 mantissa bits: 2**-4 of a normal value, 2**-10 x the scale below 2**-6 x scale.
        if name == "fp8":
            scale = x.abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX
        else:
            scale = 2.0 ** (scales.float() - E8M0_BIAS).repeat_interleave(MX_BLOCK, dim=1)
        bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
        if name == "mxfp8":  # the OCP rule saturates scaled values in [448, 512): <= 1/8
            bound = torch.maximum(bound, x.abs() - FP8_E4M3_MAX * scale)
            assert bool((bound <= x.abs() / 8 + scale * 2.0**-10).all())
        bound = bound * (1 + 1e-6)
    assert bool((err <= bound).all()), float((err - bound).max())
    # Not trivially loose: the bound is reached within a factor of 4 somewhere.
    assert bool((err * 4 >= bound).any())


def test_e8m0_scale_rule() -> None:
    fmt = transfer_format("mxfp8")
    cases = {448.0: 127, 1.0: 119, 0.75: 118, 2.0**-130: 0, 1e38: 127 + 126 - 8}
    for amax, code in cases.items():
        x = torch.zeros(1, MX_BLOCK)
        x[0, 3] = amax
        _, scales = quantize(x, fmt)
        assert int(scales[0, 0]) == code, (amax, int(scales[0, 0]))
    _, scales = quantize(torch.zeros(1, MX_BLOCK), fmt)
    assert int(scales[0, 0]) == E8M0_BIAS  # an all-zero block: 2**0
    # The largest element after the division saturates at 448 (amax 510 -> e = 0).
    x = torch.full((1, MX_BLOCK), 510.0)
    elements, scales = quantize(x, fmt)
    assert int(scales[0, 0]) == E8M0_BIAS and float(elements[0, 0].float()) == FP8_E4M3_MAX


@pytest.mark.parametrize("name", ["fp8", "mxfp8", "int8"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_rows_come_back_nan_and_zero_rows_zero(name: str, bad: float) -> None:
    fmt = transfer_format(name)
    x = torch.ones(3, 2 * MX_BLOCK)
    x[0, 40] = bad
    x[1] = 0.0
    back = dequantize(*quantize(x, fmt), fmt, torch.bfloat16)
    assert back.dtype == torch.bfloat16
    if fmt.block is None:
        assert bool(back[0].isnan().all())
    else:  # only the block holding it
        assert bool(back[0, MX_BLOCK:].isnan().all())
        assert back[0, :MX_BLOCK].tolist() == [1.0] * MX_BLOCK
    assert back[1].tolist() == [0.0] * (2 * MX_BLOCK)
    assert back[2].tolist() == [1.0] * (2 * MX_BLOCK)


def test_bytes_per_token_and_names() -> None:
    assert TRANSFER_DTYPES == ("model", "fp8", "mxfp8", "int8")
    hidden = 7168
    bf16 = bytes_per_token(transfer_format("model"), hidden, 2)
    assert bf16 == 2 * hidden
    assert bytes_per_token(transfer_format("fp8"), hidden, 2) == hidden + 4
    assert bytes_per_token(transfer_format("int8"), hidden, 2) == hidden + 4
    assert bytes_per_token(transfer_format("mxfp8"), hidden, 2) == hidden + hidden // 32
    for name in ("fp8", "mxfp8"):
        assert bytes_per_token(transfer_format(name), hidden, 2) <= 0.55 * bf16
    with pytest.raises(ValueError, match="'fp4' is not one of model, fp8, mxfp8, int8"):
        transfer_format("fp4")
