"""The Qwen family as afd finds it: its entry point, its import hook, its test block."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from afd_models_qwen import family, qwen3_5_import
from afd_models_qwen.recipes import TINY_RECIPES
from afd_models_qwen.shapes import SHAPES


def test_the_entry_point_names_this_family() -> None:
    (ep,) = [ep for ep in entry_points(group="afd.families") if ep.name == "qwen"]
    assert ep.load() is family
    assert (family.NAME, family.PACKAGE) == ("qwen", "afd_models_qwen")
    assert family.RECIPES == TINY_RECIPES and family.SHAPES == SHAPES
    assert not hasattr(family, "cpu_attention_backend")  # no CPU quirk of its own


def test_the_import_hooks_prepare_the_torchvision_free_qwen3_5_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(qwen3_5_import, "install_import_hook", lambda: calls.append("hook"))
    family.install_import_hooks()
    assert calls == ["hook"]


def test_the_test_block_is_qwen3_moe() -> None:
    from afd_models_qwen.testing import QWEN3_STYLE

    blocks = family.test_blocks()
    assert set(blocks) == {"qwen3"}
    assert blocks["qwen3"].architecture == "Qwen3MoeForCausalLM"
    hf = blocks["qwen3"].hf_config()
    assert {k: getattr(hf, k) for k in QWEN3_STYLE} == QWEN3_STYLE
