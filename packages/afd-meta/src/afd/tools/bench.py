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
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from afd.launch import (
    Deployment,
    DeploymentError,
    DeploymentSpec,
    detect_cuda_devices,
    format_cpu_list,
    forward_signals,
    usable_cpus,
)
from afd.tools import bench_metrics
from afd.tools.bench_load import percentile, run_level
from afd.tools.bench_plan import (
    EAGER_SUFFIX,
    NATIVE_CONFIGS,
    _afd_run_name,
    _plan_runs,
    _profile_dir_of,
    add_bench_arguments,
    native_config_cpus,
    parse_bench_args,
    parse_micro_batches,
)
from afd.tools.bench_report import (
    _afd,
    _profile_report,
    _ratios,
    _repeat_ratios,
    _startup_ratio,
    format_repeats,
    format_table,
    median_levels,
    pick_native_reference,
    plot,
)
from afd.tools.client import RequestResult, served_model, stream_completion
from afd.tools.demo import cache_dir, ensure_tiny_model
from afd_core.profiling import PROFILE_DIR_ENV

__all__ = [
    "NATIVE_CONFIGS",
    "RequestResult",
    "add_bench_arguments",
    "format_table",
    "native_config_cpus",
    "parse_micro_batches",
    "percentile",
    "pick_native_reference",
    "run_bench",
    "run_level",
    "stream_completion",
]


def run_bench(args: Any) -> int:
    from afd.tools.reference import FIXED_PROMPTS

    try:
        checked = parse_bench_args(args)
    except ValueError as exc:
        print(f"afd bench: {exc}", file=sys.stderr)
        return 2

    levels, modes, micro_batches, repeat = checked[:4]
    native_modes, afd_modes, native_configs = checked[4:]

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
                **(
                    {
                        "transfer_dtype": args.transfer_dtype,
                        "transfer_dtype_return": args.transfer_dtype,
                    }
                    if getattr(args, "transfer_dtype", None)
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
    # start-up seconds of every repeat of each run; the report keeps their median
    startup_repeats: dict[str, list[float]] = {}
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
                m = spec.afd.num_micro_batches
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
                    startup_repeats.setdefault(run, []).append(round(dep.startup_s or 0.0, 1))
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

    # The first start of each kind of deployment compiles its model (later ones load
    # vLLM's compile cache), so a median over repeats, not the last one, is the figure.
    startup: dict[str, float] = {
        run: statistics.median_low(values) for run, values in startup_repeats.items()
    }
    # AFD runs per compile mode, by m; the first mode's are AFD's result.
    afd_by_mode: dict[str, dict[int, dict[str, Any]]] = {}
    for run, spec in runs:
        if run not in by_run:
            continue
        res = median_levels(by_run[run], levels)
        if run.startswith("afd"):
            mode = "eager" if spec.enforce_eager else "compiled"
            afd_by_mode.setdefault(mode, {})[spec.afd.num_micro_batches] = res
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
        for c, lv in best.items():  # the m picked at each level, as a number
            lv["num_micro_batches"] = int(best_m[c])
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
            "micro_batch_min_tokens": base.afd.micro_batch_min_tokens,
            "transfer_dtype": base.afd.transfer_dtype,
            "transfer_dtype_return": base.afd.transfer_dtype_return,
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
        "startup_repeats_s": startup_repeats,
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
