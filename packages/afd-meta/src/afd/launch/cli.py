"""The ``afd launch`` command line: its arguments, the spec they make, and the run of a
deployment until a role exits or a signal stops it."""

from __future__ import annotations

import contextlib
import shlex
import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from afd.launch.cpus import CPU_BIND
from afd.launch.deployment import Deployment
from afd.launch.errors import DeploymentError, SpecError
from afd.launch.spec import DTYPES, DeploymentSpec, load_toml

__all__ = [
    "add_cpu_arguments",
    "add_launch_arguments",
    "forward_signals",
    "run_launch",
    "spec_from_args",
]


class _Interrupted(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def forward_signals() -> Any:
    """Turn the first SIGINT/SIGTERM into :class:`_Interrupted` (later ones are ignored
    while the deployment is torn down)."""
    fired: list[int] = []

    def handler(signum: int, _frame: Any) -> None:
        if fired:
            return
        fired.append(signum)
        raise _Interrupted(signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def spec_from_args(args: Any) -> DeploymentSpec:
    """A spec from ``afd launch`` arguments (a TOML file and/or flags; flags win)."""
    data: dict[str, Any] = {}
    base_dir = None
    ray_address = getattr(args, "ray", None)
    if not args.spec and ray_address and Path(ray_address).expanduser().is_file():
        # `afd launch --ray deploy.toml`: the spec, not a Ray address
        args.spec, ray_address = ray_address, ""
    if args.spec:
        data, base_dir = load_toml(args.spec)
    flags = {
        "model": args.model,
        "num_attention": args.attention,
        "num_ffn": args.ffn,
        "attention_tensor_parallel_size": getattr(args, "attention_tensor_parallel_size", None),
        "ffn_expert_parallel": getattr(args, "ffn_expert_parallel", None),
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "http_port": args.http_port,
        "connector_port": args.connector_port,
        "ffn_health_port": getattr(args, "ffn_health_port", None),
        "log_dir": args.log_dir,
        "startup_timeout_s": args.startup_timeout,
    }
    if args.gate_on_attention:
        flags["compute_gate_on_attention"] = True
    if args.native:
        flags["native"] = True
    for k, v in flags.items():
        if v is not None:
            data[k] = v
    role_flags = (
        ("attention", "devices", args.attention_devices),
        ("ffn", "devices", args.ffn_devices),
        ("attention", "cpus", getattr(args, "attention_cpus", None)),
        ("ffn", "cpus", getattr(args, "ffn_cpus", None)),
    )
    for role, key, value in role_flags:
        if value is not None:
            table = data.get(role, {})
            data[role] = {**table, key: value} if isinstance(table, Mapping) else table
    if args.model is not None:
        data["model"] = (
            str(Path(args.model).expanduser().absolute())
            if Path(args.model).expanduser().exists()
            else args.model
        )
    if args.vllm_args:
        data["vllm_args"] = [*data.get("vllm_args", []), *shlex.split(args.vllm_args)]
    if getattr(args, "no_ray", False):
        data.pop("ray", None)  # the same spec, on this host
    elif ray_address is not None:
        table = data.get("ray") or {}
        if isinstance(table, Mapping):
            table = {**table, **({"address": ray_address} if ray_address else {})}
        data["ray"] = table
    if not data.get("model"):
        raise SpecError("model: give a spec file with model = ... or --model DIR")
    return DeploymentSpec.from_dict(data, base_dir=base_dir, source=args.spec)


def add_cpu_arguments(ap: Any) -> None:
    """``--attention-cpus`` / ``--ffn-cpus`` (``afd launch``, ``afd demo``, ``afd bench``)."""
    ap.add_argument(
        "--attention-cpus",
        metavar="CPUS",
        help=f"{CPU_BIND} of the attention server (e.g. 0 or 0-3; DP ranks separated by |; "
        "auto = vLLM's own); default on a CPU host: the first half of the usable CPUs",
    )
    ap.add_argument(
        "--ffn-cpus",
        metavar="CPUS",
        help=f"{CPU_BIND} of the FFN servers, one CPU list per rank separated by | (e.g. 1 "
        "or 2|3); default on a CPU host: the CPUs after the attention server's, one block "
        "per rank",
    )


def add_launch_arguments(ap: Any) -> None:
    ap.add_argument("spec", nargs="?", help="deployment spec (TOML); flags override it")
    ap.add_argument("--model", help="checkpoint directory (or model name)")
    ap.add_argument("--attention", type=int, help="number of attention servers (default 1)")
    ap.add_argument("--ffn", type=int, help="number of FFN servers (default 1)")
    ap.add_argument(
        "--ffn-expert-parallel",
        action="store_true",
        default=None,
        help="the FFN servers share one expert set (expert parallelism over --ffn ranks)",
    )
    ap.add_argument(
        "--attention-tensor-parallel-size",
        "--attention-tp",
        type=int,
        help="vLLM tensor-parallel size of each attention rank (default 1)",
    )
    ap.add_argument(
        "--gate-on-attention",
        action="store_true",
        help="compute the MoE gate on the attention role",
    )
    ap.add_argument("--dtype", choices=DTYPES)
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--kv-cache-memory-bytes", type=int)
    ap.add_argument("--http-port", type=int, help="HTTP port of attention server 0 (0 = free)")
    ap.add_argument("--connector-port", type=int, help="AFD rendezvous port (0 = free)")
    ap.add_argument(
        "--ffn-health-port",
        type=int,
        help="/health and /metrics port of FFN server 0 (server i: +i; 0 = free)",
    )
    ap.add_argument("--log-dir", help="per-role log files (default: a temporary folder)")
    ap.add_argument(
        "--attention-devices",
        metavar="IDS",
        help="CUDA devices of the attention ranks, one per rank (e.g. 0,1; default: the "
        "first visible ones)",
    )
    ap.add_argument(
        "--ffn-devices",
        metavar="IDS",
        help="CUDA devices of the FFN ranks, one per rank (e.g. 2; default: the visible "
        "ones after the attention ranks)",
    )
    add_cpu_arguments(ap)
    ap.add_argument("--startup-timeout", type=float, help="seconds (default 600)")
    ap.add_argument(
        "--native",
        action="store_true",
        help="run one plain vLLM server with the same args instead (baseline)",
    )
    where = ap.add_mutually_exclusive_group()
    where.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="place the roles as Ray actors (needs afd[ray]); ADDRESS: the cluster (auto, "
        "HOST:6379, ray://HOST:10001; default: RAY_ADDRESS or the local cluster); same as a "
        "[ray] table in the spec",
    )
    where.add_argument(
        "--no-ray",
        action="store_true",
        help="run on this host even if the spec has a [ray] table",
    )
    ap.add_argument(
        "--quiet", action="store_true", help="role output to the log files only (not the console)"
    )
    ap.add_argument(
        "--vllm-args",
        default=None,
        metavar="'ARGS'",
        help="extra vLLM args for every role, one shell-quoted string "
        "(e.g. --vllm-args='--max-num-seqs 8')",
    )


def run_launch(args: Any) -> int:
    """``afd launch``: start the deployment, print the endpoints, run until interrupted."""
    try:
        spec = spec_from_args(args)
    except SpecError as exc:
        print(f"afd launch: invalid spec: {exc}", file=sys.stderr)
        return 2
    cls: type[Deployment] = Deployment
    if spec.ray is not None:
        from afd.launch.ray import RayDeployment

        cls = RayDeployment
    dep = cls(spec, echo=not args.quiet, console=sys.stdout)
    code = 0
    with forward_signals():
        try:
            dep.start()
            dep.say("endpoints (OpenAI-compatible API):")
            for url in dep.endpoints:
                dep.say(
                    f"  {url}/v1  (e.g. curl {url}/v1/completions -H 'Content-Type: "
                    'application/json\' -d \'{"prompt": "Hello", "max_tokens": 16}\')'
                )
                dep.say(f"  {url}/metrics  (vLLM's and the attention role's AFD metrics)")
            for role in dep.roles:
                for line in role.readiness.endpoint_lines(role.name, role.health_url):
                    dep.say(line)
            dep.say("running; Ctrl-C or SIGTERM stops every role")
            gone = dep.wait()
            dep.say(f"{gone.name} {gone.exit_description()}; stopping the deployment")
            code = 1
        except _Interrupted as sig:
            dep.say(f"{sig} received")
            # SIGTERM is the normal way to stop a launcher: a clean teardown exits 0.
            code = 0 if sig.signum == signal.SIGTERM else 130
        except DeploymentError as exc:
            print(f"afd launch: {exc}", file=sys.stderr)
            code = 1
        finally:
            clean = dep.stop()
    if not clean:
        code = code or 1
    return code
