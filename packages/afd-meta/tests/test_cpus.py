"""Same-host defaults of ``afd launch``: the shared-memory connector and one share of the
host's CPUs per role process (``VLLM_CPU_OMP_THREADS_BIND``); the split rule, the spec /
flag / env overrides and the role environments the launcher builds (no vLLM process)."""

from __future__ import annotations

import argparse
import io
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from afd.launch import (
    DEFAULT_CONNECTOR,
    Deployment,
    DeploymentSpec,
    RoleProcess,
    SpecError,
    add_launch_arguments,
    assign_cpus,
    format_cpu_list,
    omp_bind_env,
    parse_cpu_list,
    spec_from_args,
    split_cpus,
    usable_cpus,
)
from afd.launch.cpus import SHARED_OMP_ENV

BIND = "VLLM_CPU_OMP_THREADS_BIND"


@pytest.fixture(autouse=True)
def _no_inherited_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    """An exported VLLM_CPU_OMP_THREADS_BIND turns the split off: keep it out."""
    monkeypatch.delenv(BIND, raising=False)


# ---------------------------------------------------------------- the split rule


@pytest.mark.parametrize(
    ("n", "num_attention", "num_ffn", "want"),
    [
        # 1A1F
        (1, 1, 1, None),
        (2, 1, 1, {"attn": "0", "ffn0": "1"}),
        (3, 1, 1, {"attn": "0-1", "ffn0": "2"}),
        (4, 1, 1, {"attn": "0-1", "ffn0": "2-3"}),
        (8, 1, 1, {"attn": "0-3", "ffn0": "4-7"}),
        # 2A1F: the attention server's two DP ranks get one block each ("|", vLLM's format)
        (1, 2, 1, None),
        (2, 2, 1, None),
        (3, 2, 1, {"attn": "0|1", "ffn0": "2"}),
        (4, 2, 1, {"attn": "0|1", "ffn0": "2-3"}),
        (8, 2, 1, {"attn": "0-1|2-3", "ffn0": "4-7"}),
        # 1A2F: every FFN rank gets at least one CPU, even below half for the attention
        (1, 1, 2, None),
        (2, 1, 2, None),
        (3, 1, 2, {"attn": "0", "ffn0": "1", "ffn1": "2"}),
        (4, 1, 2, {"attn": "0-1", "ffn0": "2", "ffn1": "3"}),
        (8, 1, 2, {"attn": "0-3", "ffn0": "4-5", "ffn1": "6-7"}),
        # the native baseline: every CPU
        (1, 1, 0, {"attn": "0"}),
        (2, 1, 0, {"attn": "0-1"}),
        (8, 1, 0, {"attn": "0-7"}),
    ],
)
def test_split(n: int, num_attention: int, num_ffn: int, want: dict[str, str] | None) -> None:
    assert split_cpus(list(range(n)), num_attention, num_ffn) == want


def test_split_uses_the_given_cpus_not_their_count() -> None:
    # An affinity mask of 4 CPUs with holes, unsorted.
    assert split_cpus([7, 2, 4, 3], 1, 1) == {"attn": "2-3", "ffn0": "4,7"}
    assert split_cpus([5, 9], 1, 1) == {"attn": "5", "ffn0": "9"}
    assert split_cpus([], 1, 0) is None


def test_every_process_gets_its_own_cpus() -> None:
    for n in range(1, 17):
        for a, f in ((1, 1), (2, 1), (1, 2), (3, 2), (4, 4)):
            split = split_cpus(list(range(n)), a, f)
            if n < a + f:
                assert split is None
                continue
            assert split is not None
            blocks = [parse_cpu_list(b) for v in split.values() for b in v.split("|")]
            assert len(blocks) == a + f and all(blocks)
            flat = [c for b in blocks for c in b]
            assert sorted(flat) == list(range(n))  # all used, none twice
            # attention: half, rounded up, unless the FFN ranks need more
            n_attn = len(parse_cpu_list(split["attn"].replace("|", ",")))
            assert n_attn == max(a, min((n + 1) // 2, n - f))


def test_cpu_list_format_is_vllms() -> None:
    assert format_cpu_list([0, 1, 2, 4, 6, 7]) == "0-2,4,6-7"
    assert format_cpu_list([3]) == "3"
    assert parse_cpu_list("0-2,4") == [0, 1, 2, 4]
    assert parse_cpu_list("5, 1") == [1, 5]
    for bad in ("", "a", "1-", "3-1", "0|1", "auto"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)
    # The parser vLLM runs on each |-separated entry accepts what we write.
    from vllm.utils.cpu_resource_utils import parse_id_list

    for value in ("0", "0-3", "1,3", "0-2,4,6-7"):
        assert parse_id_list(value) == parse_cpu_list(value)


def test_usable_cpus_is_the_affinity_mask() -> None:
    assert usable_cpus() == sorted(os.sched_getaffinity(0))


def test_explicit_cpus_win_and_the_others_keep_their_share() -> None:
    usable = list(range(4))
    assert assign_cpus(1, 1, usable) == {"attn": "0-1", "ffn0": "2-3"}
    assert assign_cpus(1, 1, usable, attention="3") == {"attn": "3", "ffn0": "2-3"}
    assert assign_cpus(1, 2, usable, ffn=["0", "1"]) == {"attn": "0-1", "ffn0": "0", "ffn1": "1"}
    # Too few CPUs (or none, e.g. a CUDA host): only the explicit values.
    assert assign_cpus(1, 1, [0]) == {}
    assert assign_cpus(1, 1, [0], ffn=["0"]) == {"ffn0": "0"}
    assert assign_cpus(1, 1, [], attention="auto") == {"attn": "auto"}


# ---------------------------------------------------------------- spec and flags


def test_spec_cpus_one_per_rank() -> None:
    spec = DeploymentSpec(
        model="/m", num_attention=2, num_ffn=2, attention={"cpus": "0|1"}, ffn={"cpus": [2, "3"]}
    )
    assert spec.attention.cpus == ["0", "1"] and spec.ffn.cpus == ["2", "3"]
    spec = DeploymentSpec(model="/m", num_attention=2, attention={"cpus": "auto"})
    assert spec.attention.cpus == ["auto", "auto"]
    assert DeploymentSpec(model="/m", ffn={"cpus": "0-3,5"}).ffn.cpus == ["0-3,5"]
    assert DeploymentSpec(model="/m").attention.cpus is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"num_attention": 2, "attention": {"cpus": "0"}},
            r"attention.cpus: 1 CPU list\(s\) 0 for 2 rank\(s\); give exactly one CPU list",
        ),
        ({"ffn": {"cpus": ["1", "2"]}}, r"ffn.cpus: 2 CPU list\(s\) 1\|2 for 1 rank"),
        ({"ffn": {"cpus": "one"}}, r"ffn.cpus: 'one' is not a CPU list"),
        ({"ffn": {"cpus": "3-1"}}, r"ffn.cpus: '3-1': the range 3-1 is empty"),
        ({"ffn": {"cpus": 1.5}}, r'ffn.cpus: expected "0-1"'),
        ({"ffn": {"cpus": [True]}}, r"ffn.cpus: expected CPU lists"),
        (
            {"num_attention": 2, "attention": {"cpus": "auto|1"}},
            r"attention.cpus: auto\|1: auto / nobind stand for the whole server",
        ),
        (
            {"ffn": {"cpus": "1", "env": {BIND: "1"}}},
            rf"ffn.cpus and ffn.env.{BIND} are both set",
        ),
        ({"ffn": {"cpu": "1"}}, r"unknown key 'cpu' \(did you mean 'cpus'\?\)"),
    ],
)
def test_invalid_cpus_fail_with_clear_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        DeploymentSpec(model="/m", **kwargs)


def test_toml_and_flags_set_the_cpus(tmp_path: Path) -> None:
    spec_file = tmp_path / "dep.toml"
    spec_file.write_text(
        'model = "/m"\nnum_ffn = 1\n[attention]\ncpus = "0-1"\n[ffn]\ncpus = ["2"]\n'
        'env = { A = "1" }\n'
    )
    assert DeploymentSpec.from_toml(spec_file).attention.cpus == ["0-1"]
    ap = argparse.ArgumentParser()
    add_launch_arguments(ap)
    spec = spec_from_args(ap.parse_args([str(spec_file)]))
    assert spec.attention.cpus == ["0-1"] and spec.ffn.cpus == ["2"]
    args = ap.parse_args([str(spec_file), "--attention-cpus", "3", "--ffn-cpus", "0-2"])
    spec = spec_from_args(args)  # flags win
    assert spec.attention.cpus == ["3"] and spec.ffn.cpus == ["0-2"] and spec.ffn.env == {"A": "1"}
    args = ap.parse_args(["--model", "/m", "--ffn", "2", "--attention", "2", "--ffn-cpus", "2|3"])
    assert spec_from_args(args).ffn.cpus == ["2", "3"]


# ---------------------------------------------------------------- the launcher's role envs


def _built(
    spec: DeploymentSpec,
    tmp_path: Path,
    cpus: list[int] | None,
    visible: list[str] | None = None,
) -> dict[str, RoleProcess]:
    """The role processes ``Deployment.start`` would start (commands and envs only)."""
    dep = Deployment(spec, console=io.StringIO(), visible_devices=visible or [], usable_cpus=cpus)
    dep.work_dir = dep.log_dir = tmp_path
    dep.http_ports, dep.connector_port = [18000], 18001
    dep._build_roles()
    return {r.name: r for r in dep.roles}


def _binds(roles: dict[str, RoleProcess]) -> dict[str, str | None]:
    return {name: r.env.get(BIND) for name, r in roles.items()}


@pytest.mark.parametrize(
    ("num_attention", "num_ffn", "n", "want"),
    [
        (1, 1, 2, {"attn": "0-1", "ffn0": "0-1"}),  # 1A1F, m = 1: the roles take turns
        (1, 1, 8, {"attn": "0-7", "ffn0": "0-7"}),
        (2, 1, 4, {"attn": "0|1", "ffn0": "2-3"}),
        (2, 2, 4, {"attn": "0|1", "ffn0": "2", "ffn1": "3"}),
        (2, 2, 8, {"attn": "0-1|2-3", "ffn0": "4-5", "ffn1": "6-7"}),
        (1, 1, 1, {"attn": None, "ffn0": None}),  # too few: vLLM's default
        (2, 1, 2, {"attn": None, "ffn0": None}),
    ],
)
def test_role_envs_carry_the_split(
    tmp_path: Path, num_attention: int, num_ffn: int, n: int, want: dict
) -> None:
    spec = DeploymentSpec(model="/m", num_attention=num_attention, num_ffn=num_ffn)
    assert _binds(_built(spec, tmp_path, list(range(n)))) == want


def test_native_gets_every_usable_cpu(tmp_path: Path) -> None:
    spec = DeploymentSpec(model="/m", native=True)
    assert _binds(_built(spec, tmp_path, [0, 1])) == {"native0": "0-1"}
    assert _binds(_built(spec, tmp_path, [0])) == {"native0": "0"}
    assert _binds(_built(spec, tmp_path, list(range(8)))) == {"native0": "0-7"}
    # its explicit CPUs are the attention role's (as for devices)
    spec = DeploymentSpec(model="/m", native=True, attention={"cpus": "auto"})
    assert _binds(_built(spec, tmp_path, [0, 1])) == {"native0": "auto"}


def test_overrides_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpus = [0, 1, 2, 3]
    # spec cpus: used as given; the other role keeps its share
    spec = DeploymentSpec(model="/m", attention={"cpus": "3"})
    assert _binds(_built(spec, tmp_path, cpus)) == {"attn": "3", "ffn0": "2-3"}
    # a role's env wins
    spec = DeploymentSpec(model="/m", ffn={"env": {BIND: "0"}})
    assert _binds(_built(spec, tmp_path, cpus)) == {"attn": "0-1", "ffn0": "0"}
    # the top-level env: no automatic split, every role inherits it
    spec = DeploymentSpec(model="/m", env={BIND: "auto"})
    assert _binds(_built(spec, tmp_path, cpus)) == {"attn": "auto", "ffn0": "auto"}
    # ... but an explicit role value still wins over it
    spec = DeploymentSpec(model="/m", env={BIND: "auto"}, ffn={"cpus": "1"})
    assert _binds(_built(spec, tmp_path, cpus)) == {"attn": "auto", "ffn0": "1"}
    # the launcher's own environment counts as the top-level env
    monkeypatch.setenv(BIND, "nobind")
    spec = DeploymentSpec(model="/m")
    assert _binds(_built(spec, tmp_path, cpus)) == {"attn": "nobind", "ffn0": "nobind"}


def test_cuda_host_leaves_the_binding_alone(tmp_path: Path) -> None:
    spec = DeploymentSpec(model="/m")
    assert _binds(_built(spec, tmp_path, [0, 1, 2, 3], visible=["0", "1"])) == {
        "attn": None,
        "ffn0": None,
    }
    spec = DeploymentSpec(model="/m", ffn={"cpus": "2"})  # explicit values still apply
    roles = _built(spec, tmp_path, [0, 1, 2, 3], visible=["0", "1"])
    assert _binds(roles) == {"attn": None, "ffn0": "2"}
    assert roles["ffn0"].env["CUDA_VISIBLE_DEVICES"] == "1"  # devices untouched


def test_omp_settings_are_vllms() -> None:
    assert omp_bind_env("1") == {
        "OMP_NUM_THREADS": "1",
        "OMP_PLACES": "{1}",
        "OMP_PROC_BIND": "true",
    }
    assert omp_bind_env("0-2,5")["OMP_PLACES"] == "{0,1,2,5}"
    assert omp_bind_env("2-3", "/x/libgomp.so.1") == {
        "OMP_NUM_THREADS": "2",
        "GOMP_CPU_AFFINITY": "2 3",
    }
    iomp = omp_bind_env("2-3", "/x/libiomp5.so")
    assert iomp["KMP_AFFINITY"] == "granularity=fine,explicit,proclist=[2,3]"


def test_the_in_process_ffn_worker_gets_the_omp_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM applies VLLM_CPU_OMP_THREADS_BIND only to the workers its multiprocess executor
    # starts; the FFN server's worker runs in the FFN process itself.
    for var in ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "LD_PRELOAD"):
        monkeypatch.delenv(var, raising=False)
    split = DeploymentSpec(model="/m", afd={"num_micro_batches": 2})  # roles overlap
    roles = _built(split, tmp_path, list(range(4)))
    ffn = roles["ffn0"].env
    assert (ffn[BIND], ffn["OMP_NUM_THREADS"], ffn["OMP_PLACES"]) == ("2-3", "2", "{2,3}")
    assert ffn["OMP_PROC_BIND"] == "true"
    # the attention server's worker is bound by vLLM itself; its API server and engine
    # core processes are left alone
    assert "OMP_PLACES" not in roles["attn"].env and "OMP_NUM_THREADS" not in roles["attn"].env
    # a role env value is translated too; OpenMP settings given in the spec win
    spec = DeploymentSpec(model="/m", ffn={"env": {BIND: "1", "OMP_NUM_THREADS": "4"}})
    ffn = _built(spec, tmp_path, list(range(4)))["ffn0"].env
    assert (ffn["OMP_PLACES"], ffn["OMP_NUM_THREADS"]) == ("{1}", "4")
    # keywords and too few CPUs: nothing
    for spec, cpus in ((DeploymentSpec(model="/m", ffn={"cpus": "auto"}), [0, 1]),
                       (DeploymentSpec(model="/m"), [0])):  # fmt: skip
        ffn = _built(spec, tmp_path, cpus)["ffn0"].env
        assert "OMP_PLACES" not in ffn and "OMP_NUM_THREADS" not in ffn


def test_roles_that_take_turns_share_every_cpu_and_stop_spinning_soon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1A1F with one micro-batch: both roles on every usable CPU, OpenMP threads that
    sleep soon after a parallel region; roles that compute at the same time keep their
    own CPUs and vLLM's OpenMP defaults; the user's settings win."""
    for var in SHARED_OMP_ENV:
        monkeypatch.delenv(var, raising=False)
    cpus = list(range(4))
    roles = _built(DeploymentSpec(model="/m"), tmp_path, cpus)
    for role in roles.values():
        assert role.env[BIND] == "0-3"
        assert {k: role.env.get(k) for k in SHARED_OMP_ENV} == SHARED_OMP_ENV
    assert roles["ffn0"].env["OMP_NUM_THREADS"] == "4"
    for spec in (
        DeploymentSpec(model="/m", afd={"num_micro_batches": 2}),
        DeploymentSpec(model="/m", num_attention=2),
        DeploymentSpec(model="/m", attention={"cpus": "0-1"}),  # given: split the rest
    ):
        for role in _built(spec, tmp_path, cpus).values():
            assert not any(k in role.env for k in SHARED_OMP_ENV), (spec, role.name)
    # explicit overlapping CPUs are shared too, so they get the OpenMP settings
    spec = DeploymentSpec(model="/m", attention={"cpus": "0-1"}, ffn={"cpus": "1-2"})
    assert all(r.env["GOMP_SPINCOUNT"] == "10000" for r in _built(spec, tmp_path, cpus).values())
    # the spec's and the launcher's environment win
    spec = DeploymentSpec(model="/m", ffn={"env": {"GOMP_SPINCOUNT": "7"}})
    assert _built(spec, tmp_path, cpus)["ffn0"].env["GOMP_SPINCOUNT"] == "7"
    monkeypatch.setenv("KMP_BLOCKTIME", "9")
    assert _built(DeploymentSpec(model="/m"), tmp_path, cpus)["attn"].env["KMP_BLOCKTIME"] == "9"


# ---------------------------------------------------------------- connector


def test_default_connector_is_shared_memory_unless_set(tmp_path: Path) -> None:
    import json

    assert DEFAULT_CONNECTOR == "P2pShmAFDConnector"
    spec = DeploymentSpec(model="/m")
    assert spec.connector == "P2pShmAFDConnector"
    assert spec.connector_auto and spec.to_dict() == {"model": "/m"}  # what the user wrote
    for role in _built(spec, tmp_path, [0, 1]).values():
        config = json.loads(role.cmd[role.cmd.index("--additional-config") + 1])
        assert config["afd"]["connector"] == "P2pShmAFDConnector"
    spec = DeploymentSpec(model="/m", afd={"connector": "P2pGlooAFDConnector"})
    assert spec.connector == "P2pGlooAFDConnector"
    # Where CUDA devices are visible the roles' tensors are on the GPUs: NCCL.
    gpu_host = DeploymentSpec(model="/m", env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert gpu_host.connector == "P2pNcclAFDConnector"
    assert spec.afd_config("ffn", 0, port=1).connector == "P2pGlooAFDConnector"


# ---------------------------------------------------------------- printed lines


@pytest.mark.parametrize(
    ("kwargs", "cpus", "visible", "lines"),
    [
        (
            {},
            [0, 1],
            [],
            [
                "connector: P2pShmAFDConnector (same-host default)",
                f"cpus ({BIND} per role): attn=0-1, ffn0=0-1 (2 usable: 0-1)",
                "cpus: the roles take turns (1 attention rank, 1 FFN rank, one micro-batch), "
                "so both use every usable CPU; OpenMP threads sleep soon after work "
                "(GOMP_SPINCOUNT=10000, KMP_BLOCKTIME=1). Set [attention] / [ffn] cpus to "
                "split them.",
            ],
        ),
        (
            {"afd": {"num_afd_stages": 2}},
            [0, 1],
            [],
            [f"cpus ({BIND} per role): attn=0, ffn0=1 (2 usable: 0-1)"],
        ),
        (
            {"afd": {"connector": "P2pGlooAFDConnector"}, "ffn": {"cpus": "0"}},
            [0, 1],
            [],
            [
                "connector: P2pGlooAFDConnector (from [afd] connector)",
                f"cpus ({BIND} per role): attn=0, ffn0=0 (2 usable: 0-1)",
                "WARNING: attn and ffn0 share CPU 0",
            ],
        ),
        (
            {},
            [0],
            [],
            [
                f"WARNING: 1 usable CPU(s) (0) for 2 role process(es): {BIND} of attn, ffn0 "
                "left to vLLM (auto: every role binds to the same first core)"
            ],
        ),
        ({}, [0, 1], ["0", "1"], [f"cpus: CUDA host; {BIND} of attn, ffn0 left as is"]),
        (
            {"env": {BIND: "auto"}},
            [0, 1],
            [],
            [f"cpus: {BIND}=auto from the spec's env; {BIND} of attn, ffn0 left as is"],
        ),
        (
            {"ffn": {"cpus": "5"}},
            [0, 1],
            [],
            ["WARNING: ffn0: CPU 5 not usable by this process (usable: 0-1)"],
        ),
    ],
)
def test_start_prints_connector_and_cpus(
    tmp_path: Path,
    kwargs: dict,
    cpus: list[int],
    visible: list[str],
    lines: list[str],
    healthy_role: Callable[..., RoleProcess],
) -> None:
    spec = DeploymentSpec(model="/m", log_dir=str(tmp_path), startup_timeout_s=30, **kwargs)
    dep = Deployment(
        spec, console=io.StringIO(), echo=False, visible_devices=visible, usable_cpus=cpus
    )
    dep._build_roles = lambda: dep.roles.append(healthy_role())  # type: ignore[method-assign]
    with dep:
        pass
    out = dep.console.getvalue()  # type: ignore[attr-defined]
    for line in lines:
        assert f"[afd] {line}\n" in out


# ---------------------------------------------------------------- attention tensor parallelism


@pytest.mark.parametrize(
    ("num_attention", "tp", "num_ffn", "n", "want"),
    [
        # one CPU list per TP worker, in vLLM's [DP, TP] order
        (1, 2, 1, 4, {"attn": "0|1", "ffn0": "2-3"}),
        (2, 2, 1, 8, {"attn": "0|1|2|3", "ffn0": "4-7"}),
        (1, 2, 1, 8, {"attn": "0-1|2-3", "ffn0": "4-7"}),
        # fewer CPUs than processes: shared round robin (vLLM's automatic binding refuses
        # two TP workers on one NUMA node, so leaving it to vLLM would not start)
        (1, 2, 1, 2, {"attn": "0|1", "ffn0": "1"}),
    ],
)
def test_tensor_parallel_attention_gets_one_cpu_list_per_worker(
    tmp_path: Path, num_attention: int, tp: int, num_ffn: int, n: int, want: dict
) -> None:
    spec = DeploymentSpec(
        model="/m",
        num_attention=num_attention,
        num_ffn=num_ffn,
        attention_tensor_parallel_size=tp,
    )
    roles = _built(spec, tmp_path, list(range(n)))
    assert _binds(roles) == want
    attn = roles["attn"].cmd
    assert attn[attn.index("--tensor-parallel-size") + 1] == str(tp)
    for name, role in roles.items():
        if name.startswith("ffn"):
            assert "--tensor-parallel-size" not in role.cmd
            config = json.loads(role.cmd[role.cmd.index("--additional-config") + 1])
            assert config["afd"]["attention_tensor_parallel_size"] == tp


def test_tensor_parallel_spec_errors() -> None:
    with pytest.raises(SpecError, match="attention_tensor_parallel_size: expected an int >= 1"):
        DeploymentSpec(model="/m", attention_tensor_parallel_size=0)
    with pytest.raises(SpecError, match="--tensor-parallel-size is set by the launcher; use "
                       "the spec field attention_tensor_parallel_size"):  # fmt: skip
        DeploymentSpec(model="/m", attention={"vllm_args": ["--tensor-parallel-size", "2"]})
    with pytest.raises(SpecError, match=r"attention.cpus: 1 CPU list\(s\) 0 for 2 rank"):
        DeploymentSpec(model="/m", attention_tensor_parallel_size=2, attention={"cpus": "0"})


def test_expert_parallel_ffn_servers_each_get_their_rank_and_plane_ports(tmp_path: Path) -> None:
    spec = DeploymentSpec(model="/m", num_attention=1, num_ffn=2, ffn_expert_parallel=True)
    roles = _built(spec, tmp_path, list(range(4)))
    for name, rank in (("ffn0", 0), ("ffn1", 1), ("attn", None)):
        cmd = roles[name].cmd
        afd = json.loads(cmd[cmd.index("--additional-config") + 1])["afd"]
        assert afd["ffn_expert_parallel"] is True
        assert afd["num_ffn_ranks"] == 2 and afd.get("rank") == rank
    with pytest.raises(SpecError, match="or ffn_expert_parallel = true"):
        DeploymentSpec(model="/m", num_attention=1, num_ffn=2)


def test_expert_parallel_reserves_one_rendezvous_port_per_ffn_server() -> None:
    from afd.launch.ports import allocate_ports
    from afd_core.ports import port_bindable

    spec = DeploymentSpec(model="/m", num_ffn=3, ffn_expert_parallel=True)
    http, conn = allocate_ports(spec)
    assert all(port_bindable(spec.host, p) for p in range(conn, conn + 3))
    assert http[0] not in range(conn, conn + 3)
