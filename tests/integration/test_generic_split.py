"""The generic split plan read off vLLM's own model classes (afd_moe_runners.split_plan):
per-layer kinds, checkpoint-tensor ownership, and `afd models check` on a dense model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm]


def _tensor_names(model_dir: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            names += list(f.keys())
    return sorted(names)


@pytest.fixture(scope="module")
def checks(tiny_models: dict[str, Path], tiny_qwen_models: dict[str | None, Path]) -> Any:
    from afd.models.check import check_model

    cache: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in cache:
            path = tiny_models.get(name) or tiny_qwen_models[name.removeprefix("qwen3_moe-")]
            cache[name] = check_model(str(path))
        return cache[name]

    return get


@pytest.mark.parametrize(
    ("name", "kinds", "extras"),
    [
        ("deepseek_v2", ["dense", "moe", "moe"], {"shared_experts"}),
        ("deepseek_v3", ["dense", "moe", "moe"], {"shared_experts"}),
        ("qwen3_moe-dense_layers", ["moe", "dense", "moe"], set()),
    ],
)
def test_plan_per_layer(checks: Any, name: str, kinds: list[str], extras: set[str]) -> None:
    result = checks(name)
    plan = result.plan
    assert result.supported, plan.problems
    assert [layer.kind for layer in plan.layers] == kinds
    assert all(layer.attention == ("self_attn",) and layer.ffn == "mlp" for layer in plan.layers)
    assert plan.gate_attrs == {"gate"}
    assert plan.moe_extra_attrs == extras
    assert plan.embedding_prefixes == ("model.embed_tokens",)
    assert plan.lm_head_prefixes == ("lm_head",)
    assert "splits into Attention and FFN roles" in result.summary()


@pytest.mark.parametrize("gate_on_attention", [False, True])
@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe-dense_layers"])
def test_tensor_owners_equal_the_family_tables(
    checks: Any,
    tiny_models: dict[str, Path],
    tiny_qwen_models: dict[str | None, Path],
    name: str,
    gate_on_attention: bool,
) -> None:
    """The plan assigns every checkpoint tensor to the role the hand-written per-family
    tables (written and proven before the generic path) assign it to."""
    from afd_models_deepseek.weights import classify_deepseek_weight
    from afd_models_qwen.weights import classify_qwen_weight

    plan = checks(name).plan
    if name.startswith("deepseek"):
        path, table = tiny_models[name], classify_deepseek_weight
    else:
        path, table = tiny_qwen_models["dense_layers"], classify_qwen_weight
    names = _tensor_names(path)
    assert len(names) > 20
    got = {n: plan.owner(n, gate_on_attention=gate_on_attention) for n in names}
    want = {n: table(n, gate_on_attention=gate_on_attention) for n in names}
    assert got == want


def test_a_dense_model_is_refused_in_one_line(tmp_path: Path) -> None:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
    )
    config.architectures = ["LlamaForCausalLM"]
    model_dir = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(str(model_dir))
    proc = subprocess.run(
        [sys.executable, "-m", "afd.cli", "models", "check", str(model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    verdict = [ln for ln in proc.stdout.splitlines() if ln.startswith(str(model_dir))]
    assert len(verdict) == 1, proc.stdout
    assert "LlamaForCausalLM cannot be split" in verdict[0]
    assert "no MoE layer" in verdict[0]


def test_an_unreadable_model_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    proc = subprocess.run(
        [sys.executable, "-m", "afd.cli", "models", "check", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "afd models check:" in proc.stderr
