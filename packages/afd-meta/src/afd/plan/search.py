"""The plan search of ``afd plan``: every layout the launcher accepts within the device
budget, each at the largest batch that fits in memory and meets the TPOT target, ranked
by output tokens per second per device."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from afd.plan.hardware import Hardware
from afd.plan.model import Layout, Prediction, Workload, predict, valid_layout
from afd.plan.shapes import ModelShape

__all__ = ["Constraints", "best_batch", "search"]


@dataclass(frozen=True)
class Constraints:
    #: Largest number of devices (GPU/NPU ranks); a CPU host is one deployment.
    devices: int = 64
    tpot_s: float | None = None
    context: float = 2048
    max_context: float = 0.0
    max_batch: int = 512
    micro_batches: tuple[int, ...] = (1, 2, 3)
    #: Pin any of these to one value (None: searched).
    num_attention: int | None = None
    attention_tp: int | None = None
    num_ffn: int | None = None
    ffn_ep: bool | None = None
    #: Total concurrent requests (pins the batch per attention rank to
    #: concurrency / num_attention).
    concurrency: int | None = None


def _ok(p: Prediction, c: Constraints) -> bool:
    return p.fits and (c.tpot_s is None or p.tpot_s <= c.tpot_s)


def best_batch(
    shape: ModelShape, hw: Hardware, layout: Layout, c: Constraints
) -> Prediction | None:
    """The prediction at the largest batch per attention rank (<= ``max_batch``, >=
    the micro-batches) that fits and meets the TPOT target; None when none does.
    TPOT and memory grow with the batch (tested), so a bisection finds it."""
    work = Workload(batch=0, context=c.context, max_context=c.max_context)
    if c.concurrency is not None:
        p = predict(shape, hw, layout, replace(work, batch=c.concurrency / layout.num_attention))
        return p
    lo = layout.micro_batches
    first = predict(shape, hw, layout, replace(work, batch=lo))
    if not _ok(first, c):
        return None
    hi = c.max_batch
    top = predict(shape, hw, layout, replace(work, batch=hi))
    if _ok(top, c):
        return top
    best = first
    while hi - lo > 1:
        mid = (lo + hi) // 2
        p = predict(shape, hw, layout, replace(work, batch=mid))
        if _ok(p, c):
            lo, best = mid, p
        else:
            hi = mid
    return best


def _layouts(shape: ModelShape, hw: Hardware, c: Constraints) -> Iterable[Layout]:
    tps = [c.attention_tp] if c.attention_tp else [t for t in (1, 2, 4, 8, 16) if t <= c.devices]
    eps = [c.ffn_ep] if c.ffn_ep is not None else [False, True]
    for tp in tps:
        n_as = [c.num_attention] if c.num_attention else range(1, c.devices // tp + 1)
        for na in n_as:
            left = c.devices - na * tp
            n_fs = [c.num_ffn] if c.num_ffn else range(1, max(left, 0) + 1)
            for nf in n_fs:
                if hw.cores <= 0 and na * tp + nf > c.devices:
                    continue
                for ep in eps:
                    for m in c.micro_batches:
                        lay = Layout(na, tp, nf, ep, m, gate_on_attention=ep and hw.cores <= 0)
                        if not valid_layout(shape, hw, lay):
                            yield lay


def search(shape: ModelShape, hw: Hardware, c: Constraints) -> list[Prediction]:
    """Every feasible layout at its best batch, best throughput per device first."""
    found = []
    for lay in _layouts(shape, hw, c):
        p = best_batch(shape, hw, lay, c)
        if p is not None and (c.concurrency is None or _ok(p, c)):
            found.append(p)
    found.sort(key=lambda p: (-p.throughput_per_device, p.layout.devices, p.tpot_s))
    return found
