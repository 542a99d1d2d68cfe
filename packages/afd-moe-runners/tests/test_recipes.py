"""afd_moe_runners.recipes: recipes and shapes are plain data (no torch, no vLLM)."""

from __future__ import annotations

import pytest

from afd_moe_runners.recipes import DeploymentShape, TinyRecipe

R = TinyRecipe(
    "fam",
    "FamConfig",
    "FamForCausalLM",
    {"hidden_size": 8, "layers": [0]},
    variants={"wide": {"hidden_size": 16}},
    bench={"hidden_size": 64},
    bench_variants={"wide": {"hidden_size": 128}},
)


def test_config_applies_variant_then_bench_overrides() -> None:
    assert R.config() == {"hidden_size": 8, "layers": [0]}
    assert R.config("wide")["hidden_size"] == 16
    assert R.config(size="bench")["hidden_size"] == 64
    assert R.config("wide", "bench")["hidden_size"] == 128


def test_config_is_a_deep_copy() -> None:
    R.config()["layers"].append(1)
    assert R.config()["layers"] == [0]


def test_unknown_variant_and_missing_bench() -> None:
    with pytest.raises(ValueError, match="unknown fam variant 'x'; known: wide"):
        R.config("x")
    plain = TinyRecipe("p", "C", "M", {})
    with pytest.raises(ValueError, match="p has no variants"):
        plain.config("x")
    with pytest.raises(ValueError, match="p has no bench size"):
        plain.config(size="bench")


def test_shape() -> None:
    s = DeploymentShape(
        "X", "org/x", {"architectures": ["XForCausalLM"]}, moe_layers=2, dense_layers=0,
        routed_experts=12,
    )  # fmt: skip
    assert s.architecture == "XForCausalLM"
    assert s.ffn_ranks(8) == (1, 2, 3, 4, 6)
    body = s.config_json()
    body["architectures"].append("Y")
    assert s.config["architectures"] == ["XForCausalLM"]


def test_recipes_import_neither_torch_nor_vllm() -> None:
    import subprocess
    import sys

    code = (
        "import sys, afd_moe_runners.recipes, afd_models_deepseek.recipes, "
        "afd_models_deepseek.shapes, afd_models_qwen.recipes, afd_models_qwen.shapes; "
        "assert 'torch' not in sys.modules and 'vllm' not in sys.modules, "
        "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm'))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
