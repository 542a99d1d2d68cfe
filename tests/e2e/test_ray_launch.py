"""End to end: ``afd launch SPEC --ray ADDRESS`` on a one-node Ray cluster on loopback.

One cluster for the module (``ray start --head --block`` in a temporary folder, bound to
127.0.0.1, with Ray's token authentication, stopped and checked empty at the end). Each
test launches a deployment whose roles are Ray actors, checks greedy parity with native
vLLM on the tiny DeepSeek-V2 (the run's shared native reference: each prompt its own
batch, as the deployment is asked one request at a time), then stops it and checks that
nothing is left: no process of any role (nor any process naming the checkpoint or a
role's guard), no actor or placement group of the deployment in the cluster.

* 1A1F: stopped by SIGTERM (exit 0, ``stopped; no process left``).
* 2A1F: the FFN actor is killed (``ray.kill``); the launcher names the role that died,
  stops the rest and exits 1.
* Attention TP2 + FFN EP2 (float32, against native TP=2): Ray places the attention
  server's two TP workers (one CPU list each) and both FFN servers, the rendezvous ports
  of both expert planes on the attention actor's node; stopped by SIGTERM.

Ray is the meta package's ``ray`` extra: without it the module is skipped with the reason
(``nox -s tests-matrix`` installs it, and runs the 2A1F test; the 1A1F and TP2 + EP2 ones
are ``extended``, out of CI for its time budget).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from afd_processes import (
    Launcher,
    RoleProcess,
    assert_same_tokens,
    child_environ,
    free_port,
    group_pgid_members,
    stop_roles,
)

from afd.launch.readiness import NATIVE
from afd.tools.reference import FIXED_PROMPTS

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.vllm,
    # Ray's tests run in `nox -s tests-matrix` (which installs the ray extra); the
    # default run stays as fast as before.
    pytest.mark.matrix,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None,
        reason="Ray is not installed (pip install 'afd[ray]'; nox -s tests-matrix installs it)",
    ),
]

PROMPTS = list(FIXED_PROMPTS[:8])
#: The wait for the launcher's "running" line: under the 285 s per-test limit
#: (pytest-timeout, ``timeout`` in pyproject.toml), leaving the test time to stop the
#: deployment and report the launcher's output.
STARTUP_S = 210.0
NAMESPACE = "afd-e2e"


class RayCluster:
    """A one-node Ray cluster on 127.0.0.1 owned by this test module."""

    def __init__(self) -> None:
        self.temp_dir = Path(tempfile.mkdtemp(prefix="afd-ray-", dir="/tmp"))  # short socket paths
        self.address = f"127.0.0.1:{free_port()}"
        self.env = {
            # loopback only: Ray otherwise binds the host's outward address
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
            # stop at once on SIGTERM (no draining of a node nobody else uses)
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
            "VLLM_CACHE_ROOT": os.environ.get(
                "VLLM_CACHE_ROOT", str(Path(__file__).parents[2] / ".cache" / "vllm")
            ),
            "TMPDIR": str(self.temp_dir),
        }
        cmd = [
            str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
            "--node-ip-address", "127.0.0.1", "--port", self.address.split(":")[1],
            "--ray-client-server-port", str(free_port()),
            "--num-cpus", "4",  # oversubscribed: the roles ask 1 CPU per rank
            "--object-store-memory", str(100 * 1024 * 1024),
            "--include-dashboard=false", "--disable-usage-stats",
            "--temp-dir", str(self.temp_dir),
        ]  # fmt: skip
        # supervised like a role of afd launch: own process group, output in a log file
        self.head = RoleProcess("ray", NATIVE, cmd, self.temp_dir, env=self.env)
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in self.output():
            if self.head.returncode() is not None or time.monotonic() > deadline:
                out = self.output()  # (stop() removes the folder)
                self.stop()
                raise AssertionError(f"ray start failed:\n{out[-4000:]}")
            time.sleep(0.5)

    def output(self) -> str:
        return self.head.output

    def run(self, code: str, timeout: float = 120) -> str:
        """Run ``code`` in a Python process connected to the cluster as a driver;
        its stdout."""
        prologue = (
            "import json, ray\n"
            f"ray.init(address={self.address!r}, namespace={NAMESPACE!r}, "
            "log_to_driver=False, configure_logging=False)\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", prologue + code],
            capture_output=True,
            text=True,
            env={**child_environ(), **self.env},
            timeout=timeout,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        return proc.stdout

    def afd_left(self) -> dict[str, Any]:
        """The afd actors and placement groups still alive in the cluster."""
        out = self.run(
            "from ray.util.placement_group import placement_group_table\n"
            "actors = [a['name'] for a in ray.util.list_named_actors(all_namespaces=True)\n"
            "          if a['name'].startswith('afd-')]\n"
            "pgs = [p['name'] for p in placement_group_table().values()\n"
            "       if p['name'].startswith('afd-') and p['state'] != 'REMOVED']\n"
            "print(json.dumps({'actors': actors, 'placement_groups': pgs}))\n"
        )
        return dict(json.loads(out.strip().splitlines()[-1]))

    def stop(self) -> list[int]:
        """SIGTERM the cluster (``ray start --block`` stops what it started), SIGKILL
        what is left after 30 s; the processes left after that."""
        left = stop_roles([self.head], grace_s=30.0)["leftovers"]
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return [pid for pids in left.values() for pid in pids]


@pytest.fixture(scope="module")
def ray_model(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny DeepSeek-V2 under a path of this module's own: "no process left
    that names the model" then looks only at this module's deployments (another test
    process may be serving the shared checkpoint at the same time)."""
    return Path(
        shutil.copytree(tiny_models["deepseek_v2"], tmp_path_factory.mktemp("ray") / "model")
    )


@pytest.fixture(scope="module")
def native_tokens(ray_model: Path, native_references: Any) -> list[list[int]]:
    """Greedy tokens of native vLLM for PROMPTS, one request at a time (each prompt its
    own batch; the run's shared reference, the spec's dtype and eager mode)."""
    from afd_references import singles

    tokens: list[list[int]] = native_references.tokens(ray_model, singles(PROMPTS))
    return tokens


@pytest.fixture(scope="module")
def ray_cluster(native_tokens: list[list[int]]) -> Iterator[RayCluster]:
    # (after the native reference: the two never compete for the cores)
    cluster = RayCluster()
    try:
        yield cluster
    finally:
        left = cluster.stop()
    assert left == [], f"Ray processes left after the cluster stopped: {left}"


def _spec(tmp: Path, model: Path, num_attention: int) -> Path:
    spec = tmp / f"{num_attention}a1f.toml"
    spec.write_text(
        f'model = "{model}"\nnum_attention = {num_attention}\nnum_ffn = 1\n'
        # eager: the Ray placement is under test here; compiled runs in test_launch.py
        f'log_dir = "{tmp / "logs"}"\nenforce_eager = true\n'
        "[afd]\nconnect_timeout_s = 300\ntransfer_timeout_s = 120\n"
        f'[ray]\nnamespace = "{NAMESPACE}"\nplacement_timeout_s = 60\n'
        "[ray.attention]\nnum_cpus = 1\n[ray.ffn]\nnum_cpus = 1\n"
    )
    return spec


def _processes_naming(*texts: str) -> list[str]:
    """Command lines of live processes that contain any of ``texts``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X") and any(t in cmdline for t in texts):
            found.append(f"{entry}: {cmdline[:200]}")
    return found


def _launch_ready(cluster: RayCluster, spec: Path, tmp: Path) -> tuple[Launcher, str, float]:
    t0 = time.monotonic()
    launcher = Launcher(spec, tmp, "--ray", cluster.address, env=cluster.env)
    ready = launcher.wait_for(r"running; Ctrl-C or SIGTERM", STARTUP_S)
    assert ready, f"deployment did not come up in {STARTUP_S:.0f} s:\n{launcher.output[-8000:]}"
    out = launcher.output
    urls = re.findall(r"^\[afd\]\s+(http://[\d.]+:\d+)/v1", out, re.M)
    assert len(urls) == 1, out[-3000:]
    # placed by Ray: one actor per role in one placement group, the rendezvous on the
    # attention actor's node, each role's log streamed with its prefix
    assert re.search(r"^\[afd\] ray placement group STRICT_PACK \(P2pShmAFDConnector", out, re.M)
    assert re.search(r"^\[afd\] ffn0: actor afd-\w+-ffn0 on .*127\.0\.0\.1", out, re.M)
    assert re.search(r"^\[afd\] rendezvous: 127\.0\.0\.1:\d+ \(attention rank 0's node", out, re.M)
    assert re.search(r"^\[ffn0\] .*AFD FFN rank 0: attention peers connected; serving", out, re.M)
    assert re.search(r"^\[attn\] ", out, re.M)
    assert "admission: a token generated for this deployment" in out
    return launcher, urls[0], time.monotonic() - t0


def _assert_nothing_left(cluster: RayCluster, launcher: Launcher, model: Path) -> None:
    pgids = launcher.role_pgids()
    assert set(pgids) == {"ffn0", "attn"}, launcher.output[-3000:]

    def guards() -> list[str]:
        # the roles' guards (python -m afd.launch.guard OWNER START PGID GRACE); one
        # leaves within its poll interval (0.5 s) of its role's group emptying
        return [g for g in _processes_naming("afd.launch.guard") if g.split()[-2] in
                {str(p) for p in pgids.values()}]  # fmt: skip

    deadline = time.monotonic() + 20  # a dead actor's guard may still be stopping its role
    while time.monotonic() < deadline and (
        group_pgid_members(list(pgids.values())) or _processes_naming(str(model)) or guards()
    ):
        time.sleep(0.5)
    assert group_pgid_members([*pgids.values(), launcher.proc.pid]) == []
    assert _processes_naming(str(model)) == []
    assert guards() == []
    assert cluster.afd_left() == {"actors": [], "placement_groups": []}


@pytest.mark.extended  # out of CI for its time budget (`nox -s tests-extended`)
def test_ray_1a1f_parity_then_sigterm_leaves_nothing(
    ray_cluster: RayCluster,
    ray_model: Path,
    native_tokens: list[list[int]],
    tmp_path: Path,
) -> None:
    from afd.tools.client import complete_each

    model = ray_model
    launcher, url, startup_s = _launch_ready(ray_cluster, _spec(tmp_path, model, 1), tmp_path)
    try:
        assert re.search(r"^\[afd\] cpus on .*: attn=0, ffn0=1", launcher.output, re.M) or (
            os.cpu_count() != 2
        )
        got, _ = complete_each(url, PROMPTS)
        assert_same_tokens(got, native_tokens, PROMPTS)
        t0 = time.monotonic()
        launcher.proc.send_signal(signal.SIGTERM)
        rc = launcher.proc.wait(timeout=60)
        stop_s = time.monotonic() - t0
        launcher.join_output(5)
        out = launcher.output
        assert rc == 0, out[-3000:]
        assert "stopped; no process left" in out
        assert re.search(r"ray: 2 actor\(s\) and the placement group removed; nothing of", out)
        _assert_nothing_left(ray_cluster, launcher, model)
        print(f"1A1F on Ray: ready in {startup_s:.1f} s, stopped in {stop_s:.1f} s")
    finally:
        launcher.kill_all()


def test_ray_2a1f_parity_then_killed_ffn_actor_stops_the_rest(
    ray_cluster: RayCluster,
    ray_model: Path,
    native_tokens: list[list[int]],
    tmp_path: Path,
) -> None:
    from afd.tools.client import complete_each

    model = ray_model
    launcher, url, startup_s = _launch_ready(ray_cluster, _spec(tmp_path, model, 2), tmp_path)
    try:
        got, _ = complete_each(url, PROMPTS)
        assert_same_tokens(got, native_tokens, PROMPTS)
        name = re.search(r"^\[afd\] ffn0: actor (afd-\w+-ffn0) ", launcher.output, re.M)
        assert name, launcher.output[-3000:]
        t0 = time.monotonic()
        ray_cluster.run(f"ray.kill(ray.get_actor({name[1]!r}, namespace={NAMESPACE!r}))\n")
        rc = launcher.proc.wait(timeout=90)
        stop_s = time.monotonic() - t0
        launcher.join_output(5)
        out = launcher.output
        died = re.search(
            r"^\[afd\] ffn0 lost its Ray actor on .*; stopping the deployment$", out, re.M
        )
        assert died, out[-4000:]
        assert rc == 1, out[-3000:]
        assert re.search(r"^\[afd\] stopping: SIGTERM to ffn0, attn$", out, re.M)
        assert re.search(r"^\[afd\] ffn0: its Ray actor is gone .* its guard on", out, re.M)
        assert re.search(r"ray: 2 actor\(s\) and the placement group removed; nothing of", out)
        _assert_nothing_left(ray_cluster, launcher, model)
        print(f"2A1F on Ray: ready in {startup_s:.1f} s; after the FFN actor's kill: "
              f"{died[0]!r}, exit {rc} in {stop_s:.1f} s")  # fmt: skip
    finally:
        launcher.kill_all()


@pytest.mark.extended  # out of CI for its time budget (`nox -s tests-extended`)
def test_ray_attention_tp2_ffn_ep2_parity_then_sigterm_leaves_nothing(
    ray_cluster: RayCluster,
    ray_model: Path,
    native_references: Any,
    tmp_path: Path,
) -> None:
    from afd_references import singles

    from afd.tools.client import complete_each

    model = ray_model
    # MLA under TP gives other tokens than TP=1 natively (VLLM_CPU_FACTS.md): native TP=2.
    native = native_references.tokens(
        model, singles(PROMPTS), dtype="float32", max_tokens=32,
        llm_kwargs={"tensor_parallel_size": 2},
    )  # fmt: skip
    spec = tmp_path / "tp2-ep2.toml"
    spec.write_text(
        f'model = "{model}"\nnum_attention = 1\nnum_ffn = 2\nffn_expert_parallel = true\n'
        'attention_tensor_parallel_size = 2\ndtype = "float32"\n'
        f'log_dir = "{tmp_path / "logs"}"\nenforce_eager = true\n'
        "[afd]\nconnect_timeout_s = 300\ntransfer_timeout_s = 120\n"
        f'[ray]\nnamespace = "{NAMESPACE}"\nplacement_timeout_s = 60\n'
        # 2 attention workers + 2 FFN servers on the loopback cluster's 2 CPUs
        "[ray.attention]\nnum_cpus = 0.5\n[ray.ffn]\nnum_cpus = 0.5\n"
    )
    launcher = Launcher(spec, tmp_path, "--ray", ray_cluster.address, env=ray_cluster.env)
    try:
        ready = launcher.wait_for(r"running; Ctrl-C or SIGTERM", STARTUP_S)
        out = launcher.output
        assert ready, f"deployment did not come up in {STARTUP_S:.0f} s:\n{out[-8000:]}"
        url = re.findall(r"^\[afd\]\s+(http://[\d.]+:\d+)/v1", out, re.M)[0]
        assert re.search(r"^\[afd\] ray placement group .*attn=\{CPU: 1\}", out, re.M), out[-3000:]
        # both expert planes' rendezvous ports on the attention actor's node
        ports = re.search(r"^\[afd\] rendezvous: 127\.0\.0\.1:(\d+)-(\d+) ", out, re.M)
        assert ports and int(ports[2]) == int(ports[1]) + 1, out[-3000:]
        for f in range(2):
            assert re.search(
                rf"^\[ffn{f}\] .*AFD FFN rank {f} of 2 \(expert parallel\): routed_experts_held=",
                out, re.M,
            ), out[-3000:]  # fmt: skip
        got, _ = complete_each(url, PROMPTS)
        assert_same_tokens(got, native, PROMPTS)
        launcher.proc.send_signal(signal.SIGTERM)
        rc = launcher.proc.wait(timeout=60)
        launcher.join_output(5)
        assert rc == 0, launcher.output[-3000:]
        assert re.search(r"ray: 3 actor\(s\) and the placement group removed", launcher.output)
    finally:
        launcher.kill_all()
