"""afd_core.lifecycle and AFDPeerLostError.goodbye: why a role stopped, recorded by one
process, read by another."""

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


def test_peer_lost_says_whether_the_peer_said_goodbye_and_keeps_it_across_pickling() -> None:
    import pickle

    from afd_core.errors import AFDPeerLostError

    vanished = AFDPeerLostError("ffn rank 0 is gone")
    closed = AFDPeerLostError("attention rank 0 closed", goodbye=True)
    assert vanished.goodbye is False and closed.goodbye is True
    assert isinstance(closed, ConnectionError) and str(closed) == "attention rank 0 closed"
    again = pickle.loads(pickle.dumps(closed))
    assert type(again) is AFDPeerLostError and again.goodbye is True
    assert again.args == ("attention rank 0 closed",)
    assert pickle.loads(pickle.dumps(vanished)).goodbye is False
