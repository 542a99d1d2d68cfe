"""The ``afd`` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from afd._version import __version__


def _cmd_models_tiny(args: argparse.Namespace) -> int:
    from afd.models.tiny import generate_tiny_checkpoint

    path = generate_tiny_checkpoint(
        args.arch, Path(args.out), seed=args.seed, variant=args.variant, overwrite=args.overwrite
    )
    print(path)
    return 0


def _cmd_connectors(args: argparse.Namespace) -> int:
    from afd_core.registry import available_connectors

    for name in available_connectors():
        print(name)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="afd", description="Attention-FFN Disaggregation for vLLM")
    ap.add_argument("--version", action="version", version=f"afd {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="model utilities")
    msub = models.add_subparsers(dest="models_command", required=True)
    tiny = msub.add_parser("tiny", help="generate a tiny seeded checkpoint (nothing downloaded)")
    tiny.add_argument("--arch", required=True, choices=["deepseek_v2", "deepseek_v3", "qwen3_moe"])
    tiny.add_argument("--out", required=True, help="output directory")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--variant", default=None)
    tiny.add_argument("--overwrite", action="store_true")
    tiny.set_defaults(func=_cmd_models_tiny)

    conn = sub.add_parser("connectors", help="list the installed AFD connectors")
    conn.set_defaults(func=_cmd_connectors)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
