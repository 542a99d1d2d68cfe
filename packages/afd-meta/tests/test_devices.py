"""Per-role CUDA devices of ``afd launch``: detection, the assignment rule, spec overrides
and the role environments the launcher builds (no GPU, no vLLM process needed)."""

from __future__ import annotations

import argparse
import io
from collections.abc import Callable
from pathlib import Path

import pytest

from afd.launch import (
    Deployment,
    DeploymentError,
    DeploymentSpec,
    RoleProcess,
    SpecError,
    add_launch_arguments,
    assign_devices,
    detect_cuda_devices,
    parse_nvidia_smi_list,
    parse_visible_devices,
    spec_from_args,
)

NVIDIA_SMI_L = """\
GPU 0: NVIDIA H200 (UUID: GPU-11111111-2222-3333-4444-555555555555)
GPU 1: NVIDIA H200 (UUID: GPU-66666666-7777-8888-9999-000000000000)
  MIG 1g.18gb     Device  0: (UUID: MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee)
GPU 2: NVIDIA H200 (UUID: GPU-ffffffff-1111-2222-3333-444444444444)
"""

# ---------------------------------------------------------------- the assignment rule


@pytest.mark.parametrize(
    ("num_attention", "num_ffn", "visible", "want"),
    [
        (1, 1, ["0", "1"], {"attn": "0", "ffn0": "1"}),
        (2, 1, ["0", "1", "2"], {"attn": "0,1", "ffn0": "2"}),
        (3, 2, ["0", "1", "2", "3", "4"], {"attn": "0,1,2", "ffn0": "3", "ffn1": "4"}),
        (1, 2, ["0", "1", "2"], {"attn": "0", "ffn0": "1", "ffn1": "2"}),
        # more devices than ranks: the first ones; the entries are passed on as they are
        (1, 1, ["4", "6", "7"], {"attn": "4", "ffn0": "6"}),
        (2, 1, ["GPU-a", "GPU-b", "GPU-c"], {"attn": "GPU-a,GPU-b", "ffn0": "GPU-c"}),
    ],
)
def test_attention_ranks_first_then_ffn_ranks(
    num_attention: int, num_ffn: int, visible: list[str], want: dict[str, str]
) -> None:
    assert assign_devices(num_attention, num_ffn, visible) == want


def test_explicit_devices_win_and_the_other_role_keeps_its_position() -> None:
    visible = ["0", "1", "2", "3"]
    assert assign_devices(1, 1, visible, attention=["3"]) == {"attn": "3", "ffn0": "1"}
    assert assign_devices(2, 1, visible, ffn=["0"]) == {"attn": "0,1", "ffn0": "0"}
    assert assign_devices(2, 1, visible, attention="2,3", ffn=["0"]) == {
        "attn": "2,3",
        "ffn0": "0",
    }
    # Both explicit: no device count is needed, not even a visible one.
    assert assign_devices(2, 2, ["0"], attention=["5", "6"], ffn=["7", "7"]) == {
        "attn": "5,6",
        "ffn0": "7",
        "ffn1": "7",
    }
    assert assign_devices(1, 1, [], attention="", ffn=["1"]) == {"attn": "", "ffn0": "1"}


@pytest.mark.parametrize(
    ("num_attention", "num_ffn", "visible", "kwargs", "match"),
    [
        (1, 1, ["0"], {}, r"1A1F needs 2 CUDA devices .* found 1 \(0\)"),
        (2, 1, ["0", "1"], {}, r"2A1F needs 3 CUDA devices .* found 2 \(0,1\)"),
        (3, 2, ["0", "1", "2", "3"], {}, r"3A2F needs 5 CUDA devices .* found 4"),
        (1, 2, ["0", "1"], {}, r"1A2F needs 3 CUDA devices"),
        # the FFN ranks still take the positions after the attention ranks
        (2, 1, ["0", "1"], {"attention": ["7", "8"]}, r"2A1F needs 3 CUDA devices"),
        (2, 1, ["0"], {"ffn": ["7"]}, r"2A1F needs 2 CUDA devices .* found 1"),
    ],
)
def test_too_few_devices_names_needed_and_found(
    num_attention: int, num_ffn: int, visible: list[str], kwargs: dict, match: str
) -> None:
    with pytest.raises(DeploymentError, match=match) as err:
        assign_devices(num_attention, num_ffn, visible, **kwargs)
    assert "[attention] devices" in str(err.value)  # says how to choose them instead


def test_cpu_host_gets_no_devices() -> None:
    assert assign_devices(1, 1, []) == {}
    assert assign_devices(3, 2, []) == {}
    assert assign_devices(1, 0, []) == {}
    assert assign_devices(1, 0, ["0"]) == {"attn": "0"}  # the native baseline


# ---------------------------------------------------------------- detection


def _no_run(cmd: list[str]) -> str | None:
    raise AssertionError(f"{cmd} must not run when CUDA_VISIBLE_DEVICES is set")


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ("0,1,2", ["0", "1", "2"]),
        ("4, 6", ["4", "6"]),
        ("GPU-abc,MIG-def", ["GPU-abc", "MIG-def"]),
        ("", []),  # every device hidden: a CPU host
        ("-1", []),
        ("0,-1,2", ["0"]),  # CUDA stops at the first invalid entry
        ("1,,2", ["1"]),
    ],
)
def test_detection_from_cuda_visible_devices(value: str, want: list[str]) -> None:
    assert parse_visible_devices(value) == want
    assert detect_cuda_devices({"CUDA_VISIBLE_DEVICES": value}, run=_no_run) == want


def test_detection_from_nvidia_smi_output() -> None:
    calls: list[list[str]] = []

    def run(cmd: list[str]) -> str | None:
        calls.append(cmd)
        return NVIDIA_SMI_L

    assert parse_nvidia_smi_list(NVIDIA_SMI_L) == ["0", "1", "2"]  # MIG lines not counted
    assert detect_cuda_devices({}, run=run) == ["0", "1", "2"]
    assert calls == [["nvidia-smi", "-L"]]
    assert detect_cuda_devices({}, run=lambda cmd: None) == []  # missing or failing
    assert detect_cuda_devices({}, run=lambda cmd: "No devices were found\n") == []


def _fake_nvidia_smi(bin_dir: Path, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(0o755)


def test_detection_runs_nvidia_smi_from_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from afd.launch import devices

    # The launcher runs nvidia-smi once per process and executable; a test that rewrites
    # the fake executable forgets the cached answer.
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    devices._nvidia_smi_output.cache_clear()
    assert detect_cuda_devices({}) == []  # no nvidia-smi: a CPU host
    _fake_nvidia_smi(
        tmp_path / "bin", "printf 'GPU 0: A (UUID: GPU-1)\\nGPU 1: A (UUID: GPU-2)\\n'"
    )
    devices._nvidia_smi_output.cache_clear()
    assert detect_cuda_devices({}) == ["0", "1"]
    assert detect_cuda_devices({}) == ["0", "1"]  # cached
    _fake_nvidia_smi(tmp_path / "bin", "echo 'NVIDIA-SMI has failed'; exit 9")
    devices._nvidia_smi_output.cache_clear()
    assert detect_cuda_devices({}) == []


# ---------------------------------------------------------------- spec overrides


def test_spec_devices_one_per_rank() -> None:
    spec = DeploymentSpec(
        model="/m",
        num_attention=2,
        num_ffn=2,
        attention={"devices": "0, 1"},
        ffn={"devices": [2, "3"]},
    )
    assert spec.attention.devices == ["0", "1"] and spec.ffn.devices == ["2", "3"]
    assert DeploymentSpec(model="/m").attention.devices is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"num_attention": 2, "attention": {"devices": "0"}},
            r"attention.devices: 1 device\(s\) 0 for 2 rank\(s\); give exactly one device per",
        ),
        ({"ffn": {"devices": ["1", "2"]}}, r"ffn.devices: 2 device\(s\) 1,2 for 1 rank"),
        ({"ffn": {"devices": 1}}, r'ffn.devices: expected "0,1" or a list'),
        ({"ffn": {"devices": [True]}}, r"ffn.devices: expected device ids"),
        ({"ffn": {"devices": "0 1"}}, r"ffn.devices: '0 1' is not a device id"),
        ({"num_attention": 2, "attention": {"devices": "1,1"}}, r"a device is listed twice"),
        (
            {"attention": {"devices": "0"}, "ffn": {"devices": "0"}},
            r"ffn.devices: 0 also in attention.devices; every rank needs its own device",
        ),
        (
            {"ffn": {"devices": "1", "env": {"CUDA_VISIBLE_DEVICES": "1"}}},
            r"ffn.devices and ffn.env.CUDA_VISIBLE_DEVICES are both set",
        ),
        ({"ffn": {"device": "1"}}, r"unknown key 'device' \(did you mean 'devices'\?\)"),
    ],
)
def test_invalid_devices_fail_with_clear_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(SpecError, match=match):
        DeploymentSpec(model="/m", **kwargs)


def test_toml_devices(tmp_path: Path) -> None:
    spec_file = tmp_path / "dep.toml"
    spec_file.write_text(
        'model = "/m"\nnum_attention = 2\nnum_ffn = 1\n'
        '[attention]\ndevices = "0,1"\n[ffn]\ndevices = ["2"]\n'
    )
    spec = DeploymentSpec.from_toml(spec_file)
    assert spec.attention.devices == ["0", "1"] and spec.ffn.devices == ["2"]


def test_launch_flags_set_the_devices(tmp_path: Path) -> None:
    spec_file = tmp_path / "dep.toml"
    spec_file.write_text('model = "/m"\n[ffn]\nenv = { A = "1" }\n')
    ap = argparse.ArgumentParser()
    add_launch_arguments(ap)
    args = ap.parse_args(
        [str(spec_file), "--attention", "2", "--attention-devices", "4,5", "--ffn-devices", "6"]
    )
    spec = spec_from_args(args)
    assert spec.attention.devices == ["4", "5"]
    assert spec.ffn.devices == ["6"] and spec.ffn.env == {"A": "1"}


# ---------------------------------------------------------------- the launcher's role envs


def _built(
    spec: DeploymentSpec, tmp_path: Path, visible: list[str] | None
) -> dict[str, RoleProcess]:
    """The role processes ``Deployment.start`` would start (commands and envs only)."""
    dep = Deployment(spec, console=io.StringIO(), visible_devices=visible)
    dep.work_dir = dep.log_dir = tmp_path
    dep.http_ports, dep.connector_port = [18000], 18001
    dep._build_roles()
    return {r.name: r for r in dep.roles}


def _cvd(role: RoleProcess) -> str | None:
    return role.env.get("CUDA_VISIBLE_DEVICES")


@pytest.mark.parametrize(
    ("num_attention", "num_ffn", "want"),
    [
        (1, 1, {"attn": "0", "ffn0": "1"}),
        (2, 1, {"attn": "0,1", "ffn0": "2"}),
        (3, 2, {"attn": "0,1,2", "ffn0": "3", "ffn1": "4"}),
    ],
)
def test_role_envs_carry_the_mapping(
    tmp_path: Path, num_attention: int, num_ffn: int, want: dict[str, str]
) -> None:
    spec = DeploymentSpec(model="/m", num_attention=num_attention, num_ffn=num_ffn)
    roles = _built(spec, tmp_path, ["0", "1", "2", "3", "4", "5"])
    assert {name: _cvd(r) for name, r in roles.items()} == want
    if num_attention > 1:  # vLLM puts DP rank i on the attention server's i-th device
        cmd = roles["attn"].cmd
        assert cmd[cmd.index("--data-parallel-size") + 1] == str(num_attention)


def test_native_gets_the_first_device(tmp_path: Path) -> None:
    roles = _built(DeploymentSpec(model="/m", native=True), tmp_path, ["3", "4"])
    assert {name: _cvd(r) for name, r in roles.items()} == {"native0": "3"}


def test_cpu_host_leaves_the_env_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    roles = _built(DeploymentSpec(model="/m", num_attention=2), tmp_path, [])
    assert all("CUDA_VISIBLE_DEVICES" not in r.env for r in roles.values())


def test_spec_devices_and_role_env_override(tmp_path: Path) -> None:
    spec = DeploymentSpec(
        model="/m",
        num_attention=2,
        num_ffn=2,
        attention={"devices": "6,7"},
        ffn={"env": {"X": "1"}},
    )
    roles = _built(spec, tmp_path, ["0", "1", "2", "3"])
    assert {n: _cvd(r) for n, r in roles.items()} == {"attn": "6,7", "ffn0": "2", "ffn1": "3"}
    # An explicit CUDA_VISIBLE_DEVICES in a role's env wins, even on a CPU host.
    spec = DeploymentSpec(model="/m", ffn={"env": {"CUDA_VISIBLE_DEVICES": "5"}})
    for visible in (["0", "1"], []):
        roles = _built(spec, tmp_path, visible)
        assert _cvd(roles["ffn0"]) == "5"
    assert _cvd(_built(spec, tmp_path, ["0", "1"])["attn"]) == "0"


def test_spec_env_is_the_list_to_assign_from(tmp_path: Path) -> None:
    spec = DeploymentSpec(model="/m", env={"CUDA_VISIBLE_DEVICES": "4,5"})
    roles = _built(spec, tmp_path, None)  # detected from the roles' environment
    assert {n: _cvd(r) for n, r in roles.items()} == {"attn": "4", "ffn0": "5"}


def test_start_fails_before_starting_anything_when_devices_are_missing() -> None:
    spec = DeploymentSpec(model="/m", num_attention=2)
    dep = Deployment(spec, console=io.StringIO(), visible_devices=["0", "1"])
    with pytest.raises(DeploymentError, match=r"2A1F needs 3 CUDA devices .* found 2"):
        dep.start()
    assert dep.roles == [] and dep.work_dir is None


@pytest.mark.parametrize(
    ("visible", "ffn", "lines"),
    [
        (
            ["0", "1", "2"],
            {},
            ["devices (CUDA_VISIBLE_DEVICES per role): attn=0, ffn0=1 (3 visible: 0,1,2)"],
        ),
        (
            ["0", "1"],
            {"env": {"CUDA_VISIBLE_DEVICES": "0"}},
            [
                "devices (CUDA_VISIBLE_DEVICES per role): attn=0, ffn0=0 (2 visible: 0,1)",
                "WARNING: attn and ffn0 share device 0; NCCL refuses two ranks on one device",
            ],
        ),
        ([], {}, ["devices: no CUDA device visible; CUDA_VISIBLE_DEVICES left as is"]),
    ],
)
def test_start_prints_the_mapping(
    tmp_path: Path,
    visible: list[str],
    ffn: dict,
    lines: list[str],
    healthy_role: Callable[..., RoleProcess],
) -> None:
    spec = DeploymentSpec(model="/m", log_dir=str(tmp_path), ffn=ffn, startup_timeout_s=30)
    dep = Deployment(spec, console=io.StringIO(), echo=False, visible_devices=visible)
    dep._build_roles = lambda: dep.roles.append(healthy_role())  # type: ignore[method-assign]
    with dep:
        pass
    out = dep.console.getvalue()  # type: ignore[attr-defined]
    for line in lines:
        assert f"[afd] {line}\n" in out
