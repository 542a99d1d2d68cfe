"""The Ascend expert-weight contract: per-layer validation, homogeneity, geometry, signature."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from afd_moe_runners.npu.expert_weights import (
    ExpertWeightsGeometry,
    ExpertWeightsLayoutError,
    QuantizedExpertWeights,
    QuantScheme,
    graph_signature,
    validate_homogeneous_layers,
)

E, H, INTER = 4, 64, 32  # local experts, hidden size, intermediate size
GROUP = 16
W4A8_SCHEMES = (QuantScheme.W4A8_PER_CHANNEL, QuantScheme.W4A8_PER_GROUP)
SCALE_LAYOUTS = ("contiguous", "transposed", "gapped")
LAYER_ID_ORDERS = {
    "contiguous": (0, 1, 2),
    "gapped": (1, 4, 9),
    "reversed": (2, 1, 0),
}


# -- builders -----------------------------------------------------------------------
def strided(shape: tuple[int, ...], dtype: torch.dtype, layout: str, seed: int) -> torch.Tensor:
    """A tensor of ``shape`` whose strides follow ``layout``, filled from ``seed``."""
    gen = torch.Generator().manual_seed(seed)

    def fill(s: Sequence[int]) -> torch.Tensor:
        values = torch.rand(tuple(s), generator=gen) * 100
        return values.to(dtype)

    if layout == "contiguous":
        return fill(shape)
    if layout == "transposed":  # the last two dims stored swapped
        return fill((*shape[:-2], shape[-1], shape[-2])).transpose(-1, -2)
    if layout == "gapped":  # a slice of a wider buffer: gaps between rows
        return fill((*shape[:-1], shape[-1] + 8))[..., : shape[-1]]
    raise AssertionError(layout)


def make_layer(
    scheme: QuantScheme = QuantScheme.W4A8_PER_CHANNEL,
    layer_id: int = 0,
    *,
    experts: int = E,
    hidden: int = H,
    intermediate: int = INTER,
    packed: torch.dtype = torch.int32,
    float_dtype: torch.dtype = torch.bfloat16,
    scale_dtype: torch.dtype | None = None,
    scale_layout: str = "contiguous",
    per_channel_rank: int = 2,
    group_size: int | None = None,
    clamp: float = 0.0,
    bias: bool = True,
    offset: bool = False,
    device: str = "cpu",
    seed: int = 0,
    **overrides: Any,
) -> QuantizedExpertWeights:
    """A valid layer of ``scheme``; ``overrides`` replace fields before validation."""
    if scheme is QuantScheme.BF16:
        weight_dtype, pack = float_dtype, 1
    elif scheme is QuantScheme.W8A8_DYNAMIC:
        weight_dtype, pack = torch.int8, 1
    else:
        weight_dtype, pack = packed, {torch.int8: 2, torch.int32: 8}[packed]
    if group_size is None:
        group_size = GROUP if scheme is QuantScheme.W4A8_PER_GROUP else 0
    groups_of = group_size or GROUP  # scale shapes stay buildable for invalid group sizes
    fields: dict[str, Any] = {
        "layer_id": layer_id,
        "scheme": scheme,
        "num_local_experts": experts,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "w13": strided(
            (experts, hidden, 2 * intermediate // pack), weight_dtype, "contiguous", seed
        ),
        "w2": strided(
            (experts, intermediate, hidden // pack), weight_dtype, "contiguous", seed + 1
        ),
        "group_size": group_size,
        "swiglu_limit": clamp,
    }
    widths = {"w13": (hidden, 2 * intermediate), "w2": (intermediate, hidden)}
    if scheme.is_quantized:
        if scale_dtype is None:
            scale_dtype = torch.int64 if scheme.is_w4a8 else torch.float32
        for proj, (k, n) in widths.items():
            if scheme is QuantScheme.W4A8_PER_GROUP:
                shape: tuple[int, ...] = (experts, k // groups_of, n)
            elif scheme is QuantScheme.W4A8_PER_CHANNEL and per_channel_rank == 3:
                shape = (experts, 1, n)
            else:
                shape = (experts, n)
            fields[f"{proj}_scale"] = strided(shape, scale_dtype, scale_layout, seed + 2)
            if offset:
                fields[f"{proj}_offset"] = strided(shape, torch.float32, scale_layout, seed + 3)
    if bias:
        for proj, (_, n) in widths.items():
            fields[f"{proj}_bias"] = strided((experts, n), torch.float32, scale_layout, seed + 4)
    fields.update(overrides)
    tensors = {k: v for k, v in fields.items() if isinstance(v, torch.Tensor)}
    if device != "cpu":
        fields.update({k: v.to(device) for k, v in tensors.items()})
    return QuantizedExpertWeights(**fields)


def make_model(layer_ids: Sequence[int], **kwargs: Any) -> list[QuantizedExpertWeights]:
    return [make_layer(layer_id=lid, seed=10 * lid, **kwargs) for lid in layer_ids]


class _ReportedDevice(torch.Tensor):
    """A CPU tensor that reports another device (same-type, other-index checks)."""

    reported = torch.device("cpu")

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return type(self).reported


def on_reported_device(layer: QuantizedExpertWeights, device: str) -> QuantizedExpertWeights:
    cls = type(
        f"On_{device.replace(':', '_')}", (_ReportedDevice,), {"reported": torch.device(device)}
    )
    moved = {name: t.as_subclass(cls) for name, t in layer.tensors().items()}
    return dataclasses.replace(layer, **moved)


def assert_error(exc: pytest.ExceptionInfo[BaseException], *fragments: str) -> None:
    message = str(exc.value)
    assert "\n" not in message, message
    assert "expected" in message and "got" in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


# -- construction -------------------------------------------------------------------
@pytest.mark.parametrize("scale_layout", SCALE_LAYOUTS)
@pytest.mark.parametrize("scheme", list(QuantScheme))
def test_valid_layer_holds_the_given_tensors_without_copying(
    scheme: QuantScheme, scale_layout: str
) -> None:
    layer = make_layer(scheme, scale_layout=scale_layout, offset=scheme.is_quantized)
    rebuilt = dataclasses.replace(layer)  # validation runs again on the same tensors
    for name, tensor in layer.tensors().items():
        assert getattr(rebuilt, name) is tensor
        assert getattr(rebuilt, name).data_ptr() == tensor.data_ptr()
    expected = {"w13", "w2", "w13_bias", "w2_bias"}
    if scheme.is_quantized:
        expected |= {"w13_scale", "w2_scale", "w13_offset", "w2_offset"}
    assert set(layer.tensors()) == expected


@pytest.mark.parametrize(("packed", "factor"), [(torch.int8, 2), (torch.int32, 8)])
@pytest.mark.parametrize("scheme", W4A8_SCHEMES)
def test_w4a8_weights_are_int4_packed_along_the_output_width(
    scheme: QuantScheme, packed: torch.dtype, factor: int
) -> None:
    layer = make_layer(scheme, packed=packed)
    assert layer.pack_factor == factor
    assert tuple(layer.w13.shape) == (E, H, 2 * INTER // factor)
    assert tuple(layer.w2.shape) == (E, INTER, H // factor)


def test_w4a8_per_channel_accepts_rank_two_w13_scale_next_to_rank_three_w2_scale() -> None:
    # The shapes Ascend's W4A8 loader leaves behind: [E, 2I] and [E, 1, H].
    w2_scale = torch.zeros(E, 1, H, dtype=torch.int64)
    layer = make_layer(QuantScheme.W4A8_PER_CHANNEL, w2_scale=w2_scale)
    assert layer.w2_scale is w2_scale


def test_layers_on_meta_device_validate_without_storage() -> None:
    layer = make_layer(QuantScheme.W4A8_PER_GROUP, device="meta")
    assert layer.device.type == "meta"


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


W4PC, W4PG, W8, BF = (
    QuantScheme.W4A8_PER_CHANNEL,
    QuantScheme.W4A8_PER_GROUP,
    QuantScheme.W8A8_DYNAMIC,
    QuantScheme.BF16,
)

# (case id, scheme, make_layer keyword arguments, fragments the message must contain)
INVALID_LAYERS: list[tuple[str, QuantScheme, dict[str, Any], tuple[str, ...]]] = [
    ("negative layer id", W8, {"layer_id": -1}, ("layer_id", "-1")),
    ("zero experts", W8, {"num_local_experts": 0}, ("num_local_experts", "positive")),
    ("bool hidden size", W8, {"hidden_size": True}, ("hidden_size", "True")),
    ("negative clamp", W8, {"clamp": -1.0}, ("swiglu_limit", "-1.0")),
    ("nan clamp", W8, {"clamp": float("nan")}, ("swiglu_limit", "nan")),
    ("group size on a per-channel scheme", W4PC, {"group_size": 16}, ("group_size", "0 for")),
    ("per-group without a group size", W4PG, {"group_size": 0}, ("group_size", "positive")),
    ("group size not dividing hidden", W4PG, {"group_size": 24}, ("group_size", "hidden_size=64")),
    ("w13 not a tensor", W8, {"w13": [[1]]}, ("w13", "list")),
    ("float weights for w8a8", W8, {"w13": _t(E, H, 2 * INTER)}, ("w13.dtype", "int8", "float32")),
    (
        "w2 dtype differs from w13",
        W4PC,
        {"w2": _t(E, INTER, H // 2, dtype=torch.int8)},
        ("w2.dtype", "int32 (as w13)", "int8"),
    ),
    (
        "w13 expert count wrong",
        W8,
        {"w13": _t(E + 1, H, 2 * INTER, dtype=torch.int8)},
        ("w13.shape", "(4, 64, 64)", "(5, 64, 64)"),
    ),
    (
        "w4a8 w2 not packed",
        W4PC,
        {"w2": _t(E, INTER, H, dtype=torch.int32)},
        ("w2.shape", "(4, 32, 8)", "(4, 32, 64)"),
    ),
    (
        "output width not divisible by the packing",
        W4PC,
        {"hidden": 60, "w2": _t(E, INTER, 7, dtype=torch.int32)},
        ("w2.shape", "divisible by the int4 packing 8"),
    ),
    (
        "transposed w13",
        W8,
        {"w13": _t(E, 2 * INTER, H, dtype=torch.int8).transpose(1, 2)},
        ("w13.stride", "contiguous strides (4096, 64, 1)", "(4096, 1, 64)"),
    ),
    ("missing w8a8 scale", W8, {"w13_scale": None}, ("w13_scale", "a scale tensor", "None")),
    ("scale on bf16 weights", BF, {"w2_scale": _t(E, H)}, ("w2_scale", "None for bf16")),
    (
        "int64 scale for w8a8",
        W8,
        {"w13_scale": _t(E, 2 * INTER, dtype=torch.int64)},
        ("w13_scale.dtype", "float32", "int64"),
    ),
    (
        "w2 scale dtype differs from w13 scale",
        W4PC,
        {"w2_scale": _t(E, H)},
        ("w2_scale.dtype", "int64 (as w13_scale)", "float32"),
    ),
    (
        "per-channel scale on a per-group scheme",
        W4PG,
        {"w13_scale": _t(E, 2 * INTER, dtype=torch.int64)},
        ("w13_scale.shape", "(4, 4, 64)", "per-group", "(4, 64)"),
    ),
    (
        "rank-three scale for w8a8",
        W8,
        {"w2_scale": _t(E, 1, H)},
        ("w2_scale.shape", "(4, 64)", "(4, 1, 64)"),
    ),
    (
        "broadcast scale",
        W8,
        {"w13_scale": _t(1, 2 * INTER).expand(E, 2 * INTER)},
        ("w13_scale.stride", "non-zero stride on dim 0", "(0, 1)"),
    ),
    ("only one bias", W8, {"w2_bias": None}, ("w2_bias", "because w13_bias is present")),
    ("bias shape", W8, {"w13_bias": _t(E, INTER)}, ("w13_bias.shape", "(4, 64)", "(4, 32)")),
    (
        "integer bias",
        W8,
        {"w13_bias": _t(E, 2 * INTER, dtype=torch.int32)},
        ("w13_bias.dtype", "int32"),
    ),
    (
        "bias dtypes differ",
        W8,
        {"w2_bias": _t(E, H, dtype=torch.bfloat16)},
        ("w2_bias.dtype", "float32 (as w13_bias)", "bfloat16"),
    ),
    (
        "offset shape differs from its scale",
        W8,
        {"offset": True, "w2_offset": _t(E, 1, H)},
        ("w2_offset.shape", "(as w2_scale)", "(4, 1, 64)"),
    ),
    ("offsets on bf16", BF, {"w13_offset": _t(E), "w2_offset": _t(E)}, ("w13_offset", "bf16")),
    (
        "scale on another device",
        W8,
        {"w2_scale": torch.zeros(E, H, device="meta")},
        ("w2_scale.device", "cpu (as w13)", "meta"),
    ),
]


@pytest.mark.parametrize(
    ("scheme", "kwargs", "fragments"),
    [case[1:] for case in INVALID_LAYERS],
    ids=[case[0] for case in INVALID_LAYERS],
)
def test_invalid_layer_is_rejected_with_one_line_naming_the_field(
    scheme: QuantScheme, kwargs: dict[str, Any], fragments: tuple[str, ...]
) -> None:
    kwargs = {"layer_id": 7, **kwargs}
    with pytest.raises(ExpertWeightsLayoutError) as exc:
        make_layer(scheme, **kwargs)
    assert_error(exc, f"layer {kwargs['layer_id']}:", *fragments)


def test_a_scheme_that_is_not_a_quant_scheme_is_rejected() -> None:
    layer = make_layer(W8)
    with pytest.raises(ExpertWeightsLayoutError) as exc:
        dataclasses.replace(layer, scheme="w8a8_dynamic")
    assert_error(exc, "scheme", "QuantScheme", "'w8a8_dynamic'")


# -- homogeneity and geometry --------------------------------------------------------
@pytest.mark.parametrize("order", list(LAYER_ID_ORDERS))
def test_homogeneous_layers_yield_their_shared_geometry(order: str) -> None:
    ids = LAYER_ID_ORDERS[order]
    layers = make_model(ids, scheme=W4PG, scale_layout="transposed", clamp=10.0)
    geometry = validate_homogeneous_layers(layers)
    assert geometry == ExpertWeightsGeometry(
        num_layers=3,
        layer_ids=ids,
        num_local_experts=E,
        hidden_size=H,
        intermediate_size=INTER,
        scheme=W4PG,
        group_size=GROUP,
        weight_dtype="int32",
        scale_dtype="int64",
        offset_dtype=None,
        bias_dtype="float32",
        device_type="cpu",
    )


# (case id, scheme of every layer, keyword arguments of the odd layers, field named)
MIXED_LAYERS: list[tuple[str, QuantScheme, dict[str, Any], str]] = [
    ("scheme", W4PC, {"scheme": W8}, "scheme"),
    ("experts", W4PC, {"experts": E * 2}, "num_local_experts"),
    ("intermediate", W4PC, {"intermediate": 2 * INTER}, "intermediate_size"),
    ("group size", W4PG, {"group_size": 32}, "group_size"),
    ("clamp", W4PC, {"clamp": 10.0}, "swiglu_limit"),
    ("device", W4PC, {"device": "meta"}, "device"),
    ("packing dtype", W4PC, {"packed": torch.int8}, "w13.dtype"),
    ("bf16 weight dtype", BF, {"float_dtype": torch.float16}, "w13.dtype"),
    ("scale dtype", W4PC, {"scale_dtype": torch.float32}, "w13_scale.dtype"),
    ("per-channel scale rank", W4PC, {"per_channel_rank": 3}, "w13_scale.shape"),
    ("transposed scales", W4PG, {"scale_layout": "transposed"}, "w13_scale.stride"),
    ("gapped scales", W8, {"scale_layout": "gapped"}, "w13_scale.stride"),
    ("bias presence", W4PC, {"bias": False}, "w13_bias"),
    ("offset presence", W8, {"offset": True}, "w13_offset"),
]


@pytest.mark.parametrize(
    ("scheme", "odd", "field"),
    [case[1:] for case in MIXED_LAYERS],
    ids=[c[0] for c in MIXED_LAYERS],
)
def test_mixed_layers_are_rejected_naming_the_first_differing_layer_and_field(
    scheme: QuantScheme, odd: dict[str, Any], field: str
) -> None:
    base: dict[str, Any] = {"scheme": scheme}
    odd = {**base, **odd}
    layers = [
        make_layer(layer_id=3, **base),
        make_layer(layer_id=5, **base),
        make_layer(layer_id=8, **odd),
        make_layer(layer_id=9, **odd),
    ]
    with pytest.raises(ExpertWeightsLayoutError) as exc:
        validate_homogeneous_layers(layers)
    assert_error(exc, "layer 8 (index 2)", "layer 3", f" in {field}:")


def test_no_layers_is_rejected() -> None:
    with pytest.raises(ExpertWeightsLayoutError) as exc:
        validate_homogeneous_layers([])
    assert_error(exc, "at least one layer", "got 0")


def test_duplicate_layer_ids_are_rejected() -> None:
    with pytest.raises(ExpertWeightsLayoutError) as exc:
        validate_homogeneous_layers(make_model((4, 6, 4)))
    assert_error(exc, "layer_id", "unique", "got 4 at indices 0 and 2")


def test_a_non_contract_layer_is_rejected() -> None:
    with pytest.raises(ExpertWeightsLayoutError) as exc:
        validate_homogeneous_layers([make_layer(), {"w13": None}])  # type: ignore[list-item]
    assert_error(exc, "layers[1]", "QuantizedExpertWeights", "dict")


# -- graph signature -----------------------------------------------------------------
SignatureFn = Callable[[Sequence[QuantizedExpertWeights]], str]


def signature_matrix() -> dict[tuple[Any, ...], dict[str, Any]]:
    """Every combination the graph signature must tell apart."""
    configs: dict[tuple[Any, ...], dict[str, Any]] = {}
    for scheme in (W4PC, W4PG, W8, BF):
        layouts = SCALE_LAYOUTS if scheme.is_quantized else ("contiguous",)
        for clamp, order, layout in itertools.product((0.0, 10.0), LAYER_ID_ORDERS, layouts):
            configs[(scheme.value, clamp, order, layout)] = {
                "ids": LAYER_ID_ORDERS[order],
                "scheme": scheme,
                "clamp": clamp,
                "scale_layout": layout,
            }
    base = {"ids": (0, 1), "scheme": W4PG, "clamp": 0.0, "scale_layout": "contiguous"}
    for name, change in {
        "experts": {"experts": 8},
        "hidden": {"hidden": 128},
        "intermediate": {"intermediate": 64},
        "group": {"group_size": 32},
        "int8 packing": {"packed": torch.int8},
        "float32 scales": {"scale_dtype": torch.float32},
        "no bias": {"bias": False},
        "offsets": {"offset": True},
        "more layers": {"ids": (0, 1, 2, 3)},
        "meta device": {"device": "meta"},
        "base": {},
    }.items():
        configs[("variant", name)] = {**base, **change}
    configs[("per-channel rank",)] = {**base, "scheme": W4PC, "per_channel_rank": 3}
    return configs


def build(config: dict[str, Any], seed_offset: int = 0) -> list[QuantizedExpertWeights]:
    kwargs = dict(config)
    ids = kwargs.pop("ids")
    return [make_layer(layer_id=lid, seed=seed_offset + 10 * lid, **kwargs) for lid in ids]


def assert_signature_separates_layouts(signature: SignatureFn) -> None:
    seen: dict[str, tuple[Any, ...]] = {}
    for key, config in signature_matrix().items():
        value = signature(build(config))
        assert value not in seen, f"{key} and {seen.get(value)} share signature {value}"
        seen[value] = key


def assert_signature_ignores_values_and_device_index(signature: SignatureFn) -> None:
    for key, config in signature_matrix().items():
        if config.get("device") == "meta":
            continue
        first, second = build(config), build(config, seed_offset=1000)
        assert signature(first) == signature(second), key
        on_0 = [on_reported_device(layer, "cuda:0") for layer in first]
        on_1 = [on_reported_device(layer, "cuda:1") for layer in second]
        assert signature(on_0) == signature(on_1), key


def test_graph_signature_changes_with_every_layout_that_changes_a_graph() -> None:
    assert_signature_separates_layouts(graph_signature)


def test_graph_signature_ignores_tensor_values_and_device_index() -> None:
    assert_signature_ignores_values_and_device_index(graph_signature)


def test_geometry_is_equal_wherever_only_values_clamp_or_strides_differ() -> None:
    plain = make_model((0, 1), scheme=W8)
    other = [
        make_layer(W8, layer_id=lid, clamp=10.0, scale_layout="gapped", seed=99 + lid)
        for lid in (0, 1)
    ]
    assert validate_homogeneous_layers(plain) == validate_homogeneous_layers(other)
    assert graph_signature(plain) != graph_signature(other)


def test_graph_signature_treats_equal_clamps_as_equal() -> None:
    as_int = graph_signature(make_model((0,), clamp=10))
    as_float = graph_signature(make_model((0,), clamp=10.0))
    assert as_int == as_float
    assert graph_signature(make_model((0,), clamp=-0.0)) == graph_signature(make_model((0,)))


PINNED_SIGNATURE = (
    "afd-expert-weights-v1:w4a8_per_channel:"
    "21f26a4d0bfc88d3dfe0e24433ec30286566fc00d83746813ca7779d922e04e1"
)


def test_graph_signature_is_pinned() -> None:
    # Captured-graph caches are keyed on this string: change it only on purpose.
    value = graph_signature(make_model((2, 5), scheme=W4PC, clamp=10.0))
    assert value == PINNED_SIGNATURE


def test_graph_signature_validates_homogeneity_first() -> None:
    with pytest.raises(ExpertWeightsLayoutError, match="swiglu_limit"):
        graph_signature([make_layer(layer_id=0), make_layer(layer_id=1, clamp=10.0)])


# -- the checks above catch broken signatures ----------------------------------------
def _signature_ignoring_clamp(layers: Sequence[QuantizedExpertWeights]) -> str:
    return graph_signature([dataclasses.replace(layer, swiglu_limit=0.0) for layer in layers])


def _signature_ignoring_strides(layers: Sequence[QuantizedExpertWeights]) -> str:
    contiguous = [
        dataclasses.replace(
            layer,
            **{n: t.contiguous() for n, t in layer.tensors().items()},
        )
        for layer in layers
    ]
    return graph_signature(contiguous)


def _signature_with_device_index(layers: Sequence[QuantizedExpertWeights]) -> str:
    return graph_signature(layers) + str(layers[0].device)


@pytest.mark.parametrize("broken", [_signature_ignoring_clamp, _signature_ignoring_strides])
def test_a_signature_that_ignores_part_of_the_layout_fails_the_separation_check(
    broken: SignatureFn,
) -> None:
    with pytest.raises(AssertionError, match="share signature"):
        assert_signature_separates_layouts(broken)


def test_a_signature_that_includes_the_device_index_fails_the_stability_check() -> None:
    with pytest.raises(AssertionError):
        assert_signature_ignores_values_and_device_index(_signature_with_device_index)
