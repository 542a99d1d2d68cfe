"""FFNBatch.answers: the per-peer split every connector's FFN side uses."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the split slices tensors (afd-core[testing])")

from afd_core.connector import FFNBatch  # noqa: E402
from afd_core.errors import AFDTransferMismatchError  # noqa: E402
from afd_core.transfer import AttentionToFFN, FFNToAttention, PayloadKind  # noqa: E402


def batch(counts: tuple[int, ...], peers: tuple[int, ...]) -> FFNBatch:
    hidden = torch.zeros(sum(counts), 4)
    payload = AttentionToFFN(hidden)
    return FFNBatch(
        header=payload.header(layer_idx=3, micro_batch_idx=1),
        payload=payload,
        peer_ranks=peers,
        token_counts=counts,
    )


@pytest.mark.parametrize("counts", [(5,), (2, 0, 3), (1, 1), (0, 4)])
@pytest.mark.parametrize("with_shared", [False, True])
def test_each_peer_gets_its_own_rows_in_peer_order(
    counts: tuple[int, ...], with_shared: bool
) -> None:
    peers = tuple(range(10, 10 + len(counts)))
    total = sum(counts)
    output = torch.arange(total * 4, dtype=torch.float32).reshape(total, 4)
    shared = -output if with_shared else None
    answers = batch(counts, peers).answers(
        FFNToAttention(output, shared_output=shared), serving=peers, who="ffn rank 0"
    )
    assert [peer for peer, _ in answers] == list(peers)
    offset = 0
    for (_, part), n in zip(answers, counts, strict=True):
        assert torch.equal(part.output, output[offset : offset + n])
        if with_shared:
            assert part.kind is PayloadKind.OUTPUT_WITH_SHARED
            assert torch.equal(part.shared_output, shared[offset : offset + n])
        else:
            assert part.shared_output is None
        offset += n


def test_a_result_with_another_token_count_is_refused_naming_the_batch() -> None:
    with pytest.raises(AFDTransferMismatchError, match=r"ffn rank 0: result has 4 tokens.*had 5"):
        batch((2, 3), (0, 1)).answers(
            FFNToAttention(torch.zeros(4, 4)), serving=(0, 1), who="ffn rank 0"
        )


def test_a_batch_of_other_peers_is_refused() -> None:
    with pytest.raises(AFDTransferMismatchError, match=r"attention ranks \[0, 1\].*serves \[2\]"):
        batch((2, 3), (0, 1)).answers(FFNToAttention(torch.zeros(5, 4)), serving=(2,), who="x")
