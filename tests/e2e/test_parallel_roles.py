"""Parallel roles end to end: a tensor-parallel Attention role served by ``afd launch``.

Attention TP2 + 1 FFN on the tiny Qwen3-MoE in float32 (``attention_tensor_parallel_size
= 2``: one attention server with two TP workers; TP worker 0 exchanges with the FFN role
and broadcasts each answer to worker 1, afd_moe_runners.tensor_parallel). Asked one
request at a time, the greedy tokens (10 prompts x 16) equal native vLLM at
``tensor_parallel_size=2`` asked the same way. The FFN role sees one attention peer, not
two, and every token it served came once (its metrics).

The default run keeps the gate-on-Attention case (top-k payload: routing computed on both
TP workers, one message per layer); the gate on FFN runs in ``nox -s tests-matrix``.
"""

from __future__ import annotations

import importlib.util
import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from afd_processes import Launcher, assert_same_tokens, metric_samples
from afd_references import singles

from afd.reference import FIXED_PROMPTS

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

STARTUP_S = 420.0
PROMPTS = list(FIXED_PROMPTS[:10])
MAX_TOKENS = 16


def _complete(url: str, prompt: str) -> list[int]:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        model = json.loads(r.read())["data"][0]["id"]
    payload = {
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return list(json.loads(r.read())["choices"][0]["token_ids"])


MATRIX = pytest.mark.matrix


def _case(tp: int, dp: int, ep: int, gate: str, *marks: Any) -> Any:
    return pytest.param(tp, dp, ep, gate, marks=marks, id=f"tp{tp}-dp{dp}-ep{ep}-{gate}")


# The default run keeps Attention TP2 + 1 FFN with the gate on Attention (one case of
# this matrix; every path of the TP exchange); the other shapes in `nox -s tests-matrix`.
@pytest.mark.parametrize(
    ("tp", "dp", "ep", "gate"),
    [
        _case(2, 1, 1, "attention-topk"),
        _case(2, 1, 1, "ffn", MATRIX),
        _case(1, 1, 2, "attention-topk", MATRIX),
        _case(1, 1, 2, "ffn", MATRIX),
        _case(2, 1, 2, "attention-topk", MATRIX),
        _case(1, 2, 2, "attention-topk", MATRIX),
    ],
)
def test_parallel_layout_served_tokens_equal_native(
    tp: int,
    dp: int,
    ep: int,
    gate: str,
    tiny_qwen_models: dict[str | None, Path],
    native_references: Any,
    tmp_path: Path,
) -> None:
    model = tiny_qwen_models[None]
    # The reference: native vLLM at the attention TP size (Qwen3-MoE float32 gives the
    # same tokens at TP=1 and TP=2 natively; each is compared with its own).
    native = [
        g[0]
        for g in native_references.groups(
            model,
            singles(PROMPTS),
            dtype="float32",
            max_tokens=MAX_TOKENS,
            llm_kwargs={"tensor_parallel_size": tp} if tp > 1 else {},
        )
    ]
    spec = tmp_path / "layout.toml"
    spec.write_text(
        f'model = "{model}"\nnum_attention = {dp}\nnum_ffn = {ep}\n'
        f"attention_tensor_parallel_size = {tp}\n"
        f"ffn_expert_parallel = {'true' if ep > 1 else 'false'}\n"
        f'dtype = "float32"\nlog_dir = "{tmp_path / "logs"}"\n'
        f"compute_gate_on_attention = {'true' if gate != 'ffn' else 'false'}\n"
        "[afd]\nconnect_timeout_s = 300\ntransfer_timeout_s = 120\n"
    )
    launcher = Launcher(spec, tmp_path)
    try:
        ready = launcher.wait_for(r"running; Ctrl-C or SIGTERM", STARTUP_S)
        assert ready, f"deployment did not come up:\n{launcher.output[-6000:]}"
        url = re.findall(r"^\[afd\]\s+(http://[\d.]+:\d+)/v1", launcher.output, re.M)[0]
        ffn_urls = dict(
            (name, u)
            for u, name in re.findall(
                r"^\[afd\]\s+(http://[\d.]+:\d+)/health, \S+/metrics  \((ffn\d)\)",
                launcher.output,
                re.M,
            )
        )
        assert sorted(ffn_urls) == [f"ffn{f}" for f in range(ep)], launcher.output[-3000:]
        got = [_complete(url, p) for p in PROMPTS]
        what = f"native vLLM TP={tp}, one request at a time"
        assert_same_tokens(got, native, PROMPTS, what, max_tokens=MAX_TOKENS)
        attn = metric_samples(f"{url}/metrics")
        ffn = {f: metric_samples(f"{ffn_urls[f'ffn{f}']}/metrics") for f in range(ep)}
        for f in range(ep):
            rank = (("rank", str(f)),)
            # Every attention (DP) rank is a peer of every FFN rank; a TP group is one.
            assert ffn[f][("afd_ffn_peers_connected", rank)] == dp
            assert ffn[f][("afd_ffn_tokens_served_total", rank)] > 0
        if ep == 1:
            # Counted once, by TP worker 0: what the attention ranks sent is what the FFN
            # rank received (a second sender would leave them unequal).
            sent = sum(attn[("afd_attention_sent_bytes_total", (("rank", str(a)),))]
                       for a in range(dp))  # fmt: skip
            assert sent > 0
            assert sent == ffn[0][("afd_ffn_received_bytes_total", (("rank", "0"),))]
        else:
            # Each FFN rank holds only its share of the routed experts (3 MoE layers,
            # 8 experts: 4 each), the others zeroed.
            out = launcher.output
            for f in range(ep):
                assert re.search(
                    rf"\[ffn{f}\].*AFD FFN rank {f} of {ep} \(expert parallel\): "
                    r"experts_held=12 experts_zeroed=12",
                    out,
                ), out[-3000:]
    finally:
        launcher.kill_all()
