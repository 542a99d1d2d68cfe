"""``afd profile DIR``: merge the spans of an AFD deployment into a trace and a summary.

Run a deployment with ``AFD_PROFILE_DIR=DIR`` in its environment (``afd bench --profile``
does that for the AFD deployment it measures); every AFD process appends its per-layer
spans there (:mod:`afd_core.profiling`). This module merges them:

* ``trace.json``: a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing):
  one track per role process, one slice per span, with layer / micro-batch / tokens;
* a text summary: milliseconds per step by category for each role, the share of each
  role's wall time it spends waiting, and the AFD overhead per MoE layer;
* optionally a PNG of one decode step of both roles on a common time axis.

A *step* is one forward of the model: on each role, the spans of one pass over the AFD
layers (counted at the first AFD layer). Spans in the first ``skip_s`` seconds of each
process (vLLM's profiling run, warm-up) are left out of the summary.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Profile",
    "format_summary",
    "load_profile",
    "plot_step",
    "plot_steps",
    "summarize",
    "write_trace",
]

ATTENTION_CATS = ("attention", "send", "wait", "step_gap")
FFN_CATS = ("recv", "compute", "return")


@dataclass
class ProcessSpans:
    role: str
    rank: int
    pid: int
    offset_ns: int
    """Add to a span's perf_counter_ns to get wall-clock ns (aligns the processes)."""
    spans: list[dict[str, Any]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.role} rank {self.rank} (pid {self.pid})"


@dataclass
class Profile:
    processes: list[ProcessSpans]

    @property
    def start_ns(self) -> int:
        starts = [p.spans[0]["t0"] + p.offset_ns for p in self.processes if p.spans]
        return min(starts) if starts else 0


def load_profile(directory: str | Path) -> Profile:
    """Read every ``*.jsonl`` span file of ``directory`` (see :mod:`afd_core.profiling`)."""
    procs: list[ProcessSpans] = []
    files = sorted(Path(directory).glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(
            f"no span files (*.jsonl) in {directory}; run the deployment with "
            "AFD_PROFILE_DIR set to that folder (e.g. afd bench --profile)"
        )
    for path in files:
        proc: ProcessSpans | None = None
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                line = line.strip()
                if not line:
                    continue
                rec = json.loads(line)
                if rec.get("meta"):
                    proc = ProcessSpans(
                        role=rec["role"],
                        rank=int(rec["rank"]),
                        pid=int(rec["pid"]),
                        offset_ns=int(rec["wall_ns"]) - int(rec["clock_ns"]),
                    )
                    procs.append(proc)
                elif proc is not None:
                    proc.spans.append(rec)
    for p in procs:
        p.spans.sort(key=lambda s: s["t0"])
    return Profile([p for p in procs if p.spans])


def _steps(spans: Sequence[dict[str, Any]], first_cat: str) -> list[list[dict[str, Any]]]:
    """Split a process's spans into steps, a new step at each ``first_cat`` span of the
    lowest layer seen (micro-batch 0)."""
    layers = [s["layer"] for s in spans if s["cat"] == first_cat]
    if not layers:
        return []
    first = min(layers)
    steps: list[list[dict[str, Any]]] = []
    for s in spans:
        if s["cat"] == first_cat and s["layer"] == first and s.get("mb", 0) == 0:
            steps.append([])
        if steps:
            steps[-1].append(s)
    return steps


def _select(p: ProcessSpans, skip_s: float, window: tuple[int, int] | None) -> list[dict[str, Any]]:
    """The spans of ``p`` after its first ``skip_s`` seconds and inside ``window``."""
    t_start = p.spans[0]["t0"] + int(skip_s * 1e9)
    t_end: int | None = None
    if window is not None:
        t_start = max(t_start, window[0] - p.offset_ns)
        t_end = window[1] - p.offset_ns
    return [s for s in p.spans if s["t0"] >= t_start and (t_end is None or s["t1"] <= t_end)]


def summarize(
    profile: Profile, *, skip_s: float = 0.0, window: tuple[int, int] | None = None
) -> dict[str, Any]:
    """Per role process: steps, ms per step by category, busy/wait shares; see module doc.

    ``window``: only spans inside this wall-clock interval (``time.time_ns()`` values),
    e.g. one concurrency level of a benchmark.
    """
    out: dict[str, Any] = {"processes": []}
    for p in profile.processes:
        spans = _select(p, skip_s, window)
        is_attention = p.role == "attention"
        cats = ATTENTION_CATS if is_attention else FFN_CATS
        found = _steps(spans, "send" if is_attention else "recv")
        # Drop the last (possibly cut) step; a step lasts until the next one starts (its
        # last span may reach past that when several micro-batches are in flight).
        steps = found[:-1] if len(found) > 1 else found
        ends = [nxt[0]["t0"] for nxt in found[1:]] or [found[0][-1]["t1"]] if found else []
        per_cat: dict[str, list[float]] = defaultdict(list)
        step_ms: list[float] = []
        layers_per_step: list[int] = []
        tokens_per_step: list[int] = []
        micro_batches = max((int(s.get("mb", 0)) for s in spans), default=0) + 1
        for k, step in enumerate(steps):
            totals = dict.fromkeys(cats, 0.0)
            for s in step:
                if s["cat"] in totals:
                    totals[s["cat"]] += (s["t1"] - s["t0"]) / 1e6
            wall = (ends[k] - step[0]["t0"]) / 1e6
            if is_attention and micro_batches > 1:
                # The micro-batches' threads take turns, so their attention, send and
                # wait spans never overlap; their step gaps do (each covers the others'
                # last layers): count the step gap once, as what the rest leaves.
                busy = totals["attention"] + totals["send"] + totals["wait"]
                totals["step_gap"] = max(0.0, wall - busy)
            for c in cats:
                per_cat[c].append(totals[c])
            step_ms.append(wall)
            first_cat = "send" if is_attention else "recv"
            exchanges = [s for s in step if s["cat"] == first_cat]
            layers_per_step.append(len(exchanges))
            tokens_per_step.append(sum(int(s.get("tokens", 0)) for s in exchanges[:1]))
        n = len(steps)
        entry: dict[str, Any] = {
            "role": p.role,
            "rank": p.rank,
            "pid": p.pid,
            "steps": n,
            "ms_per_step": {c: statistics.fmean(per_cat[c]) if n else 0.0 for c in cats},
            "step_ms_mean": statistics.fmean(step_ms) if n else 0.0,
            "step_ms_median": statistics.median(step_ms) if n else 0.0,
            "exchanges_per_step": statistics.median(layers_per_step) if n else 0,
            "tokens_first_layer_median": statistics.median(tokens_per_step) if n else 0,
            "micro_batches": micro_batches,
        }
        if n:
            waiting = "wait" if is_attention else "recv"
            busy = sum(v for c, v in entry["ms_per_step"].items() if c not in (waiting, "step_gap"))
            entry["busy_ms_per_step"] = busy
            entry["waiting_share"] = entry["ms_per_step"][waiting] / max(
                entry["step_ms_mean"], 1e-9
            )
        out["processes"].append(entry)
    attn = [e for e in out["processes"] if e["role"] == "attention" and e["steps"]]
    ffn = [e for e in out["processes"] if e["role"] == "ffn" and e["steps"]]
    if attn and ffn and attn[0]["micro_batches"] == 1:
        # With several micro-batches the FFN computes one while the attention role waits
        # for another: the difference no longer isolates the exchange's overhead.
        a, f = attn[0], ffn[0]
        layers = max(int(a["exchanges_per_step"]), 1)
        # What the attention role waits for beyond the FFN's own compute: transport,
        # wake-up latency and bookkeeping on both sides, per AFD layer.
        overhead = a["ms_per_step"]["wait"] - f["ms_per_step"]["compute"]
        out["afd_overhead_ms_per_layer"] = overhead / layers
        out["exchanges_per_step"] = layers
    return out


def format_summary(summary: dict[str, Any], native_step_ms: float | None = None) -> str:
    lines = []
    for e in summary["processes"]:
        if not e["steps"]:
            lines.append(f"{e['role']} rank {e['rank']} (pid {e['pid']}): no complete step")
            continue
        cats = "  ".join(f"{c} {v:6.2f}" for c, v in e["ms_per_step"].items())
        lines.append(
            f"{e['role']:>9} rank {e['rank']}: {e['steps']} steps, {e['step_ms_mean']:.2f} "
            f"ms/step (median {e['step_ms_median']:.2f}), {e['exchanges_per_step']:g} "
            f"exchanges/step | ms/step: {cats} | waiting {100 * e['waiting_share']:.0f}%"
        )
    if "afd_overhead_ms_per_layer" in summary:
        lines.append(
            "attention wait - FFN compute = "
            f"{summary['afd_overhead_ms_per_layer']:.3f} ms per AFD layer "
            "(transport, wake-up and bookkeeping)"
        )
    if native_step_ms is not None:
        lines.append(f"native vLLM, same load: {native_step_ms:.2f} ms per decode step (TPOT)")
    return "\n".join(lines)


def write_trace(profile: Profile, path: str | Path) -> Path:
    """Write a Chrome trace (JSON object format) of every span."""
    t0 = profile.start_ns
    events: list[dict[str, Any]] = []
    for pid, p in enumerate(profile.processes, start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": p.label}})
        tids: dict[int, int] = {}
        for s in p.spans:
            tid = tids.setdefault(int(s.get("tid", 0)), len(tids) + 1)
            args = {k: s[k] for k in ("layer", "mb", "tokens") if k in s}
            events.append(
                {
                    "ph": "X",
                    "name": f"{s['cat']} L{s.get('layer', '?')}",
                    "cat": s["cat"],
                    "pid": pid,
                    "tid": tid,
                    "ts": (s["t0"] + p.offset_ns - t0) / 1e3,
                    "dur": max((s["t1"] - s["t0"]) / 1e3, 0.001),
                    "args": args,
                }
            )
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return out


_COLOURS = {
    "attention": "#4C72B0",
    "send": "#DD8452",
    "wait": "#D0D0D0",
    "step_gap": "#F0F0F0",
    "recv": "#D0D0D0",
    "compute": "#55A868",
    "return": "#C44E52",
}


def plot_step(
    profile: Profile,
    path: str | Path,
    *,
    skip_s: float = 0.0,
    title: str = "",
    window: tuple[int, int] | None = None,
) -> Path:
    """A PNG of one steady-state step of attention rank 0 and the FFN spans during it.

    The step shown is the median-length step after ``skip_s`` (inside ``window``, wall
    clock ns, when given).
    """
    return plot_steps([("", profile, window)], path, skip_s=skip_s, title=title)


def _median_step(
    profile: Profile, skip_s: float, window: tuple[int, int] | None
) -> tuple[int, int]:
    """Wall-clock (start, end) ns of the median-length complete step of attention rank 0."""
    attn = next((p for p in profile.processes if p.role == "attention"), None)
    if attn is None:
        raise ValueError("no attention spans to plot")
    steps = _steps(_select(attn, skip_s, window), "send")[:-1]
    if not steps:
        raise ValueError("no complete attention step to plot")
    steps.sort(key=lambda st: st[-1]["t1"] - st[0]["t0"])
    step = steps[len(steps) // 2]
    return step[0]["t0"] + attn.offset_ns, step[-1]["t1"] + attn.offset_ns


def plot_steps(
    panels: Sequence[tuple[str, Profile, tuple[int, int] | None]],
    path: str | Path,
    *,
    skip_s: float = 0.0,
    title: str = "",
) -> Path:
    """A PNG with one panel per ``(label, profile, window)``: the median-length step of
    its attention rank 0 (inside ``window``) and every role's spans during it, all panels
    on one millisecond axis (e.g. the same load at m = 1 and m = 2). A micro-batch other
    than 0 is drawn as a thinner bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not panels:
        raise ValueError("nothing to plot")
    drawn = [(label, prof, _median_step(prof, skip_s, window)) for label, prof, window in panels]
    heights = [
        1.0 + 0.6 * sum(p.role in ("attention", "ffn") for p in prof.processes)
        for _, prof, _ in drawn
    ]
    fig, axes = plt.subplots(
        len(drawn),
        1,
        figsize=(12, 1.2 + sum(heights)),
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    for ax, (label, profile, (w0, w1)) in zip(axes[:, 0], drawn, strict=True):
        rows = [p for p in profile.processes if p.role == "attention"] + [
            p for p in profile.processes if p.role == "ffn"
        ]
        for y, p in enumerate(rows):
            for s in p.spans:
                a, b = s["t0"] + p.offset_ns, s["t1"] + p.offset_ns
                if b < w0 or a > w1:
                    continue
                ax.barh(
                    y,
                    (min(b, w1) - max(a, w0)) / 1e6,
                    left=(max(a, w0) - w0) / 1e6,
                    color=_COLOURS.get(s["cat"], "#999999"),
                    edgecolor="black" if s["cat"] in ("compute", "attention") else "none",
                    linewidth=0.3,
                    height=0.6 if s.get("mb", 0) == 0 else 0.35,
                )
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"{p.role} {p.rank}" for p in rows])
        ax.invert_yaxis()
        step = f"step {(w1 - w0) / 1e6:.2f} ms"
        ax.set_title(f"{label}: {step}" if label else step, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms since the step's first send")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLOURS.values()]
    fig.legend(handles, list(_COLOURS), ncol=7, fontsize=7, loc="lower center")
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def run_profile(args: Any) -> int:
    try:
        profile = load_profile(args.dir)
    except FileNotFoundError as exc:
        print(f"afd profile: error: {exc}", file=sys.stderr)
        return 2
    summary = summarize(profile, skip_s=args.skip_s)
    trace = write_trace(profile, Path(args.dir) / "trace.json")
    (Path(args.dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    print(format_summary(summary))
    print(f"trace: {trace} (open in https://ui.perfetto.dev)")
    if args.plot:
        try:
            print(f"figure: {plot_step(profile, args.plot, skip_s=args.skip_s)}")
        except ValueError as exc:
            print(
                f"afd profile: no figure: {exc} after the first {args.skip_s:g} s of each "
                "process (--skip-s)",
                file=sys.stderr,
            )
            return 1
    return 0


def add_profile_arguments(ap: Any) -> None:
    ap.add_argument("dir", help="the AFD_PROFILE_DIR of a finished run")
    ap.add_argument(
        "--skip-s",
        type=float,
        default=0.0,
        help="leave out each process's first seconds (warm-up, vLLM's profiling run)",
    )
    ap.add_argument("--plot", help="also draw one steady-state step to this PNG")
