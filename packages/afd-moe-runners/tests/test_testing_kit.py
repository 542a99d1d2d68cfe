"""The test kit knows no model family: blocks come from the families' entry points."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from afd_moe_runners import testing


def test_the_kit_names_no_family() -> None:
    text = Path(testing.__file__).read_text()
    assert re.findall(r"(?i)deepseek|qwen", text) == []


def test_blocks_are_found_by_name_among_the_installed_families() -> None:
    block = testing.block_recipe("qwen3")
    assert isinstance(block, testing.BlockRecipe) and block.name == "qwen3"
    with pytest.raises(ValueError, match=r"unknown test block 'nope'; .*: .*qwen3"):
        testing.block_recipe("nope")
