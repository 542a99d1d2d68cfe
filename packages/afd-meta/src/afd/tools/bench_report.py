"""``afd bench``'s report: per deployment the median of its repeats, the native
reference per level (the fastest native config), AFD/native ratios, the printed table,
the plot (``bench.png``) and the per-step profile summary (``--profile``)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from afd.tools.bench_plan import MODES, _profile_dir_of

__all__ = [
    "format_repeats",
    "format_table",
    "median_levels",
    "pick_native_reference",
    "plot",
]


def median_levels(repeats: Sequence[dict[str, Any]], levels: Sequence[int]) -> dict[str, Any]:
    """One deployment's results over its repeats: per level, the repeat with the median
    output tok/s (the lower middle one for an even count), plus ``repeats_output_tok_s``
    (every repeat's, in order) when there was more than one."""
    out: dict[str, Any] = {}
    for c in levels:
        runs = [res[str(c)] for res in repeats if str(c) in res]
        if not runs:
            continue
        ranked = sorted(runs, key=lambda lv: lv["output_tok_s"])
        lv = dict(ranked[(len(ranked) - 1) // 2])
        if len(runs) > 1:
            lv["repeats_output_tok_s"] = [x["output_tok_s"] for x in runs]
        out[str(c)] = lv
    return out


def _repeat_ratios(
    by_run: dict[str, list[dict[str, Any]]], levels: Sequence[int], repeat: int
) -> dict[str, Any]:
    """Per level, AFD's best tok/s over native's best tok/s within each repeat, and their
    median (the headline ``ratio_afd_over_native`` divides the per-deployment medians)."""
    out: dict[str, Any] = {"count": repeat, "ratio_afd_over_native": {}, "median": {}}
    for c in levels:
        ratios = []
        for r in range(repeat):
            best: dict[str, float] = {}
            for run, results_of_run in by_run.items():
                lv = results_of_run[r].get(str(c)) if r < len(results_of_run) else None
                if lv is None:
                    continue
                mode = "afd" if run.startswith("afd") else "native"
                best[mode] = max(best.get(mode, 0.0), float(lv["output_tok_s"]))
            if best.get("native") and "afd" in best:
                ratios.append(round(best["afd"] / best["native"], 3))
        if ratios:
            out["ratio_afd_over_native"][str(c)] = ratios
            out["median"][str(c)] = statistics.median_low(ratios)
    return out


def format_repeats(repeats: dict[str, Any]) -> str:
    """``AFD/native tok/s per repeat`` lines of the printed report."""
    lines = [f"AFD/native tok/s in each of {repeats['count']} repeats (best m vs best native):"]
    for c, ratios in repeats["ratio_afd_over_native"].items():
        each = " ".join(f"{x:.2f}" for x in ratios)
        lines.append(f"  c={c}: {each}  (median {repeats['median'][c]:.2f})")
    return "\n".join(lines)


def pick_native_reference(
    configs: dict[str, dict[str, Any]], levels: Sequence[int], *, key: str = "native_config"
) -> tuple[dict[str, Any], dict[str, str]]:
    """The native reference: at each concurrency level, the level result of the config
    with the highest output tok/s (ties: the first config). ``configs``: config name ->
    {level: run_level result}. Returns (results per level, each with ``key``
    (the config name) added; config name per level). Also picks AFD's best
    ``num_micro_batches`` per level."""
    results: dict[str, Any] = {}
    chosen: dict[str, str] = {}
    for c in levels:
        best: str | None = None
        for name, res in configs.items():
            lv = res.get(str(c))
            if lv is None:
                continue
            if best is None or lv["output_tok_s"] > configs[best][str(c)]["output_tok_s"]:
                best = name
        if best is not None:
            results[str(c)] = {**configs[best][str(c)], key: best}
            chosen[str(c)] = best
    return results, chosen


def _ratios(results: dict[str, Any], levels: Sequence[int]) -> dict[str, Any]:
    if "native" not in results or "afd" not in results:
        return {}
    out = {}
    for c in levels:
        n, a = results["native"][str(c)], results["afd"][str(c)]

        def div(x: float | None, y: float | None) -> float | None:
            return round(x / y, 3) if x is not None and y else None

        out[str(c)] = {
            "output_tok_s": div(a["output_tok_s"], n["output_tok_s"]),
            "ttft_median": div(a["ttft_ms"]["median"], n["ttft_ms"]["median"]),
            "tpot_median": div(a["tpot_ms"]["median"], n["tpot_ms"]["median"]),
        }
    return out


def format_table(report: dict[str, Any]) -> str:
    res = report["results"]
    ratio = report["ratio_afd_over_native"]
    configs = report.get("native_configs") or {}
    reference = report.get("native_reference") or {}
    by_m = report.get("afd_micro_batches") or {}
    eager_ratio = report.get("ratio_afd_over_native_eager") or {}
    primary = (report.get("settings", {}).get("afd_modes") or ["compiled"])[0]
    other_afd = {
        mode: run["results"]
        for mode, run in (report.get("afd_modes") or {}).items()
        if mode != primary
    }
    modes = [m for m in MODES if m in res]
    head = ["conc"]
    if "native" in modes and len(configs) > 1:
        head += [f"native {name} tok/s" for name in configs] + ["native ref"]
    if len(by_m) > 1:
        head += [f"afd m={m} tok/s" for m in by_m]
        if ratio:
            head += [f"m={m}/native" for m in by_m]
        head.append("best m")
    for m in modes:
        head += [f"{m} tok/s", f"{m} TTFT ms p50/p99", f"{m} TPOT ms p50/p99"]
    head += [f"afd {mode} tok/s" for mode in other_afd]
    if ratio:
        head += ["AFD/native tok/s", "TPOT ratio"]
    if eager_ratio:
        head.append("AFD/native-eager tok/s")
    rows = [head]
    for c in report["settings"]["concurrency"]:
        row = [str(c)]
        if "native" in modes and len(configs) > 1:
            row += [f"{cf['results'][str(c)]['output_tok_s']:.1f}" for cf in configs.values()]
            row.append(reference.get(str(c), "-"))
        if len(by_m) > 1:
            row += [f"{run['results'][str(c)]['output_tok_s']:.1f}" for run in by_m.values()]
            if ratio:
                row += [
                    _f((run.get("ratio_over_native") or {}).get(str(c), {}).get("output_tok_s"), 2)
                    for run in by_m.values()
                ]
            row.append(str(res.get("afd", {}).get(str(c), {}).get("num_micro_batches", "-")))
        for m in modes:
            lv = res[m][str(c)]
            row += [
                f"{lv['output_tok_s']:.1f}",
                f"{_f(lv['ttft_ms']['median'])}/{_f(lv['ttft_ms']['p99'])}",
                f"{_f(lv['tpot_ms']['median'])}/{_f(lv['tpot_ms']['p99'])}",
            ]
        row += [f"{other[str(c)]['output_tok_s']:.1f}" for other in other_afd.values()]
        if ratio:
            row += [_f(ratio[str(c)]["output_tok_s"], 2), _f(ratio[str(c)]["tpot_median"], 2)]
        if eager_ratio:
            row.append(_f(eager_ratio[str(c)]["output_tok_s"], 2))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def plot(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    levels = report["settings"]["concurrency"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = [
        ("output tok/s", lambda lv: lv["output_tok_s"], None),
        (
            "TTFT ms (p50 solid, p99 dashed)",
            lambda lv: lv["ttft_ms"]["median"],
            lambda lv: lv["ttft_ms"]["p99"],
        ),
        (
            "TPOT ms (p50 solid, p99 dashed)",
            lambda lv: lv["tpot_ms"]["median"],
            lambda lv: lv["tpot_ms"]["p99"],
        ),
    ]
    for ax, (title, get, get99) in zip(axes, panels, strict=True):
        for mode, color in (("native", "tab:blue"), ("afd", "tab:orange")):
            if mode not in res:
                continue
            ys = [get(res[mode][str(c)]) for c in levels]
            by_m = report.get("afd_micro_batches") or {}
            label = "native vLLM (reference)" if mode == "native" else "AFD 1A1F"
            if mode == "afd" and len(by_m) > 1:
                label += " (best m)"
            ax.plot(levels, ys, "o-", color=color, label=label)
            # Throughput panel: every run behind the reference line, dotted.
            variants = (
                {f"AFD m={m}": run for m, run in by_m.items()}
                if mode == "afd"
                else {f"native {n}": cf for n, cf in (report.get("native_configs") or {}).items()}
            )
            if get99 is None and len(variants) > 1:
                for (name, run), marker in zip(variants.items(), "sv^D", strict=False):
                    ax.plot(
                        levels,
                        [get(run["results"][str(c)]) for c in levels],
                        marker + ":",
                        color=color,
                        alpha=0.5,
                        label=name,
                    )
            if get99 is not None:
                ax.plot(
                    levels,
                    [get99(res[mode][str(c)]) for c in levels],
                    "x--",
                    color=color,
                    alpha=0.6,
                )
        ax.set_title(title)
        ax.set_xlabel("concurrency")
        ax.set_xticks(levels)
        ax.grid(alpha=0.3)
    axes[0].legend()
    s = report["settings"]
    fig.suptitle(
        f"AFD 1A1F ({s.get('connector', 'P2pGlooAFDConnector')}) vs native vLLM, "
        f"{Path(s['model']).name}, {s['output_len']} output tokens, "
        f"{report['machine']['cpus']} CPUs"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _startup_ratio(startup: dict[str, float]) -> float | None:
    """AFD's (compiled) start-up over the fastest native compiled start-up of the run."""
    native = [v for k, v in startup.items() if k.startswith("native/") and "/eager" not in k]
    afd = [v for k, v in startup.items() if k.startswith("afd") and not k.endswith("/eager")]
    if not native or not afd or not min(native):
        return None
    return round(afd[0] / min(native), 2)


def _afd(results: dict[str, Any]) -> dict[str, Any]:
    return {"afd": results["afd"]} if "afd" in results else {}


def _profile_report(
    profile_dir: Path,
    windows: dict[int, dict[str, tuple[int, int]]],
    micro_batches: Sequence[int],
    results: dict[str, Any],
    say: Any,
) -> dict[str, Any]:
    """Per AFD run (m) and concurrency level: the deployment's per-step summary (its
    spans inside the level's time window) next to native's median TPOT at that level;
    plus each run's trace, and per level one step of every m drawn on a common axis
    (``step-c<N>.png``)."""
    from afd.tools.profile import format_summary, load_profile, plot_steps, summarize, write_trace

    out: dict[str, Any] = {"dir": str(profile_dir), "levels": {}, "runs": {}}
    profiles = {}
    for m in windows:
        where = _profile_dir_of(profile_dir, m, micro_batches)
        try:
            profiles[m] = load_profile(where)
        except FileNotFoundError as exc:
            say(f"profile (m={m}): {exc}")
            out["runs"][str(m)] = {"error": str(exc)}
            continue
        run: dict[str, Any] = {"trace": str(write_trace(profiles[m], where / "trace.json"))}
        run["levels"] = {}
        for c, window in windows[m].items():
            summary = summarize(profiles[m], window=window)
            native = results.get("native", {}).get(c, {}).get("tpot_ms", {})
            native_tpot = native.get("median") if isinstance(native, dict) else None
            summary["native_tpot_ms_median"] = native_tpot
            summary["window_ns"] = list(window)
            summary["text"] = format_summary(summary, native_step_ms=native_tpot)
            run["levels"][c] = summary
        out["runs"][str(m)] = run
        say(f"profile (m={m}): {run['trace']} (open in https://ui.perfetto.dev)")
    first = next(iter(out["runs"].values()), {})
    out["levels"] = first.get("levels", {})  # the first m's (the only one by default)
    out["trace"] = first.get("trace")
    levels = sorted({c for w in windows.values() for c in w}, key=int)
    for c in levels:
        panels = [
            (f"m={m}", prof, windows[m][c]) for m, prof in profiles.items() if c in windows[m]
        ]
        try:
            png = plot_steps(
                panels,
                profile_dir / f"step-c{c}.png",
                title=f"one decode step of AFD 1A1F at concurrency {c}",
            )
            figure = str(png)
        except (ImportError, ValueError, StopIteration) as exc:
            figure = f"not drawn: {exc}"
        for m in profiles:
            lv = out["runs"][str(m)]["levels"].get(c)
            if lv is not None:
                lv["figure"] = figure
    return out
