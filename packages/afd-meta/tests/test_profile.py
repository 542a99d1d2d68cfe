"""``afd profile``: spans of both roles merged into a trace and per-step numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afd import cli as afd_cli
from afd.tools import profile as afd_profile
from afd_core import profiling

MS = 1_000_000


def _recorders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[profiling.SpanRecorder, profiling.SpanRecorder]:
    """Fresh span recorders of attention rank 0 and FFN rank 0, writing to ``tmp_path``."""
    monkeypatch.setattr(profiling, "_recorders", {})
    monkeypatch.setenv(profiling.PROFILE_DIR_ENV, str(tmp_path))
    attn = profiling.recorder("attention", 0)
    ffn = profiling.recorder("ffn", 0)
    assert attn is not None and ffn is not None
    return attn, ffn


def _write_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: int = 5) -> None:
    """Two roles, 3 AFD layers per step: attention 1 ms per layer, FFN compute 2 ms,
    the attention waits 2.5 ms per layer (0.5 ms overhead per layer)."""
    attn, ffn = _recorders(tmp_path, monkeypatch)
    t = 0
    for _ in range(steps):
        for layer in (1, 2, 3):
            t += 1 * MS  # attention work (or the step gap before layer 1)
            attn.attention_sent(layer, 0, t, t + MS // 10, tokens=8)
            ffn.span("recv", t - MS, t + MS // 5, layer=layer, mb=0, tokens=8)
            ffn.span("compute", t + MS // 5, t + MS // 5 + 2 * MS, layer=layer, mb=0)
            ffn.span("return", t + 2 * MS + MS // 5, t + 2 * MS + MS // 4, layer=layer, mb=0)
            attn.attention_received(layer, 0, t + MS // 10, t + MS // 10 + 25 * MS // 10)
            t += MS // 10 + 25 * MS // 10
        t += 3 * MS  # sampling / scheduling
    attn.flush()
    ffn.flush()


def test_summary_reports_ms_per_step_and_overhead_per_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_run(tmp_path, monkeypatch)
    summary = afd_profile.summarize(afd_profile.load_profile(tmp_path))
    attn = next(e for e in summary["processes"] if e["role"] == "attention")
    ffn = next(e for e in summary["processes"] if e["role"] == "ffn")
    assert attn["steps"] == 4 and ffn["steps"] == 4  # the last (cut) step is dropped
    assert attn["exchanges_per_step"] == 3
    assert attn["ms_per_step"]["wait"] == pytest.approx(7.5)
    assert attn["ms_per_step"]["attention"] == pytest.approx(2.0)  # layers 2 and 3
    assert attn["ms_per_step"]["send"] == pytest.approx(0.3)
    assert ffn["ms_per_step"]["compute"] == pytest.approx(6.0)
    assert summary["afd_overhead_ms_per_layer"] == pytest.approx(0.5)
    text = afd_profile.format_summary(summary, native_step_ms=4.0)
    assert "0.500 ms per AFD layer" in text and "native vLLM" in text


def test_trace_is_a_chrome_trace_with_one_track_per_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_run(tmp_path, monkeypatch, steps=2)
    out = afd_profile.write_trace(afd_profile.load_profile(tmp_path), tmp_path / "trace.json")
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert any(n.startswith("attention rank 0") for n in names)
    assert any(n.startswith("ffn rank 0") for n in names)
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["cat"] for e in slices} >= {"send", "wait", "recv", "compute", "return"}
    assert min(e["ts"] for e in slices) == 0.0
    assert all(e["dur"] > 0 for e in slices)


def test_plot_draws_one_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    _write_run(tmp_path, monkeypatch)
    png = afd_profile.plot_step(afd_profile.load_profile(tmp_path), tmp_path / "step.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_empty_folder_says_how_to_record(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="AFD_PROFILE_DIR"):
        afd_profile.load_profile(tmp_path)


def _write_ping_pong(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: int = 4) -> None:
    """Two micro-batches taking turns on the attention role as the ping-pong scheduler
    runs them, 2 AFD layers per step: a turn is the wait for the micro-batch's previous
    answer (0.4 ms), 1 ms of attention work and a 0.1 ms send; after the last layer each
    micro-batch waits for its answer; 3 ms of sampling/scheduling end each step."""
    attn, ffn = _recorders(tmp_path, monkeypatch)
    t = 0
    wait = 4 * MS // 10

    for _ in range(steps):
        for layer in (1, 2):
            for mb in (0, 1):
                if layer > 1:
                    attn.attention_received(layer - 1, mb, t, t + wait)
                    t += wait
                t += MS  # this micro-batch's attention work
                attn.attention_sent(layer, mb, t, t + MS // 10, tokens=4)
                ffn.span("recv", t, t + MS // 10, layer=layer, mb=mb, tokens=4)
                ffn.span("compute", t + MS // 10, t + MS, layer=layer, mb=mb)
                ffn.span("return", t + MS, t + MS + MS // 10, layer=layer, mb=mb)
                t += MS // 10
        for mb in (0, 1):
            attn.attention_received(2, mb, t, t + wait)
            t += wait
        t += 3 * MS
    attn.flush()
    ffn.flush()


def test_summary_counts_the_step_gap_once_with_micro_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_ping_pong(tmp_path, monkeypatch)
    summary = afd_profile.summarize(afd_profile.load_profile(tmp_path))
    attn = next(e for e in summary["processes"] if e["role"] == "attention")
    assert attn["steps"] == 3 and attn["micro_batches"] == 2
    # per step: 4 turns of 1 ms work + 0.1 ms send, 4 waits of 0.4 ms, 3 ms gap
    assert attn["step_ms_mean"] == pytest.approx(4 * 1.1 + 4 * 0.4 + 3)
    assert attn["ms_per_step"]["send"] == pytest.approx(0.4)
    assert attn["ms_per_step"]["wait"] == pytest.approx(1.6)
    assert attn["ms_per_step"]["attention"] == pytest.approx(2.0)  # layer 2 of each mb
    # layer 1's work of both micro-batches + the 3 ms between steps, counted once (the
    # two micro-batches' own step-gap spans overlap: summed they would give 9.5 ms)
    assert attn["ms_per_step"]["step_gap"] == pytest.approx(5.0)
    # FFN compute overlaps the attention role's waits: no per-layer overhead is derived
    assert "afd_overhead_ms_per_layer" not in summary


def test_plot_steps_draws_one_panel_per_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    _write_run(tmp_path / "m1", monkeypatch)
    _write_ping_pong(tmp_path / "m2", monkeypatch)
    panels = [(f"m={m}", afd_profile.load_profile(tmp_path / f"m{m}"), None) for m in (1, 2)]
    png = afd_profile.plot_steps(panels, tmp_path / "steps.png", title="m=1 vs m=2")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="nothing to plot"):
        afd_profile.plot_steps([], tmp_path / "none.png")


def test_the_cli_says_why_there_is_no_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``afd profile --plot`` with every step left out by --skip-s: the summary and the
    trace are written, then one line says why there is no figure (no traceback)."""
    pytest.importorskip("matplotlib")
    _write_run(tmp_path, monkeypatch)
    parser = afd_cli.build_parser()
    args = parser.parse_args(["profile", str(tmp_path), "--skip-s", "3600", "--plot", "x.png"])
    assert afd_profile.run_profile(args) == 1
    err = capsys.readouterr().err
    assert "no figure: no complete attention step to plot after the first 3600 s" in err
    assert (tmp_path / "trace.json").is_file()
    assert afd_profile.run_profile(parser.parse_args(["profile", str(tmp_path / "none")])) == 2
    assert "AFD_PROFILE_DIR" in capsys.readouterr().err
