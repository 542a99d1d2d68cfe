"""CAMAsyncAFDConnector over the fake CAM operators: top-k only, non-blocking dispatch, combine."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from afd_connectors_npu.camasync import CAMAsyncAFDConnector
from afd_connectors_npu.camp2p import CAMP2pAFDConnector
from afd_connectors_npu.routing import A2ECodec
from afd_connectors_npu.testing import FakeCAMFabric
from afd_core.config import AFDConfig
from afd_core.errors import AFDConfigError, AFDTransferMismatchError
from afd_core.topology import AFDTopology
from afd_core.transfer import AttentionToFFN, FFNToAttention, PayloadKind

GATE = {"compute_gate_on_attention": True}


def _routed(rank: int, layer: int, n: int, k: int = 4) -> AttentionToFFN:
    g = torch.Generator().manual_seed(rank * 100 + layer)
    return AttentionToFFN(
        torch.randn(n, 16, generator=g).to(torch.bfloat16),
        topk_ids=torch.randint(0, 64, (n, k), generator=g, dtype=torch.int32),
        topk_weights=torch.rand(n, k, generator=g, dtype=torch.float32),
    )


def assert_dispatch_received_topk_unchanged(
    fabric: FakeCAMFabric, sent: list[AttentionToFFN]
) -> None:
    records = fabric.recorded("dispatch_send", "attention")
    assert len(records) == len(sent)
    for record, payload in zip(records, sent, strict=True):
        for got, want in (
            (record.message.ids, payload.topk_ids),
            (record.message.scales, payload.topk_weights),
        ):
            assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape)
            assert torch.equal(got, want)


def test_topk_handed_to_send_to_ffn_reaches_the_dispatch_operator_unchanged(cam_deployment) -> None:
    fabric, ranks = cam_deployment(CAMAsyncAFDConnector, AFDTopology(2, 1), **GATE)
    sent = [_routed(a, 0, a + 2) for a in range(2)]
    for a, payload in enumerate(sent):
        ranks[("attention", a)].send_to_ffn(payload, layer_idx=0)
    assert_dispatch_received_topk_unchanged(fabric, sent)
    batch = ranks[("ffn", 0)].recv_from_attention()
    assert batch.payload.topk_ids.dtype == torch.int32
    assert torch.equal(batch.payload.topk_weights, torch.cat([p.topk_weights for p in sent]))


class _SwappingCodec(A2ECodec):
    def _pack_topk(self, topk_ids: Any, topk_weights: Any) -> tuple[Any, Any]:
        return topk_weights, topk_ids


class BrokenCAMAsync(CAMAsyncAFDConnector):
    """Deliberately broken: swaps ids and weights before the dispatch operator."""

    codec = _SwappingCodec()


def test_the_dispatch_check_catches_a_connector_that_swaps_ids_and_weights(cam_deployment) -> None:
    fabric, ranks = cam_deployment(BrokenCAMAsync, **GATE)
    payload = _routed(0, 0, 3)
    ranks[("attention", 0)].send_to_ffn(payload, layer_idx=0)
    with pytest.raises(AssertionError):
        assert_dispatch_received_topk_unchanged(fabric, [payload])


def test_send_to_ffn_returns_before_the_dispatch_is_delivered(cam_deployment) -> None:
    # Generous margins: the bound must hold on a loaded 2-core CI machine too.
    fabric = FakeCAMFabric(dispatch_latency_s=2.0)
    _, ranks = cam_deployment(CAMAsyncAFDConnector, fabric=fabric, **GATE)
    att, ffn = ranks[("attention", 0)], ranks[("ffn", 0)]
    start = time.monotonic()
    att.send_to_ffn(_routed(0, 0, 2), layer_idx=0)
    assert time.monotonic() - start < 1.0
    assert att.pending_dispatches() == 1
    batch = ffn.recv_from_attention(timeout_s=5.0)
    ffn.send_to_attention(batch, FFNToAttention(batch.payload.hidden_states))
    att.recv_from_ffn(layer_idx=0)
    assert att.pending_dispatches() == 0


def test_combine_receive_returns_the_ffn_weighted_output_per_layer_and_micro_batch(
    cam_deployment,
) -> None:
    _, ranks = cam_deployment(CAMAsyncAFDConnector, AFDTopology(3, 2), num_micro_batches=2, **GATE)
    for layer in range(2):
        for mb in range(2):
            for a in range(3):
                ranks[("attention", a)].send_to_ffn(
                    _routed(a, layer * 2 + mb, a + 1), layer_idx=layer, micro_batch_idx=mb
                )
            for f in range(2):
                ffn = ranks[("ffn", f)]
                batch = ffn.recv_from_attention()
                p = batch.payload
                weighted = (p.hidden_states.float() * p.topk_weights.sum(1, keepdim=True)).to(
                    p.hidden_states.dtype
                )
                ffn.send_to_attention(batch, FFNToAttention(weighted))
        for mb in range(2):
            for a in range(3):
                got = ranks[("attention", a)].recv_from_ffn(layer_idx=layer, micro_batch_idx=mb)
                p = _routed(a, layer * 2 + mb, a + 1)
                want = (p.hidden_states.float() * p.topk_weights.sum(1, keepdim=True)).to(
                    torch.bfloat16
                )
                assert got.shared_output is None and torch.equal(got.output, want)


@pytest.mark.parametrize(
    "payload",
    [
        AttentionToFFN(torch.ones(2, 4)),
        AttentionToFFN(torch.ones(2, 4), token_ids=torch.tensor([1, 2])),
    ],
    ids=["hidden-only", "token-ids"],
)
def test_non_topk_payloads_are_refused_with_the_settings_to_use(cam_deployment, payload) -> None:
    _, ranks = cam_deployment(CAMAsyncAFDConnector, **GATE)
    with pytest.raises(AFDConfigError, match=r"compute_gate_on_attention=true and afd\.routing_"):
        ranks[("attention", 0)].send_to_ffn(payload, layer_idx=0)


def test_shared_output_from_the_ffn_role_is_refused(cam_deployment) -> None:
    _, ranks = cam_deployment(CAMAsyncAFDConnector, **GATE)
    ranks[("attention", 0)].send_to_ffn(_routed(0, 0, 2), layer_idx=0)
    ffn = ranks[("ffn", 0)]
    batch = ffn.recv_from_attention()
    out = torch.ones(2, 16, dtype=torch.bfloat16)
    with pytest.raises(AFDConfigError, match="shared experts run on the Attention role"):
        ffn.send_to_attention(batch, FFNToAttention(out, shared_output=out))


def test_gate_on_ffn_is_refused_at_construction() -> None:
    config = AFDConfig(role="attention", connector="CAMAsyncAFDConnector")
    with pytest.raises(AFDConfigError, match=r"set afd\.compute_gate_on_attention=true"):
        CAMAsyncAFDConnector(config, rank=0)


def test_answer_for_another_micro_batch_is_a_mismatch(cam_deployment) -> None:
    _, ranks = cam_deployment(CAMAsyncAFDConnector, num_micro_batches=2, **GATE)
    att, ffn = ranks[("attention", 0)], ranks[("ffn", 0)]
    att.send_to_ffn(_routed(0, 0, 2), layer_idx=0, micro_batch_idx=0)
    batch = ffn.recv_from_attention()
    ffn.send_to_attention(batch, FFNToAttention(batch.payload.hidden_states))
    with pytest.raises(AFDTransferMismatchError, match="micro-batch 0"):
        att.recv_from_ffn(layer_idx=0, micro_batch_idx=1)


def _payload_of(kind: PayloadKind) -> AttentionToFFN:
    routed = _routed(0, 0, 2)
    extra: dict[str, Any] = {
        PayloadKind.HIDDEN: {},
        PayloadKind.HIDDEN_TOPK: {
            "topk_ids": routed.topk_ids,
            "topk_weights": routed.topk_weights,
        },
        PayloadKind.HIDDEN_ROUTER_LOGITS: {"router_logits": torch.randn(2, 64)},
        PayloadKind.HIDDEN_TOKEN_IDS: {"token_ids": torch.tensor([1, 2])},
    }[kind]
    return AttentionToFFN(routed.hidden_states, **extra)


@pytest.mark.parametrize(
    ("connector_cls", "settings"),
    [(CAMAsyncAFDConnector, GATE), (CAMP2pAFDConnector, GATE)],
    ids=["CAMAsync", "CAMP2p"],
)
def test_declared_payload_kinds_are_the_ones_send_to_ffn_takes(
    cam_deployment, connector_cls: type, settings: dict[str, Any]
) -> None:
    """The capability the runners decide on (a connector without HIDDEN keeps dense
    layers on Attention) is what the connector really carries."""
    _, ranks = cam_deployment(connector_cls, **settings)
    attention = ranks[("attention", 0)]
    caps = connector_cls.capabilities
    for layer, kind in enumerate(k for k in PayloadKind if k.is_attention_to_ffn):
        payload = _payload_of(kind)
        assert payload.kind is kind
        if caps.carries(kind):
            attention.send_to_ffn(payload, layer_idx=layer)
        else:
            with pytest.raises(AFDConfigError):
                attention.send_to_ffn(payload, layer_idx=layer)
    assert caps.carries(PayloadKind.HIDDEN) is (connector_cls is CAMP2pAFDConnector)
