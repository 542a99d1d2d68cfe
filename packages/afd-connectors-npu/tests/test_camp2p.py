"""CAMP2pAFDConnector over the fake CAM operators: handshake, failures, payload rules."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from afd_connectors_npu.camp2p import CAMP2pAFDConnector
from afd_connectors_npu.ops import CAMUnavailableError
from afd_connectors_npu.routing import A2ECodec
from afd_connectors_npu.testing import CAMThreadHarness, FakeCAMFabric
from afd_core.config import AFDConfig
from afd_core.errors import (
    AFDConfigError,
    AFDConnectorClosedError,
    AFDConnectorError,
    AFDPeerLostError,
    AFDTimeoutError,
    AFDTransferMismatchError,
)
from afd_core.testing.conformance import SCENARIOS, TOPOLOGIES, run_scenario
from afd_core.topology import AFDTopology
from afd_core.transfer import AttentionToFFN, FFNToAttention

GATE = {"compute_gate_on_attention": True}


def _topk(n: int, k: int = 2) -> dict[str, torch.Tensor]:
    return {
        "topk_ids": torch.arange(n * k, dtype=torch.int32).reshape(n, k),
        "topk_weights": torch.full((n, k), 0.5),
    }


def test_one_layer_round_trip_carries_topk_and_the_answer(cam_deployment) -> None:
    fabric, ranks = cam_deployment(CAMP2pAFDConnector, **GATE)
    att, ffn = ranks[("attention", 0)], ranks[("ffn", 0)]
    hidden = torch.randn(3, 8)
    att.send_to_ffn(AttentionToFFN(hidden, **_topk(3)), layer_idx=5)
    batch = ffn.recv_from_attention()
    assert batch.layer_idx == 5 and torch.equal(batch.payload.topk_ids, _topk(3)["topk_ids"])
    ffn.send_to_attention(batch, FFNToAttention(batch.payload.hidden_states * 2))
    assert torch.equal(att.recv_from_ffn(layer_idx=5).output, hidden * 2)
    [sent] = fabric.recorded("a2e_send")
    assert sent.message.ids.dtype == torch.int32 and sent.message.scales.dtype == torch.float32


def test_handshake_mismatch_names_the_setting_and_both_roles(cam_deployment) -> None:
    with pytest.raises(AFDConfigError) as info:
        cam_deployment(CAMP2pAFDConnector, per_role={"attention": GATE})
    # Refused at admission (afd-core's connect phase), naming the field and both sides.
    text = str(info.value)
    assert "gate_on_attention: attention rank 0 has 'attention', ffn rank 0 has 'ffn'" in text
    assert "Start every role on the same checkpoint and settings" in text


def test_handshake_mismatch_between_ranks_of_one_role_names_the_ranks(init_all) -> None:
    fabric = FakeCAMFabric()
    common = {
        "connector": CAMP2pAFDConnector.name,
        "num_attention_ranks": 2,
        "connect_timeout_s": 5.0,
    }
    conns = [
        CAMP2pAFDConnector(
            AFDConfig(role="attention", **common), rank=0, ops_factory=fabric.ops_factory
        ),
        CAMP2pAFDConnector(
            AFDConfig(role="attention", num_micro_batches=2, **common),
            rank=1,
            ops_factory=fabric.ops_factory,
        ),
        CAMP2pAFDConnector(AFDConfig(role="ffn", **common), rank=0, ops_factory=fabric.ops_factory),
    ]
    errors = init_all(conns)
    assert all(isinstance(e, AFDConfigError) for e in errors), errors
    assert "num_micro_batches: attention rank 0 has '1', attention rank 1 has '2'" in str(errors[1])
    for c in conns:
        c.close()


def test_handshake_times_out_naming_the_missing_rank() -> None:
    fabric = FakeCAMFabric()
    conn = CAMP2pAFDConnector(
        AFDConfig(role="attention", connector="CAMP2pAFDConnector", connect_timeout_s=0.3),
        rank=0,
        ops_factory=fabric.ops_factory,
    )
    with pytest.raises(AFDTimeoutError, match="still missing: ffn rank 0 of 1A1F"):
        conn.init()
    assert not conn.is_initialized
    conn.close()


def test_init_is_idempotent_and_calls_before_init_or_after_close_fail(cam_deployment) -> None:
    fabric = FakeCAMFabric()
    conn = CAMP2pAFDConnector(
        AFDConfig(role="attention", connector="CAMP2pAFDConnector"),
        rank=0,
        ops_factory=fabric.ops_factory,
    )
    with pytest.raises(AFDConnectorError, match=r"before init\(\)"):
        conn.send_to_ffn(AttentionToFFN(torch.ones(1, 2)), layer_idx=0)
    conn.close()
    _, ranks = cam_deployment(CAMP2pAFDConnector, fabric=fabric)  # same fabric: not disturbed
    att = ranks[("attention", 0)]
    att.init()
    assert att.is_initialized
    att.close()
    att.close()
    with pytest.raises(AFDConnectorClosedError):
        att.recv_from_ffn(layer_idx=0)


def test_receive_timeout_raises_afd_timeout_error(cam_deployment) -> None:
    _, ranks = cam_deployment(CAMP2pAFDConnector)
    start = time.monotonic()
    with pytest.raises(AFDTimeoutError, match=r"within 0\.2 s"):
        ranks[("attention", 0)].recv_from_ffn(layer_idx=0, timeout_s=0.2)
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("role", ["attention", "ffn"])
def test_close_from_another_thread_unblocks_a_receive(cam_deployment, role: str) -> None:
    _, ranks = cam_deployment(CAMP2pAFDConnector)
    conn = ranks[(role, 0)]
    threading.Timer(0.2, conn.close).start()
    start = time.monotonic()
    with pytest.raises(AFDConnectorClosedError):
        if role == "ffn":
            conn.recv_from_attention(timeout_s=30.0)
        else:
            conn.recv_from_ffn(layer_idx=0, timeout_s=30.0)
    assert time.monotonic() - start < 2.0


def test_lost_ffn_peer_is_reported_to_the_waiting_attention_rank(cam_deployment) -> None:
    fabric, ranks = cam_deployment(CAMP2pAFDConnector)
    att = ranks[("attention", 0)]
    att.send_to_ffn(AttentionToFFN(torch.ones(1, 4)), layer_idx=0)
    threading.Timer(0.2, fabric.lose, args=("ffn", 0)).start()
    with pytest.raises(AFDPeerLostError, match="ffn rank 0 is gone"):
        att.recv_from_ffn(layer_idx=0, timeout_s=30.0)
    with pytest.raises(AFDPeerLostError):
        att.send_to_ffn(AttentionToFFN(torch.ones(1, 4)), layer_idx=1)


def test_answer_for_another_layer_is_a_mismatch(cam_deployment) -> None:
    _, ranks = cam_deployment(CAMP2pAFDConnector)
    att, ffn = ranks[("attention", 0)], ranks[("ffn", 0)]
    att.send_to_ffn(AttentionToFFN(torch.ones(2, 4)), layer_idx=7)
    batch = ffn.recv_from_attention()
    ffn.send_to_attention(batch, FFNToAttention(torch.ones(2, 4)))
    with pytest.raises(AFDTransferMismatchError, match="answer is for layer 7"):
        att.recv_from_ffn(layer_idx=8)


def test_topk_without_the_attention_side_gate_is_refused(cam_deployment) -> None:
    _, ranks = cam_deployment(CAMP2pAFDConnector)
    with pytest.raises(AFDConfigError, match=r"set afd\.compute_gate_on_attention=true"):
        ranks[("attention", 0)].send_to_ffn(
            AttentionToFFN(torch.ones(2, 4), **_topk(2)), layer_idx=0
        )


def test_router_logits_setting_is_refused_at_construction() -> None:
    config = AFDConfig(
        role="ffn",
        connector="CAMP2pAFDConnector",
        compute_gate_on_attention=True,
        routing_payload="router_logits",
    )
    with pytest.raises(AFDConfigError, match=r"set afd\.routing_payload='topk'"):
        CAMP2pAFDConnector(config, rank=0)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"bogus": 1}, r"unknown keys \['bogus'\]"),
        ({"token_ids_width": 0}, "expected an int >= 1"),
        ({"cam_op_namespace": 3}, "expected a non-empty string"),
        ({"cam_op_names": {"a2e_send": 1}}, "operation -> operator name"),
    ],
)
def test_extra_config_is_validated(extra: dict[str, Any], match: str) -> None:
    config = AFDConfig(role="ffn", connector="CAMP2pAFDConnector", connector_extra_config=extra)
    with pytest.raises(AFDConfigError, match=match):
        CAMP2pAFDConnector(config, rank=0)


def test_without_an_injected_fake_init_uses_the_vendor_binding_and_fails_closed() -> None:
    pytest.importorskip("torch")
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch_npu is installed; the vendor binding is exercised by test_npu.py")
    conn = CAMP2pAFDConnector(AFDConfig(role="ffn", connector="CAMP2pAFDConnector"), rank=0)
    with pytest.raises(CAMUnavailableError, match=r"needs torch_npu.*CANN.*FakeCAMFabric"):
        conn.init()
    assert not conn.is_initialized
    conn.close()


def test_the_vendor_binding_refuses_a_low_precision_transfer_dtype() -> None:
    """The Ascend adapters take (hidden, ids, scales): no slot for activation scales, so a
    quantized message would arrive without them. Refused before any operator is loaded."""
    config = AFDConfig(role="ffn", connector="CAMP2pAFDConnector", transfer_dtype="fp8")
    conn = CAMP2pAFDConnector(config, rank=0)
    with pytest.raises(AFDConfigError, match=r"moves no activation scales.*'fp8'.*'model'"):
        conn.init()
    conn.close()


class _SwappingCodec(A2ECodec):
    def _pack_topk(self, topk_ids: Any, topk_weights: Any) -> tuple[Any, Any]:
        return topk_weights, topk_ids


class _DroppingCodec(A2ECodec):
    def _pack_topk(self, topk_ids: Any, topk_weights: Any) -> tuple[Any, Any]:
        return topk_ids, torch.zeros_like(topk_weights)


class BrokenSwapCAMP2p(CAMP2pAFDConnector):
    """Deliberately broken connector: swaps ids and weights on the wire."""

    codec = _SwappingCodec()


class BrokenDropCAMP2p(CAMP2pAFDConnector):
    """Deliberately broken connector: drops the top-k weights."""

    codec = _DroppingCodec()


@pytest.mark.parametrize("broken", [BrokenSwapCAMP2p, BrokenDropCAMP2p], ids=["swap", "drop"])
def test_conformance_routing_scenario_catches_a_broken_codec(broken: type) -> None:
    scenario = next(s for s in SCENARIOS if s.name == "routing_topk")
    harness = CAMThreadHarness(broken)
    with pytest.raises(AssertionError):
        run_scenario(harness, scenario, TOPOLOGIES[0])


def test_fan_in_answers_reach_the_right_attention_ranks(cam_deployment) -> None:
    _, ranks = cam_deployment(CAMP2pAFDConnector, AFDTopology(3, 1))
    ffn = ranks[("ffn", 0)]
    hiddens = {a: torch.full((a + 1, 4), float(a)) for a in range(3)}
    for a, h in hiddens.items():
        ranks[("attention", a)].send_to_ffn(AttentionToFFN(h), layer_idx=0)
    batch = ffn.recv_from_attention()
    assert batch.peer_ranks == (0, 1, 2) and batch.token_counts == (1, 2, 3)
    ffn.send_to_attention(batch, FFNToAttention(batch.payload.hidden_states + 10))
    for a, h in hiddens.items():
        assert torch.equal(ranks[("attention", a)].recv_from_ffn(layer_idx=0).output, h + 10)
