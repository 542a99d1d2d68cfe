#!/usr/bin/env python3
"""Per-package release tooling for the afd workspace.

Each package under packages/ is versioned and released on its own; its version
lives in ``src/<import name>/_version.py`` and its history in ``CHANGELOG.md``.

    python tools/release.py list
    python tools/release.py bump afd-core minor      # 0.1.0 -> 0.2.0, changelog dated
    python tools/release.py build afd-core           # dist/afd-core/*.whl + *.tar.gz
    python tools/release.py tag afd-core [--create]  # afd-core-v0.2.0
    python tools/release.py requirements dist/ [--base-url URL]

``bump`` touches exactly two files (the version file and the changelog); ``build``
builds that package alone with ``uv build --package NAME --no-sources``.

``requirements`` writes, next to the wheels of a release, one pip requirements file per
package and extra (``afd-0.1.0-cpu.txt``, ``afd-core-0.1.0.txt``, ...) that names every
afd distribution it needs by direct URL (``afd[cpu] @ URL/afd-0.1.0-py3-none-any.whl``):
the name ``afd`` on PyPI belongs to another project, and no afd package is on PyPI, so an
install by name could take someone else's package. Third-party dependencies (vLLM, torch)
still come from the configured indexes. ``--base-url`` is where the wheels will be
served (default: the folder itself, as ``file://`` URLs).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import email.parser
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSION_RE = re.compile(r'^__version__ = "(\d+)\.(\d+)\.(\d+)"$', re.M)
PARTS = ("major", "minor", "patch")


class ReleaseError(Exception):
    pass


@dataclass(frozen=True)
class Package:
    folder: Path
    dist_name: str
    import_name: str

    @property
    def version_file(self) -> Path:
        return self.folder / "src" / self.import_name / "_version.py"

    @property
    def changelog(self) -> Path:
        return self.folder / "CHANGELOG.md"

    @property
    def version(self) -> str:
        m = VERSION_RE.search(self.version_file.read_text())
        if not m:
            raise ReleaseError(f"{self.version_file}: no '__version__ = \"X.Y.Z\"' line")
        return ".".join(m.groups())

    @property
    def tag(self) -> str:
        return f"{self.dist_name}-v{self.version}"


def packages(root: Path = ROOT) -> dict[str, Package]:
    found: dict[str, Package] = {}
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        text = pyproject.read_text()
        name = re.search(r'^name = "([^"]+)"', text, re.M)
        path = re.search(r'^path = "src/([^/]+)/_version.py"', text, re.M)
        if not name or not path:
            raise ReleaseError(f"{pyproject}: needs [project].name and [tool.hatch.version].path")
        pkg = Package(pyproject.parent, name.group(1), path.group(1))
        found[pkg.dist_name] = pkg
        found.setdefault(pyproject.parent.name, pkg)  # folder name works too (afd-meta)
    return found


def get_package(name: str, root: Path = ROOT) -> Package:
    pkgs = packages(root)
    if name not in pkgs:
        names = sorted({p.dist_name for p in pkgs.values()})
        raise ReleaseError(f"unknown package {name!r}; packages: {', '.join(names)}")
    return pkgs[name]


def bumped(version: str, part: str) -> str:
    major, minor, patch = (int(x) for x in version.split("."))
    if part == "major":
        return f"{major + 1}.0.0"
    if part == "minor":
        return f"{major}.{minor + 1}.0"
    if part == "patch":
        return f"{major}.{minor}.{patch + 1}"
    raise ReleaseError(f"part must be one of {PARTS}, got {part!r}")


def bump(pkg: Package, part: str, today: _dt.date | None = None) -> str:
    old = pkg.version
    new = bumped(old, part)
    text = pkg.changelog.read_text()
    if "## Unreleased" not in text:
        raise ReleaseError(f"{pkg.changelog}: no '## Unreleased' section to release")
    date = (today or _dt.date.today()).isoformat()
    text = text.replace("## Unreleased", f"## Unreleased\n\n## {new} — {date}", 1)
    pkg.version_file.write_text(
        VERSION_RE.sub(f'__version__ = "{new}"', pkg.version_file.read_text(), count=1)
    )
    pkg.changelog.write_text(text)
    return new


def build(pkg: Package, out_dir: Path | None = None) -> list[Path]:
    out = out_dir or ROOT / "dist" / pkg.dist_name
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    subprocess.run(
        ["uv", "build", "--package", pkg.dist_name, "--no-sources", "--out-dir", str(out)],
        cwd=pkg.folder.parents[1],
        check=True,
    )
    return sorted(out.iterdir())


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str
    """Distribution name as its metadata spells it (``afd-core``)."""
    version: str
    requires: tuple[tuple[str, str | None], ...]
    """(requirement name, the extra it belongs to or None) of each ``Requires-Dist``."""
    extras: tuple[str, ...]


_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_EXTRA_MARKER = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_wheel(path: Path) -> Wheel:
    """Name, version, requirements and extras of a wheel, from its METADATA."""
    with zipfile.ZipFile(path) as zf:
        meta = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA")), None)
        if meta is None:
            raise ReleaseError(f"{path}: no .dist-info/METADATA")
        msg = email.parser.Parser().parsestr(zf.read(meta).decode("utf-8"))
    requires = []
    for line in msg.get_all("Requires-Dist") or []:
        req, _, marker = line.partition(";")
        m = _REQ_NAME.match(req)
        if not m:
            raise ReleaseError(f"{path}: cannot read the requirement {line!r}")
        extra = _EXTRA_MARKER.search(marker)
        requires.append((_normalize(m.group(1)), extra.group(1) if extra else None))
    return Wheel(
        path,
        msg["Name"],
        msg["Version"],
        tuple(requires),
        tuple(msg.get_all("Provides-Extra") or []),
    )


def requirement_lines(
    wheels: dict[str, Wheel], package: str, extra: str | None, base_url: str
) -> list[str]:
    """Direct-URL requirement lines installing ``package[extra]`` and every afd
    distribution (one of ``wheels``, keyed by normalized name) it needs."""
    top = wheels[_normalize(package)]
    needed = [top]
    todo = [(top, extra)]
    while todo:
        wheel, wanted = todo.pop()
        for name, only_for in wheel.requires:
            if only_for is not None and only_for != wanted:
                continue
            dep = wheels.get(name)
            if dep is not None and dep not in needed:
                needed.append(dep)
                todo.append((dep, None))
    base = base_url.rstrip("/")
    lines = []
    for wheel in needed:
        label = f"{wheel.name}[{extra}]" if wheel is top and extra else wheel.name
        lines.append(f"{label} @ {base}/{wheel.path.name}")
    return lines


def write_requirements(dist: Path, base_url: str | None = None) -> list[Path]:
    """One requirements file per afd wheel in ``dist`` and per extra of it, written to
    ``dist``: ``<name>-<version>[-<extra>].txt``."""
    found = sorted(dist.glob("*.whl"))
    if not found:
        raise ReleaseError(f"{dist}: no wheels (build them with uv build --all-packages)")
    wheels = {_normalize(w.name): w for w in map(read_wheel, found)}
    base = base_url or dist.resolve().as_uri()
    out = []
    for key, wheel in sorted(wheels.items()):
        for extra in (None, *wheel.extras):
            suffix = f"-{extra}" if extra else ""
            path = dist / f"{wheel.name}-{wheel.version}{suffix}.txt"
            what = f"{wheel.name}[{extra}]" if extra else wheel.name
            header = [
                f"# {what} {wheel.version}: pip install -r {path.name}",
                "# afd distributions by direct URL (the name afd on PyPI is another project);",
                "# everything else comes from your indexes.",
            ]
            path.write_text("\n".join(header + requirement_lines(wheels, key, extra, base)) + "\n")
            out.append(path)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="packages with versions and tags")
    b = sub.add_parser("bump", help="bump one package's version and date its changelog")
    b.add_argument("package")
    b.add_argument("part", choices=PARTS)
    bd = sub.add_parser("build", help="build one package (wheel + sdist)")
    bd.add_argument("package")
    bd.add_argument("--out-dir", type=Path)
    t = sub.add_parser("tag", help="print (or create) the package's release tag")
    t.add_argument("package")
    t.add_argument("--create", action="store_true", help="create the annotated git tag")
    r = sub.add_parser(
        "requirements", help="write direct-URL requirements files next to built wheels"
    )
    r.add_argument("dist", type=Path, help="folder with the wheels of the release")
    r.add_argument("--base-url", help="where the wheels are served (default: file:// URLs)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            for pkg in {p.dist_name: p for p in packages().values()}.values():
                print(f"{pkg.dist_name:22} {pkg.version:8} {pkg.tag}")
        elif args.cmd == "bump":
            pkg = get_package(args.package)
            old = pkg.version
            new = bump(pkg, args.part)
            print(f"{pkg.dist_name}: {old} -> {new} (tag {pkg.dist_name}-v{new})")
        elif args.cmd == "build":
            for path in build(get_package(args.package), args.out_dir):
                print(path)
        elif args.cmd == "tag":
            pkg = get_package(args.package)
            if args.create:
                subprocess.run(
                    ["git", "tag", "-a", pkg.tag, "-m", f"{pkg.dist_name} {pkg.version}"],
                    cwd=ROOT,
                    check=True,
                )
            print(pkg.tag)
        elif args.cmd == "requirements":
            for path in write_requirements(args.dist, args.base_url):
                print(path)
    except ReleaseError as exc:
        print(f"release: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
