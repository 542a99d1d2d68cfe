"""tools/release.py bumps and builds one package without touching the others."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A throwaway git repo holding the working tree's files (tracked or not, not ignored)."""
    files = git(ROOT, "ls-files", "--cached", "--others", "--exclude-standard", "-z").split("\0")
    dest = tmp_path / "repo"
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    git(dest, "init", "-q")
    git(dest, "add", "-A")
    git(dest, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    return dest


def release(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(repo / "tools" / "release.py"), *args],
        cwd=repo,
        capture_output=True,
        text=True,
        check=False,
    )


def version_of(repo: Path) -> str:
    text = (repo / "packages/afd-core/src/afd_core/_version.py").read_text()
    return text.split('"')[1]


def test_minor_bump_changes_only_core_version_and_changelog(checkout: Path) -> None:
    before = version_of(checkout)
    major, minor, _ = before.split(".")
    result = release(checkout, "bump", "afd-core", "minor")
    assert result.returncode == 0, result.stderr
    expected = f"{major}.{int(minor) + 1}.0"
    assert version_of(checkout) == expected
    changed = sorted(git(checkout, "diff", "--name-only").split())
    assert changed == [
        "packages/afd-core/CHANGELOG.md",
        "packages/afd-core/src/afd_core/_version.py",
    ]
    changelog = (checkout / "packages/afd-core/CHANGELOG.md").read_text()
    assert f"## {expected} — " in changelog
    assert changelog.index("## Unreleased") < changelog.index(f"## {expected}")
    assert release(checkout, "tag", "afd-core").stdout.strip() == f"afd-core-v{expected}"


def test_build_builds_only_that_package(checkout: Path, tmp_path: Path) -> None:
    if shutil.which("uv") is None:
        pytest.fail("uv is required on PATH to build packages")
    assert release(checkout, "bump", "afd-core", "minor").returncode == 0
    out = tmp_path / "out"
    result = release(checkout, "build", "afd-core", "--out-dir", str(out))
    assert result.returncode == 0, result.stderr
    built = sorted(p.name for p in out.iterdir() if p.suffix in (".whl", ".gz"))
    v = version_of(checkout)
    assert built == [f"afd_core-{v}-py3-none-any.whl", f"afd_core-{v}.tar.gz"]


def test_unknown_package_is_a_clear_error(checkout: Path) -> None:
    result = release(checkout, "bump", "afd-nope", "minor")
    assert result.returncode == 2
    assert "unknown package 'afd-nope'" in result.stderr
    assert "afd-core" in result.stderr
