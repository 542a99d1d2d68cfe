"""afd finds the model families through entry points (``afd.families``), not by name."""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Any

import pytest

from afd import model_families as families
from afd.runtime import plugin
from afd.tools.models.recipes import GENERIC_RECIPES, TINY_RECIPES

SRC = Path(families.__file__).resolve().parent


def test_the_workspace_families_are_found_by_entry_point() -> None:
    found = {f.NAME: f for f in families.families()}
    assert set(found) >= {"deepseek", "qwen"}
    import afd_models_deepseek.family
    import afd_models_qwen.family

    assert found["deepseek"] is afd_models_deepseek.family
    assert found["qwen"] is afd_models_qwen.family
    # afd models tiny knows every family's recipes, then the generic path's
    assert (*families.family_recipes(), *GENERIC_RECIPES) == TINY_RECIPES
    assert {"deepseek_v2", "deepseek_v3", "qwen3_moe"} <= {r.arch for r in TINY_RECIPES}
    assert {"afd_models_deepseek", "afd_models_qwen"} <= set(plugin.afd_loggers())


class _EntryPoint:
    def __init__(self, name: str, family: Any) -> None:
        self.name, self.value, self._family = name, f"other_pkg.{name}", family

    def load(self) -> Any:
        if isinstance(self._family, Exception):
            raise self._family
        return self._family


@pytest.fixture
def only(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Make the given entry points the only families of the process."""

    def install(*eps: _EntryPoint) -> None:
        import importlib.metadata

        monkeypatch.setattr(
            importlib.metadata,
            "entry_points",
            lambda group: [ep for ep in eps] if group == families.GROUP else [],
        )
        families.families.cache_clear()

    yield install
    families.families.cache_clear()


def test_a_family_from_another_distribution_is_used_like_the_built_in_ones(only: Any) -> None:
    hooks: list[str] = []
    other = types.SimpleNamespace(
        NAME="other",
        PACKAGE="other_pkg",
        RECIPES=("recipe-a",),
        SHAPES=("shape-a",),
        install_import_hooks=lambda: hooks.append("other"),
        cpu_attention_backend=lambda cfg, dtype, *, amx_tiles: (
            "OTHER" if cfg.get("other_attention") and amx_tiles() else None
        ),
    )
    bare = types.SimpleNamespace(NAME="bare")  # everything else is optional
    only(_EntryPoint("zz-other", other), _EntryPoint("aa-bare", bare))
    assert families.families() == (bare, other)  # entry point name order
    assert families.family_recipes() == ("recipe-a",)
    assert families.family_shapes() == ("shape-a",)
    assert families.family_packages() == ("other_pkg",)
    assert plugin.afd_loggers()[-1] == "other_pkg"
    families.install_import_hooks()
    assert hooks == ["other"]
    assert (
        families.cpu_attention_backend({"other_attention": 1}, "float32", amx_tiles=lambda: True)
        == "OTHER"
    )
    assert families.cpu_attention_backend({}, "float32", amx_tiles=lambda: True) is None


def test_a_family_that_fails_to_load_is_named(only: Any) -> None:
    only(_EntryPoint("broken", ModuleNotFoundError("No module named 'other_pkg'")))
    with pytest.raises(ImportError, match=r"model family 'broken' \(other_pkg.broken.*other_pkg"):
        families.families()
    only(_EntryPoint("nameless", types.SimpleNamespace()))
    with pytest.raises(TypeError, match=r"'nameless'.*has no NAME"):
        families.families()


def test_afd_imports_no_model_package() -> None:
    """afd-meta's modules reach the families through :mod:`afd.model_families` only."""
    pattern = re.compile(r"^\s*(from|import)\s+afd_models_\w+", re.M)
    found = [
        str(path.relative_to(SRC))
        for path in sorted(SRC.rglob("*.py"))
        if pattern.search(path.read_text())
    ]
    assert found == []
