"""afd_core.lifecycle: the reason a role stopped, recorded by one process, read by another."""

from __future__ import annotations

from pathlib import Path

import pytest

from afd_core.lifecycle import EXIT_REASON_ENV, read_exit_reasons, record_exit_reason


def test_record_exit_reason_appends_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "reason.txt"
    monkeypatch.delenv(EXIT_REASON_ENV, raising=False)
    assert not record_exit_reason("not recorded: no file configured")
    assert read_exit_reasons(path) == []
    monkeypatch.setenv(EXIT_REASON_ENV, str(path))
    assert record_exit_reason("AFDTimeoutError: layer 3\n  took too long")
    assert record_exit_reason("second")
    assert path.read_text() == "AFDTimeoutError: layer 3 took too long\nsecond\n"
    assert read_exit_reasons(path) == ["AFDTimeoutError: layer 3 took too long", "second"]
    monkeypatch.setenv(EXIT_REASON_ENV, str(path / "not-a-dir" / "x"))
    assert not record_exit_reason("unwritable")
