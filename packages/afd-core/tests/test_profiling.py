"""Span recording for ``afd profile``: off by default, categories, files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afd_core import profiling


@pytest.fixture(autouse=True)
def fresh_recorders(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profiling, "_recorders", {})


def test_profiling_is_off_without_the_environment_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(profiling.PROFILE_DIR_ENV, raising=False)
    assert profiling.recorder("attention", 0) is None


def test_attention_spans_split_model_work_from_step_gaps(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(profiling.PROFILE_DIR_ENV, str(tmp_path))
    rec = profiling.recorder("attention", 1)
    assert rec is not None and profiling.recorder("attention", 1) is rec
    ms = 1_000_000
    # step 1: layers 1 and 2; step 2: layer 1 again (the gap before it is a step gap)
    rec.attention_sent(1, 0, 0 * ms, 1 * ms, tokens=4)
    rec.attention_received(1, 0, 1 * ms, 3 * ms)
    rec.attention_sent(2, 0, 5 * ms, 6 * ms, tokens=4)
    rec.attention_received(2, 0, 6 * ms, 7 * ms)
    rec.attention_sent(1, 0, 10 * ms, 11 * ms, tokens=4)
    rec.flush()
    lines = [json.loads(x) for x in (tmp_path / rec.path.name).read_text().splitlines()]
    assert lines[0]["meta"] and lines[0]["role"] == "attention" and lines[0]["rank"] == 1
    got = [(x["cat"], x["layer"], x["t0"] // ms, x["t1"] // ms) for x in lines[1:]]
    assert got == [
        ("send", 1, 0, 1),
        ("wait", 1, 1, 3),
        ("attention", 2, 3, 5),
        ("send", 2, 5, 6),
        ("wait", 2, 6, 7),
        ("step_gap", 1, 7, 10),
        ("send", 1, 10, 11),
    ]


def test_recording_stops_at_the_span_limit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(profiling.PROFILE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(profiling.MAX_SPANS_ENV, "3")
    rec = profiling.recorder("ffn", 0)
    assert rec is not None
    for i in range(10):
        rec.span("compute", i, i + 1, layer=i)
    rec.flush()
    assert len(rec.path.read_text().splitlines()) == 1 + 3
