"""The lines of a test failure that name its cause (printed by tests/conftest.py after
the run: CI keeps the end of the output, where a long assertion message is already cut)."""

from __future__ import annotations

import re

#: Lines of a failure that name a cause: exception lines (also inside a role's log,
#: e.g. "[rank0]: ValueError: ..."), afd's own error lines, failed assertions.
_EXCEPTION = r"\b\w*(Error|Exception|Exit|Interrupt)\b:"
_CAUSE = re.compile(
    rf"({_EXCEPTION}|\bassert |\berror\b|\bfailed\b|\btimed out\b"
    r"|\bnot ready\b|\bexited\b|\bTraceback\b)",
    re.IGNORECASE,
)
_FRAME = re.compile(r"^\W*(\[rank\d+\]:\s*)?File \"")


def failure_digest(text: str, max_lines: int = 14, width: int = 400) -> list[str]:
    """The lines of a failure report that name its cause, last ones kept (a long log in
    an assertion message is otherwise cut where CI shows it)."""
    lines = text.splitlines()
    # pytest's report: "E" lines (the error, with any log an assertion quotes) and the
    # ">" line that failed; its other lines are source around them.
    marked = [ln for ln in lines if ln.startswith(("E ", ">"))]
    seen: dict[str, None] = {}
    for line in marked or lines:
        s = line.strip()
        if s and _CAUSE.search(s) and not _FRAME.match(s):
            seen.pop(s, None)
            seen[s] = None
    return [s[:width] for s in list(seen)[-max_lines:]]


def last_exception_line(text: str, width: int = 500) -> str:
    """The last exception line of ``text`` (a process's stderr), else its last non-empty
    line: put first in a failure message, it survives a log cut short in its middle."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    exceptions = [s for s in lines if re.search(_EXCEPTION, s) and not _FRAME.match(s)]
    return (exceptions or lines or ["(no output)"])[-1][:width]
