"""The FFN role's warm-up: every layer it serves runs once, on a dummy batch of the payload
kind the deployment sends it, before its attention peers connect; results do not change.

Real vLLM blocks (a DeepSeek-V3-style MoE block and a dense MLP, seeded weights) behind
``FFNLayerCompute``; a few milliseconds each on CPU.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest

pytestmark = pytest.mark.vllm

DENSE, MOE = 0, 3
PLACEMENTS = {
    # placement: (compute_gate_on_attention, routing_payload, the MoE layer's payload kind)
    "gate_on_ffn": (False, "topk", "HIDDEN"),
    "gate_on_attention_topk": (True, "topk", "HIDDEN_TOPK"),
    "gate_on_attention_logits": (True, "router_logits", "HIDDEN_ROUTER_LOGITS"),
}


class Layers:
    """A dense MLP (layer 0) and a DeepSeek-V3-style MoE block (layer 3), built under a
    name of their own each time (vLLM's layer registry needs unique prefixes)."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.built = 0

    def compute(self) -> Any:
        import torch
        from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLP

        from afd_moe_runners import FFNLayerCompute

        self.built += 1
        name = f"warm_{self.built}.layers"
        with torch.device("cpu"):
            dense = DeepseekV2MLP(
                hidden_size=64, intermediate_size=128, hidden_act="silu",
                prefix=f"{name}.{DENSE}.mlp",
            )  # fmt: skip
        moe = self.env.build_block("deepseek", torch.float32, prefix=f"{name}.{MOE}.mlp")
        blocks = {
            DENSE: self.env.load(dense, self.env.checkpoint_for(dense, seed=7)),
            MOE: self.env.load(moe, self.env.checkpoint_for(moe, seed=1234)),
        }
        return FFNLayerCompute(blocks, vllm_config=self.env.vllm_config)


@pytest.fixture(scope="module")
def layers(moe_env: Any) -> Layers:
    return Layers(moe_env)


def warm_up_recorded(compute: Any, **kwargs: Any) -> tuple[Any, list[tuple[int, Any]]]:
    """Warm up ``compute`` and record every (layer, payload) it ran through ``compute``."""
    seen: list[tuple[int, Any]] = []
    original = compute.compute

    def record(layer_idx: int, payload: Any) -> Any:
        seen.append((layer_idx, payload))
        return original(layer_idx, payload)

    with mock.patch.object(compute, "compute", side_effect=record):
        report = compute.warm_up(**kwargs)
    return report, seen


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_warm_up_runs_every_layer_once_with_the_payload_kind_it_will_receive(
    layers: Layers, placement: str
) -> None:
    gate_on_attention, routing, moe_kind = PLACEMENTS[placement]
    compute = layers.compute()
    report, seen = warm_up_recorded(
        compute, compute_gate_on_attention=gate_on_attention, routing_payload=routing
    )
    ran = {layer: payload.kind.name for layer, payload in seen}
    assert len(seen) == 2
    assert ran == {DENSE: "HIDDEN", MOE: moe_kind}
    assert {layer: kind.name for layer, kind in report.kinds.items()} == ran
    for _, payload in seen:
        assert payload.hidden_states.shape == (report.num_tokens, 64)
        assert payload.hidden_states.dtype.is_floating_point
    summary = report.summary()
    expected = sorted([("HIDDEN", 1), (moe_kind, 1)]) if moe_kind != "HIDDEN" else [("HIDDEN", 2)]
    assert summary.startswith(
        "warmed up 2 FFN layers ("
        + ", ".join(f"{n} x {kind}" for kind, n in expected)
        + f") on {report.num_tokens} dummy tokens in "
    ), summary
    assert report.seconds >= 0


def test_warm_up_top_k_ids_are_valid_experts_of_the_layer(layers: Layers) -> None:
    import torch

    compute = layers.compute()
    moe = compute.runners[MOE].moe_config
    _, seen = warm_up_recorded(compute, compute_gate_on_attention=True, num_tokens=20)
    payload = dict(seen)[MOE]
    ids, weights = payload.topk_ids, payload.topk_weights
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32  # as Attention sends
    assert ids.shape == weights.shape == (20, moe.experts_per_token)
    assert int(ids.min()) >= 0 and int(ids.max()) < moe.num_logical_experts
    assert all(len(set(row.tolist())) == moe.experts_per_token for row in ids)
    # 20 rows cycle through all 16 experts as their first choice.
    assert set(ids[:, 0].tolist()) == set(range(moe.num_logical_experts))
    assert torch.allclose(weights.sum(dim=1), torch.ones(20))


def test_warm_up_under_expert_parallelism_routes_every_row_to_this_ranks_shard(
    layers: Layers,
) -> None:
    import torch

    from afd_core.topology import expert_shard

    compute = layers.compute()
    experts = compute.runners[MOE].moe_config.num_logical_experts
    shard = expert_shard(experts, 3, 2)  # FFN rank 2 of 3: experts 11-15 of 16
    _, seen = warm_up_recorded(
        compute, compute_gate_on_attention=True, expert_parallel=(2, 3), num_tokens=8
    )
    payload = dict(seen)[MOE]
    ids, weights = payload.topk_ids, payload.topk_weights
    assert set(ids[:, 0].tolist()) == set(shard)
    held = (ids >= shard.start) & (ids < shard.stop)
    assert torch.all(weights[~held] == 0) and torch.all(weights[held] > 0)


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_warm_up_changes_no_result(layers: Layers, placement: str) -> None:
    """A warmed-up layer set answers exactly as a cold one built from the same weights,
    for every payload kind; torch's global RNG is left as it was."""
    import torch

    from afd_core.transfer import AttentionToFFN

    gate_on_attention, routing, _ = PLACEMENTS[placement]
    cold, warm = layers.compute(), layers.compute()
    rng = torch.get_rng_state()
    warm.warm_up(compute_gate_on_attention=gate_on_attention, routing_payload=routing)
    assert torch.equal(torch.get_rng_state(), rng)

    generator = torch.Generator().manual_seed(99)
    x = torch.randn(5, 64, generator=generator)
    logits = torch.randn(5, 16, generator=generator)
    topk_weights, topk_ids = torch.softmax(logits, dim=1).topk(4, dim=1)
    payloads = {
        DENSE: AttentionToFFN(x),
        MOE: {
            "HIDDEN": AttentionToFFN(x),
            "HIDDEN_TOPK": AttentionToFFN(
                x, topk_ids=topk_ids.to(torch.int32), topk_weights=topk_weights
            ),
            "HIDDEN_ROUTER_LOGITS": AttentionToFFN(x, router_logits=logits),
        }[PLACEMENTS[placement][2]],
    }
    for layer, payload in payloads.items():
        expected, actual = cold.compute(layer, payload), warm.compute(layer, payload)
        assert expected.output.abs().sum() > 0
        assert torch.equal(actual.output, expected.output), layer
        if expected.shared_output is not None:
            assert torch.equal(actual.shared_output, expected.shared_output), layer
