"""Deployment fingerprints (afd_core.identity) and token resolution (afd_core.admission)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from afd_core.admission import TOKEN_ENV, config_fields, resolve_token, session_prefix
from afd_core.config import AFDConfig
from afd_core.errors import AFDConfigError
from afd_core.identity import (
    FINGERPRINT_FIELDS,
    checkpoint_identity,
    describe_differences,
    differences,
    format_layers,
)

TOKEN = "s3cret-token-of-the-test-deployment"


def _safetensors(path: Path, data: bytes, shape: list[int]) -> None:
    header = json.dumps(
        {"w": {"dtype": "U8", "shape": shape, "data_offsets": [0, len(data)]}}
    ).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def _checkpoint(root: Path, data: bytes, *, shape: list[int] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 8}))
    _safetensors(root / "model.safetensors", data, shape or [len(data)])
    (root / "tokenizer.json").write_text("{}")
    return root


@pytest.mark.parametrize(
    ("indices", "text"),
    [([], "none"), ([3], "3"), ([0, 1, 2, 3], "0-3"), ([5, 0, 1, 7, 8, 2], "0-2,5,7-8")],
)
def test_format_layers(indices: list[int], text: str) -> None:
    assert format_layers(indices) == text


def test_differences_name_each_field_with_both_values_and_honour_allow() -> None:
    host = {"dtype": "bfloat16", "hidden_size": "96", "checkpoint": "aa"}
    joining = {"dtype": "float32", "hidden_size": "96", "checkpoint": "bb", "top_k": "2"}
    diffs = differences(host, joining)
    assert diffs == [
        ("dtype", "bfloat16", "float32"),
        ("top_k", "(absent)", "2"),
        ("checkpoint", "aa", "bb"),
    ]
    line = describe_differences(diffs, host="attention rank 0", joining="ffn rank 0")
    assert "dtype: attention rank 0 has 'bfloat16', ffn rank 0 has 'float32'" in line
    assert differences(host, joining, allow=["dtype", "checkpoint", "top_k"]) == []
    assert differences(host, joining, allow=["*"]) == []
    assert differences(host, dict(host)) == []


def test_config_fields_cover_the_routing_settings() -> None:
    a = config_fields(AFDConfig(role="attention"))
    b = config_fields(
        AFDConfig(role="ffn", compute_gate_on_attention=True, routing_payload="router_logits")
    )
    assert set(a) <= set(FINGERPRINT_FIELDS)
    assert [d[0] for d in differences(a, b)] == ["gate_on_attention", "routing_payload"]


def test_checkpoint_identity_follows_content_not_path(tmp_path: Path) -> None:
    data = bytes(range(256)) * 4096  # 1 MiB: sampled, not read whole
    first = checkpoint_identity(_checkpoint(tmp_path / "a", data))
    assert len(first) == 16
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "a", copy)
    assert checkpoint_identity(copy) == first
    (copy / "tokenizer.json").write_text('{"other": 1}')  # not covered (documented)
    assert checkpoint_identity(copy) == first

    other_weights = bytearray(data)
    other_weights[0] ^= 0xFF  # the first byte of the data is always sampled
    assert checkpoint_identity(_checkpoint(tmp_path / "b", bytes(other_weights))) != first
    reshaped = checkpoint_identity(_checkpoint(tmp_path / "c", data, shape=[1024, 1024]))
    assert reshaped != first
    config = _checkpoint(tmp_path / "d", data)
    (config / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    assert checkpoint_identity(config) != first


def test_checkpoint_identity_of_a_name(tmp_path: Path) -> None:
    assert checkpoint_identity("org/model") == "name:org/model"
    assert checkpoint_identity(tmp_path / "missing") == f"name:{tmp_path / 'missing'}"


def test_token_sources_and_precedence(tmp_path: Path) -> None:
    env = {TOKEN_ENV: "  env-token-of-sixteen-chars  "}
    assert resolve_token(AFDConfig(role="ffn"), {}) is None
    assert resolve_token(AFDConfig(role="ffn"), env) == "env-token-of-sixteen-chars"
    assert resolve_token(AFDConfig(role="ffn", auth_token=TOKEN), env) == TOKEN
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert resolve_token(AFDConfig(role="ffn", auth_token_file=str(path)), env) == TOKEN


def test_token_errors_never_echo_the_secret(tmp_path: Path) -> None:
    with pytest.raises(AFDConfigError, match="at least 16 characters, got 5"):
        resolve_token(AFDConfig(role="ffn", auth_token="short"), {})
    with pytest.raises(AFDConfigError, match="cannot read"):
        resolve_token(AFDConfig(role="ffn", auth_token_file=str(tmp_path / "nope")), {})
    with pytest.raises(AFDConfigError, match="both given"):
        AFDConfig(role="ffn", auth_token=TOKEN, auth_token_file="x")
    assert TOKEN not in repr(AFDConfig(role="ffn", auth_token=TOKEN))


def test_fingerprint_allow_is_validated() -> None:
    assert AFDConfig(role="ffn", fingerprint_allow="*").fingerprint_allow == ("*",)
    with pytest.raises(AFDConfigError, match="did you mean 'checkpoint'"):
        AFDConfig(role="ffn", fingerprint_allow=["chekpoint"])
    config = AFDConfig(role="ffn", fingerprint_allow=["dtype", "quantization"])
    assert AFDConfig.parse(config.to_dict()) == config


def test_session_prefix_is_secret_with_a_token() -> None:
    nonce = "00ff"
    assert nonce in session_prefix(None, nonce)
    secret = session_prefix(TOKEN, nonce)
    assert nonce not in secret and secret != session_prefix(TOKEN + "x", nonce)
