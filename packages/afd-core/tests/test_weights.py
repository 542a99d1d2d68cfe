"""filter_role_weights: lazy, single-pass selection of the tensors a role loads."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from afd_core.config import AFDRole
from afd_core.weights import RoleWeightStats, WeightOwner, filter_role_weights, owner_keeps

NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.mlp.gate.weight",
    "model.layers.0.mlp.experts.0.down_proj.weight",
    "model.layers.0.mlp.experts.1.down_proj.weight",
    "model.layers.0.rotary_emb.inv_freq",
    "lm_head.weight",
]


def classify(name: str) -> WeightOwner:
    if "experts" in name:
        return WeightOwner.FFN
    if ".mlp.gate." in name:
        return WeightOwner.BOTH
    if "rotary_emb" in name:
        return WeightOwner.NONE
    return WeightOwner.ATTENTION


def test_each_role_gets_its_tensors_and_shared_ones() -> None:
    weights = [(n, i) for i, n in enumerate(NAMES)]
    attn = dict(filter_role_weights(weights, AFDRole.ATTENTION, classify))
    ffn = dict(filter_role_weights(weights, AFDRole.FFN, classify))
    assert set(attn) == {NAMES[0], NAMES[1], NAMES[2], NAMES[6]}
    assert set(ffn) == {NAMES[2], NAMES[3], NAMES[4]}
    assert attn[NAMES[6]] == 6  # tensors pass through untouched


def test_filter_is_lazy_and_single_pass() -> None:
    pulled: list[str] = []

    def source() -> Iterator[tuple[str, int]]:
        for i, name in enumerate(NAMES):
            pulled.append(name)
            yield name, i

    it = filter_role_weights(source(), "ffn", classify)  # type: ignore[arg-type]
    assert pulled == []  # nothing read before the first next()
    first = next(it)
    assert first[0] == NAMES[2]
    assert pulled == NAMES[:3]  # stopped at the first kept tensor, nothing read ahead
    rest = list(it)
    assert [n for n, _ in rest] == NAMES[3:5]
    assert pulled == NAMES  # every item pulled exactly once


def test_stats_count_kept_and_dropped_per_owner() -> None:
    stats = RoleWeightStats()
    kept = list(filter_role_weights(((n, 0) for n in NAMES), AFDRole.FFN, classify, stats=stats))
    assert len(kept) == stats.num_kept == 3
    assert stats.kept == {WeightOwner.FFN: 2, WeightOwner.BOTH: 1}
    assert stats.dropped == {WeightOwner.ATTENTION: 3, WeightOwner.NONE: 1}
    assert stats.summary() == "kept 3 (both=1, ffn=2), dropped 4 (attention=3, none=1)"


def test_classifier_must_return_a_weight_owner() -> None:
    it = filter_role_weights([("x", 0)], AFDRole.FFN, lambda name: "ffn")  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match=r"classify\('x'\) returned 'ffn'; expected a WeightOwner"):
        next(it)


def test_invalid_role_fails_before_iterating() -> None:
    with pytest.raises(ValueError):
        filter_role_weights([], "router", classify)  # type: ignore[arg-type]


def test_owner_keeps_table() -> None:
    assert owner_keeps(WeightOwner.BOTH, AFDRole.FFN) and owner_keeps(
        WeightOwner.BOTH, AFDRole.ATTENTION
    )
    assert not owner_keeps(WeightOwner.NONE, AFDRole.FFN)
    assert owner_keeps(WeightOwner.FFN, AFDRole.FFN) and not owner_keeps(
        WeightOwner.FFN, AFDRole.ATTENTION
    )
