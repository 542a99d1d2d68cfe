"""``afd plan``: arguments, the printed table of the best plans, the spec it writes."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from afd.plan.hardware import PRESETS, hardware_toml, load_hardware
from afd.plan.model import Prediction
from afd.plan.search import Constraints, search
from afd.plan.shapes import load_shape, recipe_names
from afd.plan.spec import plan_toml, validate_toml

__all__ = ["add_plan_arguments", "format_plans", "run_plan"]


def add_plan_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--model",
        required=True,
        help="checkpoint directory (its config.json) or a recipe: " + ", ".join(recipe_names()),
    )
    ap.add_argument(
        "--hardware",
        default=None,
        help="preset (" + ", ".join(h.name for h in PRESETS.values()) + ") or a TOML file of "
        "its figures (docs/plan.md); with --calibrate: where the measured figures are written "
        "(default afd-plan/cpu-calibrated.toml)",
    )
    ap.add_argument("--tpot-ms", type=float, default=None, help="TPOT target (ms per token)")
    ap.add_argument(
        "--devices",
        type=int,
        default=None,
        help="most devices (GPU/NPU ranks; role processes on a CPU host) a plan may use "
        "(default 64, CPU host: its cores + 1)",
    )
    ap.add_argument(
        "--context", type=float, default=None, help="mean cached tokens per request (default 2048)"
    )
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="KV cache reserved per request (default: --context)",
    )
    ap.add_argument("--max-batch", type=int, default=512, help="largest batch per attention rank")
    ap.add_argument("--weight-bytes", type=float, default=None, help="bytes per weight (1 = fp8)")
    pin = ap.add_argument_group("pin a dimension of the search (default: searched)")
    pin.add_argument("--num-attention", type=int, default=None)
    pin.add_argument("--attention-tp", type=int, default=None)
    pin.add_argument("--num-ffn", type=int, default=None)
    pin.add_argument(
        "--ffn-expert-parallel", choices=["true", "false"], default=None, help="FFN EP or not"
    )
    pin.add_argument("--micro-batches", default=None, help="m values, e.g. 1 or 1,2,3")
    pin.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="total concurrent requests (batch per attention rank = this / num-attention)",
    )
    ap.add_argument("--top", type=int, default=5, help="plans to print")
    ap.add_argument("--out", default=None, help="write the best plan as an afd launch spec here")
    ap.add_argument(
        "--spec-model",
        default=None,
        help="model in the written spec (default: the checkpoint directory, or the recipe's "
        "hub id)",
    )
    ap.add_argument("--json", default=None, help="also write the printed plans as JSON")
    cal = ap.add_argument_group("calibration (CPU host)")
    cal.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this host first (afd bench --profile on a 1A1F deployment of --model, "
        "tools/bench_connector.py) and fit its figures; run under the heavy-work lock",
    )
    cal.add_argument(
        "--calibration-dir",
        default="afd-plan/calibration",
        help="where --calibrate keeps its measurements; --calibrate --reuse fits them again",
    )
    cal.add_argument("--reuse", action="store_true", help="fit existing measurements only")
    cal.add_argument(
        "--calibration-repeat",
        type=int,
        default=1,
        help="run the measurements this many times (into rep-1, rep-2... of the calibration "
        "dir) and fit their medians: on a shared host one run can be disturbed (default 1)",
    )
    cal.add_argument(
        "--calibration-context",
        type=float,
        default=48.0,
        help="mean cached tokens of the calibration workload (afd bench's prompts + half "
        "the 64 output tokens)",
    )


def format_plans(plans: list[Prediction], hw_name: str) -> str:
    head = (
        f"{'#':>2} {'layout':<18} {'nA':>3} {'TP':>3} {'nF':>3} {'EP':>3} {'m':>2} "
        f"{'batch':>6} {'attn us':>8} {'ffn us':>8} {'xfer us':>8} {'TPOT ms':>8} "
        f"{'tok/s/dev':>10} {'mem A GiB':>9} {'mem F GiB':>9} bound"
    )
    lines = [f"plans on {hw_name} (per MoE layer and micro-batch: attn, ffn, one-way xfer)", head]
    for i, p in enumerate(plans, 1):
        lay = p.layout
        lines.append(
            f"{i:>2} {lay.label():<18} {lay.num_attention:>3} {lay.attention_tp:>3} "
            f"{lay.num_ffn:>3} {'y' if lay.ffn_ep else 'n':>3} {lay.micro_batches:>2} "
            f"{p.batch:>6.1f} {p.attention_s * 1e6:>8.1f} {p.ffn_s * 1e6:>8.1f} "
            f"{p.transfer_s * 1e6:>8.1f} {p.tpot_s * 1e3:>8.2f} "
            f"{p.throughput_per_device:>10.1f} {p.mem_attention_bytes / 2**30:>9.2f} "
            f"{p.mem_ffn_bytes / 2**30:>9.2f} {p.bound}"
            + (f" [{p.placement.text}]" if p.placement else "")
        )
    return "\n".join(lines)


def _as_json(p: Prediction) -> dict[str, Any]:
    lay = p.layout
    return {
        "layout": lay.label(),
        "num_attention": lay.num_attention,
        "attention_tp": lay.attention_tp,
        "num_ffn": lay.num_ffn,
        "ffn_expert_parallel": lay.ffn_ep,
        "micro_batches": lay.micro_batches,
        "batch_per_attention_rank": p.batch,
        "attention_us": p.attention_s * 1e6,
        "ffn_us": p.ffn_s * 1e6,
        "transfer_us": p.transfer_s * 1e6,
        "tpot_ms": p.tpot_s * 1e3,
        "throughput_tok_s": p.throughput,
        "throughput_per_device": p.throughput_per_device,
        "mem_attention_gib": p.mem_attention_bytes / 2**30,
        "mem_ffn_gib": p.mem_ffn_bytes / 2**30,
        "bound": p.bound,
        "cpus": p.placement.text if p.placement else None,
    }


def run_plan(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"afd plan: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    shape = load_shape(args.model, args.weight_bytes)
    if args.calibrate:
        from afd.plan.calibrate import fit, measure

        where = Path(args.calibration_dir)
        if args.calibration_repeat < 1:
            raise ValueError(
                f"--calibration-repeat must be at least 1, got {args.calibration_repeat}"
            )
        if not args.reuse:
            measure(args.model, where, repeat=args.calibration_repeat)
        hw, points = fit(shape, where, context=args.calibration_context)
        out = Path(args.hardware or "afd-plan/cpu-calibrated.toml")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(hardware_toml(hw, f"afd plan --calibrate, from {where}"), encoding="utf-8")
        (where / "fit.json").write_text(json.dumps(points, indent=2), encoding="utf-8")
        print(f"calibrated figures: {out} (fit points: {where / 'fit.json'})")
    else:
        hw = load_hardware(args.hardware or "H100-SXM")
    cpu = hw.cores > 0
    micro = (
        tuple(int(x) for x in args.micro_batches.split(",")) if args.micro_batches else (1, 2, 3)
    )
    context = args.context if args.context is not None else 2048.0
    ep = None if args.ffn_expert_parallel is None else args.ffn_expert_parallel == "true"
    c = Constraints(
        devices=args.devices or ((hw.cores + 1) if cpu else 64),
        tpot_s=args.tpot_ms / 1e3 if args.tpot_ms else None,
        context=context,
        max_context=float(args.max_model_len or 0),
        max_batch=args.max_batch,
        micro_batches=micro,
        num_attention=args.num_attention,
        attention_tp=args.attention_tp,
        num_ffn=args.num_ffn,
        ffn_ep=ep,
        concurrency=args.concurrency,
    )
    plans = search(shape, hw, c)
    if not plans:
        print(
            "afd plan: no layout fits (memory per device, TPOT target, device budget); "
            "raise --devices or --tpot-ms, or lower --context / --max-model-len",
            file=sys.stderr,
        )
        return 1
    print(
        f"model {shape.name}: {shape.layers} layers ({shape.moe_layers} MoE), "
        f"{shape.experts} experts top-{shape.top_k}, {shape.weight_bytes:g} B/weight; "
        f"context {context:g}; hardware {hw.name}: {hw.source}"
    )
    print(format_plans(plans[: args.top], hw.name))
    if args.json:
        Path(args.json).write_text(
            json.dumps([_as_json(p) for p in plans[: args.top]], indent=2), encoding="utf-8"
        )
    if args.out:
        best = plans[0]
        model = args.spec_model or _spec_model(args.model)
        text = plan_toml(best, shape, hw, model, c.max_context or context)
        validate_toml(text)
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {args.out} (plan 1; accepted by afd launch's spec loader)")
    return 0


def _spec_model(model: str) -> str:
    from afd.plan.shapes import _recipes

    recipe = _recipes().get(model.lower())
    if recipe is not None:
        return str(recipe.source)
    return str(Path(model).expanduser().absolute())
