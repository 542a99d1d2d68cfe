"""The ``afd`` command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from afd._version import __version__


def _cmd_models_tiny(args: argparse.Namespace) -> int:
    from afd.tools.models.tiny import generate_tiny_checkpoint

    try:
        path = generate_tiny_checkpoint(
            args.arch,
            Path(args.out),
            seed=args.seed,
            variant=args.variant,
            overwrite=args.overwrite,
            size=args.size,
        )
    except ValueError as e:  # unknown variant, or no bench size for the arch
        print(f"afd models tiny: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _cmd_models_check(args: argparse.Namespace) -> int:
    import json

    from afd.tools.models.check import main

    try:
        overrides = json.loads(args.hf_overrides) if args.hf_overrides else None
    except json.JSONDecodeError as e:
        print(f"afd models check: error: --hf-overrides is not JSON: {e}", file=sys.stderr)
        return 2
    return main(args.model, hf_overrides=overrides)


def _cmd_connectors(args: argparse.Namespace) -> int:
    from afd_core.registry import available_connectors

    for name in available_connectors():
        print(name)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from afd.runtime.serve import serve_attention, serve_ffn
    from afd_moe_runners.model_runner_choice import V2_RUNNER_ENV, serve_environment_problem

    # Before vLLM is imported: this process and every process it starts run vLLM's V1
    # model runner (docs/gpu.md, "Model runner").
    problem = serve_environment_problem(os.environ, role=args.role)
    if problem is not None:
        print(f"afd serve: error: {problem}", file=sys.stderr)
        return 2
    _setup_logging()
    logging.getLogger("afd.runtime.serve").info(
        "afd serve --role %s: %s=%s (vLLM's V1 model runner)",
        args.role,
        V2_RUNNER_ENV,
        os.environ[V2_RUNNER_ENV],
    )
    if args.role == "ffn":
        return serve_ffn(args.model, args.vllm_args)
    return serve_attention(args.model, args.vllm_args)


def _cmd_launch(args: argparse.Namespace) -> int:
    from afd.launch import run_launch

    return run_launch(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from afd.tools.demo import run_demo

    return run_demo(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from afd.tools.bench import run_bench

    return run_bench(args)


def _setup_logging() -> None:
    from afd.runtime.plugin import configure_logging

    configure_logging()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="afd", description="Attention-FFN Disaggregation for vLLM")
    ap.add_argument("--version", action="version", version=f"afd {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="model utilities")
    msub = models.add_subparsers(dest="models_command", required=True)
    tiny = msub.add_parser("tiny", help="generate a tiny seeded checkpoint (nothing downloaded)")
    from afd.tools.models.tiny import TINY_ARCHS  # cheap: torch/transformers load on use

    tiny.add_argument("--arch", required=True, choices=list(TINY_ARCHS))
    tiny.add_argument("--out", required=True, help="output directory")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--variant", default=None)
    tiny.add_argument(
        "--size",
        choices=["tiny", "bench"],
        default="tiny",
        help="tiny (default, for tests) or bench (hidden 512, 8 MoE layers, 16 experts "
        "top-4; qwen3_moe and deepseek_v3)",
    )
    tiny.add_argument("--overwrite", action="store_true")
    tiny.set_defaults(func=_cmd_models_tiny)
    check = msub.add_parser(
        "check",
        help="whether and how afd splits a model into Attention and FFN roles (per layer; "
        "exit 0 when it can, 1 when not, 2 when the model cannot be read)",
    )
    check.add_argument("model", help="checkpoint directory or model id vLLM can read")
    check.add_argument("--hf-overrides", default=None, help="JSON, as vLLM's --hf-overrides")
    check.set_defaults(func=_cmd_models_check)

    serve = sub.add_parser(
        "serve",
        help="start one AFD role (vLLM engine args pass through)",
        description="Start one AFD role. Every argument after MODEL goes to vLLM "
        "(the same engine/server arguments as `vllm serve`).",
    )
    serve.add_argument("--role", required=True, choices=["attention", "ffn"])
    serve.add_argument("model", help="checkpoint directory (or model name)")
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="vLLM arguments")
    serve.set_defaults(func=_cmd_serve)

    conn = sub.add_parser("connectors", help="list the installed AFD connectors")
    conn.set_defaults(func=_cmd_connectors)

    from afd.launch import add_launch_arguments
    from afd.plan.cli import add_plan_arguments, run_plan
    from afd.tools.bench import add_bench_arguments
    from afd.tools.demo import add_demo_arguments
    from afd.tools.profile import add_profile_arguments, run_profile

    # (name, help, description, adds its arguments, runs it)
    commands: list[tuple[str, str, str, Callable[[Any], None], Callable[[Any], int]]] = [
        (
            "profile",
            "merge an AFD_PROFILE_DIR into a Perfetto trace and a per-step summary",
            "Merge the per-layer spans that AFD processes wrote to AFD_PROFILE_DIR into "
            "DIR/trace.json (Perfetto / chrome://tracing) and DIR/summary.json, print ms per "
            "step by category for both roles, and optionally draw one step.",
            add_profile_arguments,
            run_profile,
        ),
        (
            "launch",
            "start a whole AFD deployment (FFN + Attention servers) until interrupted",
            "Start the FFN server(s), then the Attention server(s), wait until all are "
            "ready, print the endpoints and run until Ctrl-C / SIGTERM (which stops every "
            "role). Settings come from a TOML spec file and/or flags (flags win).",
            add_launch_arguments,
            _cmd_launch,
        ),
        (
            "demo",
            "tiny DeepSeek-V2 on 1 Attention + 1 FFN server vs native vLLM (token parity)",
            "Generate a tiny DeepSeek-V2 checkpoint (cached), serve it with 1 Attention + 1 "
            "FFN server, generate greedily for fixed prompts, then serve it natively with "
            "the same engine args and compare the token ids. Exit 0 on PASS.",
            add_demo_arguments,
            _cmd_demo,
        ),
        (
            "bench",
            "AFD 1A1F vs native vLLM: throughput, TTFT, TPOT per concurrency",
            "Run the same streaming workload against a native vLLM server and an AFD 1 "
            "Attention + 1 FFN deployment (one after the other) and report output tok/s, "
            "TTFT and TPOT (median, p99) and the AFD/native ratio; writes JSON + PNG.",
            add_bench_arguments,
            _cmd_bench,
        ),
        (
            "plan",
            "choose the Attention:FFN ratio, TP/EP sizes and micro-batches for a model",
            "Search the layouts (attention ranks, attention TP, FFN ranks, FFN EP, "
            "micro-batches, batch) of a model on a device with the performance model of "
            "docs/plan.md; print the best plans and write the best as an afd launch spec. "
            "--calibrate measures this host first.",
            add_plan_arguments,
            run_plan,
        ),
    ]
    for name, help_text, description, add_arguments, run in commands:
        parser = sub.add_parser(name, help=help_text, description=description)
        add_arguments(parser)
        parser.set_defaults(func=run)
    return ap


#: Subcommands that import vLLM or transformers' models (here or in role processes).
NEEDS_TORCH_STACK = frozenset({"serve", "launch", "demo", "bench", "models"})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in NEEDS_TORCH_STACK:
        from afd.runtime.environment import torch_companion_problem

        problem = torch_companion_problem()
        if problem is not None:
            print(f"afd {args.command}: error: {problem}", file=sys.stderr)
            return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
