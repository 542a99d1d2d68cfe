"""docs/bench/README.md indexes every measurement JSON there (tools/bench_index.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "docs" / "bench"


def test_index_is_up_to_date() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_index.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_json_and_log_is_listed() -> None:
    readme = (BENCH / "README.md").read_text()
    for path in sorted(BENCH.glob("*.json")) + sorted(BENCH.glob("20*.md")):
        assert f"]({path.name})" in readme, path.name


def test_links_of_the_logs_resolve() -> None:
    for page in [*BENCH.glob("*.md"), ROOT / "docs" / "performance.md"]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name}: {target}"
