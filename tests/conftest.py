"""Fixtures shared by the cross-package suites (integration and end-to-end)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny seeded checkpoints, generated once per session (cached across runs when
    AFD_CACHE_DIR is set, as the nox sessions do)."""
    from afd.models.tiny import generate_tiny_checkpoint

    cache = os.environ.get("AFD_CACHE_DIR")
    root = Path(cache) / "tiny" if cache else tmp_path_factory.mktemp("tiny")
    return {
        arch: generate_tiny_checkpoint(arch, root / f"{arch}-s0")
        for arch in ("deepseek_v2", "deepseek_v3")
    }
