"""The waits inside the end-to-end tests end before pytest-timeout kills the test.

A wait (deployment start-up, a native reference, an engine run) longer than the test's
own limit can never print its message: pytest-timeout kills the test first and the
failure says only "Timeout". Every such constant must leave the test time to report
(:data:`MARGIN_S`). Read from the sources (AST), nothing is imported.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: What a test has left after a wait to fail with the wait's own message.
MARGIN_S = 30.0
#: Wait constants in tests/support that only tests marked ``timeout(900)`` or
#: ``timeout(1200)`` reach (their docstrings say so), and the smaller of those marks.
SLOW_SUPPORT_WAITS = {"SLOW_REFERENCE_TIMEOUT_S", "COMPILED_ENGINE_S"}
SLOW_TEST_LIMIT_S = 900.0


def default_limit_s() -> float:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return float(config["tool"]["pytest"]["ini_options"]["timeout"])


def wait_constants(path: Path) -> dict[str, float]:
    """Module-level ``NAME_S = <number>`` assignments that name a wait."""
    found: dict[str, float] = {}
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target = node.targets[0]
        if not isinstance(target, ast.Name) or not target.id.endswith("_S"):
            continue
        if not any(w in target.id for w in ("STARTUP", "ENGINE", "REFERENCE_TIMEOUT")):
            continue
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, int | float):
            found[target.id] = float(node.value.value)
    return found


def module_limit_s(path: Path, default: float) -> float:
    """The smallest per-test limit of a test module: its tests' ``timeout(N)`` marks, or
    the default for a test without one."""
    limits: list[float] = []
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
            continue
        marks = [
            float(d.args[0].value)
            for d in node.decorator_list
            if isinstance(d, ast.Call)
            and isinstance(d.func, ast.Attribute)
            and d.func.attr == "timeout"
            and d.args
            and isinstance(d.args[0], ast.Constant)
        ]
        limits.append(max(marks) if marks else default)
    return min(limits, default=default)


def test_every_wait_ends_before_its_tests_limit() -> None:
    default = default_limit_s()
    problems = []
    checked = 0
    for path in sorted((ROOT / "tests" / "e2e").glob("test_*.py")):
        limit = module_limit_s(path, default)
        for name, value in wait_constants(path).items():
            checked += 1
            if value > limit - MARGIN_S:
                problems.append(f"{path.name}: {name} = {value:g} s, its tests' limit {limit:g} s")
    for path in sorted((ROOT / "tests" / "support").glob("*.py")):
        for name, value in wait_constants(path).items():
            checked += 1
            limit = SLOW_TEST_LIMIT_S if name in SLOW_SUPPORT_WAITS else default
            if value > limit - MARGIN_S:
                problems.append(f"{path.name}: {name} = {value:g} s, its tests' limit {limit:g} s")
    assert checked >= 6, f"found only {checked} wait constants: did their names change?"
    assert not problems, "waits a test cannot report (pytest-timeout ends it first):\n" + "\n".join(
        problems
    )


def test_the_check_sees_a_wait_longer_than_the_limit(tmp_path: Path) -> None:
    module = tmp_path / "test_slow.py"
    module.write_text(
        "STARTUP_S = 420.0\n\n\ndef test_a():\n    pass\n\n\n"
        "@pytest.mark.timeout(900)\ndef test_b():\n    pass\n"
    )
    assert wait_constants(module) == {"STARTUP_S": 420.0}
    assert module_limit_s(module, 285.0) == 285.0  # test_a has the default limit
