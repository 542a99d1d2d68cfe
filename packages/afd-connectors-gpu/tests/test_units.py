"""Fast, process-free checks: wire frames, configuration, import hygiene."""

from __future__ import annotations

import subprocess
import sys
import types
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from afd_connectors_gpu.p2p import P2pGlooAFDConnector, P2pNcclAFDConnector, buffer_plan
from afd_core.config import AFDConfig
from afd_core.errors import (
    AFDConfigError,
    AFDConnectorClosedError,
    AFDConnectorError,
    AFDTransferMismatchError,
)
from afd_core.registry import get_connector_class
from afd_core.transfer import WIRE_DTYPES, PayloadKind, TransferHeader
from afd_core.wire import FRAME_LEN, Frame

_ints = st.integers(min_value=0, max_value=2**40)


@given(
    layer=_ints,
    mb=_ints,
    tokens=_ints,
    hidden=_ints,
    dtype=st.sampled_from(sorted(WIRE_DTYPES)),
    kind=st.sampled_from(list(PayloadKind)),
    topk=_ints,
    aux=st.none() | st.sampled_from(sorted(WIRE_DTYPES)),
    sender=st.integers(min_value=0, max_value=1024),
)
def test_frame_round_trips_through_int64_words(
    layer, mb, tokens, hidden, dtype, kind, topk, aux, sender
) -> None:
    header = TransferHeader(layer, mb, tokens, hidden, dtype, kind, topk)
    frame = Frame(header, aux, sender)
    words = frame.encode()
    assert len(words) == FRAME_LEN and all(-(2**63) <= w < 2**63 for w in words)
    assert Frame.decode(words) == frame


def test_frame_with_foreign_magic_is_rejected() -> None:
    words = Frame.shutdown(0).encode()
    words[7] = 1234
    with pytest.raises(AFDTransferMismatchError, match="not an afd transfer header"):
        Frame.decode(words)


def test_importing_the_package_and_resolving_connectors_does_not_import_torch() -> None:
    code = (
        "import sys, afd_connectors_gpu\n"
        "from afd_core.registry import get_connector_class\n"
        "get_connector_class('P2pGlooAFDConnector'); get_connector_class('P2pNcclAFDConnector')\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_both_connectors_are_registered_by_name() -> None:
    assert get_connector_class("P2pGlooAFDConnector") is P2pGlooAFDConnector
    assert get_connector_class("P2pNcclAFDConnector") is P2pNcclAFDConnector


def _config(**kw) -> AFDConfig:
    return AFDConfig(role="attention", **kw)


def test_gloo_connector_validates_its_extra_config() -> None:
    with pytest.raises(AFDConfigError, match="unknown keys"):
        P2pGlooAFDConnector(_config(connector_extra_config={"slot_bytes": 4}), rank=0)
    with pytest.raises(AFDConfigError, match="buffer_pool"):
        P2pGlooAFDConnector(_config(connector_extra_config={"buffer_pool": "yes"}), rank=0)
    conn = P2pGlooAFDConnector(
        _config(connector_extra_config={"buffer_pool": True, "max_num_tokens": 4}), rank=0
    )
    assert conn.extra_config == {
        "buffer_pool": True,
        "max_num_tokens": 4,
        "hidden_size": None,
        "dtype": None,
    }
    with pytest.raises(AFDConfigError, match="hidden_size"):
        P2pGlooAFDConnector(_config(connector_extra_config={"hidden_size": 0}), rank=0)
    with pytest.raises(AFDConfigError, match="dtype"):
        P2pGlooAFDConnector(_config(connector_extra_config={"dtype": "int8"}), rank=0)


class _ModelConfig:
    def __init__(self, hidden: int, dtype: Any, top_k: int) -> None:
        self.dtype = dtype
        self.hf_text_config = types.SimpleNamespace(num_experts_per_tok=top_k)
        self._hidden = hidden

    def get_hidden_size(self) -> int:
        return self._hidden


def test_the_buffer_plan_reads_vllms_current_config_when_the_process_runs_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inside vLLM (the model build, the FFN server) the connector reserves for the
    engine's token budget, hidden size and dtype, and the top-k of a gate on Attention
    (vLLM's config stubbed at its module: nothing is imported)."""
    import torch

    engine = types.SimpleNamespace(
        model_config=_ModelConfig(24, torch.float16, 4),
        scheduler_config=types.SimpleNamespace(max_num_batched_tokens=100),
    )
    stub = types.SimpleNamespace(get_current_vllm_config_or_none=lambda: engine)
    monkeypatch.setitem(sys.modules, "vllm.config", stub)  # type: ignore[arg-type]
    config = AFDConfig(
        role="ffn", compute_gate_on_attention=True, connector_extra_config={"buffer_pool": True}
    )
    conn = P2pGlooAFDConnector(config, rank=0)
    tokens, hidden, dtype, steps = buffer_plan(conn) or (0, 0, "", [])
    assert (tokens, hidden, dtype) == (100, 24, "float16")  # budget < max_num_tokens 16384
    assert steps == [
        ("recv", 0, ((24,), "float16")),
        ("send", 0, ((24,), "float16")),
        ("recv", 1, ((4,), "int32")),
        ("recv", 2, ((4,), "float32")),
    ]
    # The deployment fingerprint, then the connector's own keys, win over the engine's.
    conn.identity = {"hidden_size": "32", "dtype": "bfloat16", "top_k": "2"}
    assert buffer_plan(conn) is not None
    assert buffer_plan(conn)[1:3] == (32, "bfloat16")  # type: ignore[index]
    extra = {"buffer_pool": True, "hidden_size": 8, "dtype": "float32", "max_num_tokens": 64}
    explicit = AFDConfig(role="ffn", connector_extra_config=extra)
    assert buffer_plan(P2pGlooAFDConnector(explicit, rank=0)) == (
        64,
        8,
        "float32",
        [("recv", 0, ((8,), "float32")), ("send", 0, ((8,), "float32"))],
    )


def test_the_buffer_plan_reserves_what_a_quantized_message_carries() -> None:
    """With low-precision transfer dtypes the reserved buffers are the 8-bit elements and
    their scales (last in the message), not model-dtype buffers no message would use."""
    extra = {"buffer_pool": True, "hidden_size": 40, "dtype": "bfloat16", "max_num_tokens": 64}
    config = AFDConfig(
        role="attention",
        compute_gate_on_attention=True,
        transfer_dtype="mxfp8",
        transfer_dtype_return="fp8",
        connector_extra_config=extra,
    )
    conn = P2pGlooAFDConnector(config, rank=0)
    conn.identity = {"top_k": "4"}
    assert buffer_plan(conn) == (
        64,
        40,
        "bfloat16",
        [
            ("send", 0, ((40,), "float8_e4m3fn")),
            ("recv", 0, ((40,), "float8_e4m3fn")),
            ("send", 1, ((4,), "int32")),
            ("send", 2, ((4,), "float32")),
            ("send", 3, ((2,), "uint8")),  # one E8M0 scale per 32 elements: ceil(40 / 32)
            ("recv", 1, ((1,), "float32")),  # fp8: one float32 scale per token
        ],
    )


def test_no_hidden_size_anywhere_means_no_reservation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "vllm.config", raising=False)
    conn = P2pGlooAFDConnector(_config(connector_extra_config={"buffer_pool": True}), rank=0)
    assert buffer_plan(conn) is None


class _Sched:
    def __init__(self, budget: int) -> None:
        self.max_num_batched_tokens = budget


class _VllmConfig:
    def __init__(self, budget: int) -> None:
        self.scheduler_config = _Sched(budget)


@pytest.mark.parametrize(
    ("cls", "extra"),
    [
        (P2pNcclAFDConnector, {}),
        (P2pGlooAFDConnector, {"buffer_pool": True}),
    ],
    ids=["nccl", "gloo-pool"],
)
def test_token_budget_above_the_buffer_limit_is_refused_at_start_up(cls, extra) -> None:
    config = _config(connector=cls.name, connector_extra_config={**extra, "max_num_tokens": 8192})
    cls.check_deployment(config, _VllmConfig(8192))  # equal: fits
    with pytest.raises(AFDConfigError) as err:
        cls.check_deployment(config, _VllmConfig(16384))
    text = str(err.value)
    assert "max_num_batched_tokens=16384" in text and "--max-num-batched-tokens" in text
    assert "connector_extra_config['max_num_tokens']=8192" in text


def test_default_buffer_limit_covers_vllms_default_token_budgets() -> None:
    # vllm.LLM on H100/H200-class GPUs defaults to 16384 batched tokens, the API server
    # to 8192; vLLM's profiling run sends one message of that size.
    config = _config(connector="P2pNcclAFDConnector")
    P2pNcclAFDConnector.check_deployment(config, _VllmConfig(16384))
    with pytest.raises(AFDConfigError, match="max_num_batched_tokens=16385"):
        P2pNcclAFDConnector.check_deployment(config, _VllmConfig(16385))


def test_gloo_without_pool_has_no_token_limit() -> None:
    P2pGlooAFDConnector.check_deployment(_config(), _VllmConfig(1 << 20))


def test_nccl_connector_validates_its_extra_config() -> None:
    with pytest.raises(AFDConfigError, match="unknown keys"):
        P2pNcclAFDConnector(
            _config(connector="P2pNcclAFDConnector", connector_extra_config={"bogus": 1}), rank=0
        )
    with pytest.raises(AFDConfigError, match="max_num_tokens"):
        P2pNcclAFDConnector(
            _config(connector="P2pNcclAFDConnector", connector_extra_config={"max_num_tokens": 0}),
            rank=0,
        )


def test_nccl_buckets_are_powers_of_two_up_to_max_num_tokens() -> None:
    conn = P2pNcclAFDConnector(
        _config(connector="P2pNcclAFDConnector", connector_extra_config={"max_num_tokens": 100}),
        rank=0,
    )
    assert [conn.bucket_of(n) for n in (0, 1, 2, 3, 5, 64, 65, 100)] == [
        1,
        1,
        2,
        4,
        8,
        64,
        128,
        128,
    ]
    assert conn.buckets() == [1, 2, 4, 8, 16, 32, 64, 128]
    with pytest.raises(AFDTransferMismatchError, match="max_num_tokens"):
        conn.bucket_of(101)


def test_calls_before_init_and_after_close_fail_clearly() -> None:
    import torch

    from afd_core.transfer import AttentionToFFN

    conn = P2pGlooAFDConnector(_config(), rank=0)
    payload = AttentionToFFN(torch.zeros(1, 4))
    with pytest.raises(AFDConnectorError, match="before init"):
        conn.send_to_ffn(payload, layer_idx=0)
    with pytest.raises(AFDConfigError, match=r"ffn-side call"):
        conn.recv_from_attention()
    conn.close()
    conn.close()
    assert not conn.is_initialized
    with pytest.raises(AFDConnectorClosedError):
        conn.send_to_ffn(payload, layer_idx=0)
    with pytest.raises(AFDConnectorClosedError):
        conn.init()
