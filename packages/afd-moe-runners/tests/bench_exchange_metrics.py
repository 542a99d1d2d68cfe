"""Micro-benchmark: one Attention-side layer exchange with the AFD metrics on.

Not a test (pytest does not collect it). In one process, over afd-core's loopback
connector: an FFN thread echoes every layer message; the Attention side runs
``send_to_ffn`` + ``PendingExchange.receive`` (what every AFD layer does) under a vLLM
forward context with AFD step metadata, ``--layers`` exchanges per step, then ends the
step (``attention_step_ended``, as ``RoleRuntime.run_forward`` does). Metrics on means
prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set to a fresh
folder, as ``afd serve`` does), so the values go to memory-mapped files as in a
deployment. Prints the median per-exchange time of ``--repeat`` rounds, and separately
the metrics' own per-exchange cost (``sent`` + ``received`` + a share of ``end_step``,
no connector) which the round trip's noise hides::

    python packages/afd-moe-runners/tests/bench_exchange_metrics.py [--off]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--off", action="store_true", help="metrics off (no multiproc dir)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200, help="steps per round")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=4)
    args = ap.parse_args()
    if args.off:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    else:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="afd-bench-prom-")

    import torch
    from vllm.forward_context import get_forward_context, set_forward_context

    from afd_core.forward_context import AFDStepMetadata, set_step_metadata
    from afd_core.transfer import AttentionToFFN, FFNToAttention
    from afd_moe_runners import metrics as afd_metrics
    from afd_moe_runners.exchange import send_to_ffn
    from afd_moe_runners.testing import MoEEnv, session_vllm_config

    torch.set_num_threads(1)
    with session_vllm_config() as config:
        env = MoEEnv(config)
        attention, ffn = env.connector_pair()
        stop = threading.Event()

        def serve() -> None:
            while not stop.is_set():
                try:
                    batch = ffn.recv_from_attention(timeout_s=1.0)
                except Exception:
                    continue
                ffn.send_to_attention(batch, FFNToAttention(batch.payload.hidden_states))

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        x = torch.randn(args.tokens, 64)
        payload = AttentionToFFN(x)
        rounds: list[float] = []
        try:
            with torch.no_grad(), set_forward_context(None, config, num_tokens=args.tokens):
                set_step_metadata(get_forward_context(), AFDStepMetadata(connector=attention))

                def run(steps: int) -> float:
                    t0 = time.perf_counter_ns()
                    for _ in range(steps):
                        for layer in range(args.layers):
                            send_to_ffn(payload, layer_idx=layer).receive()
                        afd_metrics.attention_step_ended(0)
                    return (time.perf_counter_ns() - t0) / (steps * args.layers) / 1e3

                run(20)  # warm-up
                for _ in range(args.repeat):
                    rounds.append(run(args.steps))
                m = afd_metrics.attention_metrics(0)
                own: list[float] = []
                if m is not None:
                    result = FFNToAttention(x)
                    n = args.steps * args.layers * 10
                    for _ in range(args.repeat):
                        t0 = time.perf_counter_ns()
                        for i in range(n):
                            m.sent(payload)
                            m.received(result, started_ns=1, wait_ns=1, end_ns=2)
                            if i % args.layers == args.layers - 1:
                                m.end_step()
                        own.append((time.perf_counter_ns() - t0) / n / 1e3)
        finally:
            stop.set()
            attention.close()
            server.join(5)
            ffn.close()
    print(
        json.dumps(
            {
                "metrics": "off" if args.off else "on (multiprocess mode)",
                "exchange_us_median": round(statistics.median(rounds), 2),
                "exchange_us_rounds": [round(r, 2) for r in rounds],
                "metrics_only_us_per_exchange_median": (
                    round(statistics.median(own), 3) if own else None
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
