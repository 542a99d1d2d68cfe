"""Per-layer timing spans of the AFD exchange, for ``afd profile`` (Perfetto traces).

Off unless the environment variable :data:`PROFILE_DIR_ENV` (``AFD_PROFILE_DIR``) names a
folder. Then every AFD process (each attention rank's worker, each FFN server) records
what it does per layer as spans and appends them, as JSON lines, to
``<dir>/<role><rank>-<pid>.jsonl``. ``afd profile DIR`` merges the files into one Chrome
trace (viewable in Perfetto or chrome://tracing) and prints milliseconds per step by
category for both roles.

Categories:

* attention role: ``attention`` (the model's own work between the answer of the
  previous AFD layer and the send of this one: attention, norms, residual adds),
  ``send`` (``send_to_ffn``), ``wait`` (``recv_from_ffn``: the FFN's compute, both
  transfers and any idle time), ``step_gap`` (between the last AFD layer of a step and
  the first of the next: sampling, scheduling, input preparation, or no work at all);
* FFN role: ``recv`` (``recv_from_attention``: waiting for the next layer plus its
  transfer), ``compute`` (the FFN block), ``return`` (``send_to_attention``).

A span is a few hundred nanoseconds of bookkeeping; spans are buffered and written every
:data:`FLUSH_EVERY` spans, at least once a second and at exit, and recording stops after
``AFD_PROFILE_MAX_SPANS`` spans (default 400000) per process. Nothing here imports torch.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = [
    "PROFILE_DIR_ENV",
    "FLUSH_EVERY",
    "SpanRecorder",
    "recorder",
]

PROFILE_DIR_ENV = "AFD_PROFILE_DIR"
MAX_SPANS_ENV = "AFD_PROFILE_MAX_SPANS"
FLUSH_EVERY = 2000

_lock = threading.Lock()
_recorders: dict[tuple[str, int], SpanRecorder | None] = {}


class SpanRecorder:
    """Spans of one (role, rank) in this process, appended to one JSON-lines file."""

    def __init__(self, out_dir: Path, role: str, rank: int, max_spans: int) -> None:
        self.role = role
        self.rank = rank
        self.pid = os.getpid()
        self.path = out_dir / f"{role}{rank}-{self.pid}.jsonl"
        self.max_spans = max_spans
        self.recorded = 0
        self._buffer: list[str] = []
        self._lock = threading.Lock()
        self._flushed_ns = time.perf_counter_ns()
        # Attention side: micro-batch -> (perf_counter_ns, layer) of its last answer.
        self._last: dict[int, tuple[int, int]] = {}
        out_dir.mkdir(parents=True, exist_ok=True)
        meta = {
            "meta": True,
            "role": role,
            "rank": rank,
            "pid": self.pid,
            # perf_counter_ns and wall time at the same instant, to align processes.
            "clock_ns": time.perf_counter_ns(),
            "wall_ns": time.time_ns(),
        }
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(meta) + "\n")
        atexit.register(self.flush)

    def span(self, cat: str, start_ns: int, end_ns: int, **args: Any) -> None:
        """Record one span (``perf_counter_ns`` start and end)."""
        if self.recorded >= self.max_spans:
            return
        self.recorded += 1
        record = {"cat": cat, "t0": start_ns, "t1": end_ns, "tid": threading.get_ident()}
        record.update(args)
        line = json.dumps(record, separators=(",", ":"))
        with self._lock:
            self._buffer.append(line)
            # vLLM's workers can be killed without running atexit: write at least once a
            # second so that a stopped deployment loses under a second of spans.
            due = len(self._buffer) >= FLUSH_EVERY or end_ns - self._flushed_ns > 1_000_000_000
        if due:
            self._flushed_ns = end_ns
            self.flush()

    # -- the two roles' exchange points ---------------------------------------------
    def attention_sent(self, layer: int, mb: int, t0: int, t1: int, tokens: int) -> None:
        """``send_to_ffn`` of (layer, micro-batch) ran from ``t0`` to ``t1``; the time since
        this micro-batch's previous answer was the model's own work (or a step gap)."""
        last = self._last.get(mb)
        if last is not None:
            cat = "attention" if layer > last[1] else "step_gap"
            self.span(cat, last[0], t0, layer=layer, mb=mb)
        self.span("send", t0, t1, layer=layer, mb=mb, tokens=tokens)

    def attention_received(self, layer: int, mb: int, t0: int, t1: int) -> None:
        self.span("wait", t0, t1, layer=layer, mb=mb)
        self._last[mb] = (t1, layer)

    def flush(self) -> None:
        with self._lock:
            lines, self._buffer = self._buffer, []
        if lines:
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write("\n".join(lines) + "\n")


def recorder(role: str, rank: int) -> SpanRecorder | None:
    """The span recorder of (``role``, ``rank``) in this process, or None when profiling
    is off (``AFD_PROFILE_DIR`` unset or empty)."""
    key = (role, rank)
    if key in _recorders:
        return _recorders[key]
    with _lock:
        if key not in _recorders:
            out = os.environ.get(PROFILE_DIR_ENV, "")
            if not out:
                _recorders[key] = None
            else:
                max_spans = int(os.environ.get(MAX_SPANS_ENV, "400000"))
                _recorders[key] = SpanRecorder(Path(out), role, rank, max_spans)
        return _recorders[key]
