"""Unit tests of the deployment launcher: spec parsing/validation, ports, logs, TOML."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from afd.launch import (
    CPU_BIND,
    Deployment,
    DeploymentError,
    DeploymentSpec,
    RoleProcess,
    SpecError,
    add_launch_arguments,
    allocate_health_ports,
    allocate_ports,
    bind_affinity,
    prefix_lines,
    role_env,
    spec_from_args,
)
from afd.tools.bench import format_table, percentile
from afd.tools.demo import compare_tokens

# ---------------------------------------------------------------- spec validation


def test_defaults_are_tiny_cpu_friendly() -> None:
    spec = DeploymentSpec(model="/m")
    assert (spec.num_attention, spec.num_ffn) == (1, 1)
    assert spec.kv_cache_memory_bytes == 64 * 1024 * 1024
    assert spec.gpu_memory_utilization == 0.1
    args = spec.engine_args()
    # vLLM's default compile mode, as `vllm serve` (issue 29); eager on request.
    assert "--enforce-eager" not in args and not spec.enforce_eager
    assert "--enforce-eager" in spec.replace(enforce_eager=True).engine_args()
    assert args[args.index("--dtype") + 1] == "bfloat16"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_attention": 0}, r"num_attention: expected an int >= 1, got 0"),
        ({"num_ffn": True}, r"num_ffn: expected an int >= 1"),
        ({"num_attention": 1, "num_ffn": 2}, r"num_ffn: 2 FFN servers for 1 attention"),
        ({"dtype": "fp8"}, r"dtype: expected one of auto, bfloat16"),
        ({"http_port": 70000}, r"http_port: expected an int in 0..65535"),
        ({"connector_port": -1}, r"connector_port: expected an int in 0..65535"),
        (
            {"http_port": 9000, "num_attention": 2, "connector_port": 9000},
            r"connector_port: 9000 collides with the attention HTTP port",
        ),
        ({"gpu_memory_utilization": 0}, r"gpu_memory_utilization: expected a number in"),
        ({"kv_cache_memory_bytes": "64MiB"}, r"kv_cache_memory_bytes: expected an int"),
        ({"vllm_args": "--max-num-seqs 8"}, r"vllm_args: expected a list of strings"),
        ({"vllm_args": ["--port", "8000"]}, r"--port is set by the launcher; use .*http_port"),
        ({"vllm_args": ["--additional-config={}"]}, r"--additional-config is set by the"),
        ({"env": {"A": True}}, r"env.A: expected a string"),
        ({"afd": {"port": 1}}, r"afd.port: set by the launcher; use the spec field connector_port"),
        ({"afd": {"rank": 1}}, r"afd.rank: set by the launcher"),
        ({"afd": {"afd_port": 1}}, r"afd.afd_port: set by the launcher; use .*connector_port"),
        ({"afd": {"routing_payload": "bogus"}}, r"afd.routing_payload: expected one of"),
        ({"afd": {"transfer_dtype": "fp4"}}, r"afd.transfer_dtype: expected one of 'model'"),
        ({"afd": {"conect_timeout_s": 1}}, r"conect_timeout_s"),
        ({"native": True, "num_attention": 2, "num_ffn": 1}, r"native: a native baseline"),
        ({"ffn": {"modle": "x"}}, r"ffn: unknown key 'modle' \(did you mean 'model'\?\)"),
        ({"startup_timeout_s": 0}, r"startup_timeout_s: expected a number of seconds > 0"),
    ],
)
def test_invalid_specs_fail_with_clear_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        DeploymentSpec(model="/m", **kwargs)


_NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'


def test_ngram_and_single_rank_mtp_in_a_spec_pass_to_the_roles() -> None:
    spec = DeploymentSpec(model="/m", num_attention=2, vllm_args=["--speculative-config", _NGRAM])
    assert spec.engine_args()[-2:] == ["--speculative-config", _NGRAM]
    mtp = ["--speculative-config", '{"method": "deepseek_mtp", "num_speculative_tokens": 1}']
    assert DeploymentSpec(model="/m", vllm_args=mtp).engine_args()[-2:] == mtp


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"num_attention": 2, "vllm_args": ["-sc", '{"method": "deepseek_mtp"}']},
            "vllm_args: speculative decoding method 'mtp' with 2 attention ranks is not",
        ),
        (
            {"vllm_args": ["--speculative-config", '{"model": "some/draft-model"}']},
            "vllm_args: speculative decoding method 'draft_model' is not supported by afd",
        ),
        (
            {"attention": {"vllm_args": ["--spec-method", "eagle3", "--spec-model", "e"]}},
            "attention.vllm_args: speculative decoding method 'eagle3' is not supported",
        ),
        (
            {"vllm_args": ["-sc", _NGRAM], "afd": {"num_micro_batches": 2}},
            "vllm_args: afd.num_micro_batches=2 cannot be combined with speculative decoding",
        ),
        (
            {"vllm_args": ["--speculative-config", "ngram"]},
            "vllm_args: --speculative-config: expected a JSON object, got 'ngram'",
        ),
    ],
)
def test_wrong_speculation_is_refused_before_anything_starts_in_one_line(
    kwargs: dict, message: str
) -> None:
    with pytest.raises(SpecError) as refused:
        DeploymentSpec(model="/m", **kwargs)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_afd_launch_refuses_micro_batched_speculation_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`afd launch SPEC` exits 2 before starting anything, with one line naming the fix."""
    from afd.cli import main

    spec = tmp_path / "spec.toml"
    spec.write_text(
        f'model = "/m"\nvllm_args = ["--speculative-config", {json.dumps(_NGRAM)}]\n'
        "[afd]\nnum_micro_batches = 2\n"
    )
    assert main(["launch", str(spec)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert "afd.num_micro_batches=2 cannot be combined with speculative decoding" in err[0]
    assert "set afd.num_micro_batches=1" in err[0]


def test_a_native_baseline_takes_any_speculation() -> None:
    """The native baseline is plain vLLM: its speculative config is vLLM's business."""
    mtp = ["--speculative-config", '{"method": "deepseek_mtp", "num_speculative_tokens": 1}']
    assert DeploymentSpec(model="/m", native=True, vllm_args=mtp).engine_args()[-2:] == mtp


def test_upstream_aliases_in_afd_are_resolved_once() -> None:
    spec = DeploymentSpec(
        model="/m", afd={"afd_connector": "P2pGlooAFDConnector", "num_afd_stages": 2}
    )
    assert (spec.afd.connector, spec.afd.num_micro_batches) == ("P2pGlooAFDConnector", 2)
    assert spec.connector == "P2pGlooAFDConnector" and not spec.connector_auto
    assert spec.to_dict()["afd"] == {"connector": "P2pGlooAFDConnector", "num_micro_batches": 2}
    afd = spec.afd_config("attention", 0, port=1)
    assert afd.connector == "P2pGlooAFDConnector" and "afd_connector" not in afd.to_section()
    with pytest.raises(SpecError, match=r"afd.num_micro_batches: given twice, as 'num_afd"):
        DeploymentSpec(model="/m", afd={"num_afd_stages": 2, "num_micro_batches": 2})


def test_model_is_required_and_unknown_keys_get_a_hint() -> None:
    with pytest.raises(SpecError, match=r"model: missing"):
        DeploymentSpec.from_dict({"num_attention": 1})
    with pytest.raises(SpecError, match=r"unknown key 'num_atention' \(did you mean"):
        DeploymentSpec.from_dict({"model": "/m", "num_atention": 2})


def test_afd_section_per_process() -> None:
    spec = DeploymentSpec(
        model="/m",
        num_attention=2,
        compute_gate_on_attention=True,
        afd={"routing_payload": "router_logits", "connect_timeout_s": 30},
    )
    afd = spec.afd_config("attention", 1, port=1234)
    got = {k: v for k, v in afd.to_dict().items() if k in _PER_PROCESS_CHECKED}
    assert got == {
        "routing_payload": "router_logits", "connect_timeout_s": 30.0, "role": "attention",
        "rank": 1, "host": "127.0.0.1", "port": 1234, "num_attention_ranks": 2,
        "num_ffn_ranks": 1, "compute_gate_on_attention": True,
        "connector": "P2pShmAFDConnector",  # the same-host default
    }  # fmt: skip
    from afd_core.config import AFDConfig, additional_config_json

    # what the role's command carries parses back to the same settings
    assert AFDConfig.from_additional_config(json.loads(additional_config_json(afd))) == afd
    assert spec.afd_config("ffn", 0, port=1234).rank == 0


def test_transfer_dtypes_of_a_spec_reach_both_roles() -> None:
    spec = DeploymentSpec(
        model="/m", afd={"transfer_dtype": "mxfp8", "transfer_dtype_return": "fp8"}
    )
    for role in ("attention", "ffn"):
        afd = spec.afd_config(role, 0, port=1234)
        assert (afd.transfer_dtype, afd.transfer_dtype_return) == ("mxfp8", "fp8")


_PER_PROCESS_CHECKED = (
    "routing_payload", "connect_timeout_s", "role", "rank", "host", "port",
    "num_attention_ranks", "num_ffn_ranks", "compute_gate_on_attention", "connector",
)  # fmt: skip


def test_the_spec_holds_one_typed_afd_config() -> None:
    from afd_core.config import AFDConfig

    spec = DeploymentSpec(
        model="/m", num_attention=2, num_ffn=2, ffn_expert_parallel=True,
        afd={"num_afd_stages": 2, "transfer_timeout_s": 9},
    )  # fmt: skip
    assert isinstance(spec.afd, AFDConfig)
    assert (spec.afd.num_attention_ranks, spec.afd.num_ffn_ranks) == (2, 2)
    assert (spec.num_attention, spec.num_ffn, spec.ffn_expert_parallel) == (2, 2, True)
    assert (spec.afd.num_micro_batches, spec.afd.transfer_timeout_s) == (2, 9.0)
    # a copy keeps every setting it does not change, and checks the result again
    wider = spec.replace(num_attention=4)
    assert (wider.afd.num_attention_ranks, wider.afd.num_micro_batches) == (4, 2)
    with pytest.raises(SpecError, match=r"^num_attention: expected an int >= 1, got 0"):
        spec.replace(num_attention=0)
    # an AFDConfig given as is (its role is the launcher's; the connector is explicit)
    given = AFDConfig(role="ffn", connector="P2pGlooAFDConnector", num_micro_batches=3)
    typed = DeploymentSpec(model="/m", afd=given, num_attention=2)
    assert (typed.connector, typed.connector_auto) == ("P2pGlooAFDConnector", False)
    assert (typed.afd.num_micro_batches, typed.num_attention) == (3, 2)
    with pytest.raises(SpecError, match=r"^afd.port: set by the launcher; .*connector_port$"):
        DeploymentSpec(model="/m", afd=AFDConfig(role="ffn", port=4000))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ffn_expert_parallel": 1}, r"^ffn_expert_parallel: expected a bool"),
        ({"attention_tensor_parallel_size": "2"}, r"^attention_tensor_parallel_size: expected"),
        ({"compute_gate_on_attention": "yes"}, r"^compute_gate_on_attention: expected a bool"),
        ({"afd": {"num_ffn_ranks": 2}}, r"^afd.num_ffn_ranks: set by the launcher; .* num_ffn$"),
        ({"afd": {"num_afd_stages": 0}}, r"^afd.num_micro_batches: expected an int >= 1"),
    ],
)
def test_bad_afd_settings_are_one_line_naming_the_spec_key(kwargs: dict, match: str) -> None:
    with pytest.raises(SpecError, match=match) as info:
        DeploymentSpec(model="/m", **kwargs)
    assert "\n" not in str(info.value)


def test_a_copy_chooses_the_default_connector_again() -> None:
    spec = DeploymentSpec(model="/m")  # CPU host, no connector named: shared memory
    assert (spec.connector, spec.connector_auto) == ("P2pShmAFDConnector", True)
    on_ray = spec.replace(ray={"placement": "spread"})
    assert on_ray.connector == "P2pGlooAFDConnector"  # roles may land on other hosts
    named = DeploymentSpec(model="/m", afd={"connector": "P2pGlooAFDConnector"})
    assert named.replace(ray={"placement": "pack"}).connector == "P2pGlooAFDConnector"


def test_a_spec_writes_the_file_that_builds_it_again(tmp_path: Path) -> None:
    spec = DeploymentSpec(
        model=str(tmp_path), num_attention=2, compute_gate_on_attention=True,
        dtype="float32", vllm_args=["--max-num-seqs", "8"], http_port=8000,
        afd={"num_afd_stages": 2, "routing_payload": "router_logits"},
        env={"A": "1"}, attention={"cpus": ["0", "1"]}, ffn={"env": {"B": "x y"}},
    )  # fmt: skip
    text = spec.to_toml()
    assert "num_afd_stages" not in text and "connector" not in text  # canonical; auto
    (tmp_path / "dep.toml").write_text(text)
    assert DeploymentSpec.from_toml(tmp_path / "dep.toml") == spec
    assert spec.to_dict()["afd"] == {"num_micro_batches": 2, "routing_payload": "router_logits"}
    on_ray = DeploymentSpec(
        model="/m", ray={"placement": "spread", "attention": {"num_cpus": 2}},
        afd={"connector": "P2pGlooAFDConnector"},
    )  # fmt: skip
    (tmp_path / "ray.toml").write_text(on_ray.to_toml())
    assert DeploymentSpec.from_toml(tmp_path / "ray.toml") == on_ray
    assert DeploymentSpec(model="/m").to_toml() == 'model = "/m"\n'


# ---------------------------------------------------------------- TOML loading


def test_toml_spec_with_relative_paths(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    spec_file = tmp_path / "dep.toml"
    spec_file.write_text(
        """
model = "ckpt"
num_attention = 2
num_ffn = 1
dtype = "float32"
log_dir = "logs"
vllm_args = ["--max-num-seqs", 8]
[afd]
connect_timeout_s = 120
[env]
FOO = "bar"
[attention]
vllm_args = ["--max-num-batched-tokens", "512"]
[ffn]
model = "ckpt"
env = { BAZ = 1 }
"""
    )
    spec = DeploymentSpec.from_toml(spec_file)
    assert spec.model == str(tmp_path / "ckpt")
    assert spec.log_dir == str(tmp_path / "logs")
    assert (spec.num_attention, spec.num_ffn, spec.dtype) == (2, 1, "float32")
    assert spec.vllm_args == ["--max-num-seqs", "8"]
    assert spec.afd.connect_timeout_s == 120
    assert spec.to_dict()["afd"] == {"connect_timeout_s": 120.0}  # what the file says
    assert spec.attention.vllm_args == ["--max-num-batched-tokens", "512"]
    assert spec.ffn.model == str(tmp_path / "ckpt")
    assert spec.ffn.env == {"BAZ": "1"}
    env = role_env(spec, "ffn", tmp_path)
    assert env["FOO"] == "bar" and env["BAZ"] == "1" and env["TMPDIR"] == str(tmp_path)
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


def test_toml_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("model = \n")
    with pytest.raises(SpecError, match=r"bad.toml: not valid TOML"):
        DeploymentSpec.from_toml(bad)
    bad.write_text('model = "/m"\nnum_ffn = 0\n')
    with pytest.raises(SpecError, match=r"bad.toml: num_ffn: expected an int >= 1"):
        DeploymentSpec.from_toml(bad)
    with pytest.raises(SpecError, match=r"no such spec file"):
        DeploymentSpec.from_toml(tmp_path / "missing.toml")


def test_spec_file_errors_are_the_same_from_the_cli(tmp_path: Path) -> None:
    # One loader (afd.launch.spec.load_toml) for DeploymentSpec.from_toml and afd launch.
    bad = tmp_path / "bad.toml"
    bad.write_text("model = \n")
    with pytest.raises(SpecError, match=r"bad.toml: not valid TOML"):
        spec_from_args(_launch_args([str(bad)]))
    with pytest.raises(SpecError, match=r"missing.toml: no such spec file"):
        spec_from_args(_launch_args([str(tmp_path / "missing.toml")]))
    bad.write_text('model = "/m"\nnum_ffn = 0\n')
    with pytest.raises(SpecError, match=rf"^{re.escape(str(bad))}: num_ffn: expected"):
        spec_from_args(_launch_args([str(bad)]))


def test_hub_names_are_not_resolved_as_paths(tmp_path: Path) -> None:
    spec = DeploymentSpec.from_dict({"model": "org/model"}, base_dir=tmp_path)
    assert spec.model == "org/model"


def _launch_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_launch_arguments(ap)
    return ap.parse_args(argv)


def test_flags_override_the_spec_file(tmp_path: Path) -> None:
    spec_file = tmp_path / "dep.toml"
    spec_file.write_text('model = "/m"\nnum_attention = 1\nvllm_args = ["--seed", "1"]\n')
    args = _launch_args(
        [str(spec_file), "--attention", "2", "--gate-on-attention",
         "--vllm-args=--max-num-seqs 8"]
    )  # fmt: skip
    spec = spec_from_args(args)
    assert spec.num_attention == 2 and spec.compute_gate_on_attention
    assert spec.vllm_args == ["--seed", "1", "--max-num-seqs", "8"]
    with pytest.raises(SpecError, match="model"):
        spec_from_args(_launch_args(["--attention", "2"]))


def test_launch_cli_reports_invalid_spec(capsys: pytest.CaptureFixture[str]) -> None:
    from afd.cli import main

    assert main(["launch", "--model", "/m", "--attention", "1", "--ffn", "2"]) == 2
    assert "num_ffn: 2 FFN servers for 1 attention" in capsys.readouterr().err


# ---------------------------------------------------------------- ports


def test_free_ports_are_distinct() -> None:
    spec = DeploymentSpec(model="/m", num_attention=4, num_ffn=2)
    for _ in range(20):
        http, conn = allocate_ports(spec)
        # One attention server (its DP ranks are the 4 attention ranks) + the connector.
        assert len(http) == 1 and len(set([*http, conn])) == 2
        assert all(1024 <= p <= 65535 for p in [*http, conn])


def test_picked_ports_are_reserved_host_wide_for_another_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every port a launcher picks, the expert planes' rendezvous ports included, is
    reserved (afd_core.ports) until its role can bind it: a second launcher started beside
    the first cannot pick it (CI, 2026-12-06: two deployments got one connector port)."""
    from afd_core.ports import reservation_dir

    monkeypatch.setenv("AFD_PORT_DIR", str(tmp_path / "ports"))
    spec = DeploymentSpec(model="/m", num_ffn=3, ffn_expert_parallel=True)
    http, conn = allocate_ports(spec)
    reserved = {int(p.name) for p in reservation_dir().iterdir()}
    assert {*http, conn, conn + 1, conn + 2} <= reserved
    for _ in range(20):
        http2, conn2 = allocate_ports(spec)
        assert not {*http2, *range(conn2, conn2 + 3)} & {*http, *range(conn, conn + 3)}


def test_free_ports_avoid_given_ports() -> None:
    spec = DeploymentSpec(model="/m", num_attention=2)
    http, conn = allocate_ports(spec)
    http2, conn2 = allocate_ports(spec, avoid=[*http, conn])
    assert not set([*http2, conn2]) & set([*http, conn])


def test_fixed_port_in_use_is_reported() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        with pytest.raises(DeploymentError, match=rf"port {busy} \(HTTP of attention server 0\)"):
            allocate_ports(DeploymentSpec(model="/m", http_port=busy))
        with pytest.raises(DeploymentError, match=rf"port {busy} \(AFD connector"):
            allocate_ports(DeploymentSpec(model="/m", connector_port=busy))


def test_fixed_ports_are_used_as_given() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    spec = DeploymentSpec(model="/m", num_attention=1, http_port=base)
    http, conn = allocate_ports(spec)
    assert http == [base] and conn != base
    assert allocate_ports(spec.replace(native=True)) == ([base], 0)


def test_ffn_health_ports_are_free_and_avoid_the_other_ports() -> None:
    spec = DeploymentSpec(model="/m", num_attention=2, num_ffn=2)
    for _ in range(10):
        http, conn = allocate_ports(spec)
        health = allocate_health_ports(spec, avoid=[*http, conn])
        assert len(health) == 2 and len({*http, conn, *health}) == 4
    assert allocate_health_ports(spec.replace(num_attention=1, num_ffn=1, native=True)) == []


def test_fixed_ffn_health_ports_count_up_and_a_busy_one_is_named() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    spec = DeploymentSpec(model="/m", num_attention=2, num_ffn=2, ffn_health_port=base)
    assert allocate_health_ports(spec) == [base, base + 1]
    with pytest.raises(DeploymentError, match=rf"port {base} \(health/metrics of FFN server 0\)"):
        allocate_health_ports(spec, avoid=[base])
    with pytest.raises(SpecError, match=r"ffn_health_port: expected an int in 0\.\.65535"):
        DeploymentSpec(model="/m", ffn_health_port=70000)


def test_health_port_in_vllm_args_points_to_the_spec_field() -> None:
    with pytest.raises(SpecError, match="ffn_health_port"):
        DeploymentSpec(model="/m", vllm_args=["--health-port", "9000"])


# ---------------------------------------------------------------- logs and processes


def test_prefix_lines() -> None:
    assert prefix_lines("[ffn0] ", "a\nb\n") == "[ffn0] a\n[ffn0] b\n"
    assert prefix_lines("[attn1] ", "no newline") == "[attn1] no newline\n"
    assert prefix_lines("[x] ", "") == ""


def _fake_role(tmp_path: Path, code: str, name: str = "ffn0", role: str = "ffn") -> RoleProcess:
    return RoleProcess(
        name,
        role,
        0,
        [sys.executable, "-c", code],
        {"PYTHONUNBUFFERED": "1"},
        tmp_path / "logs" / f"{name}.log",
    )


def test_each_role_kind_has_its_readiness() -> None:
    from afd.launch.readiness import NATIVE, readiness_of
    from afd.runtime.ffn_server import READY_MARKER
    from afd_core.roles import AFDRole

    ffn, attn, native = readiness_of(AFDRole.FFN), readiness_of("attention"), readiness_of(NATIVE)
    assert (ffn.role, attn.role, native.role) == (AFDRole.FFN, AFDRole.ATTENTION, None)
    assert ffn.marker == READY_MARKER and attn.marker is None  # one marker, the server's
    assert ffn.health_url("http://h:1") == "http://h:1/health"
    assert ffn.endpoint_lines("ffn0", "http://h:1") == [
        "  http://h:1/health, http://h:1/metrics  (ffn0)"
    ]
    assert attn.endpoint_lines("attn", "http://h:2") == []
    assert RoleProcess("attn", "attention", 0, [], {}, Path("x")).role is AFDRole.ATTENTION
    with pytest.raises(ValueError, match="unknown role 'gate'"):
        readiness_of("gate")


def test_role_output_is_prefixed_and_logged(tmp_path: Path) -> None:
    role = _fake_role(tmp_path, "print('hello'); print('INFO AFD FFN server ready in 1 s')")
    console = io.StringIO()
    role.start(console, threading.Lock())
    assert role.proc is not None
    role.proc.wait(10)
    role.join_output()
    assert console.getvalue().splitlines() == [
        "[ffn0] hello",
        "[ffn0] INFO AFD FFN server ready in 1 s",
    ]
    log = (tmp_path / "logs" / "ffn0.log").read_text()
    assert "hello\n" in log and log.startswith("# ")  # first line: the command
    assert not role.check_ready()  # the ready line is not readiness: /health is
    assert role.last_lines(1) == ["INFO AFD FFN server ready in 1 s\n"]


def test_a_role_is_ready_when_its_health_url_answers_200(tmp_path: Path) -> None:
    from afd.runtime.health import StatusServer

    state = {"ok": False}
    status = StatusServer("127.0.0.1", 0, lambda: (state["ok"], "x"), None)
    try:
        role = RoleProcess(
            "ffn0", "ffn", 0, ["true"], {}, tmp_path / "ffn0.log", health_url=status.url
        )
        assert role.http_url is None  # not an OpenAI endpoint
        assert not role.check_ready() and not role.ready
        state["ok"] = True
        assert role.check_ready() and role.ready
        state["ok"] = False
        assert role.check_ready()  # once ready, a role stays ready for the launcher
    finally:
        status.close()


def test_a_role_not_ready_in_time_is_reported_with_its_health(tmp_path: Path) -> None:
    from afd.runtime.health import StatusServer

    status = StatusServer("127.0.0.1", 0, lambda: (False, "waiting for the attention peers"))
    spec = DeploymentSpec(model=str(tmp_path), log_dir=str(tmp_path / "logs"), startup_timeout_s=2)
    dep = Deployment(spec, console=io.StringIO(), echo=False, visible_devices=[])
    role = _fake_role(tmp_path, "import time; print('loaded', flush=True); time.sleep(60)")
    role.health_url = status.url
    dep.roles = [role]
    dep._build_roles = lambda: None  # type: ignore[method-assign]
    try:
        with pytest.raises(DeploymentError, match=r"ffn0 not ready after 2 s"):
            dep.start()
    finally:
        status.close()
    out = dep.console.getvalue()  # type: ignore[attr-defined]
    assert "its /health: 503 waiting for the attention peers; last" in out, out
    assert "[ffn0] loaded" in out  # the log tail, as for a role that died
    assert not role.group_alive()


def test_bind_affinity() -> None:
    assert bind_affinity("0") == [0]
    assert bind_affinity("2-3,0") == [0, 2, 3]
    assert bind_affinity("0|1") == [0, 1]  # a DP server's ranks: the union
    for value in ("auto", "nobind", "", "0|auto"):
        assert bind_affinity(value) is None


def test_a_bound_role_process_and_its_children_stay_on_their_cpus(tmp_path: Path) -> None:
    # vLLM binds only its worker's OpenMP threads; the role's other processes (API server,
    # engine core) must not float onto another role's CPUs. A child started later
    # inherits the affinity.
    cpu = min(os.sched_getaffinity(0))
    code = (
        "import os, subprocess, sys; print('self', sorted(os.sched_getaffinity(0))); "
        "subprocess.run([sys.executable, '-c', "
        "'import os; print(\"child\", sorted(os.sched_getaffinity(0)))'])"
    )
    role = _fake_role(tmp_path, code)
    role.env[CPU_BIND] = str(cpu)
    console = io.StringIO()
    role.start(console, threading.Lock())
    assert role.proc is not None
    role.proc.wait(20)
    role.join_output()
    assert console.getvalue().splitlines() == [f"[ffn0] self [{cpu}]", f"[ffn0] child [{cpu}]"]
    unbound = _fake_role(tmp_path, code, name="ffn1")  # no CPU list: left as it was
    console = io.StringIO()
    unbound.start(console, threading.Lock())
    assert unbound.proc is not None
    unbound.proc.wait(20)
    unbound.join_output()
    assert f"self {sorted(os.sched_getaffinity(0))}" in console.getvalue()


def _spec_with_fake_roles(tmp_path: Path) -> DeploymentSpec:
    return DeploymentSpec(model=str(tmp_path), log_dir=str(tmp_path / "logs"), startup_timeout_s=30)


def test_failing_role_raises_with_its_last_lines(tmp_path: Path) -> None:
    dep = Deployment(
        _spec_with_fake_roles(tmp_path), console=io.StringIO(), echo=False, visible_devices=[]
    )
    dep.roles = [
        _fake_role(
            tmp_path,
            "import sys, time; [print(i) for i in range(50)]; "
            "print('boom: bad checkpoint'); sys.exit(3)",
        ),
        _fake_role(tmp_path, "import time; time.sleep(60)", name="attn0", role="attention"),
    ]
    dep._build_roles = lambda: None  # type: ignore[method-assign]
    with pytest.raises(DeploymentError, match=r"ffn0 exited with code 3 during start-up"):
        dep.start()
    out = dep.console.getvalue()  # type: ignore[attr-defined]
    assert "[ffn0] boom: bad checkpoint" in out
    assert "[ffn0] 21\n" in out and "[ffn0] 20\n" not in out  # the last 30 lines only
    assert not any(r.group_alive() for r in dep.roles)  # the sleeper was torn down


def test_stop_kills_whole_process_groups(
    tmp_path: Path, healthy_role: Callable[..., RoleProcess]
) -> None:
    # The role ignores SIGTERM and has a child: SIGKILL after the grace period, all gone.
    prelude = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"
    )
    dep = Deployment(
        _spec_with_fake_roles(tmp_path), console=io.StringIO(), echo=False, visible_devices=[]
    )
    dep.roles = [healthy_role(prelude)]
    dep._build_roles = lambda: None  # type: ignore[method-assign]
    dep.start()
    role = dep.roles[0]
    assert role.ready and role.group_alive()
    assert dep.stop(grace_s=1.0)
    assert not role.group_alive()
    assert "SIGKILL" in dep.console.getvalue()  # type: ignore[attr-defined]


def test_compile_phases_are_reported_during_start_up(
    tmp_path: Path, healthy_role: Callable[..., RoleProcess]
) -> None:
    """vLLM's compile warm-up lines in a role's output become launcher lines (once each,
    in order) and the progress line's phase of a role still starting."""
    lines = [
        "(Worker pid=1) INFO [cpu_model_runner.py:87] Warming up model for the compilation...",
        "INFO [backends.py:1166] Dynamo bytecode transform time: 9.10 s",
        "INFO [cpu_model_runner.py:91] Warming up done.",
    ]
    prelude = "; ".join(f"print({line!r}, flush=True)" for line in lines)
    dep = Deployment(
        _spec_with_fake_roles(tmp_path), console=io.StringIO(), echo=False, visible_devices=[]
    )
    dep.roles = [healthy_role(prelude)]
    dep._build_roles = lambda: None  # type: ignore[method-assign]
    dep.start()
    try:
        out = dep.console.getvalue()  # type: ignore[attr-defined]
        said = [
            ln.split("] ", 1)[1].rsplit(" (", 1)[0]
            for ln in out.splitlines()
            if "ffn0: " in ln and "pid" not in ln
        ]
        assert said == [
            "ffn0: compile warm-up started",
            "ffn0: graph traced, inductor compiling",
            "ffn0: compile warm-up done",
        ], out
        role = dep.roles[0]
        assert role.phase == "compile warm-up done" and not role.phases
        role.ready = False
        assert dep._status_line() == "ffn0 starting (compile warm-up done)"
    finally:
        dep.stop(grace_s=1.0)


# ---------------------------------------------------------------- demo / bench helpers


def test_compare_tokens() -> None:
    assert compare_tokens([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == [None, 1]
    assert compare_tokens([[1, 2]], [[1, 2, 3]]) == [2]


def test_the_demo_fails_a_compiled_deployment_that_ran_eager(tmp_path: Path) -> None:
    """`afd demo` (install-smoke runs it in CI) asks for vLLM's compile mode: it passes
    only when every step of every attention rank ran each layer's exchange through the
    compiled op (the Attention role's metrics); no metrics at all is a failure too."""
    from afd.tools.demo import compiled_problem, compiled_summary, exchanging_layers

    def samples(steps: float, compiled: float, rank: str = "0") -> dict:
        labels = (("rank", rank),)
        return {
            ("afd_attention_steps_total", labels): steps,
            ("afd_attention_compiled_exchanges_total", labels): compiled,
        }

    compiled = DeploymentSpec(model="/m")
    eager = compiled_problem(compiled, samples(40, 0), 3)
    assert eager is not None and "ran eager" in eager and "rank 0: 0 exchanges" in eager
    assert "expected 40 steps x 3 layers = 120" in eager
    assert "VLLM_USE_BREAKABLE_CUDAGRAPH" in eager
    # Some steps eager (e.g. one rank's): still a failure.
    partly = {**samples(40, 120), **samples(40, 117, rank="1")}
    problem = compiled_problem(compiled, partly, 3)
    assert problem is not None and "rank 1: 117" in problem and "rank 0" not in problem
    missing = compiled_problem(compiled, {}, 3)  # no metrics: nothing proves it
    assert missing is not None and "no afd_attention_steps_total" in missing
    assert compiled_problem(compiled, samples(0, 0), 3) is not None  # no step at all
    assert compiled_problem(compiled.replace(enforce_eager=True), {}, 3) is None
    assert compiled_problem(compiled, samples(40, 120), 3) is None
    assert compiled_summary(samples(40, 120), 3) == (
        "rank 0: 120 exchanges through the op = 40 steps x 3 layers"
    )
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 5}')
    assert exchanging_layers(tmp_path) == 5
    (tmp_path / "config.json").write_text('{"text_config": {"num_hidden_layers": 7}}')
    assert exchanging_layers(tmp_path) == 7


def test_percentile_and_table() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    lv = {
        "output_tok_s": 10.0,
        "ttft_ms": {"median": 1.0, "p99": 2.0},
        "tpot_ms": {"median": 3.0, "p99": None},
    }
    report = {
        "settings": {"concurrency": [1]},
        "results": {"native": {"1": lv}, "afd": {"1": lv}},
        "ratio_afd_over_native": {"1": {"output_tok_s": 1.0, "tpot_median": 1.0}},
    }
    table = format_table(report)
    assert "AFD/native tok/s" in table and "3.0/-" in table
    json.dumps(report)


def test_role_tmp_dir_is_short_enough_for_ipc_sockets(tmp_path: Path) -> None:
    from afd.launch import MAX_TMPDIR_LEN, role_tmp_dir

    short = role_tmp_dir(Path("/tmp") / tmp_path.name)
    assert short == Path("/tmp") / tmp_path.name / "tmp" and short.is_dir()
    deep = tmp_path / ("x" * 80)
    long_tmp = role_tmp_dir(deep)
    try:
        assert len(str(long_tmp)) <= MAX_TMPDIR_LEN and long_tmp.is_dir()
        assert len(str(long_tmp / "2e34a93b-82fe-4d61-97af-519266ce49af")) <= 107
    finally:
        import shutil

        shutil.rmtree(long_tmp)
        shutil.rmtree(Path("/tmp") / tmp_path.name)


def test_afd_plugin_async_key_in_a_spec() -> None:
    """afd-plugin's ``async`` in a spec's [afd]: false accepted, true refused in one line
    without CAMAsyncAFDConnector (afd_core.config.ASYNC_KEYS)."""
    spec = DeploymentSpec.from_dict({"model": "/tmp/m", "afd": {"async": False}})
    assert spec.afd == DeploymentSpec.from_dict({"model": "/tmp/m"}).afd
    with pytest.raises(
        SpecError,
        match=r"^afd\.async: true requires connector "
        r"'CAMAsyncAFDConnector' .*got none named",
    ):
        DeploymentSpec.from_dict({"model": "/tmp/m", "afd": {"async": True}})
