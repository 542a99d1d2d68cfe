"""Hardware figures of ``afd plan``: presets and TOML files (:func:`load_hardware`).

One :class:`Hardware` describes one *device* (a GPU, an NPU, or one CPU core of a CPU
host) and the links between devices. The GPU/NPU presets are spec-sheet figures with
stated efficiencies (docs/plan.md); the CPU preset ``cpu`` is a rough default that
``afd plan --calibrate`` replaces with figures measured on the host.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PRESETS", "Hardware", "hardware_toml", "load_hardware"]

GIB = 2**30


@dataclass(frozen=True)
class Hardware:
    """One device and its links. Times in seconds, rates per second, sizes in bytes."""

    name: str
    #: ``gpu``, ``npu`` or ``cpu`` (a CPU host: a *device* is one core, see ``cores``).
    kind: str
    #: Dense peak FLOP/s of one device at 16-bit precision, and at 8-bit (0: no 8-bit).
    flops: float
    mem_bw: float
    mem_bytes: float
    flops_fp8: float = 0.0
    #: Point-to-point bandwidth and latency between an attention and an FFN device,
    #: one direction (the link of the AFD exchange).
    link_bw: float = 50e9
    link_latency_s: float = 10e-6
    #: Bandwidth and latency of the attention TP group's collectives (intra node).
    tp_bw: float = 200e9
    tp_latency_s: float = 10e-6
    #: Achieved fractions of peak: FLOPs of the attention (projections, scores) and of
    #: the FFN's grouped GEMMs, and of memory bandwidth when reading weights / KV.
    attention_flops_eff: float = 0.5
    ffn_flops_eff: float = 0.6
    bw_eff: float = 0.8
    #: Fixed time of one layer's block for one micro-batch on each role (kernel
    #: launches, synchronisation, thread wake-ups), independent of the tokens.
    attention_layer_s: float = 20e-6
    ffn_layer_s: float = 20e-6
    #: Fixed cost of one exchange (A -> F -> A of one layer and micro-batch) beyond
    #: the link's latency and bytes: the hand-over, wake-ups, bookkeeping.
    exchange_s: float = 10e-6
    #: Per decode step outside the layers (scheduler, sampling, detokenising, HTTP):
    #: fixed, and per token of the step.
    step_s: float = 2e-3
    step_token_s: float = 0.0
    #: Memory a process reserves besides weights, KV and AFD buffers (context, graphs,
    #: workspace), and the fraction of ``mem_bytes`` a deployment may use.
    reserve_bytes: float = 4 * GIB
    mem_usable: float = 0.9
    #: Devices per node: the largest attention TP group.
    devices_per_node: int = 8
    #: CPU hosts: how many cores all the role processes share (0 on GPU/NPU, where
    #: every rank has a device of its own). See docs/plan.md, "CPU hosts".
    cores: int = 0
    #: CPU hosts, how a role process's speed depends on where ``afd launch`` places it
    #: (docs/plan.md, "CPU hosts"): what each further core of one process (its OpenMP
    #: threads) adds to a block beyond the block's fixed time, as a share of one core: a
    #: block on e >= 1 cores runs 1 + eff (e - 1) times as fast (1.0: linear).
    attention_thread_eff: float = 1.0
    ffn_thread_eff: float = 1.0
    #: CPU hosts: the exchange's fixed cost per layer when role processes share CPUs (the
    #: waiting role's threads sleep and must be woken and given a CPU the other role has
    #: just used), instead of ``exchange_s`` (each process on CPUs of its own, which are
    #: idle when it is woken). Negative: ``exchange_s``.
    shared_exchange_s: float = -1.0
    #: CPU hosts: the exchange's fixed cost per layer where the role processes outnumber
    #: the CPUs they run on (a woken role also waits for a CPU another process holds),
    #: instead of ``shared_exchange_s``. Negative: ``shared_exchange_s``.
    crowded_exchange_s: float = -1.0
    #: CPU hosts, FFN EP where the role processes outnumber the CPUs: what each further
    #: FFN rank adds to an attention rank's exchange (it serves the ranks' expert planes
    #: in turn): the attention's own side of one crowded exchange, its send (which wakes
    #: a process that takes a CPU). Negative: the whole fixed cost again per FFN rank.
    crowded_send_s: float = -1.0
    #: CPU hosts: the step outside the layers (``step_s`` + ``step_token_s`` x batch) when
    #: the attention server's scheduler and API processes may use several cores; the
    #: ``step_*`` figures are those of an attention server confined to one core.
    #: Negative: the ``step_*`` figures.
    spread_step_s: float = -1.0
    spread_step_token_s: float = -1.0
    #: Where the figures come from (printed with the plans).
    source: str = ""

    def exchange_fixed_s(self, shared: bool, crowded: bool = False) -> float:
        """The exchange's fixed cost: on CPUs shared between role processes or not, and
        where the processes outnumber the CPUs (``crowded``)."""
        if crowded and self.crowded_exchange_s >= 0:
            return self.crowded_exchange_s
        return self.shared_exchange_s if shared and self.shared_exchange_s >= 0 else self.exchange_s

    def peer_exchange_s(self, shared: bool, crowded: bool = False) -> float:
        """What each further FFN rank adds to an attention rank's exchange under FFN EP
        (``crowded_send_s`` where measured and the processes outnumber the CPUs, else
        the whole fixed cost of :meth:`exchange_fixed_s`)."""
        if crowded and self.crowded_send_s >= 0:
            return self.crowded_send_s
        return self.exchange_fixed_s(shared, crowded)

    def step_figures(self, spread: bool) -> tuple[float, float]:
        """(fixed, per token) time of a step outside the layers: with the attention
        server's processes on several cores (``spread``) or on one."""
        if spread and self.spread_step_s >= 0:
            return self.spread_step_s, max(0.0, self.spread_step_token_s)
        return self.step_s, self.step_token_s

    def dense_flops(self, weight_bytes: float) -> float:
        """Peak FLOP/s for weights of ``weight_bytes`` bytes per element."""
        if weight_bytes <= 1 and self.flops_fp8 > 0:
            return self.flops_fp8
        return self.flops


PRESETS: dict[str, Hardware] = {
    h.name.lower(): h
    for h in (
        Hardware(
            name="H100-SXM",
            kind="gpu",
            flops=989e12,
            flops_fp8=1979e12,
            mem_bw=3.35e12,
            mem_bytes=80e9,
            link_bw=50e9,  # one 400 Gb/s NIC per GPU between nodes
            link_latency_s=10e-6,
            tp_bw=450e9,  # NVLink 4, one direction
            source="NVIDIA H100 SXM datasheet (dense bf16 / fp8, HBM3, NVLink 900 GB/s "
            "both directions); 1 x 400 Gb/s NIC per GPU",
        ),
        Hardware(
            name="H800-SXM",
            kind="gpu",
            flops=989e12,
            flops_fp8=1979e12,
            mem_bw=3.35e12,
            mem_bytes=80e9,
            link_bw=50e9,
            link_latency_s=10e-6,
            tp_bw=200e9,  # NVLink cut to 400 GB/s both directions
            source="H800: H100 SXM compute and HBM, NVLink 400 GB/s both directions; "
            "1 x 400 Gb/s NIC per GPU (DeepSeek-V3 report's cluster)",
        ),
        Hardware(
            name="H200-SXM",
            kind="gpu",
            flops=989e12,
            flops_fp8=1979e12,
            mem_bw=4.8e12,
            mem_bytes=141e9,
            link_bw=50e9,
            link_latency_s=10e-6,
            tp_bw=450e9,
            source="NVIDIA H200 SXM datasheet (HBM3e 4.8 TB/s, 141 GB); 1 x 400 Gb/s NIC per GPU",
        ),
        Hardware(
            name="Ascend-A3",
            kind="npu",
            flops=752e12,
            mem_bw=3.2e12,
            mem_bytes=128e9,
            link_bw=196e9,  # unified bus inside a super node, one direction
            link_latency_s=15e-6,
            tp_bw=196e9,
            attention_layer_s=40e-6,
            ffn_layer_s=40e-6,
            devices_per_node=16,
            source="Ascend 910C (Atlas A3) as published by third parties: ~752 TFLOPS "
            "bf16, 128 GB HBM at ~3.2 TB/s, unified-bus links; not vendor-verified",
        ),
        Hardware(
            name="cpu",
            kind="cpu",
            flops=50e9,
            mem_bw=10e9,
            mem_bytes=16 * GIB,
            link_bw=5e9,
            link_latency_s=30e-6,
            tp_bw=5e9,
            tp_latency_s=100e-6,
            attention_flops_eff=1.0,
            ffn_flops_eff=1.0,
            bw_eff=1.0,
            attention_layer_s=0.5e-3,
            ffn_layer_s=0.8e-3,
            exchange_s=0.4e-3,
            step_s=5e-3,
            reserve_bytes=1 * GIB,
            devices_per_node=2,
            cores=2,
            source="a guess for a 2-core host; run afd plan --calibrate to measure",
        ),
    )
}

_FIELDS = {f.name: f for f in dataclasses.fields(Hardware)}


def _from_mapping(data: dict[str, Any], where: str) -> Hardware:
    base_name = data.pop("base", None)
    values: dict[str, Any] = {}
    if base_name is not None:
        base = PRESETS.get(str(base_name).lower())
        if base is None:
            raise ValueError(f"{where}: base = {base_name!r} is no preset ({', '.join(PRESETS)})")
        values = dataclasses.asdict(base)
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(_FIELDS)}"
        )
    values.update(data)
    missing = [
        n
        for n, f in _FIELDS.items()
        if n not in values
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"{where}: missing key(s) {', '.join(missing)} (or base = a preset)")
    return Hardware(**values)


def load_hardware(name_or_path: str) -> Hardware:
    """A preset by name (case-insensitive) or a TOML file of :class:`Hardware`'s fields
    (``base = "H100-SXM"`` starts from a preset and overrides what the file sets)."""
    preset = PRESETS.get(name_or_path.lower())
    if preset is not None:
        return preset
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        names = ", ".join(p.name for p in PRESETS.values())
        raise ValueError(f"hardware {name_or_path!r}: neither a preset ({names}) nor a TOML file")
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    return _from_mapping(dict(data), str(path))


def hardware_toml(hw: Hardware, comment: str = "") -> str:
    """``hw`` as a TOML file :func:`load_hardware` reads back."""
    lines = [f"# {line}" for line in comment.splitlines()] if comment else []
    for f in dataclasses.fields(Hardware):
        value = getattr(hw, f.name)
        if isinstance(value, str):
            lines.append(f"{f.name} = {json.dumps(value)}")
        elif isinstance(value, float):
            lines.append(f"{f.name} = {value!r}")
        else:
            lines.append(f"{f.name} = {value}")
    return "\n".join(lines) + "\n"
