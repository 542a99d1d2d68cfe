"""Unit tests of ``afd launch --ray`` without a Ray cluster: the ``[ray]`` table of the
spec, the placement plan (bundles, strategy, CPUs per node), the command line, the role
actor's process handling (run in this process) and the guard that stops a role whose
actor is gone. The end-to-end runs on a local Ray cluster are in tests/e2e/test_ray_launch.py.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from afd.launch import (
    DEFAULT_NETWORK_CONNECTOR,
    DeploymentError,
    DeploymentSpec,
    NodeInfo,
    RaySpec,
    SpecError,
    add_launch_arguments,
    plan_node_cpus,
    plan_ray,
    reserve_ports,
    spec_from_args,
    split_cpus,
)
from afd.launch.guard import guard
from afd.launch.ray import RoleActor, import_ray
from afd_core.procfs import group_members, process_start

# ---------------------------------------------------------------- the [ray] table


def test_ray_table_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "deploy.toml"
    path.write_text(
        'model = "/m"\nnum_attention = 2\n'
        '[ray]\naddress = "10.0.0.1:6379"\nplacement = "SPREAD"\nnamespace = "prod"\n'
        "[ray.attention]\nnum_cpus = 0.5\nnum_gpus = 1\n"
        "[ray.ffn]\nnum_cpus = 2\nresources = { NPU = 1 }\n"
    )
    spec = DeploymentSpec.from_toml(path)
    assert isinstance(spec.ray, RaySpec)
    assert (spec.ray.address, spec.ray.placement, spec.ray.namespace) == (
        "10.0.0.1:6379",
        "spread",
        "prod",
    )
    assert spec.ray.attention.bundle(2) == {"CPU": 1.0, "GPU": 2.0}
    assert spec.ray.ffn.bundle(1) == {"CPU": 2.0, "NPU": 1.0}
    assert spec.connector == "P2pNcclAFDConnector"  # GPUs asked of Ray


def test_no_ray_table_runs_locally() -> None:
    assert DeploymentSpec(model="/m").ray is None


@pytest.mark.parametrize(
    ("ray", "extra", "match"),
    [
        ({"adress": "auto"}, {}, r"ray: unknown key 'adress' \(did you mean 'address'\?\)"),
        ({"placement": "scatter"}, {}, r"ray.placement: expected one of strict_pack, pack"),
        ({"ffn": {"num_cpus": -1}}, {}, r"ray.ffn.num_cpus: expected a number >= 0"),
        ({"ffn": {"num_cpu": 1}}, {}, r"ray.ffn: unknown key 'num_cpu'"),
        ({"attention": {"resources": {"GPU": 1}}}, {}, r"use ray.attention.num_gpus instead"),
        ({"ffn": {"resources": {"NPU": "one"}}}, {}, r"ray.ffn.resources.NPU: expected a number"),
        ({"ffn": {"num_cpus": 0}}, {}, r"ray.ffn: asks Ray for nothing"),
        ({"address": ""}, {}, r"ray.address: expected"),
        ({"placement_timeout_s": 0}, {}, r"ray.placement_timeout_s: expected a number"),
        ({}, {"native": True}, r"native: the native baseline runs on this host"),
        ({}, {"host": "0.0.0.0"}, r"host: '0.0.0.0' with \[ray\]: every role binds its Ray node"),
        ({}, {"ffn": {"devices": "0"}}, r"ffn.devices with \[ray\]: .*ray.ffn.num_gpus"),
        (
            {"placement": "spread"},
            {"afd": {"connector": "P2pShmAFDConnector"}},
            r"ray.placement: .spread. with the shared-memory connector .* \"strict_pack\"",
        ),
    ],
)
def test_invalid_ray_tables_fail_with_clear_errors(ray: dict, extra: dict, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        DeploymentSpec(model="/m", ray=ray, **extra)


@pytest.mark.parametrize(
    ("ray", "afd", "connector", "placement"),
    [
        # The local default (shared memory) keeps every role on one node.
        ({}, {}, "P2pShmAFDConnector", "strict_pack"),
        ({"placement": "strict_pack"}, {}, "P2pShmAFDConnector", "strict_pack"),
        # Roles that may land on other hosts get a network connector.
        ({"placement": "spread"}, {}, DEFAULT_NETWORK_CONNECTOR, "spread"),
        ({"placement": "pack"}, {}, DEFAULT_NETWORK_CONNECTOR, "pack"),
        ({}, {"connector": "P2pGlooAFDConnector"}, "P2pGlooAFDConnector", "spread"),
        ({"ffn": {"num_gpus": 1}}, {}, "P2pNcclAFDConnector", "spread"),
    ],
)
def test_connector_and_placement_defaults_on_ray(
    ray: dict, afd: dict, connector: str, placement: str
) -> None:
    spec = DeploymentSpec(model="/m", ray=ray, afd=afd)
    assert (spec.connector, spec.ray_placement) == (connector, placement)
    # every process gets it, with the rendezvous host the launcher found
    afd = spec.afd_config("ffn", 0, port=1234, host="10.0.0.7")
    assert (afd.connector, afd.host, afd.port) == (connector, "10.0.0.7", 1234)


# ---------------------------------------------------------------- the placement plan


def test_plan_ray_one_bundle_per_role_process_in_start_order() -> None:
    spec = DeploymentSpec(
        model="/m",
        num_attention=2,
        num_ffn=2,
        ray={"attention": {"num_cpus": 0.5}, "ffn": {"num_cpus": 1, "resources": {"NPU": 1}}},
    )
    plan = plan_ray(spec)
    assert plan.strategy == "STRICT_PACK"
    assert [(b.name, b.resources) for b in plan.bundles] == [
        ("ffn0", {"CPU": 1.0, "NPU": 1.0}),
        ("ffn1", {"CPU": 1.0, "NPU": 1.0}),
        ("attn", {"CPU": 1.0}),  # the attention server holds both DP ranks
    ]
    assert plan.describe().startswith(
        "ray placement group STRICT_PACK (P2pShmAFDConnector needs one host): ffn0={CPU: 1, NPU: 1}"
    )


@pytest.mark.parametrize(
    ("ray", "afd", "strategy", "why"),
    [
        ({"placement": "strict_spread"}, {}, "STRICT_SPREAD", "from [ray] placement"),
        ({}, {"connector": "P2pGlooAFDConnector"}, "SPREAD", "reaches other hosts"),
    ],
)
def test_plan_ray_strategy(ray: dict, afd: dict, strategy: str, why: str) -> None:
    plan = plan_ray(DeploymentSpec(model="/m", ray=ray, afd=afd))
    assert plan.strategy == strategy
    assert why in plan.why


def test_plan_ray_needs_a_ray_table() -> None:
    with pytest.raises(ValueError, match="no \\[ray\\] table"):
        plan_ray(DeploymentSpec(model="/m"))


def _node(node_id: str, cpus: int, gpus: tuple[str, ...] = (), bind: str | None = None) -> NodeInfo:
    return NodeInfo(node_id, f"10.0.0.{len(node_id)}", "h", tuple(range(cpus)), gpus, bind)


def test_node_cpus_one_node_splits_like_the_local_launcher() -> None:
    spec = DeploymentSpec(model="/m", ray={})
    node = _node("a" * 16, 2)
    cpus, lines = plan_node_cpus(spec, {"attn": node, "ffn0": node})
    assert cpus == {"attn": "0", "ffn0": "1"}
    assert "attn=0, ffn0=1 (2 usable: 0-1)" in lines[0]
    # 2A1F on two CPUs: too few, left to vLLM with a warning
    spec2 = DeploymentSpec(model="/m", num_attention=2, ray={})
    cpus, lines = plan_node_cpus(spec2, {"attn": node, "ffn0": node})
    assert cpus == {}
    assert lines[0].startswith("WARNING: 2 usable CPU(s) (0-1)")


def test_node_cpus_per_node_and_overrides() -> None:
    spec = DeploymentSpec(model="/m", num_attention=2, num_ffn=2, ray={"placement": "spread"})
    a, b = _node("node-a", 4), _node("node-bb", 4)
    cpus, lines = plan_node_cpus(spec, {"attn": a, "ffn0": b, "ffn1": b})
    # the attention node: both DP ranks; the FFN node: its CPUs shared by its FFN ranks
    assert cpus == {"attn": "0-1|2-3", "ffn0": "0-1", "ffn1": "2-3"}
    assert len(lines) == 2
    # a node whose roles got GPUs, or whose environment binds already, is left alone
    gpu = _node("node-g", 8, gpus=("0",))
    bound = _node("node-bound", 8, bind="auto")
    cpus, lines = plan_node_cpus(spec, {"attn": gpu, "ffn0": bound, "ffn1": bound})
    assert cpus == {}
    assert any("GPUs given by Ray" in line for line in lines)
    assert any("VLLM_CPU_OMP_THREADS_BIND=auto" in line for line in lines)
    # the spec's own cpus win
    spec3 = DeploymentSpec(model="/m", ray={}, ffn={"cpus": "7"})
    cpus, _ = plan_node_cpus(spec3, {"attn": a, "ffn0": a})
    assert cpus == {"attn": "0-1", "ffn0": "7"}


def test_parallel_layouts_on_ray_ask_for_every_worker_and_split_its_cpus() -> None:
    """Attention TP2 x DP2 + FFN EP2: the attention server's bundle holds its four vLLM
    workers (one CPU list each on a CPU node), each FFN server its own."""
    spec = DeploymentSpec(
        model="/m",
        num_attention=2,
        attention_tensor_parallel_size=2,
        num_ffn=2,
        ffn_expert_parallel=True,
        ray={"attention": {"num_cpus": 1}, "ffn": {"num_cpus": 1}},
        afd={"connector": "P2pGlooAFDConnector"},
    )
    plan = plan_ray(spec)
    assert [(b.name, b.resources) for b in plan.bundles] == [
        ("ffn0", {"CPU": 1.0}),
        ("ffn1", {"CPU": 1.0}),
        ("attn", {"CPU": 4.0}),
    ]
    a, b = _node("node-a", 4), _node("node-bb", 2)
    cpus, _ = plan_node_cpus(spec, {"attn": a, "ffn0": b, "ffn1": b})
    assert cpus == {"attn": "0|1|2|3", "ffn0": "0", "ffn1": "1"}
    # TP2 on a node with fewer CPUs than workers: the workers share them (vLLM's automatic
    # binding refuses several TP workers on one NUMA node)
    small = DeploymentSpec(model="/m", attention_tensor_parallel_size=2, ray={})
    one = _node("node-c", 1)
    cpus, _ = plan_node_cpus(small, {"attn": one, "ffn0": _node("node-dd", 1)})
    assert cpus["attn"].count("|") == 1 and cpus["ffn0"] == "0"


def test_split_cpus_for_a_node_of_ffn_ranks_only() -> None:
    assert split_cpus([0, 1, 2, 3], 0, 2) == {"ffn0": "0-1", "ffn1": "2-3"}
    assert split_cpus([0], 0, 2) is None


def test_reserve_ports_names_the_field_of_a_busy_port() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(DeploymentError, match=rf"port {port} \(HTTP\) is in use .*http_port"):
            reserve_ports("127.0.0.1", [("HTTP", port, "http_port")])
        got = reserve_ports("127.0.0.1", [("a", 0, "x"), ("b", 0, "y")], avoid=[port])
    assert len(set(got)) == 2 and port not in got


# ---------------------------------------------------------------- command line


def _args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_launch_arguments(ap)
    return ap.parse_args(list(argv))


def test_cli_ray_flag_and_no_ray(tmp_path: Path) -> None:
    path = tmp_path / "deploy.toml"
    path.write_text('model = "/m"\n[ray]\nplacement = "pack"\n')
    spec = spec_from_args(_args(str(path), "--ray", "10.0.0.1:6379"))
    assert spec.ray is not None
    assert (spec.ray.address, spec.ray.placement) == ("10.0.0.1:6379", "pack")
    # the [ray] table alone is enough; --no-ray runs the same spec locally
    assert spec_from_args(_args(str(path))).ray is not None
    assert spec_from_args(_args(str(path), "--no-ray")).ray is None
    # --ray without an address, before or after the spec
    plain = tmp_path / "plain.toml"
    plain.write_text('model = "/m"\n')
    for argv in ((str(plain), "--ray"), ("--ray", str(plain))):
        spec = spec_from_args(_args(*argv))
        assert spec.ray is not None and spec.ray.address is None
    with pytest.raises(SystemExit):
        _args(str(plain), "--ray", "--no-ray")


def test_missing_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(DeploymentError, match=r"pip install 'afd\[ray\]'.*--no-ray"):
        import_ray()


# ---------------------------------------------------------------- the role actor


def test_role_actor_runs_streams_and_stops_its_process() -> None:
    actor = RoleActor("ffn0")
    script = (
        "import os, signal, sys, time\n"
        "print('hello', os.environ['AFD_X'], os.environ.get('OMP_NUM_THREADS'), "
        "os.environ['TMPDIR'] != '/nowhere', flush=True)\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))\n"
        "time.sleep(60)\n"
    )
    env = {"AFD_X": "x", "TMPDIR": "/nowhere"}
    os.environ["OMP_NUM_THREADS"] = "1"  # as Ray sets it in its workers: not inherited
    try:
        pgid = actor.start(["python-of-the-launcher", "-c", script], env, 5.0)
    finally:
        del os.environ["OMP_NUM_THREADS"]
    try:
        deadline = time.monotonic() + 30
        lines: list[str] = []
        cursor = 0
        while not lines and time.monotonic() < deadline:
            lines, cursor, rc = actor.read(cursor)
            time.sleep(0.05)
        assert lines == ["hello x None True\n"]
        assert rc is None
        assert actor.leftovers() == [pgid]
        actor.signal(signal.SIGTERM)
        while rc is None and time.monotonic() < deadline:
            more, cursor, rc = actor.read(cursor)
            assert more == []
            time.sleep(0.05)
        assert rc == 3
        assert actor.leftovers() == []
    finally:
        actor.signal(signal.SIGKILL)
        actor.cleanup()
    assert actor.tmp_root is not None and not Path(actor.tmp_root).exists()


def test_guard_stops_the_group_once_its_owner_is_gone() -> None:
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    role = subprocess.Popen(
        ["bash", "-c", "sleep 60 & sleep 60"], start_new_session=True, stdin=subprocess.DEVNULL
    )
    try:
        start = process_start(owner.pid)
        assert start
        done: list[bool] = []
        watcher = threading.Thread(
            target=lambda: done.append(guard(owner.pid, start, role.pid, 2.0, poll_s=0.05))
        )
        watcher.start()
        time.sleep(0.3)
        assert group_members(role.pid)  # the owner lives: the role is left alone
        owner.kill()
        owner.wait()
        watcher.join(10)
        role.wait(5)
        deadline = time.monotonic() + 5
        while group_members(role.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert done == [True]
        assert group_members(role.pid) == []
    finally:
        for p in (owner, role):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL) if p is role else p.kill()


def test_placement_follows_the_connectors_declared_same_host_only() -> None:
    """Not a table of names: a connector of any distribution that declares
    ``same_host_only`` is packed on one node, and refused with a placement that may
    split the roles; one that does not is spread."""
    from afd.launch.connectors import connector_capabilities, same_host_only
    from afd_core.connector import ConnectorCapabilities
    from afd_core.registry import register_connector, unregister_connector
    from afd_core.testing.loopback import LoopbackAFDConnector

    class OneHostOnly(LoopbackAFDConnector):
        name = "OneHostOnlyTestConnector"
        capabilities = ConnectorCapabilities(same_host_only=True)

    assert same_host_only("P2pShmAFDConnector")
    assert not same_host_only("P2pGlooAFDConnector")
    assert not same_host_only("NoSuchConnector")  # the roles name the installed ones
    register_connector(OneHostOnly.name, OneHostOnly)
    connector_capabilities.cache_clear()
    try:
        afd = {"connector": OneHostOnly.name}
        assert DeploymentSpec(model="/m", ray={}, afd=afd).ray_placement == "strict_pack"
        with pytest.raises(SpecError, match=r"'spread' with the shared-memory connector One"):
            DeploymentSpec(model="/m", ray={"placement": "spread"}, afd=afd)
    finally:
        unregister_connector(OneHostOnly.name)
        connector_capabilities.cache_clear()
