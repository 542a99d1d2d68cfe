"""Per-layer round-trip latency of the P2P AFD connectors vs a shared-memory floor.

    python tools/bench_connector.py [--iters N] [--json PATH] [--connector NAME ...]
        [--transfer-dtype model|fp8|mxfp8|int8 ...]

Measures P2pGlooAFDConnector and P2pShmAFDConnector by default, in the model dtype
(bf16); ``--transfer-dtype`` (repeatable) measures each connector in each transfer dtype,
both ways (``afd.transfer_dtype`` and ``transfer_dtype_return``: the round trip includes
the quantization on each sender and the dequantization on each receiver).

Attention sends ``[tokens, hidden]`` bf16, the FFN side echoes it back; one round trip
is ``send_to_ffn`` + ``recv_from_ffn`` on the attention rank. The floor is the same
bytes handed A -> F -> A through torch shared-memory tensors with a spin-wait flag
(two processes, measured in the same run; the spin yields the CPU so that an
oversubscribed host does not starve the peer): what any same-host transport must pay
at least. Prints a table of medians and the ratio connector/floor per connector, the
machine and the load average before and after the run.

Where the host has two or more usable CPUs, the attention process runs on the first
and the FFN process on the second (floor and connectors alike), as ``afd launch``
places the roles; ``--no-pin`` leaves placement to the scheduler.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

TOKENS = (1, 16, 64, 256)
HIDDEN = (2048, 7168)
WARMUP = 200  # a fresh process pair settles (CPU frequency, caches, the peer's start-up)
DEFAULT_CONNECTORS = ("P2pGlooAFDConnector", "P2pShmAFDConnector")


def _configs() -> list[tuple[int, int]]:
    return [(t, h) for h in HIDDEN for t in TOKENS]


# -- connector round trip ------------------------------------------------------------
def _pin(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def _connector_rank(
    role: str, connector: str, dtype: str, port: int, iters: int, cpu: int | None, out: Any
) -> None:
    _pin(cpu)
    import torch

    from afd_core.config import AFDConfig
    from afd_core.registry import get_connector_class
    from afd_core.transfer import AttentionToFFN, FFNToAttention

    torch.set_num_threads(1)
    config = AFDConfig(
        role=role,
        connector=connector,
        port=port,
        rank=0,
        connect_timeout_s=60,
        transfer_dtype=dtype,
        transfer_dtype_return=dtype,
    )
    conn = get_connector_class(connector)(config, rank=0)
    conn.init()
    try:
        timings: dict[str, list[float]] = {}
        for tokens, hidden in _configs():
            if role == "ffn":
                for _ in range(WARMUP + iters):
                    batch = conn.recv_from_attention()
                    conn.send_to_attention(batch, FFNToAttention(batch.payload.hidden_states))
                continue
            x = torch.randn(tokens, hidden).to(torch.bfloat16)
            samples = []
            for i in range(WARMUP + iters):
                start = time.perf_counter()
                conn.send_to_ffn(AttentionToFFN(x), layer_idx=i % 61)
                y = conn.recv_from_ffn(layer_idx=i % 61)
                elapsed = time.perf_counter() - start
                if i >= WARMUP:
                    samples.append(elapsed)
            if dtype == "model":
                assert torch.equal(y.output, x)
            else:  # quantized twice (there and back): within a few 8-bit steps of each row
                err = (y.output.float() - x.float()).abs().amax(1) / x.float().abs().amax(1)
                assert float(err.max()) < 0.3, (dtype, float(err.max()))
            timings[f"{tokens}x{hidden}"] = samples
        if role == "attention":
            out.put(timings)
    finally:
        conn.close()


# -- shared-memory floor ----------------------------------------------------------------
def _floor_rank(
    role: str, a2f: Any, f2a: Any, flags: Any, iters: int, cpu: int | None, out: Any
) -> None:
    _pin(cpu)
    import torch

    torch.set_num_threads(1)
    seq = 0
    timings: dict[str, list[float]] = {}
    for tokens, hidden in _configs():
        n = tokens * hidden
        x = torch.randn(n).to(torch.bfloat16)
        local = torch.empty(n, dtype=torch.bfloat16)
        samples = []
        for i in range(WARMUP + iters):
            seq += 1
            if role == "ffn":
                while int(flags[0]) != seq:
                    os.sched_yield()
                local.copy_(a2f[:n])
                f2a[:n].copy_(local)
                flags[1] = seq
                continue
            start = time.perf_counter()
            a2f[:n].copy_(x)
            flags[0] = seq
            while int(flags[1]) != seq:
                os.sched_yield()
            local.copy_(f2a[:n])
            elapsed = time.perf_counter() - start
            if i >= WARMUP:
                samples.append(elapsed)
        if role == "attention":
            assert torch.equal(local, x)
            timings[f"{tokens}x{hidden}"] = samples
    if role == "attention":
        out.put(timings)


def _run_pair(
    ctx: Any, target: Any, args: tuple[Any, ...], cpus: tuple[int | None, int | None]
) -> Any:
    out = ctx.Queue()
    procs = [
        ctx.Process(target=target, args=("attention", *args, cpus[0], out)),
        ctx.Process(target=target, args=("ffn", *args, cpus[1], out)),
    ]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=300)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def _machine() -> dict[str, Any]:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            mem_kib = int(f.readline().split()[1])
    except OSError:
        mem_kib = 0
    return {
        "nproc": os.cpu_count(),
        "cpu": model,
        "ram_gib": round(mem_kib / 2**20, 1),
        "python": platform.python_version(),
    }


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().strip()
    except OSError:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200, help="timed round trips per size")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--connector",
        action="append",
        help="connector name(s) to measure (default: P2pGlooAFDConnector, P2pShmAFDConnector)",
    )
    parser.add_argument(
        "--no-pin", action="store_true", help="do not give the two processes a CPU each"
    )
    parser.add_argument(
        "--transfer-dtype",
        action="append",
        choices=("model", "fp8", "mxfp8", "int8"),
        help="transfer dtype(s) to measure each connector in (default: model)",
    )
    args = parser.parse_args()
    dtypes = args.transfer_dtype or ["model"]
    runs = [
        (name, dtype, name if dtype == "model" else f"{name}[{dtype}]")
        for name in args.connector or list(DEFAULT_CONNECTORS)
        for dtype in dtypes
    ]
    connectors = [label for _, _, label in runs]
    usable = sorted(os.sched_getaffinity(0))
    cpus: tuple[int | None, int | None] = (None, None)
    if not args.no_pin and len(usable) >= 2:
        cpus = (usable[0], usable[1])
    load_before = _loadavg()

    import torch
    import torch.multiprocessing as tmp

    from afd_connectors_gpu.testing import free_port

    ctx = tmp.get_context("spawn")
    size = max(TOKENS) * max(HIDDEN)
    a2f = torch.zeros(size, dtype=torch.bfloat16).share_memory_()
    f2a = torch.zeros(size, dtype=torch.bfloat16).share_memory_()
    flags = torch.zeros(2, dtype=torch.int64).share_memory_()
    floor = _run_pair(ctx, _floor_rank, (a2f, f2a, flags, args.iters), cpus)
    measured = {}
    for name, dtype, label in runs:
        port = free_port()
        measured[label] = _run_pair(ctx, _connector_rank, (name, dtype, port, args.iters), cpus)

    machine = _machine()
    machine["load_avg_1m"] = os.getloadavg()[0]
    machine["loadavg_before"] = load_before
    machine["loadavg_after"] = _loadavg()
    machine["cpus_attention_ffn"] = list(cpus)
    placed = "unpinned" if cpus[0] is None else f"attention on CPU {cpus[0]}, FFN on CPU {cpus[1]}"
    print(
        f"machine: {machine['nproc']} CPUs, {machine['cpu']}, {machine['ram_gib']} GiB RAM; "
        f"/proc/loadavg before: {load_before}, after: {machine['loadavg_after']}; {placed}; "
        f"{args.iters} round trips per size, median ms"
    )
    header = f"{'tokens x hidden':>16} {'MiB':>6} {'shm floor':>10}"
    for name in connectors:
        header += f" {name:>20} {'ratio':>6}"
    print(header)
    rows = []
    for tokens, hidden in _configs():
        key = f"{tokens}x{hidden}"
        f_ms = statistics.median(floor[key]) * 1e3
        line = f"{key:>16} {tokens * hidden * 2 / 2**20:>6.2f} {f_ms:>10.3f}"
        row: dict[str, Any] = {"tokens": tokens, "hidden": hidden, "floor_ms": f_ms}
        for name in connectors:
            c_ms = statistics.median(measured[name][key]) * 1e3
            line += f" {c_ms:>20.3f} {c_ms / f_ms:>6.1f}"
            row[name] = {"median_ms": c_ms, "ratio": c_ms / f_ms}
        rows.append(row)
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            report = {"machine": machine, "iters": args.iters, "rows": rows}
            if args.transfer_dtype:
                report["transfer_dtypes"] = dtypes
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
