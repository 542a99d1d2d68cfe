"""The end of a CI run at a glance: minutes per nox session and the slowest tests.

    python3 tools/ci_summary.py --timings TIMINGS.tsv --reports REPORT_DIR [--top 15]

``TIMINGS.tsv``: one ``session<TAB>seconds<TAB>exit code`` line per nox session, as
``tools/dev.sh`` writes them when ``AFD_TIMINGS`` is set. ``REPORT_DIR``: the JUnit XML
reports the pytest sessions wrote (``AFD_REPORT_DIR``, see noxfile.py). Standard library
only: it runs with the machine's python3, outside every venv.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def read_timings(path: Path) -> list[tuple[str, float, int]]:
    rows: list[tuple[str, float, int]] = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) == 3:
            rows.append((parts[0], float(parts[1]), int(parts[2])))
    return rows


def read_cases(reports: Path) -> list[tuple[str, str, float, str]]:
    """(session, test id, seconds, outcome) for every test case of every report."""
    cases: list[tuple[str, str, float, str]] = []
    for xml in sorted(reports.glob("*.xml")) if reports.is_dir() else []:
        try:
            root = ET.parse(xml).getroot()
        except ET.ParseError:
            continue
        for case in root.iter("testcase"):
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome = "failed"
                elif child.tag == "skipped":
                    outcome = "skipped"
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            cases.append((xml.stem, name, float(case.get("time") or 0.0), outcome))
    return cases


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

    cases = read_cases(args.reports)
    out.write(f"\n=== CI summary: the {args.top} slowest tests (setup + call + teardown) ===\n")
    for session, name, seconds, outcome in sorted(cases, key=lambda c: -c[2])[: args.top]:
        note = "" if outcome == "passed" else f"  {outcome}"
        out.write(f"  {seconds:7.1f} s  {session:<14} {name}{note}\n")
    counts = {k: sum(1 for c in cases if c[3] == k) for k in ("passed", "failed", "skipped")}
    # The run's closing line: every pytest session of the run together.
    out.write(
        f"\nci: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
