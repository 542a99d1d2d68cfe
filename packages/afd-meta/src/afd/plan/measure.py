"""The measurements of ``afd plan --calibrate`` on this host (:func:`measure`), and where
a repeated calibration keeps them (:func:`repeat_dirs`); :mod:`afd.plan.calibrate` fits
them. Nothing is re-implemented here: ``afd bench --profile`` on 1A1F deployments,
``tools/bench_connector.py`` and one tensor copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["LEVELS", "REPEAT_PREFIX", "measure", "measure_memory_bw", "repeat_dirs"]

#: Concurrency levels of the calibration runs (one attention rank: the batch per step),
#: spanning the batches a small CPU host serves.
LEVELS = (1, 3, 6, 12, 24, 48)


def _connector_tool() -> Path | None:
    """``tools/bench_connector.py`` of the source checkout this package runs from."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        tool = parent / "tools" / "bench_connector.py"
        if tool.is_file():
            return tool
    return None


def measure_memory_bw(size_mib: int = 256, repeats: int = 5) -> float:
    """One core's copy bandwidth (bytes read + written per second, best of ``repeats``)."""
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(size_mib * 2**20 // 4)
        dst = torch.empty_like(src)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        return 2 * src.numel() * 4 / best
    finally:
        torch.set_num_threads(threads)


def _bench(model: str, out: Path, levels: Sequence[int], extra: Sequence[str]) -> list[str]:
    return [
        *(sys.executable, "-m", "afd.cli", "bench", "--model", model, "--modes", "afd"),
        *("--concurrency", ",".join(map(str, levels)), "--output-len", "64", "--profile"),
        *("--no-plot", "--out", str(out), *extra),
    ]


#: The folders of a repeated calibration: ``rep-1``, ``rep-2``...
REPEAT_PREFIX = "rep-"


def measure(
    model: str, out: Path, levels: Sequence[int] = LEVELS, say: Any = print, repeat: int = 1
) -> None:
    """Run the measurements into ``out``: memory.json, bench/bench.json (1A1F as the
    launcher places it: the roles take turns on every CPU), bench-pinned/bench.json (1A1F
    with each role on one CPU of its own), bench-crowded/bench.json (both roles on one
    CPU), connector.json. With ``repeat`` > 1 the whole set ``repeat`` times, into
    ``out/rep-1``... (:func:`fit` takes their medians)."""
    if repeat < 1:
        raise ValueError(f"--calibration-repeat must be at least 1, got {repeat}")
    if repeat > 1:
        for k in range(1, repeat + 1):
            say(f"calibrate: repeat {k} of {repeat}")
            measure(model, out / f"{REPEAT_PREFIX}{k}", levels, say)
        return
    out.mkdir(parents=True, exist_ok=True)
    bw = measure_memory_bw()
    say(f"calibrate: one core copies {bw / 1e9:.1f} GB/s")
    (out / "memory.json").write_text(json.dumps({"copy_bw_per_core": bw}), encoding="utf-8")
    from afd.launch.cpus import usable_cpus

    cpus = usable_cpus()
    runs = [(out / "bench", [])]
    if len(cpus) >= 2:
        pinned = ["--attention-cpus", str(cpus[0]), "--ffn-cpus", str(cpus[-1])]
        runs.append((out / "bench-pinned", pinned))
        # both roles on one CPU: more role processes than CPUs (as 3 on 2 CPUs)
        crowded = ["--attention-cpus", str(cpus[0]), "--ffn-cpus", str(cpus[0])]
        runs.append((out / "bench-crowded", crowded))
    for where, extra in runs:
        cmd = _bench(model, where, levels, extra)
        say("calibrate: " + " ".join(cmd[2:]))
        subprocess.run(cmd, check=True)
    tool = _connector_tool()
    if tool is None:
        say("calibrate: tools/bench_connector.py not found (no source checkout): link kept")
        return
    conn = [sys.executable, str(tool), "--iters", "100", "--connector", "P2pShmAFDConnector"]
    conn += ["--json", str(out / "connector.json")]
    say("calibrate: " + " ".join(conn[1:]))
    subprocess.run(conn, check=True, env={**os.environ})


def repeat_dirs(directory: Path) -> list[Path]:
    """The measurement folders of a calibration: its ``rep-N`` folders in order, else the
    folder itself (one run)."""
    reps = [
        p
        for p in directory.glob(f"{REPEAT_PREFIX}*")
        if p.is_dir() and p.name[len(REPEAT_PREFIX) :].isdigit()
    ]
    return sorted(reps, key=lambda p: int(p.name[len(REPEAT_PREFIX) :])) or [directory]
