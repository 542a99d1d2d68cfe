"""The layering contracts in .importlinter really catch forbidden imports."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def lint_imports(src_root: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.fail(
            f"lint-imports is not installed next to {sys.executable} (dependency group 'lint')"
        )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in sorted(src_root.iterdir()))}
    return subprocess.run(
        [str(exe), "--config", str(ROOT / ".importlinter"), "--no-cache"],
        cwd=src_root,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.fixture
def src_copy(tmp_path: Path) -> Path:
    """Every package's src/ tree copied to tmp, one folder per package (shadows the installs)."""
    for pkg in sorted((ROOT / "packages").iterdir()):
        if (pkg / "src").is_dir():
            shutil.copytree(
                pkg / "src", tmp_path / pkg.name, ignore=shutil.ignore_patterns("__pycache__")
            )
    return tmp_path


def inject(src_copy: Path, package_folder: str, module: str, line: str) -> None:
    (src_copy / package_folder / module.replace(".", "/")).with_suffix(".py").write_text(
        line + "\n"
    )


def test_clean_tree_keeps_every_contract(src_copy: Path) -> None:
    result = lint_imports(src_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("folder", "module", "line", "contract"),
    [
        ("afd-core", "afd_core.bad", "import afd_moe_runners", "only lower layers"),
        (
            "afd-models-qwen",
            "afd_models_qwen.bad",
            "import afd_models_deepseek",
            "only lower layers",
        ),
        (
            "afd-connectors-gpu",
            "afd_connectors_gpu.bad",
            "import afd_connectors_npu",
            "only lower layers",
        ),
        (
            "afd-models-deepseek",
            "afd_models_deepseek.bad",
            "import afd_connectors_gpu",
            "only through",
        ),
        ("afd-core", "afd_core.bad", "import torch", "neither torch nor vLLM"),
    ],
)
def test_forbidden_import_breaks_a_contract(
    src_copy: Path, folder: str, module: str, line: str, contract: str
) -> None:
    inject(src_copy, folder, module, line)
    result = lint_imports(src_copy)
    assert result.returncode != 0, result.stdout
    broken = [ln for ln in result.stdout.splitlines() if " BROKEN" in ln]
    assert any(contract in ln for ln in broken), result.stdout
    assert module in result.stdout


def _connector_names() -> set[str]:
    """Every connector a workspace package installs (afd.connectors entry points), plus
    afd-core's test double."""
    import tomllib

    names = {"LoopbackAFDConnector"}
    for pyproject in ROOT.glob("packages/*/pyproject.toml"):
        data = tomllib.loads(pyproject.read_text())
        names |= set(data.get("project", {}).get("entry-points", {}).get("afd.connectors", {}))
    return names


def test_runner_and_model_layers_name_no_concrete_connector() -> None:
    """They decide by the capabilities a connector class declares, so a connector from
    another distribution is treated like the built-in ones."""
    names = _connector_names()
    assert {"P2pGlooAFDConnector", "CAMP2pAFDConnector"} <= names
    found = []
    for package in ("afd-moe-runners", "afd-models-deepseek", "afd-models-qwen"):
        for path in sorted((ROOT / "packages" / package / "src").rglob("*.py")):
            text = path.read_text()
            found += [f"{path.relative_to(ROOT)}: {n}" for n in sorted(names) if n in text]
    assert found == []


def test_lower_layers_name_no_module_of_the_afd_package() -> None:
    """No string in afd-core, the connectors, the runners or the models names a module of
    the meta package ``afd`` (a ``--worker-cls`` such as ``"afd.runtime.worker.X"``): the
    runtime registers what a lower layer must know (``afd_moe_runners.worker_table``).
    Docstrings may mention them."""
    import ast
    import re

    meta = ROOT / "packages" / "afd-meta" / "src" / "afd"
    modules = sorted({p.stem for p in meta.iterdir() if not p.name.startswith("_")})
    assert {"runtime", "launch", "cli"} <= set(modules)
    pattern = re.compile(rf"\bafd\.({'|'.join(modules)})\b")
    found = []
    for package in sorted((ROOT / "packages").iterdir()):
        if package.name == "afd-meta":
            continue
        for path in sorted((package / "src").rglob("*.py")):
            tree = ast.parse(path.read_text())
            docstrings = {
                id(node.body[0].value)
                for node in ast.walk(tree)
                if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
                and node.body
                and isinstance(node.body[0], ast.Expr)
                and isinstance(node.body[0].value, ast.Constant)
            }
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and id(node) not in docstrings
                    and pattern.search(node.value)
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:60]!r}")
    assert found == []
