"""``afd serve --role {attention,ffn} MODEL [vLLM engine/server args]``.

Both roles take the same vLLM arguments as ``vllm serve``. ``afd serve`` adds what
AFD needs: the role in ``--additional-config '{"afd": {...}}'`` (merged with what
you pass), the AFD architecture alias in ``--hf-overrides`` (so native model
lookups stay untouched), and for the FFN role the worker extension that serves
layers. The Attention role runs vLLM's OpenAI-compatible API server unchanged, as a
child process (:func:`run_attention_server`); the FFN role runs
:func:`afd.runtime.ffn_server.run_ffn_server` (no scheduler, KV cache or API).

Exit codes: 0 after SIGTERM / SIGINT (a requested stop); 1 when AFD stopped the role
(its peer was lost, the connector's start-up failed, a transfer timed out or did not
match), with one log line saying why; otherwise the server's own code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from afd.runtime.plugin import afd_alias_of
from afd_core.config import AFDConfig, additional_config_json
from afd_core.errors import AFDConfigError
from afd_core.lifecycle import EXIT_REASON_ENV, read_exit_reasons
from afd_core.procfs import descendants

logger = logging.getLogger("afd.runtime.serve")

WORKER_EXTENSION = "afd.runtime.ffn_server.AFDWorkerExtension"


def _pop_option(args: list[str], name: str) -> str | None:
    """Remove ``name VALUE`` or ``name=VALUE`` from args; return VALUE (last one wins)."""
    value = None
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == name:
            if i + 1 >= len(args):
                raise AFDConfigError(f"{name} needs a value")
            value = args[i + 1]
            del args[i : i + 2]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
            del args[i]
        else:
            i += 1
    return value


def _json_option(args: list[str], name: str) -> dict[str, Any]:
    raw = _pop_option(args, name)
    if raw is None:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise AFDConfigError(f"{name}: not valid JSON ({exc}): {raw!r}") from None
    if not isinstance(value, dict):
        raise AFDConfigError(f"{name}: expected a JSON object, got {raw!r}")
    return value


def afd_architecture(model: str, hf_overrides: dict[str, Any]) -> str:
    """The AFD alias for a checkpoint's architecture (``DeepseekV3ForCausalLM`` -> ``AFD...``)."""
    archs = hf_overrides.get("architectures")
    if not archs:
        config_path = Path(model) / "config.json"
        if not config_path.is_file():
            raise AFDConfigError(
                f"cannot read the architecture of {model!r} ({config_path} not found); pass "
                'a local checkpoint directory or --hf-overrides \'{"architectures": ["AFD..."]}\''
            )
        archs = json.loads(config_path.read_text()).get("architectures") or []
    arch = str(archs[0]) if archs else ""
    if not arch:
        raise AFDConfigError(f"the config of {model!r} names no architecture")
    if arch.startswith("AFD"):
        return arch
    # A hand-written wrapper, else the generic path (it refuses a model it cannot split,
    # naming the layer and why; `afd models check MODEL` tells before starting).
    return afd_alias_of(arch)[0]


def prepare_role_args(role: str, model: str, rest: list[str]) -> list[str]:
    """vLLM CLI args for one role: AFD config merged in, AFD architecture selected."""
    return prepare_role(role, model, rest)[1]


def prepare_role(role: str, model: str, rest: list[str]) -> tuple[AFDConfig, list[str]]:
    """The edge of a role process: its AFD section parsed once (aliases resolved, every
    value checked) and the vLLM CLI args that carry it, in canonical keys
    (:meth:`AFDConfig.to_section`), with the AFD architecture selected."""
    args = list(rest)
    additional = _json_option(args, "--additional-config")
    # parsed here, once (aliases resolved, the role checked against --role): fail with
    # the CLI's error, not deep in a worker
    afd = AFDConfig.from_additional_config(additional, role=role, role_from="--role")
    if "--ffn-expert-parallel" in args:
        # afd's own switch: additional_config["afd"]["ffn_expert_parallel"] = true
        args.remove("--ffn-expert-parallel")
        afd = dataclasses.replace(afd, ffn_expert_parallel=True)
    hf_overrides = _json_option(args, "--hf-overrides")
    hf_overrides["architectures"] = [afd_architecture(model, hf_overrides)]
    return afd, [
        "--model",
        model,
        "--additional-config",
        additional_config_json(afd, additional),
        "--hf-overrides",
        json.dumps(hf_overrides),
        *args,
    ]


def attention_worker_args(
    argv: list[str], *, cuda: bool | None = None, afd: AFDConfig | None = None
) -> list[str]:
    """``--worker-cls`` of the AFD worker when the Attention role micro-batches.

    Empty when ``afd.num_micro_batches`` is 1 or the command already names a worker.
    ``afd``: the role's parsed settings (:func:`prepare_role`); without it, the
    command's ``--additional-config`` is parsed (the upstream alias num_afd_stages
    counts too).
    """
    if any(a == "--worker-cls" or a.startswith("--worker-cls=") for a in argv):
        return []
    if afd is None:
        afd = AFDConfig.from_additional_config(
            _json_option(list(argv), "--additional-config"), role="attention"
        )
    if afd.num_micro_batches <= 1:
        return []
    if cuda is None:
        import torch

        cuda = bool(torch.cuda.is_available())
    from afd.runtime.worker import WORKERS

    return ["--worker-cls", WORKERS["cuda" if cuda else "cpu"]]


#: ``--compilation-config`` of a compiled Attention role on CUDA when none is given:
#: vLLM's CUDA default (FULL_AND_PIECEWISE) would capture the AFD exchange in full decode
#: graphs; piecewise graphs split at the exchange op (afd_moe_runners.exchange_op).
CUDA_ATTENTION_COMPILATION = {"cudagraph_mode": "PIECEWISE"}


def attention_graph_args(argv: list[str], *, cuda: bool | None = None) -> list[str]:
    """``--compilation-config`` for a compiled Attention role on CUDA (piecewise graphs),
    unless the command runs eager or sets a compilation config itself; else empty."""
    # --compilation-config / -cc (also -cc.key=value) and vLLM's -O levels set it.
    if any(a.startswith(("--enforce-eager", "--compilation-config", "-cc", "-O")) for a in argv):
        return []
    if cuda is None:
        import torch

        cuda = bool(torch.cuda.is_available())
    if not cuda:
        return []
    return ["--compilation-config", json.dumps(CUDA_ATTENTION_COMPILATION)]


def serve_attention(model: str, rest: list[str]) -> int:
    afd, argv = prepare_role("attention", model, rest)
    argv += attention_worker_args(argv, afd=afd)
    argv += attention_graph_args(argv)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *argv]
    logger.info("afd serve --role attention: %s", " ".join(cmd))
    return run_attention_server(cmd)


def _parent_death_signal() -> Any:
    """A ``preexec_fn`` that makes the child get SIGTERM when this process dies (Linux
    ``PR_SET_PDEATHSIG``), or None where that is not available. libc is loaded here, in
    the parent: the child only makes the call."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def set_signal() -> None:  # pragma: no cover - runs in the child before exec
        prctl(pr_set_pdeathsig, int(signal.SIGTERM))

    return set_signal


def run_attention_server(cmd: list[str]) -> int:
    """Run vLLM's API server ``cmd`` as a child and return this role's exit code.

    vLLM's API server exits 0 whenever its engine stops, also when the engine died
    because AFD lost the FFN role. The AFD runtime in the worker records why it stopped
    (:mod:`afd_core.lifecycle`); this process forwards SIGTERM / SIGINT to the server and,
    after it exited: 0 if a stop was requested, 1 (logging the reason) if AFD recorded
    one, else the server's code. A server still running :data:`STOP_GRACE_S` after a
    reason was recorded gets SIGTERM, and :data:`STOP_GRACE_S` later it and every process
    below it get SIGKILL: a role whose AFD runtime stopped does not linger.

    The server gets ``PROMETHEUS_MULTIPROC_DIR`` (a fresh folder for its lifetime, unless
    one is set): the AFD metrics its worker processes record then appear on its
    ``/metrics`` (:mod:`afd_moe_runners.metrics`).
    """
    from afd.runtime.health import multiproc_dir

    with multiproc_dir("afd-attention-metrics-", keep_given=True):
        return _run_attention_server(cmd)


def _run_attention_server(cmd: list[str]) -> int:
    fd, reason_path = tempfile.mkstemp(prefix="afd-exit-reason-", suffix=".txt")
    os.close(fd)
    requested: list[int] = []
    sys.stdout.flush()
    sys.stderr.flush()
    child = subprocess.Popen(
        cmd,
        env={**os.environ, EXIT_REASON_ENV: reason_path},
        preexec_fn=_parent_death_signal(),
    )

    def forward(signum: int, _frame: Any) -> None:
        requested.append(signum)
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = _wait_for_server(child, reason_path, requested)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        reasons = read_exit_reasons(reason_path)
        Path(reason_path).unlink(missing_ok=True)
    if requested:
        logger.info(
            "AFD attention server stopped on %s (server exit code %d)",
            signal.Signals(requested[0]).name,
            code,
        )
        return 0
    if reasons:
        logger.error("AFD attention server stopped by AFD: %s", reasons[0])
        return 1
    return code if code >= 0 else 128 - code


#: After the AFD runtime recorded why it stopped, vLLM's API server gets this long to exit
#: on its own (it fails the requests in flight and tears its engine down), then SIGTERM,
#: then, this long again later, SIGKILL for it and every process below it. vLLM's own
#: teardown after a worker failed at start-up took 6-9 s here, which left a deployment
#: with a refused peer up for longer than the 10 s a supervisor should wait.
STOP_GRACE_S = 3.0


def _wait_for_server(child: subprocess.Popen[bytes], reason_path: str, requested: list[int]) -> int:
    """Wait for the API server; once a reason is recorded, stop it if it lingers."""
    seen_at: float | None = None
    signalled: list[int] = []
    while True:
        try:
            return child.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        if requested:  # a stop was asked for: the server got the signal, let it finish
            continue
        now = time.monotonic()
        if seen_at is None:
            with contextlib.suppress(OSError):
                if os.path.getsize(reason_path) > 0:
                    seen_at = now
            continue
        if not signalled and now - seen_at >= STOP_GRACE_S:
            logger.warning(
                "AFD stopped the attention role (%s); vLLM's API server (pid %d) is still "
                "running after %.0f s: SIGTERM",
                (read_exit_reasons(reason_path) or ["?"])[0],
                child.pid,
                STOP_GRACE_S,
            )
            signalled.append(signal.SIGTERM)
            _signal_tree(child.pid, signal.SIGTERM, include_descendants=False)
        elif len(signalled) == 1 and now - seen_at >= 2 * STOP_GRACE_S:
            logger.warning("vLLM's API server ignored SIGTERM: SIGKILL to it and its children")
            signalled.append(signal.SIGKILL)
            _signal_tree(child.pid, signal.SIGKILL, include_descendants=True)


def _signal_tree(pid: int, sig: int, *, include_descendants: bool) -> None:
    targets = [*(descendants(pid) if include_descendants else []), pid]
    for target in targets:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(target, sig)


def health_options(args: list[str]) -> tuple[str, int]:
    """Remove the FFN server's ``--health-host`` / ``--health-port`` from ``args``;
    return them (defaults: ``0.0.0.0``, port 0 = a free port picked at start-up)."""
    host = _pop_option(args, "--health-host") or "0.0.0.0"
    raw = _pop_option(args, "--health-port")
    try:
        port = int(raw) if raw is not None else 0
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise AFDConfigError(f"--health-port: expected a port in 0..65535 (0 = free), got {raw!r}")
    return host, port


def serve_ffn(model: str, rest: list[str]) -> int:
    rest = list(rest)
    health_host, health_port = health_options(rest)
    argv = prepare_role_args("ffn", model, rest)
    if "--worker-extension-cls" not in " ".join(argv):
        argv += ["--worker-extension-cls", WORKER_EXTENSION]
    # One in-process worker (UniProcExecutor): the FFN server needs no engine-core process.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # The worker records its metrics in this process's own multiprocess folder (a worker
    # of another executor backend would be another process); prometheus_client reads
    # the variable when vLLM first imports it, below.
    from afd.runtime.health import multiproc_dir

    with multiproc_dir("afd-ffn-metrics-", keep_given=False):
        return _serve_ffn(argv, health_host, health_port)


def _serve_ffn(argv: list[str], health_host: str, health_port: int) -> int:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="afd serve --role ffn")
    parser = EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    engine_args = EngineArgs.from_cli_args(ns)
    if not engine_args.enforce_eager:
        # The FFN role never runs vLLM's compiled model forward: it computes each block
        # eagerly as it arrives. vLLM's compile mode would only switch its custom ops to
        # the PyTorch-native implementations meant for inductor to fuse, which run
        # eagerly are ~16x slower here (measured end to end on a tiny DeepSeek-V3).
        logger.info(
            "AFD FFN role: vLLM eager settings (the FFN blocks run eagerly with vLLM's "
            "kernels; the Attention role compiles)"
        )
        engine_args.enforce_eager = True
    if engine_args.distributed_executor_backend is None:
        engine_args.distributed_executor_backend = "uni"
    drop_speculation(engine_args)
    from afd.runtime.ffn_server import run_ffn_server

    return run_ffn_server(engine_args, health_host=health_host, health_port=health_port)


def drop_speculation(engine_args: Any) -> None:
    """The FFN role has no proposer: speculation runs on the Attention role, whose
    verification steps reach this role as ordinary token batches. A speculative config
    given here too (``afd launch`` hands every role the same vLLM args) is checked like
    the Attention role's, then dropped, so that vLLM builds no drafter on this role."""
    from afd_moe_runners.speculation import speculative_method, speculative_problem

    settings = dict(engine_args.speculative_config or {})
    for key, attr in (("method", "spec_method"), ("model", "spec_model")):
        if getattr(engine_args, attr, None) is not None:
            settings[key] = getattr(engine_args, attr)
    if not settings and getattr(engine_args, "spec_tokens", None) is None:
        return
    problem = speculative_problem(speculative_method(settings), "afd serve --role ffn")
    if problem is not None:
        raise AFDConfigError(problem)
    logger.info(
        "AFD FFN role: speculative config %s not used here (the Attention role speculates; "
        "its verification steps arrive as token batches)",
        settings,
    )
    engine_args.speculative_config = None
    engine_args.spec_method = engine_args.spec_model = engine_args.spec_tokens = None
