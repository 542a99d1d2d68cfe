"""``afd bench``'s command line and run plan: the flags, their parsing, and the ordered
list of deployments one bench run starts (``native/<config>[/eager]`` per native config
and compile mode, then ``afd`` or ``afd/m<M>`` per AFD mode)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from afd.launch import DeploymentSpec, RoleOverrides, add_cpu_arguments, format_cpu_list

__all__ = [
    "COMPILE_MODES",
    "EAGER_SUFFIX",
    "MODES",
    "NATIVE_CONFIGS",
    "BenchArgs",
    "add_bench_arguments",
    "native_config_cpus",
    "parse_bench_args",
    "parse_micro_batches",
]

MODES = ("native", "afd")
NATIVE_CONFIGS = ("all-cores", "auto")
"""Native baselines: bound to every usable CPU, and vLLM's default binding."""
COMPILE_MODES = ("compiled", "eager")
"""vLLM's default compile mode, and ``--enforce-eager``."""
EAGER_SUFFIX = "/eager"


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
        "--transfer-dtype",
        default=None,
        choices=("model", "fp8", "mxfp8", "int8"),
        help="afd.transfer_dtype and afd.transfer_dtype_return of the AFD deployment: the "
        "format of the hidden states both ways (default model: the model dtype)",
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


class BenchArgs(NamedTuple):
    """``afd bench``'s flags, checked (:func:`parse_bench_args`)."""

    levels: list[int]
    modes: list[str]
    micro_batches: list[int]
    repeat: int
    native_modes: list[str]
    afd_modes: list[str]
    native_configs: list[str]


def parse_bench_args(args: Any) -> BenchArgs:
    """The flags of ``afd bench`` that shape its runs, checked: a one-line
    :class:`ValueError` naming the flag otherwise."""
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
    return BenchArgs(levels, modes, micro_batches, repeat, native_modes, afd_modes, native_configs)


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
                    afd = dataclasses.replace(base.afd, num_micro_batches=m)
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
