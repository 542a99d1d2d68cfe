"""The index of docs/bench: one row per measurement JSON (date, machine, command, result).

    python tools/bench_index.py          # rewrite the table in docs/bench/README.md
    python tools/bench_index.py --check  # exit 1 if the table is not up to date

The table sits between the ``<!-- index -->`` markers of docs/bench/README.md and is built
from the JSONs alone: ``afd bench`` reports (``bench.json``), connector microbenchmarks
(``tools/bench_connector.py --json``) and files that carry their own ``date``,
``machine`` and ``command`` (``tools/bf16_layouts.py``; a ``result`` string where they
carry one). ``afd bench`` reports do not
record their command line: it is rebuilt from their ``settings`` with today's flags
(runs made before ``--native-modes`` / ``--afd-modes`` existed ran eager, which today's
``--native-modes eager --afd-modes eager`` reproduces). tests/workspace/test_bench_index.py
runs ``--check``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent.parent / "docs" / "bench"
BEGIN, END = "<!-- index -->", "<!-- /index -->"


def _machine(data: dict[str, Any]) -> str:
    m = data.get("machine")
    if isinstance(m, str):
        return m
    if isinstance(m, dict) and "cpus" in m:
        return f"{m['cpus']} CPUs, Python {m.get('python', '?')}"
    if isinstance(m, dict) and "nproc" in m:
        return f"{m['nproc']} CPUs ({m.get('cpu', '?')}), load {m.get('load_avg_1m', 0):.1f}"
    return "?"


def _bench_command(s: dict[str, Any], repeat: int = 1) -> str:
    parts = ["afd bench --model QWEN3_MOE_BENCH"]
    parts.append("--concurrency " + ",".join(str(c) for c in s["concurrency"]))
    parts.append(f"--output-len {s['output_len']}")
    if s.get("connector"):
        parts.append(f"--connector {s['connector']}")
    micro = s.get("num_micro_batches") or [1]
    if micro != [1]:
        parts.append("--micro-batches " + ",".join(str(m) for m in micro))
    if s.get("micro_batch_min_tokens"):
        parts.append(f"--micro-batch-min-tokens {s['micro_batch_min_tokens']}")
    if s.get("enforce_eager"):
        parts.append("--native-modes eager --afd-modes eager")
    else:
        for flag in ("native_modes", "afd_modes"):
            modes = s.get(flag) or ["compiled"]
            if modes != ["compiled"]:
                parts.append(f"--{flag.replace('_', '-')} {','.join(modes)}")
    if s.get("compute_gate_on_attention"):
        parts.append("--gate-on-attention")
    if repeat > 1:
        parts.append(f"--repeat {repeat}")
    return " ".join(parts)


def _bench_result(data: dict[str, Any]) -> str:
    ratio = data.get("ratio_afd_over_native") or {}
    each = ", ".join(f"c={c} {v['output_tok_s']:.2f}" for c, v in ratio.items())
    out = f"AFD/native tok/s: {each}"
    repeats = data.get("repeats") or {}
    if repeats.get("count", 1) > 1:
        out += f" (medians of {repeats['count']} repeats)"
    return out


def _connector_result(data: dict[str, Any]) -> str:
    row = next(
        (r for r in data["rows"] if r["tokens"] == 64 and r["hidden"] == 2048), data["rows"][0]
    )
    names = [k for k in row if isinstance(row[k], dict)]
    each = ", ".join(f"{n} {row[n]['median_ms']:.3f} ms ({row[n]['ratio']:.1f}x)" for n in names)
    return f"{row['tokens']} x {row['hidden']} round trip: {each}; floor {row['floor_ms']:.3f} ms"


def _row(path: Path) -> tuple[str, str, str, str, str]:
    data = json.loads(path.read_text())
    date = str(data.get("date") or path.name[:10])
    link = f"[{path.name}]({path.name})"
    if "settings" in data:
        repeat = int((data.get("repeats") or {}).get("count", 1))
        command = _bench_command(data["settings"], repeat)
        return date, link, _machine(data), command, _bench_result(data)
    if "rows" in data:
        command = f"python tools/bench_connector.py --iters {data.get('iters', 200)} --json OUT"
        for dtype in data.get("transfer_dtypes") or []:
            command += f" --transfer-dtype {dtype}"
        return date, link, _machine(data), command, _connector_result(data)
    differing = data.get("differing_prompts") or {}
    result = "; ".join(f"{pair}: {len(p)} of 10 prompts differ" for pair, p in differing.items())
    result = result or str(data.get("result", "?"))
    return date, link, _machine(data), str(data.get("command", "?")), result


def table() -> str:
    rows = [_row(p) for p in sorted(BENCH.glob("*.json"))]
    lines = ["| date | file | machine | command | result |", "|---|---|---|---|---|"]
    lines += [f"| {d} | {f} | {m} | `{c}` | {r} |" for d, f, m, c, r in rows]
    return "\n".join(lines)


def render(readme: str) -> str:
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    readme = BENCH / "README.md"
    text = readme.read_text()
    new = render(text)
    if "--check" in argv:
        if new != text:
            print("docs/bench/README.md: the index is out of date; run tools/bench_index.py")
            return 1
        return 0
    readme.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
