"""FFN expert parallelism: dispatch to the FFN ranks owning a token's experts, combine
their partial answers (afd_moe_runners.expert_parallel).

The FFN ranks are threads with in-process loopback connectors, one expert plane each;
their "experts" are per-expert matrices, and each rank computes only the experts of its
shard (as the FFN role does with the others zeroed). The sum must equal the full MoE.
"""

from __future__ import annotations

import threading

import pytest
import torch

from afd_core.config import AFDConfig
from afd_core.testing.loopback import LoopbackAFDConnector
from afd_core.topology import expert_shard
from afd_core.transfer import AttentionToFFN, FFNToAttention
from afd_moe_runners.expert_parallel import (
    ExpertParallelExchange,
    combine,
    dispatch_rows,
    shard_payload,
)

HIDDEN, EXPERTS, TOP_K = 8, 8, 2
_port = iter(range(43000, 44000))


def _experts() -> torch.Tensor:
    return torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(1))


def _moe(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, experts: torch.Tensor,
         owned: range = range(EXPERTS)) -> torch.Tensor:  # fmt: skip
    """sum_k w[t, k] * x[t] @ E[ids[t, k]] over the experts in ``owned``."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e in owned:
                out[t] += w[t, k] * (x[t] @ experts[e])
    return out


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
    w = torch.rand(tokens, TOP_K, generator=g)
    return x, ids.to(torch.int32), w


def test_dispatch_sends_a_rank_only_the_tokens_routed_to_its_experts() -> None:
    ids = torch.tensor([[0, 1], [4, 5], [3, 4], [7, 6]], dtype=torch.int32)
    assert dispatch_rows(ids, range(0, 4)).tolist() == [0, 2]
    assert dispatch_rows(ids, range(4, 8)).tolist() == [1, 2, 3]
    assert dispatch_rows(ids, range(0, 4), every_row=True).tolist() == [0, 1, 2, 3]
    x = torch.arange(8.0).reshape(4, 2)
    part = shard_payload(
        AttentionToFFN(x, topk_ids=ids, topk_weights=torch.full((4, 2), 0.5)),
        torch.tensor([0, 2]),
        range(0, 4),
    )
    assert part.hidden_states.tolist() == [[0.0, 1.0], [4.0, 5.0]]
    # the weight of an expert another rank holds is zeroed
    assert part.topk_weights.tolist() == [[0.5, 0.5], [0.5, 0.0]]


@pytest.mark.parametrize("ep", [2, 3])
def test_dispatched_partials_combine_to_the_full_moe(ep: int) -> None:
    experts = _experts()
    x, ids, w = _routing(17, seed=ep)
    parts = []
    for f in range(ep):
        shard = expert_shard(EXPERTS, ep, f)
        rows = dispatch_rows(ids, shard)
        p = shard_payload(AttentionToFFN(x, topk_ids=ids, topk_weights=w), rows, shard)
        # The FFN rank computes with its experts only (the others are zero there).
        partial = _moe(p.hidden_states, p.topk_ids, p.topk_weights, experts, shard)
        parts.append((rows, FFNToAttention(partial)))
    got = combine(17, parts).output
    torch.testing.assert_close(got, _moe(x, ids, w, experts), rtol=1e-5, atol=1e-5)


def _serve_plane(ffn: LoopbackAFDConnector, f: int, ep: int, layers: int, got: dict) -> None:
    experts = _experts()
    shard = expert_shard(EXPERTS, ep, f)
    for _ in range(layers):
        batch = ffn.recv_from_attention(timeout_s=20)
        p = batch.payload
        got.setdefault(f, []).append(int(p.hidden_states.shape[0]))
        if p.topk_ids is None:  # dense layer (or gate on FFN): rank 0's weights only
            out = p.hidden_states * 3 if f == 0 else torch.zeros_like(p.hidden_states)
        else:
            out = _moe(p.hidden_states, p.topk_ids, p.topk_weights, experts, shard)
        ffn.send_to_attention(batch, FFNToAttention(out))


def test_an_attention_rank_exchanges_with_every_ffn_rank_on_its_plane() -> None:
    ep, layers, tokens = 2, 2, 9
    attn = AFDConfig(
        role="attention", connector="LoopbackAFDConnector", host="ep-test", port=next(_port),
        num_ffn_ranks=ep, rank=0, ffn_expert_parallel=True, compute_gate_on_attention=True,
    )  # fmt: skip
    ffn_cfgs = [
        AFDConfig(
            role="ffn", connector="LoopbackAFDConnector", host="ep-test", port=attn.port,
            num_ffn_ranks=ep, rank=f, ffn_expert_parallel=True, compute_gate_on_attention=True,
        ).expert_plane(f)
        for f in range(ep)
    ]  # fmt: skip
    ffns = [LoopbackAFDConnector(c, rank=0) for c in ffn_cfgs]
    for c in ffns:
        c.init()
    served: dict[int, list[int]] = {}
    threads = [
        threading.Thread(target=_serve_plane, args=(ffns[f], f, ep, layers, served))
        for f in range(ep)
    ]
    for t in threads:
        t.start()
    planes = [LoopbackAFDConnector(attn.expert_plane(f), rank=0) for f in range(ep)]
    exchange = ExpertParallelExchange(
        attn, rank=0, planes=planes, num_experts=EXPERTS, rank0_gets_every_row=False
    )
    exchange.init()
    x, ids, w = _routing(tokens, seed=7)
    # layer 0: a MoE layer with the routing from this rank's gate
    exchange.send_to_ffn(AttentionToFFN(x, topk_ids=ids, topk_weights=w), layer_idx=0)
    moe = exchange.recv_from_ffn(layer_idx=0)
    # layer 1: a dense layer: FFN rank 0 holds it, rank 1 gets no token
    exchange.send_to_ffn(AttentionToFFN(x), layer_idx=1)
    dense = exchange.recv_from_ffn(layer_idx=1)
    for t in threads:
        t.join(30)
    torch.testing.assert_close(moe.output, _moe(x, ids, w, _experts()), rtol=1e-5, atol=1e-5)
    assert torch.equal(dense.output, x * 3)
    routed = [int(dispatch_rows(ids, expert_shard(EXPERTS, ep, f)).shape[0]) for f in range(ep)]
    assert served == {0: [routed[0], tokens], 1: [routed[1], 0]}
    assert exchange.tokens_sent == [routed[0] + tokens, routed[1]]
    for c in (exchange, *ffns):
        c.close()


def test_an_unknown_expert_count_is_refused() -> None:
    from afd_core.errors import AFDConfigError
    from afd_moe_runners.expert_parallel import has_shared_experts, routed_experts_of

    class Qwen3:
        num_experts = 8

    class DeepSeek:
        n_routed_experts, n_shared_experts = 16, 1

    assert routed_experts_of(Qwen3()) == 8 and not has_shared_experts(Qwen3())
    assert routed_experts_of(DeepSeek()) == 16 and has_shared_experts(DeepSeek())
    with pytest.raises(AFDConfigError, match="names no routed expert count"):
        routed_experts_of(object())


def test_foreign_experts_are_dropped_and_rank0_parts_zeroed_before_loading() -> None:
    from afd_moe_runners.expert_parallel import shard_checkpoint

    names = [
        "model.layers.0.mlp.gate_proj.weight",  # dense layer 0
        "model.layers.1.mlp.gate.weight",  # router
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.mlp.experts.1.down_proj.weight",
        "model.layers.1.mlp.experts.6.down_proj.weight",
        "model.layers.1.mlp.shared_experts.up_proj.weight",
        "model.layers.1.input_layernorm.weight",
    ]
    weights = [(n, torch.ones(2)) for n in names]
    for rank, dropped, zeroed in (
        (0, names[4], set()),
        (1, names[3], {names[0], names[5]}),
    ):
        out = dict(shard_checkpoint(iter(weights), 8, rank, 2))
        assert list(out) == [n for n in names if n != dropped], rank
        assert {n for n, t in out.items() if not t.any()} == zeroed, rank


def _three_bf16_partials() -> list[torch.Tensor]:
    """Three FFN ranks' bfloat16 answers whose running sum rounds differently from the
    sum rounded once: 1 + 2^-8 is a tie that rounds to 1, 1 + 2^-8 + 2^-8 = 1 + 2^-7 is
    exact (bfloat16 has 8 significant bits)."""
    return [torch.full((3, 4), v, dtype=torch.bfloat16) for v in (1.0, 2.0**-8, 2.0**-8)]


def test_combine_sums_the_partials_in_float32_and_rounds_once() -> None:
    parts = _three_bf16_partials()
    exact = torch.full((3, 4), 1.0 + 2.0**-7, dtype=torch.bfloat16)
    # Gate on FFN: every FFN rank answers every row.
    got = combine(3, [(None, FFNToAttention(p)) for p in parts]).output
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, exact), got[0, 0].item()
    # Dispatch: each rank answers some rows (index_add_ into the rows it answers).
    rows = torch.tensor([0, 2])
    got = combine(3, [(rows, FFNToAttention(p[:2])) for p in parts]).output
    assert torch.equal(got[rows], exact[:2]) and not got[1].any()


def _serve_constant(ffn: LoopbackAFDConnector, value: float) -> None:
    batch = ffn.recv_from_attention(timeout_s=20)
    hidden = batch.payload.hidden_states
    ffn.send_to_attention(batch, FFNToAttention(torch.full_like(hidden, value)))


def test_an_attention_rank_rounds_the_sum_of_three_ffn_ranks_once() -> None:
    """Gate on FFN, 3 FFN ranks, bfloat16: the answer the attention rank gets is the sum
    of the three partials rounded once to bfloat16 (the dtype it sent)."""
    ep = 3
    attn = AFDConfig(
        role="attention", connector="LoopbackAFDConnector", host="ep-test", port=next(_port),
        num_ffn_ranks=ep, rank=0, ffn_expert_parallel=True,
    )  # fmt: skip
    ffns = [
        LoopbackAFDConnector(
            AFDConfig(
                role="ffn", connector="LoopbackAFDConnector", host="ep-test", port=attn.port,
                num_ffn_ranks=ep, rank=f, ffn_expert_parallel=True,
            ).expert_plane(f),
            rank=0,
        )
        for f in range(ep)
    ]  # fmt: skip
    for c in ffns:
        c.init()
    values = [p[0, 0].item() for p in _three_bf16_partials()]
    threads = [
        threading.Thread(target=_serve_constant, args=(ffns[f], values[f])) for f in range(ep)
    ]
    for t in threads:
        t.start()
    planes = [LoopbackAFDConnector(attn.expert_plane(f), rank=0) for f in range(ep)]
    exchange = ExpertParallelExchange(
        attn, rank=0, planes=planes, num_experts=EXPERTS, rank0_gets_every_row=False
    )
    exchange.init()
    x = torch.zeros(5, HIDDEN, dtype=torch.bfloat16)
    exchange.send_to_ffn(AttentionToFFN(x), layer_idx=0)
    got = exchange.recv_from_ffn(layer_idx=0).output
    for t in threads:
        t.join(30)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.full_like(x, 1.0 + 2.0**-7)), got[0, 0].item()
    for c in (exchange, *ffns):
        c.close()
