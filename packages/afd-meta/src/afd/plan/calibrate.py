"""``afd plan --calibrate``: measure this host and fit its :class:`Hardware` figures.

Two measurements, both by the tools that already exist (nothing re-implemented here):

* ``afd bench --profile --modes afd`` on a 1A1F deployment of the given checkpoint at a
  few concurrency levels: the per-layer spans of :mod:`afd.tools.profile` (attention
  block, FFN compute, send / wait, step gap) per level, with the tokens per step;
* ``tools/bench_connector.py`` (a source checkout's tool): the connector's round trip
  at several sizes.

:func:`fit` turns them into figures: per role a fixed per-layer time plus an effective
FLOP rate (least squares over the levels, the rate on a log grid), the exchange's fixed
cost (what the attention waits beyond the FFN's compute, plus its send), the step's
fixed and per-token time outside the layers, and the link's latency and bandwidth. The
1A1F deployment takes turns on every core, so the rates are per core x the host's cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from afd.plan.hardware import PRESETS, Hardware
from afd.plan.shapes import ModelShape

__all__ = ["fit", "measure"]

LEVELS = (1, 4, 16)


def _connector_tool() -> Path | None:
    """``tools/bench_connector.py`` of the source checkout this package runs from."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        tool = parent / "tools" / "bench_connector.py"
        if tool.is_file():
            return tool
    return None


def measure_memory_bw(size_mib: int = 256, repeats: int = 5) -> float:
    """One core's copy bandwidth (bytes read + written per second, best of ``repeats``)."""
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(size_mib * 2**20 // 4)
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        return 2 * src.numel() * 4 / best
    finally:
        torch.set_num_threads(threads)


def measure(model: str, out: Path, levels: Sequence[int] = LEVELS, say: Any = print) -> None:
    """Run the measurements into ``out`` (memory.json, bench/bench.json, connector.json)."""
    out.mkdir(parents=True, exist_ok=True)
    bw = measure_memory_bw()
    say(f"calibrate: one core copies {bw / 1e9:.1f} GB/s")
    (out / "memory.json").write_text(json.dumps({"copy_bw_per_core": bw}), encoding="utf-8")
    bench = [
        *(sys.executable, "-m", "afd.cli", "bench", "--model", model, "--modes", "afd"),
        *("--concurrency", ",".join(map(str, levels)), "--output-len", "64", "--profile"),
        *("--no-plot", "--out", str(out / "bench")),
    ]
    say("calibrate: " + " ".join(bench[2:]))
    subprocess.run(bench, check=True)
    tool = _connector_tool()
    if tool is None:
        say("calibrate: tools/bench_connector.py not found (no source checkout): link kept")
        return
    conn = [sys.executable, str(tool), "--iters", "100", "--connector", "P2pShmAFDConnector"]
    conn += ["--json", str(out / "connector.json")]
    say("calibrate: " + " ".join(conn[1:]))
    subprocess.run(conn, check=True, env={**os.environ})


def _grid_fit(
    points: Sequence[tuple[float, float, float]], bw: float, effs: Sequence[float] = (1.0,)
) -> tuple[float, float, float, float]:
    """Fit ``t = t0 + max(flops / F, bytes / (bw * eff))`` to (flops, bytes, t) points:
    (t0, F, eff, rms error). F on a log grid (1e7 .. 1e11 FLOP/s), eff among ``effs``,
    t0 the mean residual (>= 0). Among equal fits the highest F wins: a block whose
    points are all memory-bound says only that its FLOP rate is at least that high."""
    best = (0.0, 1.0, 1.0, float("inf"))
    for eff in effs:
        for i in range(800, -1, -1):
            rate = 10 ** (7 + i * 0.005)
            roofs = [max(f / rate, b / (bw * eff)) for f, b, _ in points]
            res = [t - r for (_, _, t), r in zip(points, roofs, strict=True)]
            t0 = max(0.0, statistics.fmean(res))
            err = statistics.fmean((t0 - d) ** 2 for d in res)
            if err < best[3] * (1 - 1e-9):
                best = (t0, rate, eff, err)
    return best[0], best[1], best[2], best[3] ** 0.5


def _linear(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` with a, b >= 0."""
    if len(set(xs)) < 2:
        return max(0.0, statistics.fmean(ys)), 0.0
    slope, icept = statistics.linear_regression(xs, ys)
    if slope < 0:
        return max(0.0, statistics.fmean(ys)), 0.0
    return max(0.0, icept), slope


def fit(
    shape: ModelShape, directory: Path, context: float = 48.0, cores: int | None = None
) -> tuple[Hardware, dict[str, Any]]:
    """The host's :class:`Hardware` from :func:`measure`'s results in ``directory``, and
    the fitted points (for the report)."""
    report = json.loads((directory / "bench" / "bench.json").read_text(encoding="utf-8"))
    base = PRESETS["cpu"]
    usable = str(report["settings"].get("usable_cpus") or "")
    if cores is None:
        from afd.launch.cpus import parse_cpu_list

        cores = len(parse_cpu_list(usable)) if usable else base.cores
    levels = report["profile"]["runs"]["1"]["levels"]
    att, ffn, exch, gap = [], [], [], []
    wb, h = shape.weight_bytes, shape.hidden
    for level in levels.values():
        procs = {p["role"]: p for p in level["processes"] if p["steps"]}
        a, f = procs["attention"], procs["ffn"]
        n = max(int(a["exchanges_per_step"]), 1)
        b = float(a["tokens_first_layer_median"])
        ms_a, ms_f = a["ms_per_step"], f["ms_per_step"]
        att.append(
            (
                b * shape.attention_flops_per_token(context) / cores,
                (shape.attention_params * wb + b * context * shape.kv_elems_per_token * 2) / cores,
                ms_a["attention"] / n / 1e3,
            )
        )
        pairs = b * shape.top_k
        from afd.plan.model import experts_hit

        hit = experts_hit(b, shape.experts, shape.top_k)
        ffn.append(
            (
                2.0
                * (pairs * shape.expert_params + b * (shape.shared_params + shape.router_params))
                / cores,
                (hit * shape.expert_params + shape.shared_params + shape.router_params)
                * wb
                / cores,
                ms_f["compute"] / n / 1e3,
            )
        )
        exch.append((b, (ms_a["send"] + ms_a["wait"] - ms_f["compute"]) / n / 1e3))
        gap.append((b, ms_a["step_gap"] / 1e3))
    mem_path = directory / "memory.json"
    bw = base.mem_bw
    if mem_path.is_file():
        bw = float(json.loads(mem_path.read_text(encoding="utf-8"))["copy_bw_per_core"])
    # the FFN reads the experts its tokens chose (more than a cache holds): fit the
    # achieved share of the copy bandwidth there, then the attention with that share
    f0, f_rate, bw_eff, f_err = _grid_fit(ffn, bw, [i / 40 for i in range(1, 41)])
    a0, a_rate, _, a_err = _grid_fit(att, bw, [bw_eff])
    link_bw, link_lat = base.link_bw, base.link_latency_s
    conn_path = directory / "connector.json"
    conn_points: list[tuple[float, float]] = []
    if conn_path.is_file():
        rows = json.loads(conn_path.read_text(encoding="utf-8"))["rows"]
        for r in rows:
            ms = r.get("P2pShmAFDConnector", {}).get("median_ms")
            if ms is not None:
                conn_points.append((float(r["tokens"] * r["hidden"] * 2), ms / 1e3))
        _, slope = _linear([p[0] for p in conn_points], [p[1] for p in conn_points])
        link_bw = 2 / slope if slope > 0 else base.link_bw
        # the latency: the smallest round trip less its bytes (the intercept of the
        # regression is dominated by the largest sizes)
        small_b, small_t = min(conn_points)
        link_lat = max(0.0, (small_t - 2 * small_b / link_bw) / 2)
    # the exchange's fixed cost: what the attention pays per layer beyond the FFN's
    # compute and the link's two transfers
    x = statistics.fmean(
        max(0.0, t - 2 * (link_lat + b * h * shape.act_bytes / link_bw)) for b, t in exch
    )
    head = [
        max(
            2.0 * b * shape.vocab * h / (a_rate * cores),
            shape.vocab * h * wb / (bw * bw_eff * cores),
        )
        for b, _ in gap
    ]
    s0, s1 = _linear([b for b, _ in gap], [t - hd for (_, t), hd in zip(gap, head, strict=True)])
    hw = dataclasses.replace(
        base,
        name="cpu-calibrated",
        flops=a_rate,
        attention_flops_eff=1.0,
        ffn_flops_eff=f_rate / a_rate,
        bw_eff=bw_eff,
        attention_layer_s=a0,
        ffn_layer_s=f0,
        exchange_s=x,
        step_s=s0,
        step_token_s=s1,
        link_bw=link_bw,
        link_latency_s=link_lat,
        mem_bw=bw,
        cores=cores,
        devices_per_node=cores,
        source=f"afd plan --calibrate on this host ({cores} cores), model {shape.name}",
    )
    points = {
        "attention": {"points": att, "layer_s": a0, "flops": a_rate, "rms_s": a_err},
        "ffn": {
            "points": ffn,
            "layer_s": f0,
            "flops": f_rate,
            "bw_eff": bw_eff,
            "rms_s": f_err,
        },
        "exchange": {"points": exch, "exchange_s": x},
        "step_gap": {"points": gap, "step_s": s0, "step_token_s": s1},
        "connector": {"points": conn_points, "latency_s": link_lat, "bw": link_bw},
        "context": context,
        "loadavg": report.get("machine", {}),
    }
    return hw, points
