"""The tiny recipes as data: a recipe change without a generator-version bump is caught.

Cached tiny checkpoints are reused by their stamp (arch, variant, seed, size, generator
version), so a recipe that changes while ``GENERATOR_VERSION`` stays would leave stale
checkpoints in every cache. The digest below is that of every (arch, variant, size)
config at version 3, computed from ``afd.models.tiny`` (commit 6af996a) before the
recipes moved to the model packages; the move kept it (and the generated files
byte-identical)."""

from __future__ import annotations

import hashlib
import json

import pytest

pytest.importorskip("tokenizers")

from afd.tools.models.tiny import (
    GENERATOR_VERSION,
    TINY_ARCHS,
    TINY_SIZES,
    tiny_config,
    tiny_variants,
)

CONFIG_DIGESTS = {
    "3": "022087a19088480956fdafbfc657910dd7ab64906a75aaad49cc649d1a8a612a",
    # version 4: deepseek_v3's ``mtp`` variant (one MTP layer); the other configs as in 3
    "4": "2a7c8a9c860018a3d2096ef88c343dd395f4ca0fa1bd354ab027d55cc7984bef",
}


def _all_configs() -> dict[str, object]:
    return {
        f"{arch}/{variant}/{size}": tiny_config(arch, variant, size)
        for arch, recipe in TINY_ARCHS.items()
        for variant in tiny_variants(arch)
        for size in TINY_SIZES
        if size == "tiny" or recipe.bench is not None
    }


def test_recipes_match_the_generator_version() -> None:
    configs = _all_configs()
    # 13 archs, qwen3_moe's 2 variants, deepseek_v3's 1, 2 bench sizes x variants
    assert len(configs) == 21
    digest = hashlib.sha256(json.dumps(configs, sort_keys=True).encode()).hexdigest()
    assert digest == CONFIG_DIGESTS.get(GENERATOR_VERSION), (
        "a tiny recipe changed: bump GENERATOR_VERSION in afd.tools.models.tiny and add "
        f"the new digest here ({GENERATOR_VERSION!r}: {digest!r})"
    )


def test_registry_holds_the_model_packages_recipes() -> None:
    from afd_models_deepseek.recipes import TINY_RECIPES as DEEPSEEK
    from afd_models_qwen.recipes import TINY_RECIPES as QWEN

    for recipe in (*DEEPSEEK, *QWEN):
        assert TINY_ARCHS[recipe.arch] is recipe


def test_configs_are_fresh_copies() -> None:
    a = tiny_config("qwen3_moe", "dense_layers")
    a["mlp_only_layers"].append(2)
    assert tiny_config("qwen3_moe", "dense_layers")["mlp_only_layers"] == [1]
