"""The environment the test harness gives the processes it starts (afd_processes.child_environ)."""

from __future__ import annotations

import os

import afd_processes
import pytest
from afd_processes import child_environ


def test_what_in_process_vllm_wrote_does_not_reach_started_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM sets VLLM_USE_BREAKABLE_CUDAGRAPH=1 in-process when it builds a DeepSeek-V3.2
    config; inherited, it turns every later deployment's compile mode off. A test's own
    setting for its processes (AFD_*, VLLM_CPU_OMP_THREADS_BIND, ...) still goes through."""
    # What vLLM's config does (config/vllm.py, _maybe_enable_breakable_cudagraph): a plain
    # write, so this test restores it itself.
    before = os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH")
    os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"
    try:
        monkeypatch.setenv("AFD_PROFILE_DIR", "/tmp/profile-of-this-test")
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        env = child_environ()
        # as this pytest process started (unset, unless the caller set it)
        started = afd_processes._START_ENV or {}
        assert env.get("VLLM_USE_BREAKABLE_CUDAGRAPH") == started.get(
            "VLLM_USE_BREAKABLE_CUDAGRAPH"
        )
        assert env["AFD_PROFILE_DIR"] == "/tmp/profile-of-this-test"
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
        assert env["PATH"] == os.environ["PATH"]
    finally:
        if before is None:
            os.environ.pop("VLLM_USE_BREAKABLE_CUDAGRAPH", None)
        else:
            os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = before
