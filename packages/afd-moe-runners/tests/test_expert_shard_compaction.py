"""FFN expert parallelism, FFN side: a rank's kernel computes its own experts' top-k slots
and nothing else (afd_moe_runners.expert_shard.compact_routing), under both gate
placements, and an expert that overflows on one rank does not turn the answers of
tokens that are not routed to it into NaN.

The slots a rank computes are read from what vLLM's fused-MoE kernel is actually given
(``FusedMoEKernelModularImpl.apply``'s ``topk_ids``), and compared with the native
block's own routing of the same tokens (the router is replicated, so both route alike).
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest

pytestmark = pytest.mark.vllm

EXPERTS, TOP_K, INTERMEDIATE = 16, 4, 32  # the "qwen3" test block (afd_models_qwen.testing)


def _ffn_config(rank: int, ep: int) -> Any:
    from afd_core.config import AFDConfig, AFDRole

    return AFDConfig(
        role=AFDRole.FFN,
        connector="LoopbackAFDConnector",
        num_ffn_ranks=ep,
        rank=rank,
        ffn_expert_parallel=True,
    )


def _build(env: Any, checkpoint: dict[str, Any] | None, tag: str, rank: int | None, ep: int) -> Any:
    """A float32 Qwen3-MoE block: native (``rank=None``) or FFN rank ``rank`` of ``ep``
    (built through the FFN role's factory, its shard of ``checkpoint``'s experts)."""
    import torch
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    from afd_core.topology import expert_shard
    from afd_moe_runners.role_model import expert_shard_factory

    factory = None
    if rank is not None:
        factory = expert_shard_factory(_ffn_config(rank, ep), env.vllm_config, FusedMoEFactory)
    who = "native" if rank is None else f"{rank}of{ep}"
    block = env.build_block(
        "qwen3", torch.float32, prefix=f"compact_{tag}_{who}.layers.1.mlp", factory=factory
    )
    if checkpoint is None:
        return block
    shard = range(EXPERTS) if rank is None else expert_shard(EXPERTS, ep, rank)
    with torch.no_grad():
        for name, param in block.named_parameters():
            value = checkpoint[name]
            if "routed_experts." in name:
                value = value[shard.start : shard.stop]
            param.copy_(value)
    for module in block.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
    return block


class KernelSpy:
    """Records the ``topk_ids`` every fused-MoE kernel call is given."""

    def __init__(self) -> None:
        self.ids: list[Any] = []

    def __enter__(self) -> KernelSpy:
        from vllm.model_executor.layers.fused_moe import modular_kernel as mk

        real = mk.FusedMoEKernelModularImpl.apply
        spy = self

        def apply(impl: Any, **kwargs: Any) -> Any:
            spy.ids.append(kwargs["topk_ids"].clone())
            return real(impl, **kwargs)

        self._patch = mock.patch.object(mk.FusedMoEKernelModularImpl, "apply", apply)
        self._patch.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._patch.__exit__(*exc)

    def rows_per_expert(self, num_experts: int) -> list[int]:
        """Kernel rows (token, slot pairs) per expert id over all calls."""
        import torch

        counts = torch.zeros(num_experts, dtype=torch.int64)
        for ids in self.ids:
            flat = ids.flatten().to(torch.int64)
            assert bool(((flat >= 0) & (flat < num_experts)).all()), flat
            counts += torch.bincount(flat, minlength=num_experts)
        return counts.tolist()


class Blocks:
    def __init__(self, env: Any) -> None:
        self.env = env
        self._cache: dict[tuple[str, int | None, int], Any] = {}
        reference = _build(env, None, "ref", None, 1)
        self.checkpoint = env.checkpoint_for(reference, seed=21)

    def get(self, tag: str, rank: int | None, ep: int, checkpoint: Any = None) -> Any:
        key = (tag, rank, ep)
        if key not in self._cache:
            self._cache[key] = _build(self.env, checkpoint or self.checkpoint, tag, rank, ep)
        return self._cache[key]


@pytest.fixture(scope="module")
def blocks(moe_env: Any) -> Blocks:
    return Blocks(moe_env)


def _native_routing(blocks: Blocks, x: Any) -> Any:
    """The global top-k ids the native block's kernel is given for ``x``."""
    import torch

    with KernelSpy() as spy:
        blocks.env.native_forward(blocks.get("main", None, 1), x)
    assert len(spy.ids) == 1
    return spy.ids[0].to(torch.int64)


def _expected_rows(ids: Any, shard: range) -> list[int]:
    import torch

    mine = ids[(ids >= shard.start) & (ids < shard.stop)] - shard.start
    return torch.bincount(mine, minlength=len(shard)).tolist()


@pytest.mark.parametrize("ep", [2, 3])
def test_gate_on_ffn_a_rank_computes_only_its_experts_slots(blocks: Blocks, ep: int) -> None:
    """The FFN rank runs the whole block (its replicated router picks global experts):
    the kernel gets one row per (token, slot) routed to one of the rank's experts, none
    for other ranks' experts (they used to land on local expert 0 with weight 0)."""
    import torch

    from afd_core.topology import expert_shard

    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(5))
    routing = _native_routing(blocks, x)
    for rank in range(ep):
        shard = expert_shard(EXPERTS, ep, rank)
        with KernelSpy() as spy:
            blocks.env.native_forward(blocks.get("main", rank, ep), x)
        assert spy.rows_per_expert(len(shard)) == _expected_rows(routing, shard), rank
        assert sum(int(ids.numel()) for ids in spy.ids) < x.shape[0] * TOP_K


@pytest.mark.parametrize("ep", [2, 3])
def test_gate_on_attention_a_rank_computes_only_its_experts_slots(blocks: Blocks, ep: int) -> None:
    """The Attention role's top-k payload, dispatched as the exchange does (rows with a
    local expert, other experts' weights zeroed but their ids still global)."""
    import torch

    from afd_core.topology import expert_shard
    from afd_core.transfer import AttentionToFFN
    from afd_moe_runners.expert_parallel import dispatch_rows, shard_payload
    from afd_moe_runners.ffn_compute import routed_experts_output

    g = torch.Generator().manual_seed(8)
    x = torch.randn(20, 64, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(20)]).int()
    weights = torch.rand(20, TOP_K, generator=g)
    payload = AttentionToFFN(x, topk_ids=ids, topk_weights=weights)
    for rank in range(ep):
        shard = expert_shard(EXPERTS, ep, rank)
        part = shard_payload(payload, dispatch_rows(ids, shard), shard)
        block = blocks.get("main", rank, ep)
        with KernelSpy() as spy, blocks.env.forward_context(part.num_tokens):
            routed_experts_output(block.experts, part)
        assert spy.rows_per_expert(len(shard)) == _expected_rows(ids.long(), shard), rank


def test_an_overflowing_expert_makes_no_nan_of_tokens_not_routed_to_it(blocks: Blocks) -> None:
    """Expert 8 (FFN rank 1's local expert 0 of 2) overflows to +inf. Natively only the
    tokens routed to it are non-finite; the sum of the ranks' answers must be the same
    (it used to be NaN for every token with an expert of rank 0: 0 * inf)."""
    import torch

    ep, hot = 2, 8
    checkpoint = {k: v.clone() for k, v in blocks.checkpoint.items()}
    w13 = checkpoint["experts.routed_experts.w13_weight"]
    gate = w13[hot, :INTERMEDIATE] * 10
    w13[hot] = torch.cat([gate, gate])  # up = gate: silu(g) * g >= 0, no inf - inf
    checkpoint["experts.routed_experts.w2_weight"][hot] = 1e38
    native = blocks.get("hot", None, 1, checkpoint)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(13))
    with KernelSpy() as spy:
        expected = blocks.env.native_forward(native, x)
    routed_to_hot = (spy.ids[0] == hot).any(dim=1)
    assert 0 < int(routed_to_hot.sum()) < x.shape[0]
    assert bool(torch.isposinf(expected[routed_to_hot]).all())
    assert bool(torch.isfinite(expected[~routed_to_hot]).all())
    parts = [blocks.env.native_forward(blocks.get("hot", r, ep, checkpoint), x) for r in range(ep)]
    for rank, part in enumerate(parts):
        assert not bool(part.isnan().any()), (rank, int(part.isnan().any(dim=1).sum()))
    total = parts[0] + parts[1]
    assert torch.equal(torch.isfinite(total), torch.isfinite(expected))
    torch.testing.assert_close(
        total[~routed_to_hot], expected[~routed_to_hot], rtol=1e-5, atol=1e-6
    )


def test_compact_routing_keeps_local_slots_in_top_k_order() -> None:
    import torch

    from afd_moe_runners.expert_shard import compact_routing

    ids = torch.tensor([[0, 5, 4, 9], [1, 2, 3, 0], [7, 4, 6, 5]], dtype=torch.int32)
    weights = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    pairs = compact_routing(ids, weights, range(4, 8))
    assert pairs.rows.tolist() == [0, 0, 2, 2, 2, 2]
    assert pairs.topk_ids.dtype == torch.int32
    assert pairs.topk_ids.flatten().tolist() == [1, 0, 3, 0, 2, 1]
    assert pairs.topk_weights.flatten().tolist() == [1.0, 2.0, 8.0, 9.0, 10.0, 11.0]
