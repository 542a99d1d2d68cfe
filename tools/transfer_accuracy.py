"""Accuracy of each transfer dtype against native vLLM on served completions (issue 44).

    python tools/transfer_accuracy.py --model DIR [--model DIR ...] [--dtype fp8 ...]
        [--json PATH] [--vllm-arg=--dtype=bfloat16 ...]

For each checkpoint: native ``vllm serve`` once, then a 1A1F AFD deployment (gate on FFN,
``afd serve``'s default connector, eager) per transfer dtype, with the dtype both ways
(``transfer_dtype`` and ``transfer_dtype_return``; ``model`` is the AFD baseline). The
10 fixed prompts x 64 greedy tokens, one request at a time, with the chosen tokens'
logprobs; per dtype: prompts identical to native, token agreement up to each prompt's
first difference, the mean and max |logprob gap| over those common prefixes
(tests/support/afd_transfer.py defines them). The deployments run one after another, so
run it on a quiet host.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

DTYPES = ("model", "fp8", "mxfp8", "int8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True, type=Path)
    parser.add_argument("--dtype", action="append", choices=DTYPES)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--vllm-arg", action="append", default=[])
    args = parser.parse_args()

    from afd_transfer import compare, served_afd, served_native

    from afd.tools.reference import FIXED_PROMPTS

    prompts = list(FIXED_PROMPTS[:10])
    rows: list[dict[str, Any]] = []
    for model in args.model:
        with tempfile.TemporaryDirectory(prefix="afd-transfer-") as tmp:
            t0 = time.monotonic()
            native = served_native(model, Path(tmp), prompts, *args.vllm_arg)
            print(f"{model.name}: native in {time.monotonic() - t0:.0f} s", flush=True)
            for dtype in args.dtype or DTYPES:
                t0 = time.monotonic()
                got, _ = served_afd(model, Path(tmp), prompts, dtype, dtype, *args.vllm_arg)
                row = {"model": model.name, "transfer_dtype": dtype}
                row.update(compare(native, got).as_dict())
                rows.append(row)
                print(json.dumps(row), f"({time.monotonic() - t0:.0f} s)", flush=True)
    print(
        "\n| checkpoint | transfer dtype | identical prompts | token agreement | "
        "mean abs logprob gap | max |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['transfer_dtype']} | {r['identical']}/{r['prompts']} | "
            f"{r['token_agreement']:.3f} | {r['logprob_gap']:.2e} | {r['logprob_gap_max']:.2e} |"
        )
    if args.json:
        worst = {
            d: min(r["token_agreement"] for r in rows if r["transfer_dtype"] == d)
            for d in dict.fromkeys(r["transfer_dtype"] for r in rows)
        }
        report = {
            "date": time.strftime("%Y-%m-%d"),
            "command": "python tools/transfer_accuracy.py "
            + " ".join(f"--model {m.name}" for m in args.model)
            + "".join(f" --dtype {d}" for d in args.dtype or [])
            + " --json OUT",
            "machine": {"nproc": os.cpu_count(), "python": platform.python_version()},
            "prompts": len(prompts),
            "max_tokens": 64,
            "results": rows,
            "result": "lowest token agreement with native per transfer dtype: "
            + ", ".join(f"{d} {v:.3f}" for d, v in worst.items()),
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
