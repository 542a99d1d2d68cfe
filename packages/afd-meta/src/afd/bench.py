"""``afd bench``: AFD (1 Attention + 1 FFN) against native colocated vLLM, same machine.

The same workload runs against a native vLLM API server and then against an AFD
1A1F deployment (never both at once), each with the same engine arguments: for
every concurrency level, ``requests`` streaming greedy completions of the fixed
prompts (``output_len`` tokens each, ``ignore_eos``) are sent by ``concurrency``
client threads. Per request the client records TTFT (time to the first streamed
token) and TPOT ((latency - TTFT) / (tokens - 1), as vLLM's serving benchmark); per
level it reports
output throughput (tokens / wall time), TTFT and TPOT median and p99, and the
AFD/native ratio. Results go to ``<out>/bench.json`` and ``<out>/bench.png``.

Cores: on a CPU host the launcher gives the AFD roles their own cores (see
:func:`afd.launch.split_cpus`). The native baseline runs once per ``--native-configs``
entry: ``all-cores`` (``VLLM_CPU_OMP_THREADS_BIND`` = every usable CPU) and ``auto``
(vLLM's default binding), and per ``--native-modes`` entry: ``compiled`` (vLLM's
default compile mode) and ``eager`` (``--enforce-eager``; config names end in
``/eager``); at each concurrency level the fastest of them (higher output tok/s) is
the reference of the AFD/native ratios (:func:`pick_native_reference`). AFD runs in
each ``--afd-modes`` entry (default ``compiled``); the first one is AFD's result. The
report also gives AFD's ratio against the best *eager* native run
(``ratio_afd_over_native_eager``), the baseline of the ratios published before AFD
ran compiled.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from afd import bench_metrics
from afd.demo import cache_dir, ensure_tiny_model, served_model
from afd.launch import (
    Deployment,
    DeploymentError,
    DeploymentSpec,
    RoleOverrides,
    add_cpu_arguments,
    detect_cuda_devices,
    format_cpu_list,
    forward_signals,
    usable_cpus,
)
from afd_core.profiling import PROFILE_DIR_ENV

__all__ = [
    "NATIVE_CONFIGS",
    "RequestResult",
    "native_config_cpus",
    "percentile",
    "pick_native_reference",
    "run_bench",
    "run_level",
    "stream_completion",
]

MODES = ("native", "afd")
NATIVE_CONFIGS = ("all-cores", "auto")
"""Native baselines: bound to every usable CPU, and vLLM's default binding."""
COMPILE_MODES = ("compiled", "eager")
"""vLLM's default compile mode, and ``--enforce-eager``."""
EAGER_SUFFIX = "/eager"


@dataclass
class RequestResult:
    ttft_s: float
    tpot_s: float | None
    latency_s: float
    output_tokens: int
    error: str | None = None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def stream_completion(
    base_url: str, model: str, prompt: str, max_tokens: int, timeout: float = 600.0
) -> RequestResult:
    """One streaming greedy completion; token timing from the server-sent events."""
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    first = None
    chunks = 0
    usage_tokens = None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                if obj.get("choices") and obj["choices"][0].get("text") is not None:
                    now = time.perf_counter()
                    if obj["choices"][0].get("text") == "" and not obj["choices"][0].get(
                        "finish_reason"
                    ):
                        continue
                    first = first if first is not None else now
                    chunks += 1
    except Exception as exc:
        end = time.perf_counter()
        return RequestResult(math.nan, None, end - t0, 0, f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    n = int(usage_tokens) if usage_tokens is not None else chunks
    if first is None:
        return RequestResult(math.nan, None, end - t0, n, "no tokens streamed")
    # TPOT as in vLLM's serving benchmark: (latency - TTFT) / (output tokens - 1).
    tpot = (end - first) / (n - 1) if n > 1 else None
    return RequestResult(first - t0, tpot, end - t0, n)


def run_level(
    base_url: str,
    prompts: Sequence[str],
    concurrency: int,
    num_requests: int,
    output_len: int,
    *,
    on_done: Any = None,
) -> dict[str, Any]:
    """``num_requests`` streaming requests, ``concurrency`` at a time; summary stats."""
    model = served_model(base_url)
    results: list[RequestResult] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        r = stream_completion(base_url, model, prompts[i % len(prompts)], output_len)
        with lock:
            results.append(r)
        if on_done is not None:
            on_done()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(one, range(num_requests)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft_s for r in ok]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    ms = 1000.0
    return {
        "concurrency": concurrency,
        "requests": num_requests,
        "completed": len(ok),
        "errors": errors[:5],
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "output_tok_s": round(tokens / wall, 2) if wall > 0 else 0.0,
        "ttft_ms": {
            "median": _r(statistics.median(ttft) * ms if ttft else math.nan),
            "p99": _r(percentile(ttft, 99) * ms),
        },
        "tpot_ms": {
            "median": _r(statistics.median(tpot) * ms if tpot else math.nan),
            "p99": _r(percentile(tpot, 99) * ms),
        },
        "per_request": [asdict(r) for r in results],
    }


def _r(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 2)


def native_config_cpus(config: str, cpus: Sequence[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` of a native config: ``all-cores`` -> every CPU of
    ``cpus`` (``"0-N"``), ``auto`` -> ``"auto"`` (vLLM's default binding); an eager
    config (``auto/eager``) binds as its compiled twin."""
    config = config.removesuffix(EAGER_SUFFIX)
    if config == "all-cores":
        return format_cpu_list(cpus)
    if config == "auto":
        return "auto"
    raise ValueError(f"native config: expected one of {', '.join(NATIVE_CONFIGS)}, got {config!r}")


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
    from afd.profile import format_summary, load_profile, plot_steps, summarize, write_trace

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


# --------------------------------------------------------------------------- CLI


def add_bench_arguments(ap: Any) -> None:
    ap.add_argument(
        "--model",
        help="checkpoint (default: the tiny DeepSeek-V2, generated "
        "under $AFD_CACHE_DIR or ~/.cache/afd)",
    )
    ap.add_argument("--cache-dir", help="where the tiny checkpoint lives")
    ap.add_argument(
        "--concurrency", default="1,4,8", help="comma-separated concurrency levels (default 1,4,8)"
    )
    ap.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    ap.add_argument(
        "--requests",
        type=int,
        default=0,
        help="requests per level (default: max(8, 4 x concurrency))",
    )
    ap.add_argument("--modes", default="native,afd", help="which servers: native,afd")
    ap.add_argument(
        "--native-configs",
        default=",".join(NATIVE_CONFIGS),
        help="native baselines to measure (default all-cores,auto): all-cores = "
        "VLLM_CPU_OMP_THREADS_BIND on every usable CPU, auto = vLLM's default binding; "
        "per concurrency level the faster one is the reference",
    )
    ap.add_argument(
        "--native-modes",
        default=",".join(COMPILE_MODES),
        help="compile modes of the native baselines (default compiled,eager): compiled = "
        "vLLM's default compile mode, eager = --enforce-eager; the fastest native run per "
        "level is the reference",
    )
    ap.add_argument(
        "--afd-modes",
        default="compiled",
        help="compile modes of the AFD deployment (default compiled; compiled,eager also "
        "measures AFD eager); the first one is AFD's result",
    )
    ap.add_argument("--gate-on-attention", action="store_true")
    ap.add_argument(
        "--num-attention", type=int, default=1, help="attention (DP) ranks of the AFD deployment"
    )
    ap.add_argument("--num-ffn", type=int, default=1, help="FFN ranks of the AFD deployment")
    ap.add_argument(
        "--attention-tp",
        type=int,
        default=1,
        help="tensor-parallel size of each attention rank of the AFD deployment",
    )
    ap.add_argument(
        "--ffn-expert-parallel",
        action="store_true",
        help="the FFN ranks share one expert set (each holds 1/num-ffn of the routed experts)",
    )
    ap.add_argument(
        "--connector",
        default=None,
        help="AFD connector of the AFD deployment (default: P2pShmAFDConnector, the "
        "launcher's same-host default; e.g. P2pGlooAFDConnector)",
    )
    ap.add_argument(
        "--micro-batches",
        default="1",
        help="afd.num_micro_batches of the AFD deployment (ping-pong overlap; default 1); "
        "a comma-separated list (e.g. 1,2,3) measures one AFD deployment per value in the "
        "same run, the best per level being AFD's result",
    )
    ap.add_argument(
        "--micro-batch-min-tokens",
        type=int,
        default=None,
        help="afd.micro_batch_min_tokens of the AFD deployment: steps with fewer "
        "scheduled tokens run whole even when m > 1 (default 0: split whenever a step "
        "has m requests)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measure every deployment this many times, alternating the order (native "
        "first, then AFD first, ...); each level reports the median run and the AFD/native "
        "ratio of every repeat (default 1)",
    )
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--out", default="afd-bench", help="folder for bench.json and bench.png")
    ap.add_argument("--log-dir", help="keep role logs here (default: a temporary folder)")
    ap.add_argument("--verbose", action="store_true", help="stream role logs to the console")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="record per-layer spans of the AFD deployment (AFD_PROFILE_DIR=OUT/profile): "
        "OUT/profile/trace.json (Perfetto), a per-level summary next to native's TPOT, "
        "and OUT/profile/step-c<N>.png",
    )
    add_cpu_arguments(ap)


def run_bench(args: Any) -> int:
    from afd.reference import FIXED_PROMPTS

    try:
        levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
        modes = [m.strip() for m in str(args.modes).split(",") if m.strip()]
        if not levels or min(levels) < 1:
            raise ValueError("concurrency levels must be ints >= 1")
        bad = [m for m in modes if m not in MODES]
        if bad or not modes:
            raise ValueError(f"modes: expected some of {', '.join(MODES)}, got {args.modes!r}")
        micro_batches = parse_micro_batches(args.micro_batches)
        if args.output_len < 2:
            raise ValueError("--output-len must be >= 2 (TPOT needs two tokens)")
        repeat = int(getattr(args, "repeat", 1))
        if repeat < 1:
            raise ValueError(f"--repeat must be >= 1, got {repeat}")
        if repeat > 1 and getattr(args, "profile", False):
            raise ValueError("--profile records one run of each deployment; use --repeat 1")
        native_modes = _parse_modes("--native-modes", getattr(args, "native_modes", "compiled"))
        afd_modes = _parse_modes("--afd-modes", getattr(args, "afd_modes", "compiled"))
        native_configs = [c.strip() for c in str(args.native_configs).split(",") if c.strip()]
        bad = [c for c in native_configs if c not in NATIVE_CONFIGS]
        if "native" in modes and (bad or not native_configs):
            raise ValueError(
                f"native-configs: expected some of {', '.join(NATIVE_CONFIGS)}, "
                f"got {args.native_configs!r}"
            )
    except ValueError as exc:
        print(f"afd bench: {exc}", file=sys.stderr)
        return 2

    def say(msg: str) -> None:
        print(f"[bench] {msg}", flush=True)

    t_total = time.monotonic()
    if args.model:
        model = Path(args.model).expanduser().absolute()
    else:
        model = ensure_tiny_model(cache_dir(args.cache_dir), log=say)
    try:
        base = DeploymentSpec(
            model=str(model),
            max_model_len=args.max_model_len,
            compute_gate_on_attention=bool(args.gate_on_attention),
            num_attention=int(getattr(args, "num_attention", 1)),
            num_ffn=int(getattr(args, "num_ffn", 1)),
            attention_tensor_parallel_size=int(getattr(args, "attention_tp", 1)),
            ffn_expert_parallel=bool(getattr(args, "ffn_expert_parallel", False)),
            startup_timeout_s=600.0,
            afd={
                **({"connector": args.connector} if args.connector else {}),
                **(
                    {"micro_batch_min_tokens": args.micro_batch_min_tokens}
                    if args.micro_batch_min_tokens is not None
                    else {}
                ),
            },
            attention={"cpus": args.attention_cpus},
            ffn={"cpus": args.ffn_cpus},
        )
    except ValueError as exc:  # SpecError
        print(f"afd bench: {exc}", file=sys.stderr)
        return 2
    cpus = usable_cpus()
    if "native" in modes and len(native_configs) > 1 and detect_cuda_devices():
        say("CUDA host: one native run with vLLM's default CPU binding")
        native_configs = ["auto"]
    runs = _plan_runs(
        base,
        modes,
        native_configs,
        cpus,
        micro_batches,
        native_modes=native_modes if "native" in modes else (),
        afd_modes=afd_modes,
    )
    say(f"connector: {base.connector}; usable CPUs: {format_cpu_list(cpus)}")
    prompts = list(FIXED_PROMPTS)
    per_level = {c: (args.requests or max(8, 4 * c)) for c in levels}
    profile_dir: Path | None = None
    if getattr(args, "profile", False):
        profile_dir = Path(args.out).absolute() / "profile"
        shutil.rmtree(profile_dir, ignore_errors=True)
        profile_dir.mkdir(parents=True)
    # AFD runs by m: the wall-clock window of each level (for the profile), the results.
    windows: dict[int, dict[str, tuple[int, int]]] = {}
    afd_runs: dict[int, dict[str, Any]] = {}
    results: dict[str, Any] = {}
    native_runs: dict[str, dict[str, Any]] = {}
    startup: dict[str, float] = {}
    bound: dict[str, dict[str, str]] = {}

    from tqdm import tqdm

    by_run: dict[str, list[dict[str, Any]]] = {}
    # Repeats alternate the order, so that a slow phase of the host does not always
    # fall on the same deployment.
    schedule = [
        (r, run, spec)
        for r in range(repeat)
        for run, spec in (runs if r % 2 == 0 else list(reversed(runs)))
    ]

    with forward_signals():
        try:
            for r, run, spec in schedule:
                sub = run.replace("/", "-")
                spec = spec.replace(
                    log_dir=None if args.log_dir is None else str(Path(args.log_dir) / sub),
                )
                is_afd = run.startswith("afd")
                m = int(spec.afd.get("num_micro_batches", 1))
                # the profile records the runs of AFD's first compile mode
                profiled = is_afd and spec.enforce_eager == (afd_modes[0] == "eager")
                if profiled and profile_dir is not None:
                    where = _profile_dir_of(profile_dir, m, micro_batches)
                    where.mkdir(parents=True, exist_ok=True)
                    spec = spec.replace(env={**spec.env, PROFILE_DIR_ENV: str(where)})
                compile_mode = "eager" if spec.enforce_eager else "compiled"
                shape = (
                    f"{spec.num_attention}A{spec.num_ffn}F"
                    + (
                        f", TP{spec.attention_tensor_parallel_size}"
                        if spec.attention_tensor_parallel_size > 1
                        else ""
                    )
                    + (f", EP{spec.num_ffn}" if spec.ffn_expert_parallel else "")
                )
                what = (
                    f"{shape}, {m} micro-batch{'es' if m > 1 else ''}, {compile_mode}"
                    if is_afd
                    else f"plain vLLM, CPUs {run.split('/')[1]}, {compile_mode}"
                )
                say(
                    f"starting {run} ({what})"
                    + (f", repeat {r + 1}/{repeat}" if repeat > 1 else "")
                )
                dep = Deployment(spec, echo=args.verbose, console=sys.stdout, name=f"bench-{sub}")
                with dep:
                    startup[run] = round(dep.startup_s or 0.0, 1)
                    bound[run] = dict(dep.cpus or {})
                    model_name = served_model(dep.url)
                    for p in prompts[: max(levels)]:  # warm-up (not measured)
                        stream_completion(dep.url, model_name, p, 4)
                    res: dict[str, Any] = {}
                    total = sum(per_level.values())
                    with tqdm(total=total, desc=run, unit="req", file=sys.stderr) as bar:
                        for c in levels:
                            bar.set_description(f"{run} c={c}")
                            started_ns = time.time_ns()
                            counters = (
                                bench_metrics.scrape(getattr(dep, "roles", ())) if is_afd else {}
                            )
                            res[str(c)] = run_level(
                                dep.url,
                                prompts,
                                c,
                                per_level[c],
                                args.output_len,
                                on_done=lambda: bar.update(1),
                            )
                            if is_afd:
                                level = bench_metrics.delta(
                                    counters, bench_metrics.scrape(getattr(dep, "roles", ()))
                                )
                                res[str(c)]["afd_roles"] = level
                                bar.write(
                                    f"[bench] {run} c={c}: {bench_metrics.format_level(level)}"
                                )
                            if profiled:
                                windows.setdefault(m, {})[str(c)] = (started_ns, time.time_ns())
                    by_run.setdefault(run, []).append(res)
        except DeploymentError as exc:
            say(f"FAILED: {exc}")
            return 1
        except BaseException as exc:
            if isinstance(exc, Exception):
                raise
            say(f"interrupted ({exc}); stopped")
            return 130

    # AFD runs per compile mode, by m; the first mode's are AFD's result.
    afd_by_mode: dict[str, dict[int, dict[str, Any]]] = {}
    for run, spec in runs:
        if run not in by_run:
            continue
        res = median_levels(by_run[run], levels)
        if run.startswith("afd"):
            mode = "eager" if spec.enforce_eager else "compiled"
            afd_by_mode.setdefault(mode, {})[int(spec.afd.get("num_micro_batches", 1))] = res
        else:
            native_runs[run.split("/", 1)[1]] = res
    native_reference: dict[str, str] = {}
    native_eager: dict[str, Any] = {}
    if native_runs:
        native_results, native_reference = pick_native_reference(native_runs, levels)
        results["native"] = native_results
        startup["native"] = next(v for k, v in startup.items() if k.startswith("native/"))
        eager_runs = {k: v for k, v in native_runs.items() if k.endswith(EAGER_SUFFIX)}
        if eager_runs:
            native_eager, _ = pick_native_reference(eager_runs, levels)
    afd_best: dict[str, str] = {}
    afd_modes_report: dict[str, Any] = {}
    for mode, by_m in afd_by_mode.items():
        best, best_m = pick_native_reference(
            {str(m): res for m, res in by_m.items()}, levels, key="num_micro_batches"
        )
        for lv in best.values():
            lv["num_micro_batches"] = int(lv["num_micro_batches"])
        afd_modes_report[mode] = {
            "results": best,
            "ratio_over_native": _ratios({**results, "afd": best}, levels),
            "ratio_over_native_eager": _ratios({"native": native_eager, "afd": best}, levels)
            if native_eager
            else {},
        }
        if mode == afd_modes[0] or "afd" not in results:
            results["afd"], afd_best, afd_runs = best, best_m, by_m
    if afd_runs:
        startup["afd"] = next(v for k, v in startup.items() if k.startswith("afd"))
    report = {
        "settings": {
            "model": str(model),
            "concurrency": levels,
            "requests_per_level": {str(c): n for c, n in per_level.items()},
            "output_len": args.output_len,
            "prompts": len(prompts),
            "dtype": base.dtype,
            "max_model_len": base.max_model_len,
            "kv_cache_memory_bytes": base.kv_cache_memory_bytes,
            "native_modes": list(native_modes) if "native" in modes else [],
            "afd_modes": list(afd_modes) if "afd" in modes else [],
            "compute_gate_on_attention": base.compute_gate_on_attention,
            "num_attention": base.num_attention,
            "num_ffn": base.num_ffn,
            "attention_tensor_parallel_size": base.attention_tensor_parallel_size,
            "ffn_expert_parallel": base.ffn_expert_parallel,
            "connector": base.connector,
            "num_micro_batches": micro_batches,
            "micro_batch_min_tokens": int(base.afd.get("micro_batch_min_tokens", 0)),
            "thread_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
            "attention_cpus": args.attention_cpus,
            "ffn_cpus": args.ffn_cpus,
            "usable_cpus": format_cpu_list(cpus),
            "cpus": bound,
            "native_configs": list(native_runs),
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "startup_s": startup,
        "startup_ratio_afd_over_native_compiled": _startup_ratio(startup),
        "results": results,
        "native_configs": {
            name: {
                "cpus": native_config_cpus(name, cpus),
                "startup_s": startup.get(f"native/{name}"),
                "results": res,
            }
            for name, res in native_runs.items()
        },
        "native_reference": native_reference,
        "ratio_afd_over_native": _ratios(results, levels),
        "ratio_afd_over_native_eager": _ratios({"native": native_eager, **_afd(results)}, levels)
        if native_eager
        else {},
        "afd_modes": afd_modes_report,
        "afd_micro_batches": {
            str(m): {
                "startup_s": startup.get(_afd_run_name(m, micro_batches)),
                "results": res,
                "ratio_over_native": _ratios(
                    {"native": results.get("native", {}), "afd": res}, levels
                )
                if "native" in results
                else {},
            }
            for m, res in afd_runs.items()
        },
        "afd_best_micro_batches": {c: int(m) for c, m in afd_best.items()},
        "repeats": _repeat_ratios(by_run, levels, repeat),
        "total_s": round(time.monotonic() - t_total, 1),
    }
    if profile_dir is not None and windows:
        report["profile"] = _profile_report(profile_dir, windows, micro_batches, results, say)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    print(format_table(report))
    if repeat > 1:
        print(format_repeats(report["repeats"]))
    for m, run in report.get("profile", {}).get("runs", {}).items():
        for c, prof in run.get("levels", {}).items():
            print(f"\nprofile, m={m}, concurrency {c}:\n{prof['text']}")
    say(f"wrote {out / 'bench.json'}")
    if not args.no_plot:
        try:
            png = plot(report, out / "bench.png")
            say(f"wrote {png}")
        except ImportError:
            say("matplotlib is not installed (extra afd[plot]): no plot")
    say(f"total {report['total_s']:.0f} s")
    every = [res for results_of_run in by_run.values() for res in results_of_run]
    failed = any(lv["completed"] < lv["requests"] for m in every for lv in m.values())
    return 1 if failed else 0


def _startup_ratio(startup: dict[str, float]) -> float | None:
    """AFD's (compiled) start-up over the fastest native compiled start-up of the run."""
    native = [v for k, v in startup.items() if k.startswith("native/") and "/eager" not in k]
    afd = [v for k, v in startup.items() if k.startswith("afd") and not k.endswith("/eager")]
    if not native or not afd or not min(native):
        return None
    return round(afd[0] / min(native), 2)


def _afd(results: dict[str, Any]) -> dict[str, Any]:
    return {"afd": results["afd"]} if "afd" in results else {}


def _parse_modes(flag: str, value: str) -> list[str]:
    """``--native-modes`` / ``--afd-modes``: some of :data:`COMPILE_MODES`, no repeats."""
    out = [m.strip() for m in str(value).split(",") if m.strip()]
    if not out or any(m not in COMPILE_MODES for m in out) or len(set(out)) != len(out):
        raise ValueError(f"{flag}: expected some of {', '.join(COMPILE_MODES)}, got {value!r}")
    return out


def parse_micro_batches(value: str | int) -> list[int]:
    """``--micro-batches``: ``"2"`` -> ``[2]``, ``"1,2,3"`` -> ``[1, 2, 3]`` (each >= 1,
    no repeats, order kept)."""
    try:
        out = [int(x) for x in str(value).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--micro-batches: expected ints such as 1,2,3, got {value!r}") from None
    if not out or min(out) < 1 or len(set(out)) != len(out):
        raise ValueError(f"--micro-batches: expected distinct ints >= 1, got {value!r}")
    return out


def _afd_run_name(m: int, micro_batches: Sequence[int]) -> str:
    return "afd" if len(micro_batches) == 1 else f"afd/m{m}"


def _profile_dir_of(profile_dir: Path, m: int, micro_batches: Sequence[int]) -> Path:
    return profile_dir if len(micro_batches) == 1 else profile_dir / f"m{m}"


def _plan_runs(
    base: DeploymentSpec,
    modes: Sequence[str],
    native_configs: Sequence[str],
    cpus: Sequence[int],
    micro_batches: Sequence[int] = (1,),
    *,
    native_modes: Sequence[str] = ("compiled",),
    afd_modes: Sequence[str] = ("compiled",),
) -> list[tuple[str, DeploymentSpec]]:
    """(run name, spec) in order: ``native/<config>`` per native config and compile mode
    (``native/<config>/eager`` for eager), then ``afd`` (one run, ``afd/m<M>`` for each M
    when several ``micro_batches`` are measured; ``.../eager`` for eager) per AFD mode.
    A native run's CPUs come from its config only (not from ``--attention-cpus``)."""
    runs = []
    for mode in modes:
        if mode == "afd":
            for compile_mode in afd_modes:
                eager = compile_mode == "eager"
                for m in micro_batches:
                    afd = {k: v for k, v in base.afd.items() if k != "num_micro_batches"}
                    if m > 1:
                        afd["num_micro_batches"] = m
                    name = _afd_run_name(m, micro_batches) + (EAGER_SUFFIX if eager else "")
                    runs.append((name, base.replace(afd=afd, enforce_eager=eager)))
            continue
        for compile_mode in native_modes:
            eager = compile_mode == "eager"
            for config in native_configs:
                attention = RoleOverrides(cpus=native_config_cpus(config, cpus))
                name = f"native/{config}" + (EAGER_SUFFIX if eager else "")
                spec = base.replace(native=True, attention=attention, enforce_eager=eager)
                runs.append((name, spec))
    return runs


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
