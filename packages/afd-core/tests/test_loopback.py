"""LoopbackAFDConnector behaviour beyond the conformance suite (lifecycle, peer loss, errors)."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from afd_core.config import AFDConfig, AFDRole  # noqa: E402
from afd_core.errors import (  # noqa: E402
    AFDConfigError,
    AFDConnectorClosedError,
    AFDConnectorError,
    AFDPeerLostError,
    AFDTimeoutError,
    AFDTransferMismatchError,
)
from afd_core.testing.loopback import LoopbackAFDConnector  # noqa: E402
from afd_core.transfer import AttentionToFFN, FFNToAttention  # noqa: E402

_ports = itertools.count(20000)


def make_pair(
    a: int = 1, f: int = 1, **overrides: object
) -> tuple[list[LoopbackAFDConnector], list[LoopbackAFDConnector]]:
    port = next(_ports)

    def build(role: AFDRole, rank: int) -> LoopbackAFDConnector:
        config = AFDConfig(
            role=role,
            connector=LoopbackAFDConnector.name,
            host="test-loopback",
            port=port,
            num_attention_ranks=a,
            num_ffn_ranks=f,
            **overrides,  # type: ignore[arg-type]
        )
        conn = LoopbackAFDConnector(config, rank=rank)
        conn.init()
        return conn

    return [build(AFDRole.ATTENTION, r) for r in range(a)], [
        build(AFDRole.FFN, r) for r in range(f)
    ]


def test_init_is_idempotent_and_close_is_idempotent() -> None:
    (attn,), (ffn,) = make_pair()
    attn.init()
    assert attn.is_initialized
    attn.close()
    attn.close()
    assert not attn.is_initialized
    ffn.close()
    with pytest.raises(AFDConnectorClosedError, match="init\\(\\) after close\\(\\)"):
        attn.init()


def test_calls_before_init_or_on_the_wrong_role_fail_clearly() -> None:
    config = AFDConfig(role=AFDRole.ATTENTION, host="test-loopback", port=next(_ports))
    conn = LoopbackAFDConnector(config, rank=0)
    with pytest.raises(AFDConnectorError, match="before init\\(\\)"):
        conn.send_to_ffn(AttentionToFFN(torch.zeros(1, 4)), layer_idx=0)
    conn.init()
    # a misuse, as on every connector: AFDConfigError
    with pytest.raises(AFDConfigError, match="ffn-side call"):
        conn.recv_from_attention()
    conn.close()
    with pytest.raises(AFDConnectorClosedError):
        conn.send_to_ffn(AttentionToFFN(torch.zeros(1, 4)), layer_idx=0)


def test_two_connectors_for_one_rank_are_refused() -> None:
    (attn,), (ffn,) = make_pair()
    twin = LoopbackAFDConnector(attn.config, rank=0)
    with pytest.raises(AFDConnectorError, match="already connected"):
        twin.init()
    attn.close()
    ffn.close()


def test_tensors_are_cloned_on_send() -> None:
    (attn,), (ffn,) = make_pair()
    hidden = torch.ones(2, 4)
    attn.send_to_ffn(AttentionToFFN(hidden), layer_idx=0)
    hidden.fill_(7)
    batch = ffn.recv_from_attention(timeout_s=1)
    assert torch.equal(batch.payload.hidden_states, torch.ones(2, 4))  # type: ignore[arg-type]
    out = torch.full((2, 4), 3.0)
    ffn.send_to_attention(batch, FFNToAttention(out))
    out.fill_(0)
    assert torch.equal(attn.recv_from_ffn(layer_idx=0, timeout_s=1).output, torch.full((2, 4), 3.0))  # type: ignore[arg-type]
    attn.close()
    ffn.close()


def test_explicit_timeout_overrides_the_config_default() -> None:
    (attn,), (ffn,) = make_pair(transfer_timeout_s=60.0)
    start = time.monotonic()
    with pytest.raises(AFDTimeoutError, match=r"timed out after 0\.2 s"):
        attn.recv_from_ffn(layer_idx=0, timeout_s=0.2)
    assert time.monotonic() - start < 2.0
    attn.close()
    ffn.close()


def test_a_timeout_on_a_shared_ffn_rank_says_the_other_attention_ranks_count() -> None:
    # 2A1F: attention rank 0 sent, rank 1 did not; the FFN rank cannot answer, and rank 0's
    # error says why its wait includes rank 1. 1A1F: no such note.
    attns, (ffn,) = make_pair(a=2, f=1)
    attns[0].send_to_ffn(AttentionToFFN(torch.zeros(1, 4)), layer_idx=0)
    with pytest.raises(AFDTimeoutError, match=r"once all 2 of its attention ranks sent"):
        attns[0].recv_from_ffn(layer_idx=0, timeout_s=0.2)
    for c in [*attns, ffn]:
        c.close()
    (attn,), (ffn,) = make_pair()
    with pytest.raises(AFDTimeoutError) as err:
        attn.recv_from_ffn(layer_idx=0, timeout_s=0.2)
    assert "attention ranks" not in str(err.value)
    attn.close()
    ffn.close()


def test_peer_closing_makes_receives_and_sends_raise_peer_lost() -> None:
    (attn,), (ffn,) = make_pair()
    attn.send_to_ffn(AttentionToFFN(torch.zeros(1, 4)), layer_idx=0)
    attn.close()
    # Data sent before close is still delivered; then the peer is reported gone.
    batch = ffn.recv_from_attention(timeout_s=1)
    assert batch.layer_idx == 0
    with pytest.raises(AFDPeerLostError, match=r"attention rank 0 \(global rank 0\) closed") as e:
        ffn.recv_from_attention(timeout_s=5)
    assert e.value.goodbye is True
    with pytest.raises(AFDPeerLostError):
        ffn.recv_from_attention(timeout_s=5)  # and stays so
    with pytest.raises(AFDPeerLostError, match=r"attention rank 0 .* is gone"):
        ffn.send_to_attention(batch, FFNToAttention(torch.zeros(1, 4)))
    ffn.close()


def test_close_from_another_thread_unblocks_a_receive() -> None:
    (attn,), (ffn,) = make_pair()
    threading.Timer(0.1, attn.close).start()
    start = time.monotonic()
    with pytest.raises(AFDConnectorClosedError):
        attn.recv_from_ffn(layer_idx=0, timeout_s=30)
    assert time.monotonic() - start < 2.0
    ffn.close()


def test_fan_in_rejects_peers_on_different_layers() -> None:
    attns, (ffn,) = make_pair(a=2, f=1)
    attns[0].send_to_ffn(AttentionToFFN(torch.zeros(1, 4)), layer_idx=0)
    attns[1].send_to_ffn(AttentionToFFN(torch.zeros(1, 4)), layer_idx=1)
    with pytest.raises(AFDTransferMismatchError, match="attention peers disagree on the layer"):
        ffn.recv_from_attention(timeout_s=1)
    for c in [*attns, ffn]:
        c.close()


def test_result_with_wrong_token_count_is_rejected() -> None:
    (attn,), (ffn,) = make_pair()
    attn.send_to_ffn(AttentionToFFN(torch.zeros(3, 4)), layer_idx=0)
    batch = ffn.recv_from_attention(timeout_s=1)
    with pytest.raises(AFDTransferMismatchError, match="result has 2 tokens"):
        ffn.send_to_attention(batch, FFNToAttention(torch.zeros(2, 4)))
    attn.close()
    ffn.close()


def test_idle_ffn_rank_refuses_to_receive() -> None:
    (attn,), ffns = make_pair(a=1, f=2)
    with pytest.raises(AFDConfigError, match="serves no attention rank in topology 1A2F"):
        ffns[1].recv_from_attention(timeout_s=1)
    for c in [attn, *ffns]:
        c.close()
