"""Expert-weight contract for FFN-side native MoE compute on Ascend.

A model's FFN adapter exports one :class:`QuantizedExpertWeights` per MoE layer; the
compute implementations consume them. The contract only holds references to tensors
the model already owns: it copies nothing, looks up no native operator and allocates
no workspace, so it can be built and checked on any device (``meta`` included).

Tensor orientation is ``[E, K, N]`` (experts, input features, output features), the
layout grouped-matmul kernels read:

* ``w13`` (gate and up projections fused): ``[E, hidden, 2 * intermediate / pack]``
* ``w2`` (down projection): ``[E, intermediate, hidden / pack]``

``pack`` is 1 except for W4A8, whose int4 values are packed along ``N``: two per
``int8`` element or eight per ``int32`` element. Scales, offsets and biases are indexed
by the unpacked output width ``N``.

Layouts:

* Weights (``w13``, ``w2``) must be contiguous: the kernels read packed storage
  directly and a strided view would silently reinterpret it.
* Scales, offsets and biases may be strided (transposed views, or slices of a larger
  buffer with gaps). Their strides are part of the layer layout, so every layer of a
  model must use the same strides and the strides enter the graph signature. A zero
  stride on a dimension longer than one (a broadcast ``expand``) is rejected: it
  would alias one expert's or channel's scale across others.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from afd_core.errors import AFDConfigError

__all__ = [
    "EXPERT_TENSOR_FIELDS",
    "ExpertWeightsGeometry",
    "ExpertWeightsLayoutError",
    "QuantScheme",
    "QuantizedExpertWeights",
    "TensorLayout",
    "graph_signature",
    "validate_homogeneous_layers",
]

EXPERT_TENSOR_FIELDS: tuple[str, ...] = (
    "w13",
    "w2",
    "w13_scale",
    "w2_scale",
    "w13_offset",
    "w2_offset",
    "w13_bias",
    "w2_bias",
)
"""The tensor fields of :class:`QuantizedExpertWeights`, in a fixed order."""

_SIGNATURE_VERSION = "afd-expert-weights-v1"

# int4 values held by one storage element, per storage dtype.
_INT4_PER_ELEMENT: dict[torch.dtype, int] = {torch.int8: 2, torch.int32: 8}
_FLOAT_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FLOAT_SCALE_DTYPES = (torch.float32, torch.bfloat16)
# Ascend W4A8 kernels take fp32 scale bits widened to int64; unprocessed exports are fp.
_W4A8_SCALE_DTYPES = (torch.int64, torch.float32, torch.bfloat16)
_OFFSET_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ExpertWeightsLayoutError(AFDConfigError):
    """Expert tensors that do not match the declared layer or the model's other layers."""


class QuantScheme(enum.Enum):
    """How one MoE layer's expert weights are stored."""

    BF16 = "bf16"
    """Unquantized floating weights (bf16, fp16 or fp32); no scales."""
    W8A8_DYNAMIC = "w8a8_dynamic"
    """int8 weights with per-output-channel scales; activations quantized per token."""
    W4A8_PER_CHANNEL = "w4a8_per_channel"
    """Packed int4 weights with one scale per output channel."""
    W4A8_PER_GROUP = "w4a8_per_group"
    """Packed int4 weights with one scale per output channel and ``group_size`` inputs."""

    @property
    def is_w4a8(self) -> bool:
        return self in (QuantScheme.W4A8_PER_CHANNEL, QuantScheme.W4A8_PER_GROUP)

    @property
    def is_quantized(self) -> bool:
        return self is not QuantScheme.BF16


@dataclass(frozen=True)
class TensorLayout:
    """What a captured graph depends on for one tensor: shape, strides, dtype."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorLayout:
        return cls(tuple(tensor.shape), tuple(tensor.stride()), _dtype_name(tensor.dtype))


@dataclass(frozen=True, eq=False)
class QuantizedExpertWeights:
    """References to one MoE layer's local expert tensors, validated on construction.

    ``num_local_experts``, ``hidden_size`` and ``intermediate_size`` declare the
    geometry; every tensor is checked against them (see the module docstring for the
    orientation). ``intermediate_size`` is the per-rank expert intermediate width.
    ``group_size`` is the number of input features per scale group (W4A8 per-group
    only; 0 otherwise). ``swiglu_limit`` is the activation clamp applied inside SwiGLU;
    0 means no clamp. Offsets and biases are optional, and each pair (``w13_*`` and
    ``w2_*``) is present or absent together.

    Raises :class:`ExpertWeightsLayoutError` naming the field, what was expected and
    what was found.
    """

    layer_id: int
    scheme: QuantScheme
    num_local_experts: int
    hidden_size: int
    intermediate_size: int
    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w13_offset: torch.Tensor | None = None
    w2_offset: torch.Tensor | None = None
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    group_size: int = 0
    swiglu_limit: float = 0.0

    def __post_init__(self) -> None:
        _LayerValidator(self).run()

    # -- derived views ---------------------------------------------------------------
    @property
    def pack_factor(self) -> int:
        """Weight values per storage element along ``N`` (int4 packing; else 1)."""
        return _INT4_PER_ELEMENT[self.w13.dtype] if self.scheme.is_w4a8 else 1

    @property
    def device(self) -> torch.device:
        return self.w13.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """The present tensors by field name, in :data:`EXPERT_TENSOR_FIELDS` order."""
        present = {name: getattr(self, name) for name in EXPERT_TENSOR_FIELDS}
        return {name: tensor for name, tensor in present.items() if tensor is not None}

    def tensor_layouts(self) -> dict[str, TensorLayout | None]:
        """Layout of every tensor field (``None`` where the field is absent)."""
        result: dict[str, TensorLayout | None] = {}
        for name in EXPERT_TENSOR_FIELDS:
            tensor = getattr(self, name)
            result[name] = None if tensor is None else TensorLayout.of(tensor)
        return result

    def layout_fields(self) -> list[tuple[str, Any]]:
        """Every field that must agree across the layers of one model, in check order."""
        fields: list[tuple[str, Any]] = [
            ("scheme", self.scheme.value),
            ("num_local_experts", self.num_local_experts),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("group_size", self.group_size),
            ("swiglu_limit", _canonical_limit(self.swiglu_limit)),
            ("device", str(self.device)),
        ]
        for name, layout in self.tensor_layouts().items():
            fields.append((name, "absent" if layout is None else "present"))
            if layout is not None:
                fields.append((f"{name}.dtype", layout.dtype))
                fields.append((f"{name}.shape", layout.shape))
                fields.append((f"{name}.stride", layout.stride))
        return fields


@dataclass(frozen=True)
class ExpertWeightsGeometry:
    """The shared geometry of a model's homogeneous expert layers."""

    num_layers: int
    layer_ids: tuple[int, ...]
    num_local_experts: int
    hidden_size: int
    intermediate_size: int
    scheme: QuantScheme
    group_size: int
    weight_dtype: str
    scale_dtype: str | None
    offset_dtype: str | None
    bias_dtype: str | None
    device_type: str


def validate_homogeneous_layers(
    layers: Sequence[QuantizedExpertWeights],
) -> ExpertWeightsGeometry:
    """Check that all of a model's expert layers share one layout; return its geometry.

    Layers keep the given order (it is the slot order of the compute). Layer ids must
    be unique. Every field of :meth:`QuantizedExpertWeights.layout_fields` must equal
    the first layer's; the error names the first differing layer and field.
    """
    if not layers:
        raise ExpertWeightsLayoutError("expert weights: expected at least one layer, got 0")
    seen: dict[int, int] = {}
    for index, layer in enumerate(layers):
        if not isinstance(layer, QuantizedExpertWeights):
            raise ExpertWeightsLayoutError(
                f"expert weights: layers[{index}]: expected QuantizedExpertWeights, "
                f"got {type(layer).__name__}"
            )
        if layer.layer_id in seen:
            raise ExpertWeightsLayoutError(
                f"expert weights: layer_id: expected unique layer ids, got {layer.layer_id} "
                f"at indices {seen[layer.layer_id]} and {index}"
            )
        seen[layer.layer_id] = index
    first = layers[0]
    reference = first.layout_fields()
    for index, layer in enumerate(layers[1:], start=1):
        for (field, expected), (_, got) in zip(reference, layer.layout_fields(), strict=True):
            if expected != got:
                raise ExpertWeightsLayoutError(
                    f"expert weights: layer {layer.layer_id} (index {index}) differs from "
                    f"layer {first.layer_id} in {field}: expected {expected}, got {got}"
                )
    layouts = first.tensor_layouts()
    return ExpertWeightsGeometry(
        num_layers=len(layers),
        layer_ids=tuple(layer.layer_id for layer in layers),
        num_local_experts=first.num_local_experts,
        hidden_size=first.hidden_size,
        intermediate_size=first.intermediate_size,
        scheme=first.scheme,
        group_size=first.group_size,
        weight_dtype=_dtype_name(first.w13.dtype),
        scale_dtype=_layout_dtype(layouts["w13_scale"]),
        offset_dtype=_layout_dtype(layouts["w13_offset"]),
        bias_dtype=_layout_dtype(layouts["w13_bias"]),
        device_type=first.device.type,
    )


def graph_signature(layers: Sequence[QuantizedExpertWeights]) -> str:
    """A stable key for graphs captured over ``layers``.

    It changes with anything a captured graph bakes in: scheme, geometry, layer ids and
    their order, group size, SwiGLU clamp, and every tensor's presence, shape, strides
    and dtype, plus the device type. It ignores tensor values, storage addresses and the
    device index, so equal layouts on ``npu:0`` and ``npu:1`` share a key.
    """
    geometry = validate_homogeneous_layers(layers)
    first = layers[0]
    tensors = {
        name: None if layout is None else [list(layout.shape), list(layout.stride), layout.dtype]
        for name, layout in first.tensor_layouts().items()
    }
    payload = {
        "scheme": geometry.scheme.value,
        "layer_ids": list(geometry.layer_ids),
        "num_local_experts": geometry.num_local_experts,
        "hidden_size": geometry.hidden_size,
        "intermediate_size": geometry.intermediate_size,
        "group_size": geometry.group_size,
        "swiglu_limit": _canonical_limit(first.swiglu_limit),
        "device_type": geometry.device_type,
        "tensors": tensors,
    }
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    return f"{_SIGNATURE_VERSION}:{geometry.scheme.value}:{digest}"


# -- per-layer validation -------------------------------------------------------------
class _LayerValidator:
    """Validation of one layer; every failure is one line naming field/expected/got."""

    def __init__(self, weights: QuantizedExpertWeights) -> None:
        self.w = weights

    def fail(self, field: str, expected: object, got: object) -> NoReturn:
        raise ExpertWeightsLayoutError(
            f"expert weights layer {self.w.layer_id}: {field}: expected {expected}, got {got}"
        )

    def run(self) -> None:
        self.check_scalars()
        self.check_weights()
        self.check_scales()
        self.check_offsets_and_biases()
        self.check_devices()

    def check_scalars(self) -> None:
        w = self.w
        if not isinstance(w.layer_id, int) or isinstance(w.layer_id, bool) or w.layer_id < 0:
            self.fail("layer_id", "a non-negative int", repr(w.layer_id))
        if not isinstance(w.scheme, QuantScheme):
            self.fail("scheme", "a QuantScheme", repr(w.scheme))
        for field in ("num_local_experts", "hidden_size", "intermediate_size"):
            value = getattr(w, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                self.fail(field, "a positive int", repr(value))
        limit = w.swiglu_limit
        if (
            not isinstance(limit, int | float)
            or isinstance(limit, bool)
            or not math.isfinite(limit)
            or limit < 0
        ):
            self.fail("swiglu_limit", "a finite number >= 0 (0 disables the clamp)", repr(limit))
        if w.scheme is QuantScheme.W4A8_PER_GROUP:
            if not isinstance(w.group_size, int) or w.group_size <= 0:
                self.fail("group_size", "a positive int for w4a8_per_group", repr(w.group_size))
            for k_name, k in (
                ("hidden_size", w.hidden_size),
                ("intermediate_size", w.intermediate_size),
            ):
                if k % w.group_size:
                    self.fail(
                        "group_size",
                        f"a divisor of {k_name}={k}",
                        w.group_size,
                    )
        elif w.group_size != 0:
            self.fail("group_size", f"0 for {w.scheme.value}", repr(w.group_size))

    def check_weights(self) -> None:
        w = self.w
        for name in ("w13", "w2"):
            tensor = getattr(w, name)
            if not isinstance(tensor, torch.Tensor):
                self.fail(name, "a torch.Tensor", type(tensor).__name__)
        if w.scheme is QuantScheme.BF16:
            allowed: tuple[torch.dtype, ...] = _FLOAT_WEIGHT_DTYPES
        elif w.scheme is QuantScheme.W8A8_DYNAMIC:
            allowed = (torch.int8,)
        else:
            allowed = tuple(_INT4_PER_ELEMENT)
        if w.w13.dtype not in allowed:
            self.fail(
                "w13.dtype",
                f"one of {_names(allowed)} for {w.scheme.value}",
                _dtype_name(w.w13.dtype),
            )
        if w.w2.dtype != w.w13.dtype:
            self.fail("w2.dtype", f"{_dtype_name(w.w13.dtype)} (as w13)", _dtype_name(w.w2.dtype))
        pack = _INT4_PER_ELEMENT[w.w13.dtype] if w.scheme.is_w4a8 else 1
        e, h, i = w.num_local_experts, w.hidden_size, w.intermediate_size
        for name, k, n in (("w13", h, 2 * i), ("w2", i, h)):
            tensor = getattr(w, name)
            if n % pack:
                self.fail(
                    f"{name}.shape",
                    f"an output width {n} divisible by the int4 packing {pack} "
                    f"of {_dtype_name(tensor.dtype)}",
                    tuple(tensor.shape),
                )
            expected = (e, k, n // pack)
            if tuple(tensor.shape) != expected:
                self.fail(f"{name}.shape", f"{expected} [E, K, N/{pack}]", tuple(tensor.shape))
            if not tensor.is_contiguous():
                self.fail(
                    f"{name}.stride",
                    f"contiguous strides {_contiguous_strides(expected)}",
                    tuple(tensor.stride()),
                )

    def check_scales(self) -> None:
        w = self.w
        if not w.scheme.is_quantized:
            for name in ("w13_scale", "w2_scale"):
                if getattr(w, name) is not None:
                    self.fail(name, "None for bf16 (unquantized) weights", "a tensor")
            return
        allowed = _W4A8_SCALE_DTYPES if w.scheme.is_w4a8 else _FLOAT_SCALE_DTYPES
        e, h, i = w.num_local_experts, w.hidden_size, w.intermediate_size
        for name, k, n in (("w13_scale", h, 2 * i), ("w2_scale", i, h)):
            scale = getattr(w, name)
            if scale is None:
                self.fail(name, f"a scale tensor for {w.scheme.value}", None)
            self.check_tensor_type(name, scale)
            if scale.dtype not in allowed:
                self.fail(f"{name}.dtype", f"one of {_names(allowed)}", _dtype_name(scale.dtype))
            shape = tuple(scale.shape)
            if w.scheme is QuantScheme.W4A8_PER_GROUP:
                accepted: tuple[tuple[int, ...], ...] = ((e, k // w.group_size, n),)
                label = "[E, K/group_size, N] (per-group)"
            elif w.scheme is QuantScheme.W4A8_PER_CHANNEL:
                accepted = ((e, n), (e, 1, n))
                label = "[E, N] or [E, 1, N] (per-channel)"
            else:
                accepted = ((e, n),)
                label = "[E, N] (per-channel)"
            if shape not in accepted:
                self.fail(f"{name}.shape", f"{' or '.join(map(str, accepted))} {label}", shape)
            self.check_strides(name, scale)
        # Per-channel W4A8 may give w13 and w2 scales different ranks ([E, N] next to
        # [E, 1, N] is what Ascend's W4A8 loader produces), but one dtype.
        w13_scale, w2_scale = w.w13_scale, w.w2_scale
        if w13_scale is not None and w2_scale is not None and w2_scale.dtype != w13_scale.dtype:
            self.fail(
                "w2_scale.dtype",
                f"{_dtype_name(w13_scale.dtype)} (as w13_scale)",
                _dtype_name(w2_scale.dtype),
            )

    def check_offsets_and_biases(self) -> None:
        w = self.w
        e, h, i = w.num_local_experts, w.hidden_size, w.intermediate_size
        for kind, allowed in (("offset", _OFFSET_DTYPES), ("bias", _BIAS_DTYPES)):
            pair = ((f"w13_{kind}", 2 * i), (f"w2_{kind}", h))
            present = [name for name, _ in pair if getattr(w, name) is not None]
            if not present:
                continue
            if len(present) == 1:
                absent = next(name for name, _ in pair if name not in present)
                self.fail(absent, f"a tensor because {present[0]} is present", None)
            if kind == "offset" and not w.scheme.is_quantized:
                self.fail(pair[0][0], "None for bf16 (unquantized) weights", "a tensor")
            for name, n in pair:
                tensor = getattr(w, name)
                self.check_tensor_type(name, tensor)
                if tensor.dtype not in allowed:
                    self.fail(
                        f"{name}.dtype", f"one of {_names(allowed)}", _dtype_name(tensor.dtype)
                    )
                if kind == "offset":
                    # Offsets are zero points of the scales: one per scale entry.
                    scale_name = name.replace("offset", "scale")
                    expected_shape = tuple(getattr(w, scale_name).shape)
                    label = f"{expected_shape} (as {scale_name})"
                else:
                    expected_shape = (e, n)
                    label = f"{expected_shape} [E, N]"
                if tuple(tensor.shape) != expected_shape:
                    self.fail(f"{name}.shape", label, tuple(tensor.shape))
                self.check_strides(name, tensor)
            first, second = (getattr(w, name) for name, _ in pair)
            if second.dtype != first.dtype:
                self.fail(
                    f"{pair[1][0]}.dtype",
                    f"{_dtype_name(first.dtype)} (as {pair[0][0]})",
                    _dtype_name(second.dtype),
                )

    def check_devices(self) -> None:
        device = self.w.w13.device
        for name, tensor in self.w.tensors().items():
            if tensor.device != device:
                self.fail(f"{name}.device", f"{device} (as w13)", tensor.device)

    def check_tensor_type(self, name: str, tensor: object) -> None:
        if not isinstance(tensor, torch.Tensor):
            self.fail(name, "a torch.Tensor or None", type(tensor).__name__)

    def check_strides(self, name: str, tensor: torch.Tensor) -> None:
        for dim, (size, stride) in enumerate(zip(tensor.shape, tensor.stride(), strict=True)):
            if size > 1 and stride == 0:
                self.fail(
                    f"{name}.stride",
                    f"a non-zero stride on dim {dim} of size {size} (a broadcast aliases "
                    "one scale across experts or channels; pass a .contiguous() copy)",
                    tuple(tensor.stride()),
                )


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides: list[int] = []
    running = 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def _canonical_limit(limit: float) -> float:
    # float() folds 10 and 10.0 together; "or 0.0" folds -0.0 into 0.0.
    return float(limit) or 0.0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _names(dtypes: Sequence[torch.dtype]) -> str:
    return "{" + ", ".join(_dtype_name(d) for d in dtypes) + "}"


def _layout_dtype(layout: TensorLayout | None) -> str | None:
    return None if layout is None else layout.dtype
