"""Drift tests for the one patch afd-models-qwen applies to vLLM.

The wrappers replace a few module-level names of vLLM's Qwen model files while vLLM's
own constructors run (afd_core.patching.scoped_globals). These tests fail when upstream
renames one of those names or stops calling it where we expect: exactly when the
role-aware construction would silently build native modules again.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm

qm = pytest.importorskip("vllm.model_executor.models.qwen3_moe")


def test_supported_vllm_line() -> None:
    import vllm

    assert vllm.__version__.startswith("0.32."), (
        f"afd-models-qwen was written against vLLM 0.32; installed {vllm.__version__}"
    )


def test_every_qwen3_moe_substituted_name_still_exists() -> None:
    from afd_models_qwen.qwen3_moe import SUBSTITUTED_NAMES

    for role, names in SUBSTITUTED_NAMES.items():
        for name in names:
            assert hasattr(qm, name), f"{role.value}: qwen3_moe.{name} is gone"


@pytest.mark.parametrize(
    ("constructor", "names"),
    [
        ("Qwen3MoeSparseMoeBlock.__init__", {"FusedMoEFactory", "Qwen3MoeMLP"}),
        (
            "Qwen3MoeDecoderLayer.__init__",
            {"Qwen3MoeAttention", "Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP"},
        ),
        ("Qwen3MoeModel.__init__", {"VocabParallelEmbedding"}),
        ("Qwen3MoeForCausalLM.__init__", {"ParallelLMHead", "Qwen3MoeModel"}),
    ],
)
def test_qwen3_moe_constructors_still_call_the_substituted_names(
    constructor: str, names: set[str]
) -> None:
    from afd_core.patching import referenced_globals

    cls_name, attr = constructor.split(".")
    func = getattr(getattr(qm, cls_name), attr)
    missing = names - referenced_globals(func)
    assert not missing, f"{constructor} no longer refers to {sorted(missing)}"


def test_qwen3_moe_for_causal_lm_still_does_not_forward_decoder_layer_type() -> None:
    """Why the wrapper patches names instead of using ``decoder_layer_type``: if this
    starts failing, upstream made the seam reachable and the patch may be retired."""
    import inspect

    assert "decoder_layer_type: type" in inspect.getsource(qm.Qwen3MoeModel)
    src = inspect.getsource(qm.Qwen3MoeForCausalLM.__init__)
    assert "decoder_layer_type" not in src


def test_qwen3_next_block_still_calls_the_factory() -> None:
    qn = pytest.importorskip("vllm.model_executor.models.qwen3_next")
    from afd_core.patching import referenced_globals
    from afd_models_qwen.qwen3_5_moe_names import SUBSTITUTED_NAMES

    for role, modules in SUBSTITUTED_NAMES.items():
        for name in modules.get("vllm.model_executor.models.qwen3_next", ()):
            assert hasattr(qn, name), f"{role.value}: qwen3_next.{name} is gone"
    assert "FusedMoEFactory" in referenced_globals(qn.Qwen3NextSparseMoeBlock.__init__)


def test_qwen3_5_constructors_still_call_the_substituted_names() -> None:
    from afd_models_qwen.availability import qwen3_5_import_error

    blocker = qwen3_5_import_error()
    if blocker is not None:
        pytest.skip(f"vLLM's qwen3_5 model file does not import here: {blocker}")
    import vllm.model_executor.models.qwen3_5 as q5

    from afd_core.patching import referenced_globals
    from afd_models_qwen.qwen3_5_moe_names import SUBSTITUTED_NAMES

    for role, modules in SUBSTITUTED_NAMES.items():
        for name in modules.get("vllm.model_executor.models.qwen3_5", ()):
            assert hasattr(q5, name), f"{role.value}: qwen3_5.{name} is gone"
    layer = referenced_globals(q5.Qwen3_5DecoderLayer.__init__)
    assert {"QwenGatedDeltaNetAttention", "Qwen3NextAttention", "Qwen3NextSparseMoeBlock"} <= layer
    assert "VocabParallelEmbedding" in referenced_globals(q5.Qwen3_5Model.__init__)
    assert "ParallelLMHead" in referenced_globals(q5.Qwen3_5ForCausalLMBase.__init__)


def test_scoped_globals_restores_on_error() -> None:
    from afd_core.patching import scoped_globals

    original = qm.FusedMoEFactory
    with (
        pytest.raises(RuntimeError, match="boom"),
        scoped_globals(qm, {"FusedMoEFactory": object()}),
    ):
        raise RuntimeError("boom")
    assert qm.FusedMoEFactory is original
