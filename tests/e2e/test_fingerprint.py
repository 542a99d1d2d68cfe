"""A deployment assembled from roles that loaded different things does not come up.

Real ``afd serve`` processes on tiny checkpoints: the FFN role is started on another
architecture, on the same architecture with other weights, and with another dtype and
other routing settings (one start for both) than its Attention role. Both roles must exit non-zero
within 10 s of meeting at the rendezvous, each naming the differing fields with both
values. (The same checkpoint starting as before is what every other served test does.)
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from afd_processes import FFNServer, Server, afd_settings

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]

# Log lines that say a role reached the rendezvous.
FFN_AT_RENDEZVOUS = "waiting for attention ranks"
ATTENTION_AT_RENDEZVOUS = "connecting to the FFN role"


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deepseek_v3 with another seed: same config, names, shapes and file sizes."""
    from afd.tools.models.tiny import generate_tiny_checkpoint

    root = tmp_path_factory.mktemp("other-weights")
    return generate_tiny_checkpoint("deepseek_v3", root / "deepseek_v3-s1", seed=1)


def _run_mismatch(
    attention_model: Path,
    ffn_model: Path,
    tmp: Path,
    *,
    ffn_afd: dict[str, Any] | None = None,
    ffn_args: tuple[str, ...] = (),
) -> tuple[FFNServer, Server, float]:
    """Start both roles; wait until both exited; return them and the seconds between
    both reaching the rendezvous and the later exit."""
    afd = afd_settings("ffn", connect_timeout_s=120)
    ffn = FFNServer(ffn_model, {**afd, "role": "ffn", **(ffn_afd or {})}, tmp, *ffn_args)
    attention = Server.afd_attention(attention_model, {**afd, "role": "attention"}, tmp)
    try:
        met: float | None = None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            at_rendezvous = FFN_AT_RENDEZVOUS in ffn.output
            if met is None and at_rendezvous and ATTENTION_AT_RENDEZVOUS in attention.output:
                met = time.monotonic()
            if ffn.proc.poll() is not None and attention.proc.poll() is not None:
                break
            time.sleep(0.1)
        done = time.monotonic()
        assert ffn.proc.poll() is not None and attention.proc.poll() is not None, (
            "a role kept running after a fingerprint mismatch:\n"
            f"FFN:\n{ffn.output[-3000:]}\nattention:\n{attention.output[-3000:]}"
        )
        assert met is not None, (
            f"FFN:\n{ffn.output[-3000:]}\nattention:\n{attention.output[-3000:]}"
        )
        return ffn, attention, done - met
    finally:
        attention.kill()
        ffn.kill()


def _assert_refused(ffn: FFNServer, attention: Server, took: float, fields: list[str]) -> None:
    logs = {"FFN": ffn.output, "attention": attention.output}
    assert ffn.proc.returncode != 0, logs["FFN"][-3000:]
    assert attention.proc.returncode != 0, logs["attention"][-3000:]
    for name, log in logs.items():
        line = next((ln for ln in log.splitlines() if "AFDFingerprintMismatchError" in ln), "")
        assert line, f"{name} did not say why it stopped:\n{log[-4000:]}"
        for field in fields:
            assert field in line, (name, field, line)
    assert took < 10.0, f"the roles took {took:.1f} s to stop after meeting"


@pytest.mark.extended  # out of CI for its time budget (`nox -s tests-extended`)
def test_ffn_on_another_architecture(
    tiny_models: dict[str, Path], tiny_qwen_models: dict[str | None, Path], tmp_path: Path
) -> None:
    ffn, attention, took = _run_mismatch(
        tiny_models["deepseek_v3"], tiny_qwen_models[None], tmp_path
    )
    _assert_refused(
        ffn,
        attention,
        took,
        ["architecture: attention rank 0 has 'AFDDeepseekV3", "model_type:", "checkpoint:"],
    )


@pytest.mark.matrix  # runs in `nox -s tests-matrix`; the default run checks fingerprints
# at the connector level (packages/afd-connectors-gpu/tests/test_admission.py)
def test_ffn_on_other_weights(
    tiny_models: dict[str, Path], other_weights: Path, tmp_path: Path
) -> None:
    config = json.loads((other_weights / "config.json").read_text())
    assert config == json.loads((tiny_models["deepseek_v3"] / "config.json").read_text())
    ffn, attention, took = _run_mismatch(tiny_models["deepseek_v3"], other_weights, tmp_path)
    _assert_refused(ffn, attention, took, ["checkpoint: attention rank 0 has '"])
    line = next(ln for ln in ffn.output.splitlines() if "AFDFingerprintMismatchError" in ln)
    assert "architecture:" not in line and "dtype:" not in line, line


@pytest.mark.extended  # out of CI for its time budget (`nox -s tests-extended`)
def test_ffn_with_another_dtype_and_other_routing_settings(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """One start answers both drills: each differing field is named, with both values."""
    ffn, attention, took = _run_mismatch(
        tiny_models["deepseek_v3"],
        tiny_models["deepseek_v3"],
        tmp_path,
        ffn_afd={"compute_gate_on_attention": True, "routing_payload": "topk"},
        ffn_args=(
            "--dtype",
            "float32",
            "--hf-overrides",
            json.dumps({"routed_scaling_factor": 7.5}),
        ),
    )
    _assert_refused(
        ffn,
        attention,
        took,
        [
            "dtype: attention rank 0 has 'bfloat16', ffn rank 0 has 'float32'",
            "routed_scaling_factor:",
            "ffn rank 0 has '7.5'",
            "gate_on_attention: attention rank 0 has 'ffn', ffn rank 0 has 'attention'",
            "routing_payload:",
        ],
    )


@pytest.mark.matrix  # runs in `nox -s tests-matrix` (CI runs it too)
def test_attention_tp_size_the_ffn_side_was_not_started_for(
    tiny_qwen_models: dict[str | None, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The FFN role was started for attention ranks of TP size 1 (the default of
    afd.attention_tensor_parallel_size); the attention server runs TP2."""
    model = tiny_qwen_models[None]
    afd = afd_settings("ffn", connect_timeout_s=120)
    ffn = FFNServer(model, {**afd, "role": "ffn"}, tmp_path)
    # vLLM CPU's automatic binding refuses two TP workers on one NUMA node.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    attention = Server.afd_attention(
        model, {**afd, "role": "attention"}, tmp_path, "--tensor-parallel-size", "2"
    )
    try:
        met: float | None = None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if (
                met is None
                and FFN_AT_RENDEZVOUS in ffn.output
                and (ATTENTION_AT_RENDEZVOUS in attention.output)
            ):
                met = time.monotonic()
            if ffn.proc.poll() is not None and attention.proc.poll() is not None:
                break
            time.sleep(0.1)
        took = time.monotonic() - (met or 0.0)
        assert met is not None, (
            f"FFN:\n{ffn.output[-3000:]}\nattention:\n{attention.output[-3000:]}"
        )
    finally:
        attention.kill()
        ffn.kill()
    _assert_refused(
        ffn, attention, took, ["attention_tp: attention rank 0 has '2', ffn rank 0 has '1'"]
    )
