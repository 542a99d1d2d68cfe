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
    report_experts = len(sys.argv) > 5 and json.loads(sys.argv[5]).get("experts", False)

    def expert_tensors(wrapper):
        # Per MoE layer of the built model (run on the worker): the expert shard its
        # routed experts were built for, and per tensor of them its shape, dtype, sha256
        # and, where dim 0 is the held experts, one sha256 per expert: of the bytes as
        # the kernel holds them and of the expert's sorted values (which packing into a
        # kernel layout does not change).
        import hashlib
        import torch
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

        def digest(t):
            return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()

        worker = getattr(wrapper, "worker", wrapper)
        out = {}
        for name, module in worker.model_runner.get_model().named_modules():
            if not isinstance(module, RoutedExperts):
                continue
            shard = getattr(module, "afd_shard", range(module.global_num_experts))
            tensors = {}
            for pname, p in module.named_parameters(recurse=False):
                t = p.detach()
                entry = {
                    "shape": list(t.shape),
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "digest": digest(t),
                }
                if t.dim() and t.shape[0] == module.local_num_experts:
                    entry["bytes"] = [digest(t[e]) for e in range(t.shape[0])]
                    entry["values"] = [
                        digest(t[e].reshape(-1).float().sort().values)
                        for e in range(t.shape[0])
                    ]
                tensors[pname] = entry
            out[name] = {
                "shard": [shard.start, shard.stop],
                "experts": int(module.global_num_experts),
                "tensors": tensors,
            }
        return out
    cfg = EngineArgs(
        model=model_dir, hf_overrides={"architectures": [arch]},
        additional_config={"afd": afd}, enforce_eager=True, dtype="bfloat16",
        max_model_len=256, gpu_memory_utilization=0.1,
        distributed_executor_backend="uni",
        worker_extension_cls="afd.runtime.ffn_server.AFDWorkerExtension", **extra,
    ).create_engine_config()
    executor = Executor.get_class(cfg)(cfg)
    try:
        inventory = executor.collective_rpc("afd_inventory")[0]
        names = executor.collective_rpc("afd_parameter_names")[0]
        owners = executor.collective_rpc("afd_weight_owners")[0]
        result = {"inventory": inventory, "names": names, "owners": owners}
        if report_experts:
            result["experts"] = executor.collective_rpc(expert_tensors)[0]
        print("RESULT " + json.dumps(result))
    finally:
        executor.shutdown()
    """
)


# A build server: imports vLLM once, then forks a fresh child per build (the child has
# vLLM imported but no state of any earlier build: no distributed groups, no layer
# registry), so a build costs its own seconds, not another ~15 s of imports. Requests and
# answers are JSON lines on stdin / stdout; each child's output goes to files.
ZYGOTE = textwrap.dedent(
    """
    import json, os, sys, tempfile
    from vllm.engine.arg_utils import EngineArgs  # noqa: F401  (imported once, inherited)
    from vllm.v1.executor import Executor  # noqa: F401
    import vllm.v1.worker.cpu_worker  # noqa: F401
    import afd.runtime.ffn_server  # noqa: F401
    BUILD = sys.argv[1]
    print("ZYGOTE READY", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        out = open(req["stdout"], "w")
        err = open(req["stderr"], "w")
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            os.environ["TMPDIR"] = req["tmp"]
            tempfile.tempdir = None
            sys.argv = ["-c", *req["argv"]]
            code = 0
            try:
                exec(compile(BUILD, "<build>", "exec"), {"__name__": "__main__"})
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.close()
        err.close()
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
    """
)


class _BuildServer:
    """The session's build server (started on first use, stopped at interpreter exit)."""

    proc: subprocess.Popen[str] | None = None
    env_key: tuple[tuple[str, str], ...] | None = None

    @classmethod
    def build(
        cls, argv: list[str], tmp_path: Path, env: dict[str, str]
    ) -> subprocess.CompletedProcess[str]:
        # (pytest names the running test in the environment: not a reason to restart)
        key = tuple(
            sorted((k, v) for k, v in env.items() if k not in ("TMPDIR", "PYTEST_CURRENT_TEST"))
        )
        if cls.proc is not None and (cls.proc.poll() is not None or cls.env_key != key):
            cls.stop()
        if cls.proc is None:
            import atexit

            cls.proc = subprocess.Popen(
                [sys.executable, "-c", ZYGOTE, BUILD], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True, env=env,
            )  # fmt: skip
            cls.env_key = key
            atexit.register(cls.stop)
            assert cls.proc.stdout is not None
            ready = cls.proc.stdout.readline()
            assert ready.startswith("ZYGOTE READY"), f"the build server did not start: {ready!r}"
        assert cls.proc.stdin is not None and cls.proc.stdout is not None
        out, err = tmp_path / "build.stdout", tmp_path / "build.stderr"
        request = {"argv": argv, "tmp": str(tmp_path), "stdout": str(out), "stderr": str(err)}
        cls.proc.stdin.write(json.dumps(request) + "\n")
        cls.proc.stdin.flush()
        answer = cls.proc.stdout.readline()
        assert answer, "the build server died"
        code = int(json.loads(answer)["returncode"])
        return subprocess.CompletedProcess(
            [sys.executable, "-c", "BUILD", *argv], code, out.read_text(), err.read_text()
        )

    @classmethod
    def stop(cls) -> None:
        if cls.proc is not None:
            if cls.proc.poll() is None:
                cls.proc.kill()
            cls.proc.wait(10)
            cls.proc = None


def run_role_model_build(
    model_dir: Path,
    arch: str,
    afd: dict[str, object],
    tmp_path: Path,
    engine_kwargs: dict[str, object] | None = None,
    *,
    experts: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Build (and load) ``arch`` for the role in ``afd`` with vLLM's executor, in a new
    process of its own (forked from the session's build server, which imported vLLM
    once); ``engine_kwargs`` are extra ``EngineArgs`` fields. ``experts``: the result
    also has ``experts``, what each MoE layer's routed experts hold (see ``BUILD``)."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    argv = [str(model_dir), arch, json.dumps(afd), json.dumps(engine_kwargs or {})]
    argv.append(json.dumps({"experts": experts}))
    return _BuildServer.build(argv, tmp_path, env)


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
    model_dir: Path,
    arch: str,
    afd: dict[str, object],
    tmp_path: Path,
    engine_kwargs: dict[str, object] | None = None,
    *,
    experts: bool = False,
) -> dict[str, Any]:
    """The built model's parameter inventory, parameter names, and the checkpoint tensors
    it loaded / left to the other role by owner (``owners``: ``kept`` / ``dropped``);
    with ``experts``, also per MoE layer the expert shard and per-expert tensor digests
    (``experts``)."""
    proc = run_role_model_build(model_dir, arch, afd, tmp_path, engine_kwargs, experts=experts)
    return probe_result(proc)
