"""docs/development.md's coverage table (README's "What is verified" claims -> the CI
tests and sessions that check them) names only tests that CI runs where it says.

Every backticked ``path::test[case]`` of a row's test cell must be collected by pytest in
the selection of one of the row's CI sessions (``tests``, ``tests-matrix``: the markers
noxfile.py gives them), and every pytest session a row names must collect one of the
row's tests. ``*`` in an id stands for any text; an id without ``[...]`` names every case
of the test; a backticked ``[case]`` alone is another case of the id before it. Only the
files the table names are collected (``pytest --co``, both sessions at once: ~10 s).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "development.md"
HEADING = "#### Coverage: README's claims and the CI checks"

#: The pytest sessions of CI and their marker selections (noxfile.py: tests, tests_matrix).
SELECTIONS = {
    "tests": "not gpu and not npu and not matrix and not compiled and not extended",
    "tests-matrix": "matrix and not gpu and not npu and not extended",
}
#: CI sessions that run no pytest selection of their own (``.ci/run``).
OTHER_CI_SESSIONS = {"lint", "typecheck", "core-no-torch", "build", "install-each", "install-smoke"}

_TICKED = re.compile(r"`([^`]+)`")

#: (capability, test ids, sessions): one row of the table.
Row = tuple[str, list[str], list[str]]


def table_rows(text: str) -> list[Row]:
    """(capability, test ids, sessions) per row of the coverage table."""
    start = text.index(HEADING)
    end = text.find("\n#### ", start + len(HEADING))
    section = text[start : end if end >= 0 else len(text)]
    rows: list[Row] = []
    for line in section.splitlines():
        if not line.startswith("|") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 3, f"a row of the coverage table has {len(cells)} cells: {line}"
        if cells[0].startswith("capability"):
            continue  # the header
        ids: list[str] = []
        base = None
        for token in _TICKED.findall(cells[1]):
            if ".py::" in token:
                base = token.split("[", 1)[0]
                ids.append(token)
            elif token.startswith("[") and token.endswith("]") and base is not None:
                ids.append(base + token)
        sessions = [s.strip() for s in cells[2].split(",") if s.strip()]
        rows.append((cells[0], ids, sessions))
    return rows


def matches(test_id: str, collected: set[str]) -> bool:
    """Whether pytest collected ``test_id`` (``*``: any text; no ``[...]``: every case)."""
    if "*" in test_id:
        pattern = re.compile(".*".join(re.escape(part) for part in test_id.split("*")))
        return any(pattern.fullmatch(c) for c in collected)
    if "[" in test_id:
        return test_id in collected
    return test_id in collected or any(c.startswith(test_id + "[") for c in collected)


def collect(files: list[str]) -> dict[str, set[str]]:
    """Node ids pytest collects from ``files`` per CI session selection (run at once)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    base = [sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider"]
    procs = {
        session: subprocess.Popen(
            [*base, "-m", selection, *files],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for session, selection in SELECTIONS.items()
    }
    collected: dict[str, set[str]] = {}
    for session, proc in procs.items():
        out, _ = proc.communicate(timeout=240)
        # 0: collected; 5: nothing selected in these files (then no id matches)
        assert proc.returncode in (0, 5), f"pytest --co for {session} failed:\n{out[-4000:]}"
        collected[session] = {ln for ln in out.splitlines() if "::" in ln}
    return collected


@pytest.fixture(scope="module")
def rows() -> list[Row]:
    found = table_rows(DOC.read_text())
    assert len(found) >= 20, f"the coverage table has only {len(found)} rows"
    return found


def test_every_row_names_ci_sessions_and_tests(rows: list[Row]) -> None:
    for capability, ids, sessions in rows:
        assert sessions, f"{capability!r}: no CI session"
        unknown = [s for s in sessions if s not in SELECTIONS and s not in OTHER_CI_SESSIONS]
        assert not unknown, f"{capability!r}: {unknown} are not CI sessions (.ci/run)"
        if not ids:
            assert not set(sessions) & set(SELECTIONS), f"{capability!r}: no test named"
        for test_id in ids:
            path = test_id.split("::", 1)[0]
            assert (ROOT / path).is_file(), f"{capability!r}: no file {path}"


def test_each_named_test_is_collected_in_its_session(rows: list[Row]) -> None:
    files = sorted({i.split("::", 1)[0] for _, ids, _ in rows for i in ids})
    files = [f for f in files if (ROOT / f).is_file()]
    collected = collect(files)
    problems = []
    for capability, ids, sessions in rows:
        named = [s for s in sessions if s in SELECTIONS]
        for test_id in ids:
            if not any(matches(test_id, collected[s]) for s in named):
                problems.append(f"{capability!r}: {test_id} is not collected in {named}")
        for session in named:
            if not any(matches(test_id, collected[session]) for test_id in ids):
                problems.append(f"{capability!r}: none of its tests runs in {session}")
    assert not problems, "\n".join(problems)
