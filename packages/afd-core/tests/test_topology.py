"""AFDTopology: peer mapping between attention and FFN ranks."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afd_core.config import AFDRole
from afd_core.errors import AFDConfigError
from afd_core.topology import AFDTopology

sizes = st.integers(min_value=1, max_value=64)


@settings(max_examples=200, deadline=None)
@given(sizes, sizes)
def test_every_attention_rank_has_exactly_one_ffn_peer_and_fan_in_is_balanced(
    a: int, f: int
) -> None:
    topo = AFDTopology(a, f)
    served = Counter(topo.ffn_peer_of(r) for r in range(a))
    for rank in range(a):
        peer = topo.ffn_peer_of(rank)
        assert 0 <= peer < f
        assert rank in topo.attention_peers_of(peer)
    listed = [r for ffn in range(f) for r in topo.attention_peers_of(ffn)]
    assert sorted(listed) == list(range(a))  # each attention rank listed exactly once
    fan_in = [topo.fan_in(ffn) for ffn in range(f)]
    active = [n for n in fan_in if n > 0]
    assert max(active) - min(active) <= 1
    assert max(fan_in) - min(fan_in) <= 1
    assert all(served[ffn] == topo.fan_in(ffn) for ffn in range(f))
    for ffn in range(f):
        peers = topo.attention_peers_of(ffn)
        assert list(peers) == sorted(peers)


@settings(max_examples=200, deadline=None)
@given(sizes, sizes)
def test_idle_ffn_ranks_are_exactly_those_without_peers(a: int, f: int) -> None:
    topo = AFDTopology(a, f)
    idle = tuple(ffn for ffn in range(f) if not topo.attention_peers_of(ffn))
    assert topo.idle_ffn_ranks == idle
    assert (len(idle) > 0) == (a < f)
    assert set(topo.active_ffn_ranks) | set(idle) == set(range(f))


@settings(max_examples=200, deadline=None)
@given(sizes, sizes)
def test_global_rank_is_a_bijection_with_attention_first(a: int, f: int) -> None:
    topo = AFDTopology(a, f)
    assert topo.world_size == a + f
    seen = set()
    for role in AFDRole:
        for rank in range(topo.size_of(role)):
            g = topo.global_rank(role, rank)
            assert topo.role_rank_of(g) == (role, rank)
            seen.add(g)
    assert seen == set(range(a + f))
    assert topo.global_rank(AFDRole.ATTENTION, 0) == 0
    assert topo.global_rank(AFDRole.FFN, 0) == a


@settings(max_examples=100, deadline=None)
@given(sizes, sizes)
def test_mapping_is_deterministic(a: int, f: int) -> None:
    one, two = AFDTopology(a, f), AFDTopology(a, f)
    assert one == two
    assert [one.ffn_peer_of(r) for r in range(a)] == [two.ffn_peer_of(r) for r in range(a)]
    assert [one.attention_peers_of(r) for r in range(f)] == [
        two.attention_peers_of(r) for r in range(f)
    ]


def test_examples() -> None:
    topo = AFDTopology(3, 2)
    assert topo.attention_peers_of(0) == (0, 2)
    assert topo.attention_peers_of(1) == (1,)
    assert topo.label == "3A2F"
    assert AFDTopology(1, 2).idle_ffn_ranks == (1,)
    assert topo.size_of("ffn") == 2
    assert topo.peers_of(AFDRole.ATTENTION, 2) == (0,)


@pytest.mark.parametrize(("a", "f"), [(0, 1), (1, 0), (-1, 2), (True, 1), (1.0, 1), ("2", 1)])
def test_invalid_sizes_are_config_errors(a: object, f: object) -> None:
    with pytest.raises(
        AFDConfigError, match=r"afd\.num_(attention|ffn)_ranks: expected an int >= 1"
    ):
        AFDTopology(a, f)  # type: ignore[arg-type]


def test_out_of_range_ranks_are_config_errors() -> None:
    topo = AFDTopology(2, 1)
    with pytest.raises(AFDConfigError, match=r"attention rank: expected an int in 0\.\.1"):
        topo.ffn_peer_of(2)
    with pytest.raises(AFDConfigError, match=r"ffn rank"):
        topo.attention_peers_of(1)
    with pytest.raises(AFDConfigError, match=r"global rank: expected an int in 0\.\.2"):
        topo.role_rank_of(3)
    with pytest.raises(AFDConfigError, match="'attention' or 'ffn'"):
        topo.size_of("router")


# ---------------------------------------------------------------- expert parallelism


def test_expert_shards_are_contiguous_balanced_and_cover_every_expert() -> None:
    from afd_core.topology import expert_owner, expert_shard

    assert [expert_shard(16, 3, r) for r in range(3)] == [range(0, 6), range(6, 11), range(11, 16)]
    assert [expert_shard(8, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    for experts in range(1, 40):
        for size in range(1, experts + 1):
            shards = [expert_shard(experts, size, r) for r in range(size)]
            assert [e for s in shards for e in s] == list(range(experts))
            assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert expert_owner(5, 2) == [0, 0, 0, 1, 1]


def test_fewer_experts_than_ffn_ranks_is_refused() -> None:
    from afd_core.topology import expert_shard

    with pytest.raises(AFDConfigError, match="2 routed experts cannot be shared by 3 FFN ranks"):
        expert_shard(2, 3, 0)
    with pytest.raises(AFDConfigError, match=r"ep_rank: expected an int in 0..1"):
        expert_shard(8, 2, 2)
