"""bfloat16 under parallel layouts: native TP=1 vs TP=2 beside two AFD layouts.

    python tools/bf16_layouts.py CHECKPOINT OUT_DIR

Greedy tokens of 10 fixed prompts (one request at a time, 16 tokens, bfloat16, eager)
from native vLLM at TP=1 and TP=2 and from two AFD layouts (Attention TP2 + FFN EP2 with
the gate on Attention; Attention TP1 + FFN EP2 with the gate on FFN). Writes
OUT_DIR/result.json with every token list and, per pair, the prompts whose tokens differ
and the first differing position; prints the summary. About 8 minutes on a 2-core host.
Results: docs/bench/2026-12-02-bf16-layouts.md; what they decided: docs/architecture.md
("bfloat16 under parallel layouts").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

PROMPTS = 10
TOKENS = 16
LAYOUTS: dict[str, dict[str, Any]] = {
    "afd-tp2-ep2-attention": {
        "attention_tensor_parallel_size": 2,
        "num_ffn": 2,
        "ffn_expert_parallel": True,
        "compute_gate_on_attention": True,
    },
    "afd-tp1-ep2-ffn": {"num_ffn": 2, "ffn_expert_parallel": True},
}
PAIRS = (
    ("native-tp1", "native-tp2"),
    ("afd-tp2-ep2-attention", "native-tp2"),
    ("afd-tp2-ep2-attention", "native-tp1"),
    ("afd-tp1-ep2-ffn", "native-tp1"),
    ("afd-tp1-ep2-ffn", "native-tp2"),
)


def native(model: Path, out: Path, prompts: list[str], tp: int) -> list[list[int]]:
    groups = out / "groups.json"
    groups.write_text(json.dumps([[p] for p in prompts]))
    env = dict(os.environ)
    result = out / f"native-tp{tp}.json"
    cmd = [
        sys.executable, "-m", "afd.reference", str(model), "--groups-file", str(groups),
        "--dtype", "bfloat16", "--max-tokens", str(TOKENS), "--json", str(result),
    ]  # fmt: skip
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            str(i % (os.cpu_count() or 1)) for i in range(tp)
        )
        cmd += ["--llm-kwargs", json.dumps({"tensor_parallel_size": tp})]
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    return [g["token_ids"][0] for g in json.loads(result.read_text())["groups"]]


def afd(model: Path, out: Path, prompts: list[str], name: str) -> list[list[int]]:
    from afd.launch import Deployment, DeploymentSpec
    from afd.tools.client import complete_each

    spec = DeploymentSpec(
        model=str(model),
        dtype="bfloat16",
        enforce_eager=True,
        startup_timeout_s=900,
        log_dir=str(out / name),
        **LAYOUTS[name],
    )
    with Deployment(spec, echo=False, name=name) as dep:
        ids, _ = complete_each(dep.url, prompts, TOKENS)
    return ids


def main() -> int:
    from afd.tools.reference import FIXED_PROMPTS

    model, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    prompts = list(FIXED_PROMPTS[:PROMPTS])
    tokens = {f"native-tp{tp}": native(model, out, prompts, tp) for tp in (1, 2)}
    tokens.update({name: afd(model, out, prompts, name) for name in LAYOUTS})
    differing: dict[str, list[int]] = {}
    first: dict[str, list[int | None]] = {}
    for a, b in PAIRS:
        key = f"{a} vs {b}"
        differing[key] = [i for i in range(len(prompts)) if tokens[a][i] != tokens[b][i]]
        first[key] = [
            next(
                (
                    j
                    for j, (x, y) in enumerate(zip(tokens[a][i], tokens[b][i], strict=True))
                    if x != y
                ),
                None,
            )
            for i in differing[key]
        ]
    summary = {"differing_prompts": differing, "first_differing_token": first}
    (out / "result.json").write_text(json.dumps({"tokens": tokens, **summary}, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
