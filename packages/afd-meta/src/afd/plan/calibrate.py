"""``afd plan --calibrate``: measure this host and fit its :class:`Hardware` figures.

The measurements (:mod:`afd.plan.measure`, re-exported here), all by the tools that
already exist (nothing re-implemented):

* ``afd bench --profile --modes afd`` on a 1A1F deployment of the given checkpoint at a
  few concurrency levels, twice: placed as the launcher places it (the roles take turns
  on every CPU) and pinned (each role on one CPU of its own): the per-layer spans of
  :mod:`afd.tools.profile` (attention block, FFN compute, send / wait, step gap) per
  level, with the tokens per step;
* ``tools/bench_connector.py`` (a source checkout's tool): the connector's round trip
  at several sizes.

:func:`fit` turns them into figures: from the pinned run, per role a fixed per-layer
time plus an effective FLOP rate per core (least squares over the levels, the rate on a
log grid), the exchange's fixed cost (what the attention waits beyond the FFN's
compute, plus its send) and the step's fixed and per-token time outside the layers;
from the turn-taking run, what each further core adds to a role's block, the exchange's
cost on shared CPUs and the step with the server on every CPU (docs/plan.md, "CPU
hosts"); from the connector, the link's latency and bandwidth.

With ``repeat`` > 1 the whole set of measurements runs that many times, one after the
other, into ``rep-1``, ``rep-2``... of the calibration folder, and :func:`fit` fits the
median of the repeats: per run and concurrency level the median of each span, the median
copy bandwidth and per size the median connector round trip (on a shared VM one
calibration's figures moved up to 2.5x within an hour; a median of repeats is what one
disturbed run cannot move).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from afd.plan.hardware import PRESETS, Hardware
from afd.plan.measure import LEVELS, measure, repeat_dirs
from afd.plan.shapes import ModelShape

__all__ = ["LEVELS", "fit", "measure", "repeat_dirs"]


def _grid_fit(
    points: Sequence[tuple[float, float, float]], bw: float, effs: Sequence[float] = (1.0,)
) -> tuple[float, float, float, float]:
    """Fit ``t = t0 + max(flops / F, bytes / (bw * eff))`` to (flops, bytes, t) points:
    (t0, F, eff, rms error). F on a log grid (1e7 .. 1e11 FLOP/s), eff among ``effs``,
    t0 the median residual (>= 0). Among equal fits the highest F wins: a block whose
    points are all memory-bound says only that its FLOP rate is at least that high."""
    best = (0.0, 1.0, 1.0, float("inf"))
    for eff in effs:
        for i in range(800, -1, -1):
            rate = 10 ** (7 + i * 0.005)
            roofs = [max(f / rate, b / (bw * eff)) for f, b, _ in points]
            res = [t - r for (_, _, t), r in zip(points, roofs, strict=True)]
            # the median residual: a level disturbed by other work does not move it
            t0 = max(0.0, statistics.median(res))
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


@dataclasses.dataclass(frozen=True)
class _Level:
    """One concurrency level of a profiled 1A1F run, per MoE layer (seconds)."""

    batch: float
    attention: float
    ffn: float
    #: what the attention sends and waits beyond the FFN's compute
    exchange: float
    #: the attention's send alone
    send: float
    #: the step outside the layers (per step)
    gap: float


def _levels(path: Path) -> list[_Level]:
    report = json.loads(path.read_text(encoding="utf-8"))
    out = []
    for level in report["profile"]["runs"]["1"]["levels"].values():
        procs = {p["role"]: p for p in level["processes"] if p["steps"]}
        a, f = procs["attention"], procs["ffn"]
        n = max(int(a["exchanges_per_step"]), 1)
        ms_a, ms_f = a["ms_per_step"], f["ms_per_step"]
        out.append(
            _Level(
                batch=float(a["tokens_first_layer_median"]),
                attention=ms_a["attention"] / n / 1e3,
                ffn=ms_f["compute"] / n / 1e3,
                exchange=(ms_a["send"] + ms_a["wait"] - ms_f["compute"]) / n / 1e3,
                send=ms_a["send"] / n / 1e3,
                gap=ms_a["step_gap"] / 1e3,
            )
        )
    return out


def _median_levels(paths: Sequence[Path]) -> list[_Level]:
    """Per concurrency level (in each report's order), the median of every field over the
    reports ``paths`` (the repeats of one run)."""
    runs = [_levels(p) for p in paths]
    count = min(len(r) for r in runs)
    names = [f.name for f in dataclasses.fields(_Level)]
    return [
        _Level(**{n: statistics.median(getattr(r[i], n) for r in runs) for n in names})
        for i in range(count)
    ]


def _run_levels(reps: Sequence[Path], run: str) -> list[_Level]:
    """The median levels of ``run`` (``bench``, ``bench-pinned``, ``bench-crowded``) over
    the repeats that have it (none: no levels)."""
    paths = [p for p in (d / run / "bench.json" for d in reps) if p.is_file()]
    return _median_levels(paths) if paths else []


def _median_connector(reps: Sequence[Path]) -> list[dict[str, Any]]:
    """connector.json's rows with each size's median round trip over the repeats."""
    times: dict[tuple[int, int], list[float]] = {}
    for d in reps:
        path = d / "connector.json"
        if not path.is_file():
            continue
        for r in json.loads(path.read_text(encoding="utf-8"))["rows"]:
            ms = r.get("P2pShmAFDConnector", {}).get("median_ms")
            if ms is not None:
                times.setdefault((int(r["tokens"]), int(r["hidden"])), []).append(float(ms))
    return [
        {"tokens": t, "hidden": h, "P2pShmAFDConnector": {"median_ms": statistics.median(v)}}
        for (t, h), v in sorted(times.items())
    ]


def _attention_work(shape: ModelShape, b: float, context: float) -> tuple[float, float]:
    """(FLOPs, bytes) of one layer's attention block for ``b`` tokens."""
    return (
        b * shape.attention_flops_per_token(context),
        shape.attention_params * shape.weight_bytes + b * context * shape.kv_elems_per_token * 2,
    )


def _ffn_work(shape: ModelShape, b: float) -> tuple[float, float]:
    """(FLOPs, bytes) of one layer's FFN block for ``b`` tokens on the only FFN rank."""
    from afd.plan.model import experts_hit

    pairs = b * shape.top_k
    hit = experts_hit(b, shape.experts, shape.top_k)
    return (
        2.0 * (pairs * shape.expert_params + b * (shape.shared_params + shape.router_params)),
        (hit * shape.expert_params + shape.shared_params + shape.router_params)
        * shape.weight_bytes,
    )


def _thread_fit(
    points: Sequence[tuple[float, float]], t0: float, cores: int
) -> tuple[float, float, float]:
    """Fit ``t = t0 + delta + variable / (1 + eff (cores - 1))`` to (variable time on one
    core, measured time on ``cores``) points: (eff on a grid of 0.01 in [0, 1], delta >=
    0 the median residual: a fixed cost the block pays on shared CPUs, rms error)."""
    best = (1.0, 0.0, float("inf"))
    for i in range(100, -1, -1):
        eff = i / 100
        speed = 1.0 + eff * (cores - 1)
        res = [t - t0 - v / speed for v, t in points]
        delta = max(0.0, statistics.median(res))
        err = statistics.fmean((r - delta) ** 2 for r in res)
        if err < best[2] * (1 - 1e-9):
            best = (eff, delta, err)
    return best[0], best[1], best[2] ** 0.5


def fit(
    shape: ModelShape, directory: Path, context: float = 48.0, cores: int | None = None
) -> tuple[Hardware, dict[str, Any]]:
    """The host's :class:`Hardware` from :func:`measure`'s results in ``directory``, and
    the fitted points (for the report).

    With ``bench-pinned`` (each role on one core of its own) the per-core figures come
    from there, and the turn-taking run (both roles on every core) gives what more
    threads add (``*_thread_eff``), the exchange's cost on shared CPUs and the step with
    the attention server on every core. Without it (one core: no pinned run; or an old
    calibration) everything comes from the turn-taking run, whose rates are taken as
    per core x the cores (linear in the threads). A repeated calibration (``rep-N``
    folders) is fitted on the median of its repeats."""
    reps = repeat_dirs(directory)
    report = json.loads((reps[0] / "bench" / "bench.json").read_text(encoding="utf-8"))
    base = PRESETS["cpu"]
    usable = str(report["settings"].get("usable_cpus") or "")
    if cores is None:
        from afd.launch.cpus import parse_cpu_list

        cores = len(parse_cpu_list(usable)) if usable else base.cores
    turns = _run_levels(reps, "bench")
    pinned = _run_levels(reps, "bench-pinned")
    # the per-core run: pinned, else the turn-taking one with its work spread over the cores
    own, per = (pinned, 1) if pinned else (turns, cores)
    wb, h = shape.weight_bytes, shape.hidden
    att = [
        (f / per, by / per, lv.attention)
        for lv in own
        for f, by in [_attention_work(shape, lv.batch, context)]
    ]
    ffn = [(f / per, by / per, lv.ffn) for lv in own for f, by in [_ffn_work(shape, lv.batch)]]
    bws = [
        float(json.loads(m.read_text(encoding="utf-8"))["copy_bw_per_core"])
        for m in (d / "memory.json" for d in reps)
        if m.is_file()
    ]
    bw = statistics.median(bws) if bws else base.mem_bw
    # the FFN reads the experts its tokens chose (more than a cache holds): fit the
    # achieved share of the copy bandwidth there, then the attention with that share
    f0, f_rate, bw_eff, f_err = _grid_fit(ffn, bw, [i / 40 for i in range(1, 41)])
    a0, a_rate, _, a_err = _grid_fit(att, bw, [bw_eff])
    link_bw, link_lat = base.link_bw, base.link_latency_s
    conn_points: list[tuple[float, float]] = []
    rows = _median_connector(reps)
    if rows:
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

    def exchange(levels: Sequence[_Level]) -> float:
        # what the attention pays per layer beyond the FFN's compute and the link's two
        # transfers (the median over the levels: one level disturbed by other work on the
        # host does not move it)
        return statistics.median(
            max(0.0, lv.exchange - 2 * (link_lat + lv.batch * h * shape.act_bytes / link_bw))
            for lv in levels
        )

    def variable_a(b: float) -> float:
        f, by = _attention_work(shape, b, context)
        return max(f / a_rate, by / (bw * bw_eff))

    def variable_f(b: float) -> float:
        f, by = _ffn_work(shape, b)
        return max(f / f_rate, by / (bw * bw_eff))

    def step(levels: Sequence[_Level], speed: float) -> tuple[float, float]:
        head = [
            max(2.0 * lv.batch * shape.vocab * h / a_rate, shape.vocab * h * wb / (bw * bw_eff))
            / speed
            for lv in levels
        ]
        return _linear(
            [lv.batch for lv in levels], [lv.gap - hd for lv, hd in zip(levels, head, strict=True)]
        )

    x = exchange(own)
    s0, s1 = step(own, float(per))
    figures: dict[str, Any] = {}
    if pinned:
        a_eff, a_delta, a_terr = _thread_fit(
            [(variable_a(lv.batch), lv.attention) for lv in turns], a0, cores
        )
        f_eff, f_delta, f_terr = _thread_fit(
            [(variable_f(lv.batch), lv.ffn) for lv in turns], f0, cores
        )
        shared_x = exchange(turns) + a_delta + f_delta
        t0, t1 = step(turns, 1.0 + a_eff * (cores - 1))
        figures = {
            "attention_thread_eff": a_eff,
            "ffn_thread_eff": f_eff,
            "shared_exchange_s": shared_x,
            "spread_step_s": t0,
            "spread_step_token_s": t1,
        }
        thread_points = {
            "attention": {"eff": a_eff, "shared_fixed_s": a_delta, "rms_s": a_terr},
            "ffn": {"eff": f_eff, "shared_fixed_s": f_delta, "rms_s": f_terr},
        }
        crowd = _run_levels(reps, "bench-crowded")
        if crowd:
            # one thread per role on one CPU: what the blocks take beyond their pinned
            # times, and the exchange, is what crowding costs a layer
            ca = statistics.median(lv.attention - a0 - variable_a(lv.batch) for lv in crowd)
            cf = statistics.median(lv.ffn - f0 - variable_f(lv.batch) for lv in crowd)
            figures["crowded_exchange_s"] = exchange(crowd) + max(0.0, ca) + max(0.0, cf)
            # the attention's own side of it: its send beyond the link's transfer
            figures["crowded_send_s"] = statistics.median(
                max(0.0, lv.send - link_lat - lv.batch * h * shape.act_bytes / link_bw)
                for lv in crowd
            )
            thread_points["crowded"] = {
                "levels": [dataclasses.asdict(lv) for lv in crowd],
                "attention_fixed_s": ca,
                "ffn_fixed_s": cf,
            }
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
        source=f"afd plan --calibrate on this host ({cores} cores"
        + (", pinned and turn-taking 1A1F" if pinned else ", turn-taking 1A1F")
        + (f", median of {len(reps)} repeats" if len(reps) > 1 else "")
        + f"), model {shape.name}",
        **figures,
    )
    points = {
        "per_core_run": "bench-pinned" if pinned else "bench (turns, / cores)",
        "attention": {"points": att, "layer_s": a0, "flops": a_rate, "rms_s": a_err},
        "ffn": {
            "points": ffn,
            "layer_s": f0,
            "flops": f_rate,
            "bw_eff": bw_eff,
            "rms_s": f_err,
        },
        "exchange": {"points": [(lv.batch, lv.exchange) for lv in own], "exchange_s": x},
        "step_gap": {
            "points": [(lv.batch, lv.gap) for lv in own],
            "step_s": s0,
            "step_token_s": s1,
        },
        "connector": {"points": conn_points, "latency_s": link_lat, "bw": link_bw},
        "context": context,
        "repeats": [d.name for d in reps] if len(reps) > 1 else [],
        "loadavg": report.get("machine", {}),
    }
    if pinned:
        points["turns"] = {
            "levels": [dataclasses.asdict(lv) for lv in turns],
            "threads": thread_points,
            **figures,
        }
    return hw, points
