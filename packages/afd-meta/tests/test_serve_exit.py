"""``afd serve --role attention``'s exit code: the API server runs as a child; a reason
recorded by the AFD runtime turns its exit into 1, a requested stop into 0. The child
here is a stand-in for vLLM's API server (no vLLM process)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from afd.runtime.serve import run_attention_server
from afd_core.procfs import process_start


def _child(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_recorded_reason_makes_the_exit_code_1(caplog: pytest.LogCaptureFixture) -> None:
    code = (
        "import os\n"
        "with open(os.environ['AFD_EXIT_REASON_FILE'], 'a') as f:\n"
        "    f.write('AFDPeerLostError: ffn rank 0 is gone\\n')\n"
    )
    with caplog.at_level("ERROR", logger="afd.runtime.serve"):
        assert run_attention_server(_child(code)) == 1
    assert "stopped by AFD: AFDPeerLostError: ffn rank 0 is gone" in caplog.text


def test_the_server_code_passes_through_without_a_reason() -> None:
    assert run_attention_server(_child("pass")) == 0
    assert run_attention_server(_child("import sys; sys.exit(3)")) == 3
    assert run_attention_server(_child("import os; os.kill(os.getpid(), 9)")) == 128 + 9


def test_sigterm_is_forwarded_and_is_a_clean_stop(tmp_path: object) -> None:
    # The child records a reason and exits 1 when signalled: a requested stop still
    # exits 0 (a peer lost while both roles were being stopped is not a failure).
    code = (
        "import os, signal, sys, time\n"
        "def bye(*a):\n"
        "    open(os.environ['AFD_EXIT_REASON_FILE'], 'a').write('AFDPeerLostError: x\\n')\n"
        "    sys.exit(1)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    timer = threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.start()
    t0 = time.monotonic()
    try:
        assert run_attention_server(_child(code)) == 0
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 20
    # the supervisor's own handlers are restored afterwards
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, signal.default_int_handler)


def test_the_server_gets_a_fresh_prometheus_folder_or_the_given_one(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = Path(str(tmp_path)) / "seen.txt"
    code = (
        "import os\n"
        "d = os.environ['PROMETHEUS_MULTIPROC_DIR']\n"
        f"open({str(seen)!r}, 'w').write(d + ' ' + str(os.path.isdir(d) and not os.listdir(d)))\n"
    )
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert run_attention_server(_child(code)) == 0
    folder, empty = seen.read_text().split()
    assert empty == "True" and not Path(folder).exists()  # removed once the server stopped
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    given = Path(str(tmp_path)) / "mine"
    given.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(given))
    assert run_attention_server(_child(code)) == 0
    assert seen.read_text() == f"{given} True" and given.is_dir()  # the user's, kept


@pytest.mark.parametrize("ignores_sigterm", [False, True])
def test_a_server_that_lingers_after_a_reason_is_stopped(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch, ignores_sigterm: bool
) -> None:
    """The runtime recorded why it stopped but the server (and a process below it, like
    vLLM's engine core) keep running: SIGTERM after the grace period, then SIGKILL for
    the whole tree; the exit code is still 1."""
    import afd.runtime.serve

    monkeypatch.setattr(afd.runtime.serve, "STOP_GRACE_S", 0.5)
    pid_file = os.path.join(str(tmp_path), "grandchild.pid")
    code = (
        "import os, signal, subprocess, sys, time\n"
        f"if {ignores_sigterm}: signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "g = subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        f"open({pid_file!r}, 'w').write(str(g.pid))\n"
        "open(os.environ['AFD_EXIT_REASON_FILE'], 'a').write('AFDFingerprintMismatchError: x\\n')\n"
        "time.sleep(60)\n"
    )
    t0 = time.monotonic()
    assert run_attention_server(_child(code)) == 1
    took = time.monotonic() - t0
    grandchild = int(Path(pid_file).read_text())
    if ignores_sigterm:
        assert process_start(grandchild) is None, "a process below the server survived SIGKILL"
    else:
        with contextlib.suppress(ProcessLookupError):  # SIGTERM reached only the server
            os.kill(grandchild, signal.SIGKILL)
    assert took < 10, took
