"""Build one role-aware model with vLLM's own executor in a fresh interpreter and report
its parameter inventory (integration tests of the model packages)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

BUILD = textwrap.dedent(
    """
    import json, sys
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor import Executor

    model_dir, arch, afd = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    if afd.get("connector") == "LoopbackAFDConnector":  # a test double: registered here
        from afd_core.testing.loopback import register_loopback
        register_loopback()
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    cfg = EngineArgs(
        model=model_dir, hf_overrides={"architectures": [arch]},
        additional_config={"afd": afd}, enforce_eager=True, dtype="bfloat16",
        max_model_len=256, gpu_memory_utilization=0.1,
        distributed_executor_backend="uni",
        worker_extension_cls="afd.ffn_server.AFDWorkerExtension", **extra,
    ).create_engine_config()
    executor = Executor.get_class(cfg)(cfg)
    try:
        inventory = executor.collective_rpc("afd_inventory")[0]
        names = executor.collective_rpc("afd_parameter_names")[0]
        owners = executor.collective_rpc("afd_weight_owners")[0]
        print("RESULT " + json.dumps({"inventory": inventory, "names": names, "owners": owners}))
    finally:
        executor.shutdown()
    """
)


def run_role_model_build(
    model_dir: Path,
    arch: str,
    afd: dict[str, object],
    tmp_path: Path,
    engine_kwargs: dict[str, object] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Build (and load) ``arch`` for the role in ``afd`` with vLLM's executor, in a new
    interpreter; ``engine_kwargs`` are extra ``EngineArgs`` fields."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    argv = [str(model_dir), arch, json.dumps(afd), json.dumps(engine_kwargs or {})]
    return subprocess.run(
        [sys.executable, "-c", BUILD, *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


def probe_result(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The JSON of the last ``RESULT {...}`` line a probe printed; the probe must have
    exited 0 (else its output tails are the failure message)."""
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return dict(json.loads(lines[-1][len("RESULT ") :]))


def run_probe(code: str, *argv: str, env: dict[str, str], timeout: float = 300) -> dict[str, Any]:
    """Run ``python -c code argv...`` with ``env`` and return its ``RESULT`` JSON."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    return probe_result(proc)


def build_role_model(
    model_dir: Path, arch: str, afd: dict[str, object], tmp_path: Path
) -> dict[str, Any]:
    """The built model's parameter inventory, parameter names, and the checkpoint tensors
    it loaded / left to the other role by owner (``owners``: ``kept`` / ``dropped``)."""
    return probe_result(run_role_model_build(model_dir, arch, afd, tmp_path))
