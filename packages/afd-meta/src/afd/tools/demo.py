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
"""

from __future__ import annotations

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
from afd.tools.client import complete_each

__all__ = [
    "cache_dir",
    "compare_tokens",
    "ensure_tiny_model",
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
                eager_problem = compiled_problem(spec, afd.log_dir)
                if eager_problem:
                    say(f"FAIL: {eager_problem}")
                    code = 1
                elif not spec.enforce_eager:
                    say("the Attention role ran vLLM's compiled model (the exchange as its op)")
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
                return 0

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


def compiled_problem(spec: DeploymentSpec, log_dir: Path | None) -> str | None:
    """Why a deployment that asked for vLLM's compile mode did not run its Attention role
    compiled (its log lacks the exchange op's first-call line), or None (it did, it ran
    eager as asked, or there is no log to read). A compiled deployment must not fall
    back to eager silently: e.g. ``VLLM_USE_BREAKABLE_CUDAGRAPH=1`` or
    ``TORCH_COMPILE_DISABLE=1`` in the environment turn vLLM's compile mode off."""
    from afd_moe_runners.exchange_op import COMPILED_LOG

    if spec.enforce_eager or log_dir is None:
        return None
    logs = sorted(log_dir.glob("attn*.log"))
    if not logs:
        return None
    text = "\n".join(p.read_text(errors="replace") for p in logs)
    if COMPILED_LOG in text:
        return None
    return (
        "AFD was asked for vLLM's compile mode, but its Attention role ran eager (no "
        f"{COMPILED_LOG!r} line in {', '.join(p.name for p in logs)}): check "
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
