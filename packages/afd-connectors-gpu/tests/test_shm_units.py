"""Process-free checks of the shared-memory connector: registration, config, import cost."""

from __future__ import annotations

import subprocess
import sys

import pytest

from afd_connectors_gpu.shm import P2pShmAFDConnector
from afd_connectors_gpu.testing import shm_pair
from afd_core.config import AFDConfig
from afd_core.errors import AFDConfigError, AFDConnectorError
from afd_core.registry import get_connector_class


def _conn(role: str = "attention", **extra) -> P2pShmAFDConnector:
    config = AFDConfig(role=role, connector="P2pShmAFDConnector", connector_extra_config=extra)
    return P2pShmAFDConnector(config, rank=0)


def test_registered_by_name_and_lazily_exported() -> None:
    import afd_connectors_gpu

    assert get_connector_class("P2pShmAFDConnector") is P2pShmAFDConnector
    assert afd_connectors_gpu.P2pShmAFDConnector is P2pShmAFDConnector


def test_resolving_the_shm_connector_does_not_import_torch_or_vllm() -> None:
    code = (
        "import sys, afd_connectors_gpu\n"
        "from afd_core.registry import get_connector_class\n"
        "get_connector_class('P2pShmAFDConnector')\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert 'vllm' not in sys.modules, 'vllm imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"bogus": 1}, "unknown keys"),
        ({"max_num_tokens": 0}, "max_num_tokens"),
        ({"hidden_size": -1}, "hidden_size"),
        ({"slot_bytes": 100}, "slot_bytes"),
        ({"num_slots": 0}, "num_slots"),
        ({"spin_us": -1}, "spin_us"),
        ({"spin_us": True}, "spin_us"),
        ({"dtype": "int8"}, "dtype"),
    ],
)
def test_extra_config_is_validated(extra, match) -> None:
    with pytest.raises(AFDConfigError, match=match):
        _conn(**extra)


def test_slot_size_follows_max_num_tokens_and_hidden_size() -> None:
    default = _conn()
    assert default.slot_bytes == 32 << 20
    assert default.num_slots == 4
    sized = _conn(max_num_tokens=256, hidden_size=7168)
    # output + shared output in bf16 plus 1 KiB of routing per token, plus the slot head
    assert 256 * (2 * 7168 * 2 + 1024) <= sized.slot_bytes < 256 * (2 * 7168 * 2 + 1024) + 4096
    fp32 = _conn(max_num_tokens=256, hidden_size=7168, dtype="float32")
    assert fp32.slot_bytes > sized.slot_bytes
    assert _conn(slot_bytes=5000, hidden_size=7168).slot_bytes == 5056  # explicit wins, aligned
    config = AFDConfig(role="ffn", connector="P2pShmAFDConnector", num_micro_batches=3)
    assert P2pShmAFDConnector(config, rank=0).num_slots == 6


def test_calls_before_init_fail_clearly() -> None:
    conn = _conn(role="ffn")
    with pytest.raises(AFDConnectorError, match="before init"):
        conn.recv_from_attention()
    with pytest.raises(AFDConfigError, match="attention-side call"):
        conn.recv_from_ffn(layer_idx=0)
    conn.close()
    conn.close()
    assert not conn.is_initialized


def test_hot_path_reuses_receive_buffers_and_moves_any_layout() -> None:
    """Receives of one shape and micro-batch land in one buffer (nothing allocated per
    layer); another micro-batch gets its own; sent tensors may be non-contiguous."""
    import torch

    from afd_core.transfer import AttentionToFFN, FFNToAttention

    attn, ffn = shm_pair(slot_bytes=1 << 20)
    try:
        ptrs: dict[str, set[int]] = {"a2f": set(), "f2a": set(), "mb1": set()}
        kept = []  # every received tensor stays referenced: fresh ones could not share memory
        for layer in range(6):
            x = torch.randn(8, 5, dtype=torch.float32).to(torch.bfloat16).t()  # [5, 8] view
            assert not x.is_contiguous()
            ids = torch.randint(0, 16, (5, 2), dtype=torch.int32)
            weights = torch.rand(5, 2)
            for mb in (0, 1):
                payload = AttentionToFFN(x + mb, topk_ids=ids, topk_weights=weights)
                attn.send_to_ffn(payload, layer_idx=layer, micro_batch_idx=mb)
            for mb in (0, 1):
                batch = ffn.recv_from_attention()
                got = batch.payload
                assert batch.micro_batch_idx == mb
                assert torch.equal(got.hidden_states, x + mb)
                assert torch.equal(got.topk_ids, ids) and torch.equal(got.topk_weights, weights)
                ptrs["a2f" if mb == 0 else "mb1"].add(got.hidden_states.data_ptr())
                kept.append(got.hidden_states)
                out = got.hidden_states * 2
                ffn.send_to_attention(batch, FFNToAttention(out, shared_output=out + 1))
            for mb in (0, 1):
                result = attn.recv_from_ffn(layer_idx=layer, micro_batch_idx=mb)
                assert torch.equal(result.output, (x + mb) * 2)
                assert torch.equal(result.shared_output, (x + mb) * 2 + 1)
                if mb == 0:
                    ptrs["f2a"].add(result.output.data_ptr())
                kept.append(result.output)
        assert len(ptrs["a2f"]) == len(ptrs["f2a"]) == len(ptrs["mb1"]) == 1, ptrs
        assert ptrs["a2f"] != ptrs["mb1"]
    finally:
        attn.close()
        ffn.close()
