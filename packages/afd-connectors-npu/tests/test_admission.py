"""Admission for the CAM connectors: afd-core's connect phase (token, rank, fingerprint)
runs before the CAM world is set up, as it does for gloo, NCCL and shared memory.

Over the fake CAM operators (FakeCAMFabric: its rendezvous is an in-memory store, the
Ascend binding's is the TCP store at afd.host:afd.port); one thread per rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from afd_connectors_npu.camasync import CAMAsyncAFDConnector
from afd_connectors_npu.camp2p import CAMP2pAFDConnector
from afd_connectors_npu.exchange import CAMConnector
from afd_connectors_npu.testing import FakeCAMFabric
from afd_core.config import AFDConfig
from afd_core.errors import AFDAdmissionError, AFDTimeoutError
from afd_core.transfer import AttentionToFFN, FFNToAttention

TOKEN = "token-of-the-cam-deployment"
GATE = {"compute_gate_on_attention": True}


def _pair(
    cls: type[CAMConnector], attention: dict[str, Any], ffn: dict[str, Any], **common: Any
) -> tuple[FakeCAMFabric, CAMConnector, CAMConnector]:
    fabric = FakeCAMFabric()
    values = {"connector": cls.name, "connect_timeout_s": 1.5, "transfer_timeout_s": 5.0}
    values.update(common)
    att = cls(
        AFDConfig(role="attention", **values, **attention), rank=0, ops_factory=fabric.ops_factory
    )
    ffn_conn = cls(AFDConfig(role="ffn", **values, **ffn), rank=0, ops_factory=fabric.ops_factory)
    return fabric, att, ffn_conn


@pytest.mark.parametrize("cls", [CAMP2pAFDConnector, CAMAsyncAFDConnector], ids=["p2p", "async"])
@pytest.mark.parametrize(
    ("joiner", "message"),
    [
        ({}, "requires a token and the process presented none"),
        ({"auth_token": "a-wrong-token-of-enough-chars"}, "wrong token"),
    ],
    ids=["no-token", "wrong-token"],
)
def test_a_cam_deployment_with_a_token_refuses_a_joiner_without_it(
    init_all: Any, cls: type[CAMConnector], joiner: dict[str, Any], message: str
) -> None:
    fabric, att, ffn = _pair(cls, {"auth_token": TOKEN}, joiner, **GATE)
    try:
        att_error, ffn_error = init_all([att, ffn])
        assert isinstance(ffn_error, AFDAdmissionError), ffn_error
        assert message in str(ffn_error)
        assert not ffn.is_initialized
        # The host refused it and kept waiting for a legitimate FFN rank 0.
        assert isinstance(att_error, AFDTimeoutError), att_error
        assert "still missing: ffn rank 0 of 1A1F" in str(att_error)
        # The refused process reached no CAM operator.
        assert fabric.records == [] and ffn.transport.session is None
    finally:
        att.close()
        ffn.close()


def test_an_open_cam_deployment_refuses_a_joiner_with_a_token(init_all: Any) -> None:
    _, att, ffn = _pair(CAMP2pAFDConnector, {}, {"auth_token": TOKEN})
    try:
        _, ffn_error = init_all([att, ffn])
        assert isinstance(ffn_error, AFDAdmissionError)
        assert "started without one" in str(ffn_error)
    finally:
        att.close()
        ffn.close()


@pytest.mark.parametrize("cls", [CAMP2pAFDConnector, CAMAsyncAFDConnector], ids=["p2p", "async"])
def test_a_cam_deployment_whose_ranks_share_the_token_connects_and_exchanges(
    init_all: Any, cls: type[CAMConnector]
) -> None:
    _, att, ffn = _pair(cls, {"auth_token": TOKEN}, {"auth_token": TOKEN}, **GATE)
    try:
        assert init_all([att, ffn]) == [None, None]
        hidden = torch.randn(3, 8)
        routing = {
            "topk_ids": torch.zeros(3, 2, dtype=torch.int32),
            "topk_weights": torch.ones(3, 2),
        }
        att.send_to_ffn(AttentionToFFN(hidden, **routing), layer_idx=1)
        batch = ffn.recv_from_attention()
        ffn.send_to_attention(batch, FFNToAttention(batch.payload.hidden_states * 2))
        assert torch.equal(att.recv_from_ffn(layer_idx=1).output, hidden * 2)
        desk = att.transport.session.desk if att.transport.session else None
        assert desk is not None and desk.complete and desk.refused == 0
    finally:
        att.close()
        ffn.close()
