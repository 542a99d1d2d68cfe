"""Role-aware DeepSeek wrappers, built and loaded by real vLLM (CPU) from a tiny checkpoint.

Each case runs in a process of its own (forked from a build server that imported vLLM
once, tests/support/afd_role_models.py): vLLM keeps process-global state (distributed
groups, the layer registry) that one model build per process keeps honest.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from afd_role_models import build_role_model

pytestmark = [pytest.mark.vllm]

CASES = [
    ("deepseek_v2", "AFDDeepseekV2ForCausalLM", False),
    ("deepseek_v3", "AFDDeepseekV3ForCausalLM", True),
]


@pytest.mark.parametrize(("arch", "alias", "gate_on_attention"), CASES)
def test_attention_role_holds_no_ffn_parameters(
    tiny_models: dict[str, Path], tmp_path: Path, arch: str, alias: str, gate_on_attention: bool
) -> None:
    afd = {
        "role": "attention",
        "connector": "LoopbackAFDConnector",
        "port": 1,
        "compute_gate_on_attention": gate_on_attention,
    }
    result = build_role_model(tiny_models[arch], alias, afd, tmp_path)
    names = result["names"]
    assert not [n for n in names if ".experts." in n or "shared_expert" in n]
    assert not [n for n in names if ".mlp." in n and ".mlp.gate." not in n]
    gates = [n for n in names if ".mlp.gate." in n]
    assert bool(gates) == gate_on_attention, gates
    assert any(".self_attn." in n for n in names)
    assert any("embed_tokens" in n for n in names) and any("lm_head" in n for n in names)
    assert result["inventory"].get("routed_experts", 0) == 0


@pytest.mark.parametrize(("arch", "alias", "gate_on_attention"), CASES)
def test_ffn_role_holds_no_attention_parameters(
    tiny_models: dict[str, Path], tmp_path: Path, arch: str, alias: str, gate_on_attention: bool
) -> None:
    afd = {"role": "ffn", "compute_gate_on_attention": gate_on_attention}
    result = build_role_model(tiny_models[arch], alias, afd, tmp_path)
    names = result["names"]
    assert not [n for n in names if ".self_attn." in n or "embed_tokens" in n or "lm_head" in n]
    assert any(".mlp.experts." in n for n in names)
    assert any(".mlp.shared_experts." in n for n in names)
    assert any(".mlp.gate_up_proj." in n for n in names)  # the dense layer 0
    assert result["inventory"].get("attention", 0) == 0
