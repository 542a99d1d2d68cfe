"""Micro-benchmark: FFN-side compute of a gate-on-FFN expert-parallel MoE block on CPU.

Not a test (pytest does not collect it). Builds a bench-size Qwen3-MoE block (hidden 512,
moe_intermediate 256, 16 experts top-4) natively and as the 2 expert-parallel FFN shards
(``ExpertShardRoutedExperts``), then times ``block(x)`` (router + routed experts, as the
FFN rank runs it with the gate on FFN) for 16 and 64 tokens: median of ``--repeat``
calls after a warm-up, one thread. Also counts the (token, expert) slots each shard's
kernel computed. Used for docs/bench/2026-12-04-ep-foreign-experts.md::

    OMP_NUM_THREADS=1 python packages/afd-moe-runners/tests/bench_ep_foreign_experts.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any
from unittest import mock

BENCH = {"hidden_size": 512, "moe_intermediate_size": 256, "num_experts": 16}
EXPERTS, EP = 16, 2


def _build(env: Any, dtype: Any, rank: int | None, tag: str) -> Any:
    import torch
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    from afd_core.config import AFDConfig, AFDRole
    from afd_moe_runners.role_model import expert_shard_factory

    factory = None
    if rank is not None:
        afd = AFDConfig(
            role=AFDRole.FFN,
            connector="LoopbackAFDConnector",
            num_ffn_ranks=EP,
            rank=rank,
            ffn_expert_parallel=True,
        )
        factory = expert_shard_factory(afd, env.vllm_config, FusedMoEFactory)
    name = "native" if rank is None else f"shard{rank}"
    block = env.build_block(
        "qwen3", dtype, prefix=f"bench_{tag}_{name}.layers.1.mlp", factory=factory
    )
    checkpoint = env.checkpoint_for(
        env.build_block("qwen3", dtype, prefix=f"bench_{tag}_{name}_ref.layers.1.mlp"), seed=5
    )
    from afd_core.topology import expert_shard

    shard = range(EXPERTS) if rank is None else expert_shard(EXPERTS, EP, rank)
    with torch.no_grad():
        for pname, param in block.named_parameters():
            value = checkpoint[pname]
            if "routed_experts." in pname:
                value = value[shard.start : shard.stop]
            param.copy_(value)
    for module in block.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
    return block


def _median_ms(env: Any, block: Any, x: Any, repeat: int) -> float:
    import torch

    times = []
    with torch.no_grad(), env.forward_context(x.shape[0]):
        for _ in range(5):
            block(x)
        for _ in range(repeat):
            t0 = time.perf_counter()
            block(x)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _slots(block: Any, env: Any, x: Any) -> int:
    """(token, expert) slots the shard's kernel computed for ``x`` (rows of topk_ids
    passed to the fused-MoE kernel)."""
    import torch
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk

    seen: list[int] = []
    real = mk.FusedMoEKernelModularImpl.apply

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("topk_ids")
        seen.append(int(ids.numel()))
        return real(self, *args, **kwargs)

    with (
        mock.patch.object(mk.FusedMoEKernelModularImpl, "apply", spy),
        torch.no_grad(),
        env.forward_context(x.shape[0]),
    ):
        block(x)
    return sum(seen)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--label", default="")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()

    import torch

    from afd_models_qwen.testing import QWEN3_STYLE  # the "qwen3" test block's config
    from afd_moe_runners.testing import MoEEnv, session_vllm_config

    torch.set_num_threads(1)
    results: list[dict[str, Any]] = []
    with session_vllm_config() as config, mock.patch.dict(QWEN3_STYLE, BENCH):
        env = MoEEnv(config)
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            native = _build(env, dtype, None, dtype_name)
            shards = [_build(env, dtype, r, dtype_name) for r in range(EP)]
            for tokens in (16, 64):
                x = (
                    torch.randn(tokens, 512, generator=torch.Generator().manual_seed(tokens)) * 0.5
                ).to(dtype)
                row = {"dtype": dtype_name, "tokens": tokens}
                row["native_ms"] = _median_ms(env, native, x, args.repeat)
                for r, block in enumerate(shards):
                    row[f"shard{r}_ms"] = _median_ms(env, block, x, args.repeat)
                    row[f"shard{r}_slots"] = _slots(block, env, x)
                row["native_slots"] = _slots(native, env, x)
                results.append(row)
                print(json.dumps(row), flush=True)
    print(json.dumps({"label": args.label, "results": results}))


if __name__ == "__main__":
    main()
