"""``afd demo``: a tiny DeepSeek-V2 served by 1 Attention + 1 FFN server, checked against
native vLLM token by token (both in vLLM's default compile mode, float32 by default).

1. a tiny seeded DeepSeek-V2 checkpoint is generated under the cache directory
   (``--cache-dir``, else ``$AFD_CACHE_DIR``, else ``~/.cache/afd``) unless present;
2. :class:`afd.launch.Deployment` starts 1 FFN + 1 Attention server, the fixed prompts
   go through the OpenAI-compatible API as greedy requests, one at a time, the
   generations are printed and the deployment is stopped;
3. a native vLLM API server starts with the same engine arguments and gets the same
   requests (same serving path, same batches: the tokens must match exactly);
4. the token ids are compared per prompt: PASS (exit 0) or FAIL (exit 1).

Compiled (the default), the AFD deployment must also have run its Attention role's
compiled graph in every step: before it stops, its ``/metrics`` must show, per
attention rank, as many exchanges through the ``afd::exchange`` op as steps x layers
(:func:`compiled_problem`); else FAIL.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from afd.launch import (
    Deployment,
    DeploymentError,
    DeploymentSpec,
    RoleOverrides,
    SpecError,
    add_cpu_arguments,
    forward_signals,
)
from afd.tools.bench_metrics import Samples
from afd.tools.client import complete_each

__all__ = [
    "attention_samples",
    "cache_dir",
    "compare_tokens",
    "compiled_problem",
    "compiled_summary",
    "ensure_tiny_model",
    "exchanging_layers",
    "run_demo",
]

DEMO_ARCH = "deepseek_v2"


def cache_dir(explicit: str | None = None) -> Path:
    base = explicit or os.environ.get("AFD_CACHE_DIR") or "~/.cache/afd"
    return Path(base).expanduser()


def ensure_tiny_model(cache: Path, arch: str = DEMO_ARCH, *, log: Any = print) -> Path:
    """The tiny ``arch`` checkpoint under ``cache`` (generated, seed 0, if missing)."""
    from afd.tools.models.tiny import generate_tiny_checkpoint

    out = cache / f"tiny-{arch}"
    t0 = time.monotonic()
    path = generate_tiny_checkpoint(arch, out, seed=0)
    dt = time.monotonic() - t0
    if dt > 1.0:
        log(f"generated the tiny {arch} checkpoint in {path} ({dt:.1f} s)")
    else:
        log(f"using the cached tiny {arch} checkpoint in {path}")
    return Path(path)


def compare_tokens(
    afd: Sequence[Sequence[int]], native: Sequence[Sequence[int]]
) -> list[int | None]:
    """Per prompt: None when identical, else the index of the first differing token."""
    out: list[int | None] = []
    for a, n in zip(afd, native, strict=True):
        if list(a) == list(n):
            out.append(None)
            continue
        i = next((k for k, (x, y) in enumerate(zip(a, n, strict=False)) if x != y), None)
        out.append(i if i is not None else min(len(a), len(n)))
    return out


# --------------------------------------------------------------------------- demo


def _short(text: str, n: int = 60) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= n else text[: n - 3] + "..."


def add_demo_arguments(ap: Any) -> None:
    ap.add_argument(
        "--cache-dir",
        help="where the tiny checkpoint lives (default: $AFD_CACHE_DIR or ~/.cache/afd)",
    )
    ap.add_argument("--model", help="use this checkpoint instead of the tiny DeepSeek-V2")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--gate-on-attention",
        action="store_true",
        help="compute the MoE gate on the attention role",
    )
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="model dtype of both deployments (default float32: compiled, the exchange op "
        "is a graph boundary native vLLM does not have, so in bfloat16 rounding around the "
        "FFN blocks differs and greedy tokens of a tiny random model can too; see "
        "docs/architecture.md, Compiled execution)",
    )
    ap.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run both deployments eager (vLLM's --enforce-eager); default: vLLM's default "
        "compile mode, the first start compiles for about a minute",
    )
    ap.add_argument("--log-dir", help="keep the role logs here (default: a temporary folder)")
    ap.add_argument("--verbose", action="store_true", help="stream the role logs to the console")
    ap.add_argument(
        "--skip-native", action="store_true", help="only run the AFD deployment (no parity check)"
    )
    add_cpu_arguments(ap)


def run_demo(args: Any) -> int:
    from afd.tools.reference import FIXED_PROMPTS

    t_total = time.monotonic()
    timings: dict[str, float] = {}

    def say(msg: str) -> None:
        print(f"[demo] {msg}", flush=True)

    def phase(name: str, t0: float) -> None:
        timings[name] = time.monotonic() - t0
        say(f"{name}: {timings[name]:.1f} s")

    prompts = list(FIXED_PROMPTS)
    t0 = time.monotonic()
    if args.model:
        model = Path(args.model).expanduser().absolute()
        say(f"using the checkpoint {model}")
    else:
        model = ensure_tiny_model(cache_dir(args.cache_dir), log=say)
    phase("checkpoint", t0)

    try:
        spec = demo_spec(model, args)
    except SpecError as exc:
        say(f"invalid settings: {exc}")
        return 2
    code = 0
    with forward_signals():
        try:
            # ---- AFD: 1 FFN + 1 Attention
            say("starting 1 FFN + 1 Attention server (AFD)")
            t0 = time.monotonic()
            afd = Deployment(
                spec.replace(log_dir=_sub(args.log_dir, "afd")),
                echo=args.verbose,
                console=sys.stdout,
                name="demo",
            )
            with afd:
                phase("afd start", t0)
                t0 = time.monotonic()
                afd_ids, afd_texts = complete_each(afd.url, prompts, args.max_tokens)
                phase("afd generate", t0)
                if not spec.enforce_eager:
                    layers = exchanging_layers(model)
                    samples = attention_samples(afd.url)
                    eager_problem = compiled_problem(spec, samples, layers)
                    if eager_problem:
                        say(f"FAIL: {eager_problem}")
                        code = 1
                    else:
                        say(
                            "the Attention role ran vLLM's compiled model in every step: "
                            f"{compiled_summary(samples, layers)}"
                        )
                t0 = time.monotonic()
            phase("afd stop", t0)
            say(
                f"AFD generations ({len(prompts)} prompts, {args.max_tokens} tokens, greedy; "
                "random tiny weights, so the text is gibberish: token parity is the check):"
            )
            for p, text in zip(prompts, afd_texts, strict=True):
                print(f"  {_short(p, 40)!r:44} -> {_short(text)!r}")
            if args.skip_native:
                say("--skip-native: no parity check")
                return code

            # ---- native vLLM, same engine args, same requests
            say("starting native vLLM (same engine args) for the reference")
            t0 = time.monotonic()
            native = Deployment(
                native_spec(spec).replace(log_dir=_sub(args.log_dir, "native")),
                echo=args.verbose,
                console=sys.stdout,
                name="demo",
            )
            with native:
                phase("native start", t0)
                t0 = time.monotonic()
                nat_ids, _ = complete_each(native.url, prompts, args.max_tokens)
                phase("native generate", t0)
                t0 = time.monotonic()
            phase("native stop", t0)
        except DeploymentError as exc:
            say(f"FAIL: {exc}")
            return 1
        except Exception as exc:  # a request failed: report it, the deployment is down
            say(f"FAIL: {type(exc).__name__}: {exc}")
            return 1
        except BaseException as exc:  # interrupted (SIGINT/SIGTERM): torn down by `with`
            say(f"interrupted ({exc}); stopped")
            return 130

    diffs = compare_tokens(afd_ids, nat_ids)
    say("token ids, AFD vs native, per prompt:")
    for i, (p, d) in enumerate(zip(prompts, diffs, strict=True)):
        n = len(afd_ids[i])
        verdict = "identical" if d is None else f"DIFFER from token {d}"
        print(f"  {i:2d} {_short(p, 40)!r:44} {n:3d} tokens  {verdict}")
    ok = all(d is None for d in diffs) and all(len(t) > 0 for t in afd_ids)
    n_same = sum(d is None for d in diffs)
    timings["total"] = time.monotonic() - t_total
    say("timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    if ok and code == 0:
        say(f"PASS: {n_same}/{len(prompts)} prompts token-identical to native vLLM")
    elif ok:
        say(f"FAIL: {n_same}/{len(prompts)} prompts token-identical, but see above")
    else:
        say(f"FAIL: {len(prompts) - n_same}/{len(prompts)} prompts differ from native vLLM")
        code = 1
    return code


#: Attention-role metrics (afd_moe_runners.metrics) the compiled check reads.
STEPS_METRIC = "afd_attention_steps_total"
COMPILED_METRIC = "afd_attention_compiled_exchanges_total"


def exchanging_layers(model: str | os.PathLike[str]) -> int:
    """Decoder layers of the checkpoint ``model`` (its ``config.json``, the text model's
    of a multimodal one): every one exchanges with the FFN role, the dense ones through
    the dense stand-in."""
    config = json.loads((Path(model) / "config.json").read_text())
    text = config.get("text_config") or config
    return int(text["num_hidden_layers"])


def attention_samples(url: str, *, quiet_s: float = 0.3, timeout_s: float = 15.0) -> Samples:
    """``GET url/metrics`` (the Attention role's API server) parsed, once two scrapes
    ``quiet_s`` apart agree (a step's counters are written one after another at its end);
    empty when nothing answers."""
    from afd.tools.bench_metrics import metric_samples, settled

    return settled(lambda: metric_samples(url), quiet_s=quiet_s, timeout_s=timeout_s)


def _per_rank(samples: Samples, name: str) -> dict[str, float]:
    return {
        dict(labels).get("rank", ""): value for (n, labels), value in samples.items() if n == name
    }


def compiled_summary(samples: Samples, layers: int) -> str:
    """Per attention rank: compiled exchanges of steps x layers."""
    compiled = _per_rank(samples, COMPILED_METRIC)
    return ", ".join(
        f"rank {rank}: {compiled.get(rank, 0.0):.0f} exchanges through the op "
        f"= {steps:.0f} steps x {layers} layers"
        for rank, steps in sorted(_per_rank(samples, STEPS_METRIC).items())
    )


def compiled_problem(spec: DeploymentSpec, samples: Samples, layers: int) -> str | None:
    """Why a deployment that asked for vLLM's compile mode did not run its Attention role
    compiled in every step, or None (it did, or it ran eager as asked).

    ``samples``: the Attention role's ``/metrics`` (:func:`attention_samples`) while the
    deployment is up; ``layers``: its exchanging layers (:func:`exchanging_layers`). Every
    attention rank must have run steps, and every layer of each of its steps must have
    gone through the ``afd::exchange`` op (``afd_attention_compiled_exchanges_total`` ==
    ``afd_attention_steps_total`` x layers; one micro-batch per step, as the demo runs).
    No such metric is a failure too: nothing proves the role ran compiled. A compiled
    deployment must not fall back to eager silently: e.g.
    ``VLLM_USE_BREAKABLE_CUDAGRAPH=1`` or ``TORCH_COMPILE_DISABLE=1`` in the environment
    turn vLLM's compile mode off."""
    if spec.enforce_eager:
        return None
    asked = "AFD was asked for vLLM's compile mode, but"
    steps = _per_rank(samples, STEPS_METRIC)
    if not steps:
        return (
            f"{asked} its Attention role's /metrics has no {STEPS_METRIC} (metrics off or "
            "unreachable?): nothing proves it ran the compiled graph"
        )
    compiled = _per_rank(samples, COMPILED_METRIC)
    bad = [
        f"rank {rank}: {compiled.get(rank, 0.0):.0f} exchanges through the op, expected "
        f"{n:.0f} steps x {layers} layers = {n * layers:.0f}"
        for rank, n in sorted(steps.items())
        if n <= 0 or compiled.get(rank, 0.0) != n * layers
    ]
    if not bad:
        return None
    return (
        f"{asked} its Attention role ran eager in some or all steps ({'; '.join(bad)}; "
        f"{COMPILED_METRIC} and {STEPS_METRIC} of its /metrics): check "
        "VLLM_USE_BREAKABLE_CUDAGRAPH and TORCH_COMPILE_DISABLE in the environment"
    )


def demo_spec(model: str | os.PathLike[str], args: Any) -> DeploymentSpec:
    """The demo's 1A1F spec (the launcher's same-host defaults: shared-memory connector,
    own cores per role on a CPU host; ``--attention-cpus`` / ``--ffn-cpus`` override)."""
    return DeploymentSpec(
        model=str(model),
        max_model_len=256,
        dtype=str(getattr(args, "dtype", "float32")),
        compute_gate_on_attention=bool(args.gate_on_attention),
        enforce_eager=bool(getattr(args, "enforce_eager", False)),
        log_dir=args.log_dir,
        startup_timeout_s=600.0,
        attention={"cpus": getattr(args, "attention_cpus", None)},
        ffn={"cpus": getattr(args, "ffn_cpus", None)},
    )


def native_spec(spec: DeploymentSpec) -> DeploymentSpec:
    """The native reference of ``spec``: same engine args, the launcher's default CPUs
    (all usable ones), not the attention role's."""
    attention = RoleOverrides(
        model=spec.attention.model,
        vllm_args=list(spec.attention.vllm_args),
        env=dict(spec.attention.env),
        devices=spec.attention.devices,
    )
    return spec.replace(native=True, attention=attention)


def _sub(log_dir: str | None, name: str) -> str | None:
    return None if log_dir is None else str(Path(log_dir) / name)
