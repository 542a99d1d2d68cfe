"""More MoE families through the generic role-aware path (afd_moe_runners.generic): no
afd code is written for any of them. For each family both gate placements, 1A1F: one
placement with the prompts in a batch (vllm.LLM), the other served one request at a time
(afd serve / vllm serve); greedy tokens equal to native vLLM, the role inventories, and
every checkpoint tensor loaded by exactly one role or by both, as the split plan says.
Mixtral is also served 2A1F.

Batched and served run the same generic path (what differs between them is vLLM's front
end, covered for every family by one served run each); what differs per family is the
gate placement (the family's router on the FFN role or on the Attention role), so each
family runs each placement once. CI runs the served case of every family (``matrix``,
one served parity run per family); the batched cases and Mixtral 2A1F are ``extended``
(`nox -s tests-extended`, by hand): the same generic path as the served ones, and CI's
40-minute budget has no room for a second deployment per family. One native engine per
family answers both references (tests/support/afd_references.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from afd_processes import (
    afd_settings,
    assert_role_inventories,
    assert_same_tokens,
    run_offline_afd,
    run_served_afd,
)

from afd.tools.reference import FIXED_PROMPTS

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]

MATRIX = pytest.mark.matrix
#: Out of CI for its time budget (`nox -s tests-extended`, docs/development.md).
EXTENDED = pytest.mark.extended
#: Tiny arch -> the checkpoint's vLLM architecture (its AFD alias is AFD<architecture>).
FAMILIES = {
    "mixtral": "MixtralForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    # Batched in test_qwen_parity.py (both gates); served here.
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}
PROMPTS = list(FIXED_PROMPTS)


@pytest.fixture(scope="session")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import os

    from afd.tools.models.tiny import checkpoint_name, generate_tiny_checkpoint

    cache = os.environ.get("AFD_CACHE_DIR")
    root = Path(cache) / "tiny" if cache else tmp_path_factory.mktemp("tiny-families")

    def get(arch: str) -> Path:
        return generate_tiny_checkpoint(arch, root / checkpoint_name(arch))

    return get


@pytest.fixture(scope="module")
def native(family_models: Any, native_references: Any) -> Any:
    """Native vLLM's greedy tokens per (arch, "batched" | "served"): the prompts as one
    batch, or each prompt as its own batch (served one request at a time)."""

    def get(arch: str, how: str) -> list[list[int]]:
        batched, served = native_references.served_and_batched(
            family_models(arch), PROMPTS, PROMPTS
        )
        # The family's native run (packages/afd-meta/tests/test_tiny_models.py leaves
        # these families to this one): not degenerate, so equal tokens mean something.
        for ids in (batched, served):
            assert len({tuple(t) for t in ids}) == len(ids), (arch, ids)
            assert len({t[0] for t in ids}) >= len(ids) // 2, (arch, ids)
            assert len({x for t in ids for x in t}) > 50, (arch, ids)
        return batched if how == "batched" else served

    return get


_KEPT = re.compile(
    r"AFD (\w+) role parameter inventory: .*?; checkpoint tensors kept \d+ \(([^)]*)\)"
)


def _kept(log: str, role: str) -> dict[str, int]:
    found = [m for m in _KEPT.finditer(log) if m.group(1) == role]
    assert found, f"no {role} weight summary in the log:\n{log[-3000:]}"
    items = [kv.split("=") for kv in found[-1].group(2).split(", ") if kv]
    return {k: int(v) for k, v in items}


def _assert_split(attention_log: str, ffn_log: str, model: Path, gate: str) -> None:
    """Inventories per role, and each checkpoint tensor loaded by one role or both."""
    from safetensors import safe_open

    assert_role_inventories(attention_log, ffn_log, gate_on_attention=gate.startswith("attention"))
    assert "from vLLM's own model" in attention_log  # the generic path built it
    attention, ffn = _kept(attention_log, "attention"), _kept(ffn_log, "ffn")
    assert attention.get("both", 0) == ffn.get("both", 0)
    assert "ffn" not in attention and "attention" not in ffn
    total = 0
    for shard in model.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            total += len(list(f.keys()))
    loaded = attention.get("attention", 0) + ffn.get("ffn", 0) + attention.get("both", 0)
    assert loaded == total, (attention, ffn, total)


#: (family, gate placement) run batched; the family's other placement is served.
BATCHED = [
    pytest.param("mixtral", "ffn", marks=EXTENDED),
    pytest.param("glm4_moe", "attention-topk", marks=EXTENDED),
    pytest.param("ernie4_5_moe", "ffn", marks=EXTENDED),
    pytest.param("qwen3_next", "attention-topk", marks=EXTENDED),
    pytest.param("gpt_oss", "ffn", marks=EXTENDED),
    # qwen3_5_moe_text: batched with the gate on FFN in test_qwen_parity.py
]
SERVED = [
    pytest.param("mixtral", "attention-topk", marks=MATRIX),
    pytest.param("glm4_moe", "ffn", marks=MATRIX),
    pytest.param("ernie4_5_moe", "attention-topk", marks=MATRIX),
    pytest.param("qwen3_next", "ffn", marks=MATRIX),
    pytest.param("gpt_oss", "attention-topk", marks=MATRIX),
    pytest.param("qwen3_5_moe_text", "attention-topk", marks=MATRIX),
]


def test_every_family_runs_each_gate_placement_once() -> None:
    """The case lists above cover every family with both placements (a family added to
    FAMILIES without its cases fails here)."""
    batched = {tuple(c.values) for c in BATCHED}
    served = {tuple(c.values) for c in SERVED}
    pairs = batched | served | {("qwen3_5_moe_text", "ffn")}
    assert pairs == {(a, g) for a in FAMILIES for g in ("ffn", "attention-topk")}
    assert not batched & served


@pytest.mark.parametrize(("arch", "gate"), BATCHED)
def test_batched_tokens_equal_native(
    family_models: Any, native: Any, tmp_path: Path, arch: str, gate: str
) -> None:
    model = family_models(arch)
    result, ffn_log = run_offline_afd(model, f"AFD{FAMILIES[arch]}", afd_settings(gate), tmp_path)
    assert_same_tokens(result["token_ids"], native(arch, "batched"), PROMPTS)
    _assert_split(result["log"], ffn_log, model, gate)


@pytest.mark.parametrize(("arch", "gate"), SERVED)
def test_served_tokens_equal_native(
    family_models: Any, native: Any, tmp_path: Path, arch: str, gate: str
) -> None:
    model = family_models(arch)
    got, attention_log, ffn_log = run_served_afd(model, afd_settings(gate), tmp_path, PROMPTS)
    assert_same_tokens(got, native(arch, "served"), PROMPTS, "native vLLM, one request at a time")
    _assert_split(attention_log, ffn_log, model, gate)


@EXTENDED
def test_mixtral_2a1f_served_tokens_equal_native(
    family_models: Any, native: Any, tmp_path: Path
) -> None:
    afd = afd_settings("ffn", num_attention_ranks=2)
    got, attention_log, ffn_log = run_served_afd(family_models("mixtral"), afd, tmp_path, PROMPTS)
    assert_same_tokens(
        got, native("mixtral", "served"), PROMPTS, "native vLLM, one request at a time"
    )
    _assert_split(attention_log, ffn_log, family_models("mixtral"), "ffn")
