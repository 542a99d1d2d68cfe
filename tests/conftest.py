"""Fixtures shared by the cross-package suites (integration and end-to-end)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny seeded checkpoints, generated once per session (cached across runs when
    AFD_CACHE_DIR is set, as the nox sessions do)."""
    from afd.tools.models.tiny import generate_tiny_checkpoint

    cache = os.environ.get("AFD_CACHE_DIR")
    root = Path(cache) / "tiny" if cache else tmp_path_factory.mktemp("tiny")
    return {
        arch: generate_tiny_checkpoint(arch, root / f"{arch}-s0")
        for arch in ("deepseek_v2", "deepseek_v3")
    }


@pytest.fixture(scope="session")
def tiny_qwen_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str | None, Path]:
    """Tiny seeded Qwen3-MoE checkpoints by variant (None = default, ``no_norm_topk``,
    ``dense_layers``), plus ``"qwen3_5_moe_text"`` (the Qwen3.5/3.6-MoE text model)."""
    from afd.tools.models.tiny import checkpoint_name, generate_tiny_checkpoint, tiny_variants

    cache = os.environ.get("AFD_CACHE_DIR")
    root = Path(cache) / "tiny" if cache else tmp_path_factory.mktemp("tiny-qwen")
    models: dict[str | None, Path] = {
        variant: generate_tiny_checkpoint(
            "qwen3_moe", root / checkpoint_name("qwen3_moe", variant), variant=variant
        )
        for variant in tiny_variants("qwen3_moe")
    }
    models["qwen3_5_moe_text"] = generate_tiny_checkpoint(
        "qwen3_5_moe_text", root / checkpoint_name("qwen3_5_moe_text")
    )
    return models


@pytest.fixture(scope="session")
def tiny_model_of(request: pytest.FixtureRequest) -> Callable[[str], Path]:
    """The default tiny checkpoint of a family: ``qwen3_moe`` (its default variant),
    ``deepseek_v2`` or ``deepseek_v3``; each set is generated on first use only."""

    def of(family: str) -> Path:
        if family == "qwen3_moe":
            qwen: dict[str | None, Path] = request.getfixturevalue("tiny_qwen_models")
            return qwen[None]
        deepseek: dict[str, Path] = request.getfixturevalue("tiny_models")
        return deepseek[family]

    return of


@pytest.fixture(scope="session")
def native_references(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The run's native vLLM references (tests/support/afd_references.py): one per
    (checkpoint content, prompts, grouping, dtype, engine mode, vLLM version), on disk in
    ``AFD_REFERENCE_DIR`` (shared by every nox session of a ``.ci/run``) or in this
    session's temp folder."""
    from afd_references import NativeReferences

    root = os.environ.get("AFD_REFERENCE_DIR")
    refs = NativeReferences(Path(root) if root else tmp_path_factory.mktemp("references"))
    yield refs
    print(f"\n[afd] native references: {refs.engines} engine(s) started, {refs.hits} hit(s)")


# ------------------------------------------------------------------ failure digest


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """After the run: each failed test with the lines of its report that name a cause
    (CI keeps the end of the output; a failure's own report may be cut)."""
    from afd_failure_digest import failure_digest

    reports = [*terminalreporter.stats.get("failed", []), *terminalreporter.stats.get("error", [])]
    if not reports:
        return
    terminalreporter.section("afd failure digest")
    for report in reports:
        terminalreporter.write_line(f"{report.nodeid} ({report.when}):")
        for line in failure_digest(report.longreprtext) or ["(no cause line found)"]:
            terminalreporter.write_line(f"    {line}")
