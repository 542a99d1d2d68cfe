"""End to end: ``afd launch`` brings a deployment up, serves, and tears it down cleanly.

Real vLLM processes on a tiny DeepSeek-V2 (generated once per session). Every port
is picked free at run time; every process started here is killed by process group.

The 2A1F deployment is one attention server with two data-parallel ranks (vLLM keeps
them in lock step, running dummy batches on the idle one, which the FFN fan-in needs)
and one FFN server. ``afd launch`` waits for the FFN server's ``/health`` (200 once both
attention ranks are connected); its ``/metrics`` and the attention server's carry the
AFD metrics of every rank. It is also the default run's 2A1F served parity case: the
tiny DeepSeek-V3 with the gate on Attention (top-k payload) and two micro-batches, set by
the upstream alias ``num_afd_stages`` (asked one request at a time, the busy DP rank runs
each step whole and every rank adds a shadow micro-batch, so both send two per layer:
each rank's ``afd_attention_exchanges_total`` of micro-batch 0 and of micro-batch 1 both
equal its ``afd_attention_steps_total`` x layers; the idle rank's dummy steps carry no
token and send empty messages, so the FFN computes the busy rank's tokens alone, the rows
native vLLM computes for that request; every role process runs on one CPU, and so does
the native reference: vLLM's bfloat16 kernels depend on the thread count on CPUs without
AMX),
eager (``enforce_eager = true``; ``afd launch`` compiles by default, and the same case
compiled, float32, is tests/e2e/test_compiled_parity.py's ``deepseek_v3-gate_attention-2A1F-m2``
in CI's matrix); greedy tokens
equal native vLLM asked the same way (the matrix runs the same case through ``afd
serve`` directly: tests/e2e/test_deepseek_served.py).
"""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from afd_processes import (
    Launcher,
    assert_role_inventories,
    assert_same_tokens,
    group_pgid_members,
    metric_samples,
    settled_metric_samples,
)
from afd_references import ONE_CPU, singles

from afd.launch.cpus import usable_cpus
from afd.tools.client import completion_response
from afd.tools.reference import FIXED_PROMPTS

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

#: The wait for the launcher's "running" line: under the 285 s per-test limit
#: (pytest-timeout, ``timeout`` in pyproject.toml), leaving the test time to stop the
#: deployment and report the launcher's output.
STARTUP_S = 210.0


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from afd.tools.models.tiny import generate_tiny_checkpoint

    return Path(generate_tiny_checkpoint("deepseek_v2", tmp_path_factory.mktemp("ckpt") / "dsv2"))


def complete(
    url: str, prompt: str, max_tokens: int, timeout: float, *, return_token_ids: bool = False
) -> dict:
    return completion_response(
        url, prompt, max_tokens, timeout=timeout, return_token_ids=return_token_ids
    )


def metric_values(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``GET url/metrics`` parsed: (sample name, sorted labels) -> value."""
    return metric_samples(f"{url}/metrics")


#: Asked one at a time (the reference: each prompt its own batch, on one CPU).
PROMPTS = list(FIXED_PROMPTS[:8])


def test_2a1f_serves_and_stops_on_sigterm(
    tiny_models: dict[str, Path], native_references: Any, tmp_path: Path
) -> None:
    model = tiny_models["deepseek_v3"]
    # Every role process on one CPU (one OpenMP thread), and the reference native vLLM on
    # one CPU too: without AMX, vLLM's bfloat16 kernels answer differently on one thread
    # and on two (native alone shows it), so the same thread count is the same computation.
    native = [
        group[0]
        for group in native_references.groups(model, singles(PROMPTS), llm_kwargs={ONE_CPU: True})
    ]
    cpus = usable_cpus()
    spec = tmp_path / "2a1f.toml"
    spec.write_text(
        f'model = "{model}"\nnum_attention = 2\nnum_ffn = 1\n'
        f'log_dir = "{tmp_path / "logs"}"\ncompute_gate_on_attention = true\n'
        "enforce_eager = true\n"
        "[afd]\nconnect_timeout_s = 600\ntransfer_timeout_s = 120\n"
        'routing_payload = "topk"\nnum_afd_stages = 2\n'
        f'[attention]\ncpus = "{cpus[0]}|{cpus[1 % len(cpus)]}"\n'
        f'[ffn]\ncpus = ["{cpus[2 % len(cpus)]}"]\n'
    )
    launcher = Launcher(spec, tmp_path)
    try:
        ready = launcher.wait_for(r"running; Ctrl-C or SIGTERM", STARTUP_S)
        assert ready, f"deployment did not come up in {STARTUP_S:.0f} s:\n{launcher.output[-6000:]}"
        urls = re.findall(r"^\[afd\]\s+(http://[\d.]+:\d+)/v1", launcher.output, re.M)
        assert len(urls) == 1
        pgids = launcher.role_pgids()
        assert set(pgids) == {"ffn0", "attn"}
        found = re.search(
            r"^\[afd\]\s+(http://[\d.]+:\d+)/health, \S+/metrics  \(ffn0\)", launcher.output, re.M
        )
        assert found, launcher.output[-3000:]
        ffn_url = found[1]
        with urllib.request.urlopen(f"{ffn_url}/health", timeout=10) as r:
            assert (r.status, r.read()) == (200, b"serving 2 attention peer(s)\n")
        rank0, rank1 = (("rank", "0"),), (("rank", "1"),)
        assert metric_values(ffn_url)[("afd_ffn_peers_connected", rank0)] == 2

        # A lone request (the other DP rank idles with dummy batches), then two at once.
        lone = complete(urls[0], "The quick brown fox", 8, 120)
        assert lone["usage"]["completion_tokens"] == 8
        with ThreadPoolExecutor(2) as pool:
            prompts = ["The quick brown fox", "def fibonacci(n):"]
            futures = [pool.submit(complete, urls[0], p, 8, 120) for p in prompts]
            answers = [f.result() for f in futures]
        for a in answers:
            assert a["choices"][0]["finish_reason"] == "length"
            assert a["usage"]["completion_tokens"] == 8
        # Two at once, the FFN computes both ranks' tokens in one call: in bfloat16 that is
        # "serves in full" (docs/architecture.md, "What parity is promised"), not the
        # lone answer's text (the expert kernels are not batch-invariant on every CPU).
        # One request at a time (only the busy rank's tokens reach the FFN, the idle
        # rank's dummy steps send none): token for token what native vLLM answers.
        got = [
            complete(urls[0], p, 32, 300, return_token_ids=True)["choices"][0]["token_ids"]
            for p in PROMPTS
        ]
        assert_same_tokens(got, native, PROMPTS, "native vLLM, one request at a time")
        # Both DP ranks exchanged layers (the idle one with dummy batches); the FFN
        # served each layer once for both.
        attn = metric_values(urls[0])
        ffn = metric_values(ffn_url)
        for rank in (rank0, rank1):
            assert attn[("afd_attention_peers_connected", rank)] == 1
            assert attn[("afd_exchange_latency_seconds_count", rank)] > 0
            assert attn[("afd_attention_sent_bytes_total", rank)] > 0
        assert ffn[("afd_ffn_layers_served_total", rank0)] > 0
        assert ffn[("afd_ffn_tokens_served_total", rank0)] >= 3 * 8  # 3 completions x 8
        # Ping-pong micro-batching, counted: every forward step of each attention rank
        # (served, an idle rank's dummy steps, profile and warm-up runs) ran both
        # micro-batches, real or shadow, through every layer (the dense ones through the
        # dense stand-in), eager (no exchange went through the compiled op).
        config = json.loads((model / "config.json").read_text())
        layers = int(config["num_hidden_layers"])
        attn = settled_metric_samples(f"{urls[0]}/metrics")
        for rank in (rank0, rank1):
            steps = attn[("afd_attention_steps_total", rank)]
            per_micro_batch = {
                dict(labels)["micro_batch"]: value
                for (name, labels), value in attn.items()
                if name == "afd_attention_exchanges_total" and ("rank", rank[0][1]) in labels
            }
            assert steps > len(PROMPTS) * 32, (rank, steps)
            assert per_micro_batch == {"0": steps * layers, "1": steps * layers}, (
                rank, steps, layers, per_micro_batch,
            )  # fmt: skip
            assert attn[("afd_attention_compiled_exchanges_total", rank)] == 0

        t0 = time.monotonic()
        launcher.proc.send_signal(signal.SIGTERM)
        rc = launcher.proc.wait(timeout=30)
        stopped_s = time.monotonic() - t0
        launcher.join_output(5)
        assert rc == 0, launcher.output[-3000:]
        assert "stopped; no process left" in launcher.output
        out = launcher.output.splitlines()
        attention_log = "\n".join(ln for ln in out if ln.startswith("[attn]"))
        ffn_log = "\n".join(ln for ln in out if ln.startswith("[ffn0]"))
        assert_role_inventories(attention_log, ffn_log, gate_on_attention=True)
        # The FFN warmed up every layer with the payload kind it then received (dense
        # layers hidden states, MoE layers top-k) before it waited for its peers.
        dense = int(config.get("first_k_dense_replace", 0))
        moe = int(config["num_hidden_layers"]) - dense
        warmed = (
            f"AFD FFN rank 0: warmed up {dense + moe} FFN layers "
            f"({dense} x HIDDEN, {moe} x HIDDEN_TOPK) on 8 dummy tokens in "
        )
        assert warmed in ffn_log, ffn_log[-3000:]
        assert ffn_log.index(warmed) < ffn_log.index("waiting for attention ranks")
        # afd serve ran both roles (and the attention server's engine and workers) on
        # vLLM's V1 model runner: scheduler and micro-batching worker agree (issue 31)
        for log in (attention_log, ffn_log):
            assert "VLLM_USE_V2_MODEL_RUNNER=0 (vLLM's V1 model runner)" in log, log[-3000:]
        assert stopped_s < 10.0, f"teardown took {stopped_s:.1f} s"
        assert group_pgid_members([*pgids.values(), launcher.proc.pid]) == []
    finally:
        launcher.kill_all()


def test_role_failing_at_startup_fails_the_launch(tiny_model: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-checkpoint"
    spec = tmp_path / "bad.toml"
    spec.write_text(f'model = "{tiny_model}"\n[ffn]\nmodel = "{missing}"\n')
    t0 = time.monotonic()
    launcher = Launcher(spec, tmp_path)
    try:
        rc = launcher.proc.wait(timeout=60)
        elapsed = time.monotonic() - t0
        launcher.join_output(5)
        out = launcher.output
        assert rc != 0, out[-3000:]
        assert elapsed < 60
        assert re.search(r"ffn0 exited with code \d+ during start-up", out), out[-3000:]
        # The role's own error, with its prefix, in the launcher's output.
        assert re.search(rf"^\[ffn0\] .*{re.escape(str(missing))}", out, re.M), out[-3000:]
        pgids = launcher.role_pgids()
        assert set(pgids) == {"ffn0", "attn"}
        assert group_pgid_members([*pgids.values(), launcher.proc.pid]) == []
    finally:
        launcher.kill_all()
