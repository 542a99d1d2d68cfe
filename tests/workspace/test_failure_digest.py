"""The failure digest printed after a run (tests/conftest.py): CI keeps the end of the
output, so each failure's cause must be there even when its own report was cut."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]


def test_digest_keeps_the_cause_lines_of_a_role_log() -> None:
    from afd_failure_digest import failure_digest

    report = "\n".join(
        [
            "        assert ready, launcher.output  # source around the failure",
            "E       AssertionError: 'cache_dir': '', ... long engine config ...",
            'E       [rank0]:   File "/x/vllm/v1/worker/gpu_worker.py", line 594, in load_model',
            "E       INFO 12-01 [cpu_model_runner.py:68] Starting to load model /m",
            "E       [rank0]: ValueError: ERNIE: no gate found in layer 1",
            "E       --- FFN role's log (end) ---",
            "E       [afd] error: peer closed the connection",
        ]
    )
    digest = failure_digest(report)
    assert digest[-2:] == [
        "E       [rank0]: ValueError: ERNIE: no gate found in layer 1",
        "E       [afd] error: peer closed the connection",
    ]
    assert not any("File " in line or "INFO" in line or "ready" in line for line in digest)
    assert len(failure_digest("\n".join(f"RuntimeError: {i}" for i in range(50)))) == 14


def test_a_failing_run_ends_with_the_digest(pytester: pytest.Pytester) -> None:
    from pathlib import Path

    pytester.makeconftest((Path(__file__).parents[1] / "conftest.py").read_text())
    pytester.makepyfile(
        "def test_boom():\n"
        "    raise AssertionError('big log\\n' + 'filler\\n' * 500 + 'OSError: ' + 'port in use')\n"
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == 1
    lines = result.outlines
    start = max(i for i, line in enumerate(lines) if "afd failure digest" in line)
    assert start > max(i for i, line in enumerate(lines) if line.strip() == "E       filler")
    digest = lines[start + 1 : start + 6]
    # (the node id starts with the test file's path from the rootdir, which varies)
    assert digest[0].endswith("test_a_failing_run_ends_with_the_digest.py::test_boom (call):")
    assert any(line.strip().endswith("OSError: port in use") for line in digest), digest
