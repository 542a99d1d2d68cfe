"""Speculative decoding through AFD (issue 43 item 1), end to end with `afd launch`.

The same spec is served twice, plainly (`afd launch --native`) and as an AFD deployment,
with the same `--speculative-config` in the spec's `vllm_args`, float32, eager, 10 prompts
x 32 greedy tokens one request at a time. Equal: the tokens, and the draft tokens proposed
and accepted (`vllm:spec_decode_num_draft_tokens_total` / `..._accepted_tokens_total` of
each server's /metrics). The proposer runs on the Attention role; each verification step
carries up to 1 + k tokens per request through every layer's exchange, as a prefill chunk
does, which the FFN role's own counter shows: the tokens it served during the requests are
exactly every layer's share of the tokens the Attention role forwarded (prompt tokens, one
per decode step, and every proposed draft token).

CI runs the Qwen3-MoE 2A1F n-gram case and the MTP case (``matrix``); the DeepSeek-V3
n-gram case is ``extended`` (CI's time budget).
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from afd_processes import Launcher, assert_same_tokens, settled_metric_samples

from afd.tools.client import complete
from afd.tools.reference import FIXED_PROMPTS

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

PROMPTS = list(FIXED_PROMPTS[:10])
MAX_TOKENS = 32
STARTUP_S = 420.0
# prompt_lookup_min 1: the tiny random checkpoints rarely repeat a bigram in 32 tokens
# (min 2 proposed nothing natively); single-token lookups propose 35 (DeepSeek-V3) / 65
# (Qwen3-MoE) draft tokens over the 10 prompts, 3 / 11 of them accepted (native, measured).
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip
DRAFTS, ACCEPTED = (
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)
COUNTERS = (
    DRAFTS,
    ACCEPTED,
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:spec_decode_num_drafts_total",
    "vllm:iteration_tokens_total_count",
)
FFN_TOKENS = "afd_ffn_tokens_served_total"


def _sum(samples: dict[Any, float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def _serve(
    spec: Path, tmp: Path, *args: str
) -> tuple[list[list[int]], dict[str, float], float | None]:
    """(tokens, the API server's counters, the FFN tokens served during the requests)."""
    launcher = Launcher(spec, tmp, *args)
    try:
        ready = launcher.wait_for(r"running; Ctrl-C or SIGTERM", STARTUP_S)
        assert ready, f"deployment did not come up:\n{launcher.output[-6000:]}"
        url = re.findall(r"^\[afd\]\s+(http://[\d.]+:\d+)/v1", launcher.output, re.M)[0]
        ffn = re.findall(r"^\[afd\] ffn0: pid \d+, (http://[\d.:]+)$", launcher.output, re.M)
        before = _sum(settled_metric_samples(f"{ffn[0]}/metrics"), FFN_TOKENS) if ffn else None
        tokens = [complete(url, p, MAX_TOKENS, timeout=300).token_ids for p in PROMPTS]
        samples = settled_metric_samples(f"{url}/metrics")
        served = None
        if ffn and before is not None:
            served = _sum(settled_metric_samples(f"{ffn[0]}/metrics"), FFN_TOKENS) - before
        return tokens, {name: _sum(samples, name) for name in COUNTERS}, served
    finally:
        launcher.kill_all()


def _assert_ffn_served_every_forwarded_token(
    counts: dict[str, float], served: float | None, model: Path
) -> None:
    """Every layer of the FFN role served each token the Attention role forwarded once:
    the prompts, and per decode step the last token plus every proposed draft token. One
    request at a time, each engine step is one request's: the decode steps are the engine
    steps (``vllm:iteration_tokens_total`` observations) less one prefill step a prompt.
    (Generated tokens would undercount them: tokens accepted past ``max_tokens`` are
    counted as accepted and cut from the output.)"""
    steps = counts["vllm:iteration_tokens_total_count"] - len(PROMPTS)
    generated = counts["vllm:generation_tokens_total"] - len(PROMPTS) - counts[ACCEPTED]
    assert steps >= generated, counts
    forwarded = counts["vllm:prompt_tokens_total"] + steps + counts[DRAFTS]
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    assert served == forwarded * layers, (served, forwarded, layers)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize(
    ("family", "num_attention", "gate_on_attention"),
    [
        # Out of CI for its budget (`nox -s tests-extended`): speculative decoding on
        # DeepSeek-V3 runs in CI with MTP (below), the n-gram proposer with Qwen3-MoE 2A1F.
        pytest.param(
            "deepseek_v3", 1, False, id="deepseek_v3-1A1F-gate_ffn", marks=pytest.mark.extended
        ),
        pytest.param(
            "qwen3_moe", 2, True, id="qwen3_moe-2A1F-gate_attention", marks=pytest.mark.matrix
        ),
    ],
)
def test_ngram_speculative_decoding_equals_native(
    family: str,
    num_attention: int,
    gate_on_attention: bool,
    tiny_model_of: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    model = tiny_model_of(family)
    args: list[Any] = ["--speculative-config", json.dumps(NGRAM)]
    common = (
        f'model = "{model}"\ndtype = "float32"\nenforce_eager = true\n'
        f'log_dir = "{tmp_path / "logs"}"\nvllm_args = {json.dumps(args)}\n'
    )
    native_spec, spec = tmp_path / "native.toml", tmp_path / "spec.toml"
    native_spec.write_text(common)  # a native baseline is one server
    spec.write_text(
        f"{common}num_attention = {num_attention}\nnum_ffn = 1\n"
        f"compute_gate_on_attention = {'true' if gate_on_attention else 'false'}\n"
        "[afd]\nconnect_timeout_s = 600\ntransfer_timeout_s = 120\n"
    )
    native, native_counts, _ = _serve(native_spec, tmp_path / "native", "--native")
    got, afd_counts, served = _serve(spec, tmp_path / "afd")
    print(f"\n[{family}] native {native_counts}\n[{family}] afd {afd_counts}, FFN served {served}")
    assert native_counts[ACCEPTED] > 0, f"no draft accepted natively: {native_counts}"
    assert_same_tokens(got, native, PROMPTS, "native vLLM with the same n-gram config",
                       max_tokens=MAX_TOKENS)  # fmt: skip
    assert afd_counts == native_counts
    _assert_ffn_served_every_forwarded_token(afd_counts, served, model)


MTP = {"method": "deepseek_mtp", "num_speculative_tokens": 1}


@pytest.fixture(scope="module")
def tiny_mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny DeepSeek-V3 with one MTP layer (variant ``mtp``)."""
    import os

    from afd.tools.models.tiny import checkpoint_name, generate_tiny_checkpoint

    cache = os.environ.get("AFD_CACHE_DIR")
    root = Path(cache) / "tiny" if cache else tmp_path_factory.mktemp("tiny-mtp")
    name = checkpoint_name("deepseek_v3", "mtp")
    return generate_tiny_checkpoint("deepseek_v3", root / name, variant="mtp")


@pytest.mark.matrix  # `nox -s tests-matrix` (CI): 2 deployments, ~2 min
@pytest.mark.timeout(1200)
def test_mtp_speculative_decoding_equals_native(tiny_mtp_model: Path, tmp_path: Path) -> None:
    """DeepSeek MTP through AFD 1A1F: vLLM builds the MTP layer (MLA attention + MoE) as
    the drafter on the Attention role, whole and native, experts local; the FFN role serves
    the main model's layers only (3 per forwarded token, none for the drafter)."""
    args: list[Any] = ["--speculative-config", json.dumps(MTP)]
    common = (
        f'model = "{tiny_mtp_model}"\ndtype = "float32"\nenforce_eager = true\n'
        f'log_dir = "{tmp_path / "logs"}"\nvllm_args = {json.dumps(args)}\n'
    )
    native_spec, spec = tmp_path / "native.toml", tmp_path / "spec.toml"
    native_spec.write_text(common)
    spec.write_text(f"{common}[afd]\nconnect_timeout_s = 600\ntransfer_timeout_s = 120\n")
    native, native_counts, _ = _serve(native_spec, tmp_path / "native", "--native")
    got, afd_counts, served = _serve(spec, tmp_path / "afd")
    print(f"\n[mtp] native {native_counts}\n[mtp] afd {afd_counts}, FFN served {served}")
    assert native_counts[DRAFTS] > 0, f"no MTP draft natively: {native_counts}"
    assert_same_tokens(got, native, PROMPTS, "native vLLM with the same MTP config",
                       max_tokens=MAX_TOKENS)  # fmt: skip
    assert afd_counts == native_counts
    _assert_ffn_served_every_forwarded_token(afd_counts, served, tiny_mtp_model)
