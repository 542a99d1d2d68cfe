"""The collective part of an attention TP group's exchange, two gloo processes on CPU.

    python tools/tp_collectives.py [HIDDEN]

Per size T, the median time of a broadcast of [T, HIDDEN] bf16 from rank 0 (afd's
TensorParallelExchange: TP worker 0 exchanges and broadcasts the answer) and of an
all-gather of [T/2, HIDDEN] per rank (the token-sharding alternative).
docs/bench/2026-12-02-tp-broadcast-vs-sharding.md has the results; docs/architecture.md
("Broadcast or token sharding") what they decided.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (1, 8, 32, 256, 1024)


def run(rank: int, hidden: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("MASTER_PORT", "29577")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    res: dict[tuple[int, str], float] = {}
    for t in SIZES:
        x = torch.randn(t, hidden, dtype=torch.bfloat16)
        half = torch.randn((t + 1) // 2, hidden, dtype=torch.bfloat16)
        parts = [torch.empty_like(half) for _ in range(2)]
        calls = {
            "broadcast": lambda x=x: dist.broadcast(x, 0),
            "all_gather": lambda parts=parts, half=half: dist.all_gather(parts, half),
        }
        for name, call in calls.items():
            for _ in range(20):
                call()
            dist.barrier()
            t0 = time.perf_counter()
            n = 200
            for _ in range(n):
                call()
            dist.barrier()
            res[(t, name)] = (time.perf_counter() - t0) / n * 1e6
    if rank == 0:
        for t in SIZES:
            print(
                f"T={t:5d} H={hidden}: broadcast {res[(t, 'broadcast')]:8.1f} us  "
                f"all_gather(T/2) {res[(t, 'all_gather')]:8.1f} us"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(int(sys.argv[1]) if len(sys.argv) > 1 else 2048,), nprocs=2)
