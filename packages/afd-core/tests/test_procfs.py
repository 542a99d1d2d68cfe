"""afd_core.procfs against real processes (Linux /proc)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from afd_core.procfs import descendants, group_members, process_start, read_stat

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


def test_this_process() -> None:
    stat = read_stat(os.getpid())
    assert stat is not None and stat.alive
    assert stat.pgrp == os.getpgrp()
    assert process_start(os.getpid()) == stat.start_time != ""
    assert os.getpid() in group_members(os.getpgrp())


def test_a_zombie_and_a_reaped_child_are_gone() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "pass"], start_new_session=True
    )  # its own group: only it is in it
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stat = read_stat(child.pid)
        if stat is not None and not stat.alive:
            break
        time.sleep(0.02)
    assert stat is not None and stat.state == "Z"  # exited, not yet reaped
    assert process_start(child.pid) is None
    assert group_members(child.pid) == []
    child.wait()
    assert read_stat(child.pid) is None and process_start(child.pid) is None


def test_descendants_are_children_then_their_children() -> None:
    grandchild = "import time; time.sleep(30)"
    code = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {grandchild!r}])\n"
        "time.sleep(30)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 20
        below: list[int] = []
        while time.monotonic() < deadline and not below:
            below = descendants(child.pid)
            time.sleep(0.1)
        assert len(below) == 1, below  # the grandchild
        mine = descendants(os.getpid())
        assert mine.index(child.pid) < mine.index(below[0])
    finally:
        for pid in [*descendants(child.pid), child.pid]:
            os.kill(pid, 9)
        child.wait()
