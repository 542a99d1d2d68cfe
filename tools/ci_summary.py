"""The end of a CI run at a glance: minutes per nox session and the slowest tests.

    python3 tools/ci_summary.py --timings TIMINGS.tsv --reports REPORT_DIR [--top 15]

``TIMINGS.tsv``: one ``session<TAB>seconds<TAB>exit code`` line per nox session, as
``tools/dev.sh`` writes them when ``AFD_TIMINGS`` is set. ``REPORT_DIR``: the JUnit XML
reports the pytest sessions wrote (``AFD_REPORT_DIR``, see noxfile.py). Standard library
only: it runs with the machine's python3, outside every venv.

Exit code 1 when a report does not parse, or shows a skipped test whose reason no rule of
:data:`ALLOWED_SKIPS` allows: a skip hides a check (a vLLM rename that an
``importorskip`` turned into a skip, a missing dependency in the test venv), so only
the skips the run cannot avoid pass (the hardware or platform is absent, a conformance
scenario does not apply to a topology, torch and vLLM are absent by design in
``core-no-torch``); every other skip is listed and fails the run (docs/development.md).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SkipRule:
    """A skip the run may show: its reason matches ``pattern`` (``re.search``), in one of
    ``sessions`` (the report's name, i.e. the nox session; ``None``: any session)."""

    why: str
    pattern: str
    sessions: frozenset[str] | None = None

    def allows(self, session: str, reason: str) -> bool:
        if self.sessions is not None and session not in self.sessions:
            return False
        return re.search(self.pattern, reason) is not None


#: The skips a run may show, from the skip reasons of the suites (grep ``pytest.skip``,
#: ``skipif`` and ``importorskip`` in packages/ and tests/). Anything else fails the run.
ALLOWED_SKIPS: tuple[SkipRule, ...] = (
    SkipRule(
        "no CUDA device here (gpu-marked tests and the NCCL cases)",
        r"requires (CUDA|\d+ CUDA devices?)|torch\.cuda\.is_available\(\) is False",
    ),
    SkipRule(
        "no Ascend NPU here (npu-marked tests)",
        r"requires torch_npu with an Ascend device|requires an Ascend host",
    ),
    SkipRule(
        "an Ascend host: its CPU stand-in is not the path there",
        r"torch_npu is installed; the vendor binding|vllm_ascend is installed here",
    ),
    SkipRule(
        "the gpu and npu sessions select hardware tests only",
        r".",
        frozenset({"tests-gpu", "tests-npu"}),
    ),
    SkipRule(
        "a conformance scenario that does not apply to the topology",
        r"^scenario \S+ does not apply to topology ",
    ),
    SkipRule(
        "a conformance scenario the CAM connector does not carry by design (the UNSUPPORTED "
        "table of packages/afd-connectors-npu/tests/test_conformance.py)",
        r"^CAM carries no router_logits |^CAMAsync carries only top-k routing payloads "
        r"|^CAMAsync runs shared experts on the Attention role",
    ),
    SkipRule(
        "the platform lacks what the test reads (procfs, futex, ptrace-readable syscalls)",
        r"^needs /proc$|^needs Linux /proc/net/tcp$|^no futex on this platform$"
        r"|^/proc/<tid>/syscall is not readable here$",
    ),
    SkipRule("the host holds the fixed port the test binds", r"^port \d+ is in use on this host$"),
    SkipRule(
        "afd-core alone: torch and vLLM are absent by design",
        r"could not import '(torch|vllm)[\w.]*': No module named '(torch|vllm)'$"
        r"|^vLLM is not installed$"
        r"|^requires vLLM 0\.32 |^the split slices tensors \(afd-core\[testing\]\)$",
        frozenset({"core-no-torch"}),
    ),
)


@dataclass(frozen=True)
class Case:
    session: str
    name: str
    seconds: float
    outcome: str  # passed, failed, skipped or xfailed
    reason: str = ""  # why it was skipped (or expected to fail)


def allowed_skip(session: str, reason: str) -> SkipRule | None:
    """The rule of :data:`ALLOWED_SKIPS` that allows this skip, or None."""
    return next((r for r in ALLOWED_SKIPS if r.allows(session, reason)), None)


def _skip_reason(element: ET.Element) -> str:
    """The reason of a JUnit ``<skipped>``: its message, or for a module skipped while
    collected (``message="collection skipped"``) the reason inside its text, which pytest
    writes as the tuple ``(path, line, "Skipped: reason")``."""
    message = element.get("message") or ""
    if message == "collection skipped":
        text = (element.text or "").strip()
        try:
            parts = ast.literal_eval(text)
            message = str(parts[-1])
        except (ValueError, SyntaxError, IndexError, TypeError):
            message = text
        message = message.removeprefix("Skipped: ")
    return message.strip()


def read_timings(path: Path) -> list[tuple[str, float, int]]:
    rows: list[tuple[str, float, int]] = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) == 3:
            rows.append((parts[0], float(parts[1]), int(parts[2])))
    return rows


def read_cases(reports: Path, unreadable: list[str] | None = None) -> list[Case]:
    """Every test case of every report (a report's name is its session's); the reports
    that do not parse are left out and named in ``unreadable``."""
    cases: list[Case] = []
    for xml in sorted(reports.glob("*.xml")) if reports.is_dir() else []:
        try:
            root = ET.parse(xml).getroot()
        except ET.ParseError as exc:
            if unreadable is not None:
                unreadable.append(f"{xml.name}: unreadable JUnit report ({exc})")
            continue
        for case in root.iter("testcase"):
            outcome, reason = "passed", ""
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome = "failed"
                elif child.tag == "skipped":
                    xfail = child.get("type") == "pytest.xfail"
                    # a strict xfail is a declared, checked failure, not a hidden check
                    outcome = "xfailed" if xfail else "skipped"
                    reason = _skip_reason(child)
            classname, name = case.get("classname", ""), case.get("name", "")
            test_id = f"{classname}::{name}" if classname else name
            cases.append(Case(xml.stem, test_id, float(case.get("time") or 0.0), outcome, reason))
    return cases


def unallowed_skips(cases: list[Case]) -> list[Case]:
    """The skipped cases no rule of :data:`ALLOWED_SKIPS` allows."""
    return [
        c for c in cases if c.outcome == "skipped" and allowed_skip(c.session, c.reason) is None
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timings", type=Path, required=True)
    ap.add_argument("--reports", type=Path, required=True)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)

    out = sys.stdout
    out.write("\n=== CI summary: minutes per nox session ===\n")
    timings = read_timings(args.timings)
    for session, seconds, code in timings:
        status = "ok" if code == 0 else f"FAILED (exit {code})"
        out.write(f"  {session:<16} {seconds / 60:6.1f} min  {status}\n")
    if timings:
        out.write(f"  {'all sessions':<16} {sum(s for _, s, _ in timings) / 60:6.1f} min\n")

    unreadable: list[str] = []
    cases = read_cases(args.reports, unreadable)
    out.write(f"\n=== CI summary: the {args.top} slowest tests (setup + call + teardown) ===\n")
    for case in sorted(cases, key=lambda c: -c.seconds)[: args.top]:
        note = "" if case.outcome == "passed" else f"  {case.outcome}"
        out.write(f"  {case.seconds:7.1f} s  {case.session:<14} {case.name}{note}\n")
    skipped = [c for c in cases if c.outcome == "skipped"]
    bad = unallowed_skips(cases)
    if skipped:
        out.write("\n=== CI summary: skips by reason ===\n")
        by_reason: dict[tuple[str, str], int] = {}
        for c in skipped:
            by_reason[(c.session, c.reason)] = by_reason.get((c.session, c.reason), 0) + 1
        for (session, reason), n in sorted(by_reason.items()):
            rule = allowed_skip(session, reason)
            verdict = f"allowed: {rule.why}" if rule else "NOT ALLOWED"
            out.write(f"  {n:4d}  {session:<14} {reason[:110]}  [{verdict}]\n")
    if bad:
        out.write(
            f"\nci: {len(bad)} skipped test(s) with a reason no rule of tools/ci_summary.py "
            "ALLOWED_SKIPS allows (a skip hides a check; fix the cause, or add a rule "
            "if the run truly cannot avoid it):\n"
        )
        for c in bad:
            out.write(f"  {c.session:<14} {c.name}: {c.reason or '(no reason given)'}\n")
    for problem in unreadable:  # its skips cannot be judged
        out.write(f"\nci: {problem}\n")
    counts = {
        k: sum(1 for c in cases if c.outcome == k)
        for k in ("passed", "failed", "skipped", "xfailed")
    }
    # The run's closing line: every pytest session of the run together.
    xfailed = f", {counts['xfailed']} xfailed" if counts["xfailed"] else ""
    out.write(
        f"\nci: {counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['skipped']} skipped ({len(bad)} not allowed){xfailed}\n"
    )
    return 1 if bad or unreadable else 0


if __name__ == "__main__":
    raise SystemExit(main())
