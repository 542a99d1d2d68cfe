"""FFN expert parallelism, FFN side: a real vLLM MoE block built for FFN rank f of nF
allocates only its shard of routed experts, loads only those through vLLM's own weight
loader, and computes exactly its share of the block (the sum over the ranks is the
block)."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm

EXPERTS = 16  # the "qwen3" / "deepseek" test blocks (afd_models_*.testing)


def _ffn_config(rank: int, ep: int) -> Any:
    from afd_core.config import AFDConfig, AFDRole

    return AFDConfig(
        role=AFDRole.FFN,
        connector="LoopbackAFDConnector",
        num_ffn_ranks=ep,
        rank=rank,
        ffn_expert_parallel=True,
    )


class Built:
    """One native block per family and its expert-parallel shards, built once each."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self._native: dict[str, tuple[Any, dict[str, Any]]] = {}
        self._shards: dict[tuple[str, int, int], Any] = {}
        #: w2 of each shard as loaded (vLLM CPU repacks it afterwards).
        self.loaded_w2: dict[tuple[str, int, int], Any] = {}

    def native(self, family: str) -> tuple[Any, dict[str, Any]]:
        import torch

        if family not in self._native:
            block = self.env.build_block(
                family, torch.float32, prefix=f"ep_native_{family}.layers.2.mlp"
            )
            checkpoint = self.env.checkpoint_for(block, seed=7)
            self._native[family] = (self.env.load(block, checkpoint), checkpoint)
        return self._native[family]

    def shard(self, family: str, rank: int, ep: int) -> Any:
        """FFN rank ``rank`` of ``ep``'s block: built through the FFN role's factory, its
        experts loaded expert by expert through vLLM's weight loader (every expert of
        the checkpoint offered; the foreign ones must be skipped), the rest as the FFN
        role loads it (:func:`shard_checkpoint`: shared experts zero on ranks > 0)."""
        import torch
        from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

        from afd_moe_runners.expert_parallel import shard_checkpoint
        from afd_moe_runners.role_model import expert_shard_factory

        key = (family, rank, ep)
        if key not in self._shards:
            _, full = self.native(family)
            checkpoint = dict(shard_checkpoint(full.items(), EXPERTS, rank, ep))
            factory = expert_shard_factory(
                _ffn_config(rank, ep), self.env.vllm_config, FusedMoEFactory
            )
            block = self.env.build_block(
                family,
                torch.float32,
                prefix=f"ep_shard_{family}_{rank}of{ep}.layers.2.mlp",
                factory=factory,
            )
            experts = block.experts.routed_experts
            with torch.no_grad():
                for name, param in block.named_parameters():
                    if "routed_experts." in name:
                        continue
                    param.copy_(checkpoint[name])
                w13 = checkpoint["experts.routed_experts.w13_weight"]
                w2 = checkpoint["experts.routed_experts.w2_weight"]
                for e in range(EXPERTS):
                    gate, up = w13[e].chunk(2, dim=0)
                    for param, tensor, shard_id in (
                        (experts.w13_weight, gate, "w1"),
                        (experts.w13_weight, up, "w3"),
                        (experts.w2_weight, w2[e], "w2"),
                    ):
                        experts.weight_loader(
                            param, tensor, f"experts.{e}.{shard_id}.weight", shard_id, e
                        )
            self.loaded_w2[key] = experts.w2_weight.detach().clone()
            for module in block.modules():
                method = getattr(module, "quant_method", None)
                if method is not None and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(module)
            self._shards[key] = block
        return self._shards[key]


@pytest.fixture(scope="module")
def built(moe_env: Any) -> Built:
    return Built(moe_env)


@pytest.mark.parametrize("ep", [2, 3])
def test_a_rank_allocates_and_loads_only_its_shard(built: Built, ep: int) -> None:
    from afd_core.topology import expert_shard
    from afd_moe_runners.expert_shard import ExpertShardRoutedExperts, held_experts

    _, checkpoint = built.native("qwen3")
    total = 0
    for rank in range(ep):
        shard = expert_shard(EXPERTS, ep, rank)
        block = built.shard("qwen3", rank, ep)
        experts = block.experts.routed_experts
        assert isinstance(experts, ExpertShardRoutedExperts)
        assert experts.w13_weight.shape[0] == experts.w2_weight.shape[0] == len(shard)
        assert held_experts({2: block}) == {
            "routed_experts_held": len(shard),
            "routed_experts_absent": EXPERTS - len(shard),
        }
        # What the loader put there: exactly the checkpoint's experts of the shard.
        loaded = checkpoint["experts.routed_experts.w2_weight"][shard.start : shard.stop]
        assert built.loaded_w2[("qwen3", rank, ep)].equal(loaded)
        total += len(shard)
    assert total == EXPERTS


@pytest.mark.parametrize("family", ["qwen3", "deepseek"])
def test_the_ranks_partial_blocks_sum_to_the_native_block(built: Built, family: str) -> None:
    """Gate on FFN: every rank runs the whole block (router replicated) on every token;
    FFN rank 0 alone has the shared expert (zeroed on the others by the role)."""
    import torch

    from afd_moe_runners.expert_parallel import zero_foreign_experts

    ep = 2
    native, _ = built.native(family)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3))
    expected = built.env.native_forward(native, x)
    parts = []
    for rank in range(ep):
        block = built.shard(family, rank, ep)
        held = zero_foreign_experts({2: block}, [2], rank, ep)
        assert held["routed_experts_held"] == EXPERTS // ep
        parts.append(built.env.native_forward(block, x))
    assert all(p.abs().sum() > 0 for p in parts)
    torch.testing.assert_close(parts[0] + parts[1], expected, rtol=1e-5, atol=1e-6)


def test_a_top_k_payload_computes_exactly_the_shard_share(built: Built) -> None:
    """Gate on Attention: global top-k ids and weights in; the rank's answer is the native
    experts' answer with the weights of other ranks' experts zeroed (float32: up to the
    order of the sum over a token's local experts, which the rank adds itself; the
    foreign experts are not computed, test_expert_shard_compaction.py)."""
    import torch

    from afd_core.topology import expert_shard
    from afd_core.transfer import AttentionToFFN
    from afd_moe_runners.ffn_compute import routed_experts_output

    ep = 3
    native, _ = built.native("qwen3")
    g = torch.Generator().manual_seed(11)
    x = torch.randn(12, 64, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:4] for _ in range(12)]).int()
    weights = torch.rand(12, 4, generator=g)
    total = torch.zeros_like(x)
    with built.env.forward_context(12):
        full = routed_experts_output(
            native.experts, AttentionToFFN(x, topk_ids=ids, topk_weights=weights)
        )
        for rank in range(ep):
            shard = expert_shard(EXPERTS, ep, rank)
            mine = (ids >= shard.start) & (ids < shard.stop)
            ref = routed_experts_output(
                native.experts,
                AttentionToFFN(x, topk_ids=ids, topk_weights=torch.where(mine, weights, 0.0)),
            )
            block = built.shard("qwen3", rank, ep)
            got = routed_experts_output(
                block.experts, AttentionToFFN(x, topk_ids=ids, topk_weights=weights)
            )
            assert got.abs().sum() > 0
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
            total += got
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-6)


def test_a_model_with_its_own_experts_class_is_refused(moe_env: Any) -> None:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from afd_core.errors import AFDConfigError
    from afd_moe_runners.role_model import expert_shard_factory

    def native_factory(**kwargs: Any) -> Any:
        raise AssertionError("must not be reached")

    factory = expert_shard_factory(_ffn_config(0, 2), moe_env.vllm_config, native_factory)
    with pytest.raises(AFDConfigError, match=r"own class RoutedExperts.*ffn_expert_parallel"):
        factory(prefix="model.layers.1.mlp.experts", routed_experts_cls=RoutedExperts)
