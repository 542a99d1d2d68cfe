"""One-GPU checks of the NCCL connector, for a machine with CUDA but without vLLM.

Usage (on the GPU host, with afd-core and afd-connectors-gpu importable)::

    python tools/gpu_check.py --out gpu_check.json

What it runs, each part in fresh spawned processes (one per AFD rank):

1. ``same_gpu_refused``: a real ``P2pNcclAFDConnector`` 1A1F deployment with both ranks
   on GPU 0 -> every rank's ``init()`` must raise ``AFDConfigError`` naming both ranks
   and the device (what the join-time device check is for).
2. ``nccl_exchange_<topo>``: NCCL's own verdict on two ranks of one GPU, and, if NCCL
   allows it on this host, the connector's whole CUDA data path (per-peer buffer pool,
   one communicator per direction, the NCCL wait loop, the peer watchers, the FFN's idle
   wait) with a connector whose device check is switched off (``SameGpuNccl`` below, a
   test-only subclass: on a real deployment the check stays on). Exact values are
   checked (the FFN computes ``hidden * 2 + layer``); 2A1F puts two attention peers
   of one FFN rank in the same size bucket every layer, which fails without per-peer
   buffers.
3. ``nccl_peer_loss``: the FFN side waiting in the NCCL receive while its attention
   peer's process dies must raise ``AFDPeerLostError`` quickly (the gloo watcher).

4. ``compiled_exchange``: the Attention role's exchange op (``afd::exchange``,
   afd_moe_runners.exchange_op; torch only) on cuda:0 inside ``torch.compile(backend=
   "inductor", fullgraph=True, dynamic=True)`` of a small Linear -> exchange -> Linear
   model whose fake layer's exchange runs host code (a counter, a host copy): outputs
   equal eager, the op runs once per call; then the same compiled call captured whole in
   a CUDA graph and replayed: the replay skips the exchange's host code (the counter does
   not move), which is why full CUDA graphs are refused and piecewise graphs split at the
   op (docs/architecture.md, "Compiled execution").
5. ``micro_batch_threads`` (in this process; torch only): a thread started by the
   micro-batch scheduler's helper (afd_moe_runners.micro_batch_threads) from a thread on
   a non-default stream of the last GPU must see that device and stream; its work (a
   ~0.1 s sleep kernel, then a fill) is still running when the starter, after joining
   it, queues the merge (a sum) behind ``wait_for_threads``, and the merge must see the
   fill.
6. ``nccl_send_timeout``: a real 1A1F deployment on GPUs 0 and 1 (skipped, saying so,
   with fewer than 2 GPUs: NCCL refuses two ranks on one GPU). After one full round trip
   (both communicators exist) the attention rank sends two 14 MiB messages that the FFN
   never receives; staging the second one settles the first NCCL send, which must time
   out after ``transfer_timeout_s`` (2 s) with ``AFDTimeoutError``, abort both
   communicators (recorded by a test-only subclass) and leave the device able to
   synchronize.

7. ``piecewise_graph_contract`` (in this process; torch only): vLLM's piecewise CUDA
   graphs as they run a model split at a splitting op, with real ``torch.cuda.CUDAGraph``
   pieces: piece 1 (``relu(a(x))``, captured) -> an eager custom op whose body runs host
   code, as the AFD exchange does -> piece 2 (``b(y + x)``, captured, reading the op's
   result). Captured once on a static input, then replayed on new inputs with the op
   run eagerly between the pieces (``CUDAGraphWrapper`` copies no inputs). Three ops:
   ``clone_return`` (returns a fresh tensor: afd's op before issue 40), ``output_write``
   (writes into an ``output`` the traced code allocated before the op, ``mutates_args``:
   vLLM's splitting-op contract) and ``afd_exchange`` (afd's ``afd::exchange`` as the
   Attention role's compiled graph calls it). For each: whether the op's result stayed
   at the address piece 2 captured, and whether the replayed output equals eager.

Prints one JSON document (also written to ``--out``). This is a tool, not a test: the
GPU-marked tests need one GPU per rank (see docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from typing import Any

HIDDEN = 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _connector(
    kind: str, role: str, rank: int, a: int, f: int, port: int, timeout: float, device: int = 0
) -> Any:
    from afd_connectors_gpu.p2p import P2pNcclAFDConnector
    from afd_core.config import AFDConfig

    class SameGpuNccl(P2pNcclAFDConnector):
        """Test-only: the join-time device check off, so one GPU can host two ranks."""

        def _device_identity(self) -> str | None:
            return None

    class AbortRecordingNccl(P2pNcclAFDConnector):
        """Test-only: records the directions of the communicators it aborts."""

        aborted: tuple[str, ...] = ()

        def _abort_nccl(self, group: Any) -> None:
            self.aborted = tuple(sorted(group.nccl))
            super()._abort_nccl(group)

    classes = {"real": P2pNcclAFDConnector, "same": SameGpuNccl, "recording": AbortRecordingNccl}
    cls = classes[kind]
    config = AFDConfig(
        role=role,
        connector="P2pNcclAFDConnector",
        num_attention_ranks=a,
        num_ffn_ranks=f,
        host="127.0.0.1",
        port=port,
        connect_timeout_s=60.0,
        transfer_timeout_s=timeout,
        num_micro_batches=2,
        connector_extra_config={"device": device, "max_num_tokens": 1024},
    )
    return cls(config, rank=rank)


def _rank_main(part: str, role: str, rank: int, a: int, f: int, port: int, q: Any) -> None:
    import torch

    from afd_core.transfer import AttentionToFFN, FFNToAttention

    result: dict[str, Any] = {"role": role, "rank": rank}
    try:
        if part == "same_gpu_refused":
            conn = _connector("real", role, rank, a, f, port, 30.0)
            try:
                conn.init()
                result["error"] = None
            except Exception as exc:
                result["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                conn.close()
        elif part == "exchange":
            conn = _connector("same", role, rank, a, f, port, 2.0)
            t0 = time.monotonic()
            conn.init()
            result["init_s"] = round(time.monotonic() - t0, 2)
            layers, mismatches, rtts = 4, 0, []
            if role == "ffn":
                t0 = time.monotonic()
                first = True
                for _ in range(layers * 2 + 20):  # 4 layers x 2 micro-batches + timing
                    batch = conn.recv_from_attention()
                    if first:
                        result["idle_wait_s"] = round(time.monotonic() - t0, 2)
                        first = False
                    h = batch.payload.hidden_states
                    conn.send_to_attention(batch, FFNToAttention(h * 2 + batch.layer_idx))
            else:
                time.sleep(3 * 2.0)  # idle for 3x transfer_timeout_s before the first step
                for layer in range(layers):
                    sent = {}
                    for mb in range(2):
                        # Several sizes, all in one bucket (17..32) for every peer.
                        n = 17 + (rank * 5 + layer * 3 + mb * 7) % 16
                        g = torch.Generator(device="cuda").manual_seed(
                            1000 * rank + 10 * layer + mb
                        )
                        h = torch.randn(n, HIDDEN, device="cuda:0", generator=g).to(torch.bfloat16)
                        sent[mb] = h
                        conn.send_to_ffn(AttentionToFFN(h), layer_idx=layer, micro_batch_idx=mb)
                    for mb in range(2):
                        out = conn.recv_from_ffn(layer_idx=layer, micro_batch_idx=mb).output
                        if not torch.equal(out, sent[mb] * 2 + layer):
                            mismatches += 1
                result["mismatches"] = mismatches
                h = torch.randn(64, 7168, device="cuda:0").to(torch.bfloat16)
                for i in range(20):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    conn.send_to_ffn(AttentionToFFN(h), layer_idx=100 + i)
                    conn.recv_from_ffn(layer_idx=100 + i)
                    torch.cuda.synchronize()
                    rtts.append(time.perf_counter() - t0)
                result["rtt_ms_64x7168_median"] = round(sorted(rtts)[len(rtts) // 2] * 1e3, 3)
            conn.close()
            result["error"] = None
        elif part == "peer_loss":
            conn = _connector("same", role, rank, a, f, port, 30.0)
            conn.init()
            if role == "attention":
                h = torch.ones(8, HIDDEN, device="cuda:0", dtype=torch.bfloat16)
                conn.send_to_ffn(AttentionToFFN(h), layer_idx=0)
                conn.recv_from_ffn(layer_idx=0)
                # Send only the frame of the next message, then die: the FFN side is then
                # blocked in the NCCL receive of the tensor.
                from afd_core.wire import Frame

                frame = Frame(AttentionToFFN(h).header(1, 0), None, 0)
                head = torch.tensor(frame.encode(), dtype=torch.int64)
                conn.transport._group.gloo.send([head], conn.peers[0], 0).wait()
                time.sleep(1.0)
                os._exit(0)
            batch = conn.recv_from_attention()
            conn.send_to_attention(batch, FFNToAttention(batch.payload.hidden_states))
            t0 = time.monotonic()
            try:
                conn.recv_from_attention()
                result["error"] = None
            except Exception as exc:
                result["error"] = f"{type(exc).__name__}: {exc}"
            result["detected_after_s"] = round(time.monotonic() - t0, 2)
            conn.close()
        elif part == "send_timeout":
            _send_timeout_rank(role, rank, a, f, port, result)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-3000:]
    q.put(result)


def _send_timeout_rank(
    role: str, rank: int, a: int, f: int, port: int, result: dict[str, Any]
) -> None:
    """Part 6, one rank (attention on cuda:0, FFN on cuda:1): see the module docstring."""
    import torch

    from afd_core.transfer import AttentionToFFN, FFNToAttention

    device = 0 if role == "attention" else 1
    conn = _connector("recording", role, rank, a, f, port, 2.0, device=device)
    conn.init()
    if role == "ffn":
        batch = conn.recv_from_attention()
        conn.send_to_attention(batch, FFNToAttention(batch.payload.hidden_states))
        time.sleep(10.0)  # never receives layers 1 and 2
        conn.close()
        result["error"] = None
        return
    h = torch.ones(8, HIDDEN, device=f"cuda:{device}", dtype=torch.bfloat16)
    conn.send_to_ffn(AttentionToFFN(h), layer_idx=0)
    conn.recv_from_ffn(layer_idx=0)  # both communicators now exist
    big = torch.ones(1024, 7168, device=f"cuda:{device}", dtype=torch.bfloat16)  # 14 MiB
    t0 = time.monotonic()
    try:
        conn.send_to_ffn(AttentionToFFN(big), layer_idx=1)
        conn.send_to_ffn(AttentionToFFN(big), layer_idx=2)  # same buffer: settles layer 1
        result["error"] = None
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["detected_after_s"] = round(time.monotonic() - t0, 2)
    result["aborted"] = list(conn.aborted)
    t0 = time.monotonic()
    torch.cuda.synchronize(device)  # hangs if the abort left the send kernel running
    result["synchronize_s"] = round(time.monotonic() - t0, 2)
    conn.close()


def _run(part: str, a: int, f: int, timeout: float = 120.0) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(part, role, r, a, f, port, q))
        for role, n in (("attention", a), ("ffn", f))
        for r in range(n)
    ]
    for p in procs:
        p.start()
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    expected = len(procs) - (1 if part == "peer_loss" else 0)
    while len(out) < expected and time.monotonic() < deadline:
        try:
            out.append(q.get(timeout=1.0))
        except Exception:
            if not any(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    if len(out) < expected:
        out.append({"error": f"only {len(out)} of {expected} ranks reported within {timeout} s"})
    return out


def compiled_exchange_probe() -> dict[str, Any]:
    """Part 4 (in this process, cuda:0): see the module docstring."""
    import torch

    from afd_moe_runners import exchange_op

    result: dict[str, Any] = {}
    try:

        class HostLayer:
            calls = 0

            def afd_exchange(self, x: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
                HostLayer.calls += 1
                return (x.cpu() * 2 + 1).to(x.device)  # host code, as a connector's

        layer = HostLayer()
        exchange_op.register_layer("probe.layers.0.mlp", layer)

        class Model(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = torch.nn.Linear(HIDDEN, HIDDEN)
                self.b = torch.nn.Linear(HIDDEN, HIDDEN)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                y = exchange_op.exchange(layer, "probe.layers.0.mlp", torch.relu(self.a(x)))
                return self.b(y + x)

        model = Model().cuda().eval()
        compiled = torch.compile(model, backend="inductor", fullgraph=True, dynamic=True)
        t0 = time.perf_counter()
        with torch.no_grad():
            for n in (3, 17, 64):
                x = torch.randn(n, HIDDEN, device="cuda")
                before = (HostLayer.calls, exchange_op.compiled_calls())
                got = compiled(x)
                calls = (HostLayer.calls - before[0], exchange_op.compiled_calls() - before[1])
                want = model(x)
                result[f"tokens_{n}"] = {
                    "max_abs_diff_vs_eager": float((got - want).abs().max()),
                    "op_calls": calls[1],
                    "host_calls": calls[0],
                }
            result["compile_s"] = round(time.perf_counter() - t0, 2)
            static = torch.randn(8, HIDDEN, device="cuda")
            compiled(static)  # warm
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    out = compiled(static)
                calls = HostLayer.calls
                graph.replay()
                torch.cuda.synchronize()
                result["full_graph_capture"] = {
                    "captured": True,
                    "host_calls_during_replay": HostLayer.calls - calls,
                    "replay_equals_eager": bool(torch.allclose(out, model(static), atol=1e-3)),
                }
            except Exception as exc:  # capture of host code may fail outright
                result["full_graph_capture"] = {
                    "captured": False,
                    "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                }
    except Exception:
        result["error"] = traceback.format_exc()[-2000:]
    return result


def piecewise_contract_probe() -> dict[str, Any]:
    """Part 7 (in this process, cuda:0): see the module docstring."""
    import torch

    result: dict[str, Any] = {}
    try:
        lib = "afd_gpu_check"

        def host_body(x: torch.Tensor) -> torch.Tensor:
            return (x.cpu() * 2 + 1).to(x.device)  # host code between the pieces

        # Explicit schemas: this module's annotations are strings and torch is not one of
        # its globals, so the schema cannot be inferred from them.
        @torch.library.custom_op(
            f"{lib}::clone_return", mutates_args=(), schema="(Tensor x) -> Tensor"
        )
        def clone_return(x: torch.Tensor) -> torch.Tensor:
            return host_body(x).clone()

        @torch.library.custom_op(
            f"{lib}::output_write",
            mutates_args=("output",),
            schema="(Tensor x, Tensor(a!) output) -> ()",
        )
        def output_write(x: torch.Tensor, output: torch.Tensor) -> None:
            output.copy_(host_body(x))

        # name -> (op, writes into an output allocated by piece 1?)
        variants: dict[str, tuple[Any, bool]] = {
            "clone_return": (lambda h, out: clone_return(h), False),
            "output_write": (lambda h, out: output_write(h, out), True),
        }
        try:
            from afd_moe_runners import exchange_op

            class HostLayer:
                def afd_exchange(
                    self, x: torch.Tensor, logits: torch.Tensor | None
                ) -> torch.Tensor:
                    return host_body(x)

            host_layer = HostLayer()  # the registry holds layers weakly: keep it alive
            exchange_op.register_layer("probe.layers.1.mlp", host_layer)
            variants["afd_exchange"] = (
                lambda h, out: torch.ops.afd.exchange(h, None, out, "probe.layers.1.mlp"),
                True,
            )
        except Exception as exc:  # afd not importable here: report, go on
            result["afd_exchange"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}

        torch.manual_seed(0)
        a = torch.nn.Linear(HIDDEN, HIDDEN).cuda()
        b = torch.nn.Linear(HIDDEN, HIDDEN).cuda()
        for name, (op, writes) in variants.items():
            try:
                result[name] = _piecewise_run(torch, a, b, op, writes, host_body)
            except Exception as exc:
                result[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    except Exception:
        result["error"] = traceback.format_exc()[-2000:]
    return result


def _piecewise_run(
    torch: Any, a: Any, b: Any, op: Any, writes: bool, host_body: Any
) -> dict[str, Any]:
    """Capture piece 1 and piece 2 around an eager ``op``, replay on new inputs. With
    ``writes`` piece 1 also allocates the op's output (traced code, graph memory) and the
    op writes into it; otherwise the op returns its result."""
    tokens = 16
    static_x = torch.zeros(tokens, HIDDEN, device="cuda")
    with torch.no_grad():

        def piece1(x: Any) -> Any:
            h = torch.relu(a(x))
            return h, (torch.empty_like(h) if writes else None)

        def run_op(h: Any, out: Any) -> Any:
            got = op(h, out)
            return out if writes else got

        def piece2(y: Any, x: Any) -> Any:
            return b(y + x)

        def eager(x: Any) -> Any:
            return piece2(host_body(torch.relu(a(x))), x)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up, as vLLM runs before capturing
            piece2(run_op(*piece1(static_x)), static_x)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g1, pool=pool):
            h, out = piece1(static_x)
        y = run_op(h, out)  # eager between the pieces (reads what capture left in h)
        captured = y.data_ptr()
        with torch.cuda.graph(g2, pool=pool):
            z = piece2(y, static_x)
        stable, equal, worst = [], [], 0.0
        for seed in range(3):
            x = torch.randn(tokens, HIDDEN, device="cuda") * (seed + 1)
            static_x.copy_(x)
            g1.replay()
            y_now = run_op(h, out)
            stable.append(y_now.data_ptr() == captured)
            g2.replay()
            torch.cuda.synchronize()
            want = eager(x)
            worst = max(worst, float((z - want).abs().max()))
            equal.append(bool(torch.allclose(z, want, atol=1e-4, rtol=1e-4)))
        return {
            "op_result_at_captured_address": all(stable),
            "replay_equals_eager": all(equal),
            "max_abs_diff_vs_eager": worst,
        }


def micro_batch_threads_probe() -> dict[str, Any]:
    """Part 5 (in this process, on the last GPU): see the module docstring."""
    import torch

    from afd_moe_runners.micro_batch_threads import (
        start_thread,
        starter_placement,
        wait_for_threads,
    )

    result: dict[str, Any] = {}
    try:
        device = torch.cuda.device_count() - 1
        stream = torch.cuda.Stream(device=device)
        out = torch.zeros(1 << 20, device=f"cuda:{device}")
        done = torch.cuda.Event()
        seen: dict[str, Any] = {}

        def body() -> None:
            seen["device"] = torch.cuda.current_device()
            seen["on_starters_stream"] = torch.cuda.current_stream() == stream
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: still running at the merge
            out.fill_(1.0)
            done.record()

        with torch.cuda.device(device), torch.cuda.stream(stream):
            placement = starter_placement()
            start_thread(body, (), name="afd-probe", placement=placement).join()
            result["thread_work_running_at_merge"] = not done.query()
            wait_for_threads(placement)
            merged = out.sum()  # the merge, queued on the starter's stream
            result["merge_saw_thread_work"] = float(merged) == out.numel()
        result["starter"] = {
            "device": device,
            "stream_is_default": stream == torch.cuda.default_stream(device),
        }
        result["thread"] = seen
    except Exception:
        result["error"] = traceback.format_exc()[-2000:]
    return result


def nccl_send_timeout_probe() -> Any:
    """Part 6: see the module docstring."""
    import torch

    found = torch.cuda.device_count()
    if found < 2:
        return {"skipped": f"needs 2 GPUs (NCCL refuses two ranks on one GPU), found {found}"}
    return _run("send_timeout", 1, 1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_check.json")
    args = ap.parse_args()
    import torch

    report: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": str(torch.cuda.nccl.version()),
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "python": sys.version.split()[0],
    }
    report["same_gpu_refused"] = _run("same_gpu_refused", 1, 1)
    report["nccl_exchange_1A1F"] = _run("exchange", 1, 1)
    report["nccl_exchange_2A1F"] = _run("exchange", 2, 1)
    report["nccl_peer_loss"] = _run("peer_loss", 1, 1)
    report["compiled_exchange"] = compiled_exchange_probe()
    report["micro_batch_threads"] = micro_batch_threads_probe()
    report["piecewise_graph_contract"] = piecewise_contract_probe()
    report["nccl_send_timeout"] = nccl_send_timeout_probe()
    text = json.dumps(report, indent=2)
    print(text)
    with open(args.out, "w") as fh:
        fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
