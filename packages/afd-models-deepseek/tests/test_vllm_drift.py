"""Drift tests for the one patch afd-models-deepseek applies to vLLM.

The wrappers replace a few module-level names of ``vllm.model_executor.models.deepseek_v2``
while vLLM's own constructors run (afd_core.patching.scoped_globals). These tests fail
when upstream renames one of those names or stops calling it where we expect, which is
exactly when the role-aware construction would silently build native modules again.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm

ds = pytest.importorskip("vllm.model_executor.models.deepseek_v2")


def test_supported_vllm_line() -> None:
    import vllm

    assert vllm.__version__.startswith("0.32."), (
        f"afd-models-deepseek was written against vLLM 0.32; installed {vllm.__version__}"
    )


def test_every_substituted_name_still_exists() -> None:
    from afd_models_deepseek.model import SUBSTITUTED_NAMES

    for role, names in SUBSTITUTED_NAMES.items():
        for name in names:
            assert hasattr(ds, name), f"{role.value}: deepseek_v2.{name} is gone"


@pytest.mark.parametrize(
    ("constructor", "names"),
    [
        ("DeepseekV2MoE.__init__", {"FusedMoEFactory", "DeepseekV2MLP"}),
        (
            "DeepseekV2DecoderLayer.__init__",
            {
                "DeepseekV2MoE",
                "DeepseekV2MLP",
                "DeepseekAttention",
                "DeepseekV2Attention",
                "DeepseekV2MLAAttention",
            },
        ),
        ("DeepseekV2Model.__init__", {"VocabParallelEmbedding"}),
        ("DeepseekV2ForCausalLM.__init__", {"ParallelLMHead"}),
    ],
)
def test_constructors_still_call_the_substituted_names(constructor: str, names: set[str]) -> None:
    from afd_core.patching import referenced_globals

    cls_name, attr = constructor.split(".")
    func = getattr(getattr(ds, cls_name), attr)
    missing = names - referenced_globals(func)
    assert not missing, f"{constructor} no longer refers to {sorted(missing)}"


def test_scoped_globals_restores_on_error() -> None:
    from afd_core.patching import scoped_globals

    original = ds.FusedMoEFactory
    with (
        pytest.raises(RuntimeError, match="boom"),
        scoped_globals(ds, {"FusedMoEFactory": object()}),
    ):
        raise RuntimeError("boom")
    assert ds.FusedMoEFactory is original


def test_weight_classification_covers_every_tensor_kind() -> None:
    from afd_core.weights import WeightOwner
    from afd_models_deepseek.weights import classify_deepseek_weight

    cases = {
        "model.embed_tokens.weight": (WeightOwner.ATTENTION, WeightOwner.ATTENTION),
        "lm_head.weight": (WeightOwner.ATTENTION, WeightOwner.ATTENTION),
        "model.norm.weight": (WeightOwner.BOTH, WeightOwner.BOTH),
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (
            WeightOwner.ATTENTION,
            WeightOwner.ATTENTION,
        ),
        "model.layers.0.input_layernorm.weight": (WeightOwner.BOTH, WeightOwner.BOTH),
        "model.layers.0.mlp.gate_proj.weight": (WeightOwner.FFN, WeightOwner.FFN),
        "model.layers.1.mlp.experts.3.down_proj.weight": (WeightOwner.FFN, WeightOwner.FFN),
        "model.layers.1.mlp.shared_experts.up_proj.weight": (WeightOwner.FFN, WeightOwner.FFN),
        "model.layers.1.mlp.gate.weight": (WeightOwner.FFN, WeightOwner.BOTH),
        "model.layers.1.mlp.gate.e_score_correction_bias": (WeightOwner.FFN, WeightOwner.BOTH),
    }
    for name, (gate_on_ffn, gate_on_attention) in cases.items():
        assert classify_deepseek_weight(name, gate_on_attention=False) is gate_on_ffn, name
        assert classify_deepseek_weight(name, gate_on_attention=True) is gate_on_attention, name
