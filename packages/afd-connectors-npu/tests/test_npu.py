"""The real vendor CAM binding on an Ascend device (skipped with a reason elsewhere)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from afd_connectors_npu.camp2p import CAMP2pAFDConnector
from afd_core.config import AFDConfig
from afd_core.transfer import AttentionToFFN, FFNToAttention

pytestmark = pytest.mark.npu


def _require_ascend() -> Any:
    try:
        import torch
        import torch_npu  # noqa: F401
    except ImportError:
        pytest.skip("requires torch_npu with an Ascend device (torch_npu is not installed)")
    if not torch.npu.is_available() or torch.npu.device_count() < 1:
        pytest.skip("requires torch_npu with an Ascend device (torch_npu sees no device)")
    return torch


def test_camp2p_round_trip_through_the_vendor_binding() -> None:
    torch = _require_ascend()
    common = {
        "connector": "CAMP2pAFDConnector",
        "port": 29871,
        "connect_timeout_s": 60.0,
        "transfer_timeout_s": 60.0,
    }
    att = CAMP2pAFDConnector(AFDConfig(role="attention", **common), rank=0)
    ffn = CAMP2pAFDConnector(AFDConfig(role="ffn", **common), rank=0)
    t = threading.Thread(target=att.init)
    t.start()
    ffn.init()
    t.join(60)
    try:
        hidden = torch.randn(4, 128, dtype=torch.bfloat16, device="npu")
        att.send_to_ffn(AttentionToFFN(hidden), layer_idx=0)
        batch = ffn.recv_from_attention()
        ffn.send_to_attention(batch, FFNToAttention(batch.payload.hidden_states * 2))
        assert torch.equal(att.recv_from_ffn(layer_idx=0).output.cpu(), (hidden * 2).cpu())
    finally:
        att.close()
        ffn.close()
