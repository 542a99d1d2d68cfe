"""Prefill/decode disaggregation with AFD on the decode side (issue 43 item 2), with
`afd launch` and a `[prefill]` table.

Native vLLM's tokens (each prompt as a batch of its own, eager, as a plain server asked
one request at a time computes them: tests/support/afd_references.py) against PD + AFD
1A1F (`afd launch` of a spec with `[prefill]`: a native prefill instance, `kv_producer`,
hands each prompt's KV cache to the Attention role, `kv_consumer`, through afd's
`WholePromptConnector`, vLLM's `ExampleConnector` with every prompt token handed over;
the proxy routes prefill -> decode). Float32, eager, greedy, 10 prompts x 32 tokens, one
request at a time, vLLM's default KV block size (CPU attention 128, CPU MLA 16: the
prompts end in a partial block, or are one). Equal: the tokens. Shown from vLLM's own
`vllm:prompt_tokens_by_source` counters: the prefill instance computed every prompt token;
the decode side loaded every prompt token from the connector and computed one token per
request (the prefill's first token, appended to the prompt: vLLM's scheduler computes at
least one token of every request, the one whose logits give the next).

CI runs the Qwen3-MoE case (``matrix``); the DeepSeek-V3-style (MLA) case is ``extended``
(CI's time budget).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from afd_processes import Launcher, assert_same_tokens, settled_metric_samples
from afd_references import singles

from afd.tools.client import completion_response
from afd.tools.reference import FIXED_PROMPTS

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

# Long enough that the prompts span several CPU MLA blocks of 16 (24-77 tokens).
PROMPTS = [" ".join([p] * 6) for p in FIXED_PROMPTS[:10]]
MAX_TOKENS = 32
STARTUP_S = 420.0


def _by_source(url: str) -> dict[str, float]:
    samples = settled_metric_samples(f"{url}/metrics")
    out: dict[str, float] = {}
    for (name, labels), value in samples.items():
        if name == "vllm:prompt_tokens_by_source_total":
            source = dict(labels)["source"]
            out[source] = out.get(source, 0.0) + value
    return out


#: Served: (generated token ids, prompt token ids, launcher output, tokens by source).
Served = tuple[list[list[int]], list[list[int]], str, dict[str, dict[str, float]]]


def _serve_pd(spec: Path, tmp: Path) -> Served:
    """(generated token ids, prompt token ids, the launcher's output, prompt tokens by
    source of the prefill instance and of the attention server) of PROMPTS served by
    the PD + AFD deployment of ``spec``."""
    launcher = Launcher(spec, tmp)
    try:
        ready = launcher.wait_for(r"running; Ctrl-C or SIGTERM", STARTUP_S)
        assert ready, f"deployment did not come up:\n{launcher.output[-6000:]}"
        url = re.findall(r"^\[afd\]\s+(http://[\d.]+:\d+)/v1", launcher.output, re.M)[0]
        answers = [completion_response(url, p, MAX_TOKENS, timeout=300) for p in PROMPTS]
        tokens = [list(a["choices"][0]["token_ids"]) for a in answers]
        prompt_ids = [list(a["choices"][0]["prompt_token_ids"]) for a in answers]
        role_urls = dict(
            re.findall(r"^\[afd\] (\w+): pid \d+, (http://[\d.:]+)$", launcher.output, re.M)
        )
        sources = {name: _by_source(role_urls[name]) for name in ("prefill0", "attn")}
        return tokens, prompt_ids, launcher.output, sources
    finally:
        launcher.kill_all()


@pytest.mark.timeout(1200)
@pytest.mark.parametrize(
    ("family", "gate_on_attention"),
    [
        pytest.param("qwen3_moe", False, id="qwen3_moe-gate_ffn", marks=pytest.mark.matrix),
        # Out of CI for its budget (`nox -s tests-extended`): the connector's store -> load
        # round trip in CPU MLA's cache layout runs in the default run (test_kv_connector).
        pytest.param(
            "deepseek_v3", True, id="deepseek_v3-mla-gate_attention", marks=pytest.mark.extended
        ),
    ],
)
def test_prefill_decode_with_afd_decode_equals_native_and_computes_one_token_per_request(
    family: str,
    gate_on_attention: bool,
    tiny_model_of: Callable[[str], Path],
    native_references: Any,
    tmp_path: Path,
) -> None:
    from transformers import AutoTokenizer

    model = tiny_model_of(family)
    spec = tmp_path / "spec.toml"
    spec.write_text(
        f'model = "{model}"\ndtype = "float32"\nenforce_eager = true\n'
        f'log_dir = "{tmp_path / "logs"}"\n'
        f"compute_gate_on_attention = {'true' if gate_on_attention else 'false'}\n"
        "[afd]\nconnect_timeout_s = 600\ntransfer_timeout_s = 120\n"
        "[prefill]\n"
    )
    native = native_references.tokens(
        model, singles(PROMPTS), dtype="float32", max_tokens=MAX_TOKENS
    )
    got, prompts, output, sources = _serve_pd(spec, tmp_path / "pd")
    assert "1A1F (decode) + prefill (WholePromptConnector)" in output
    # the proxy hands the prompt over unchanged: the ids vLLM's tokenizer gives it
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    assert prompts == [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert_same_tokens(got, native, PROMPTS, "plain native vLLM", max_tokens=MAX_TOKENS)
    print(f"\n[{family}] prompt tokens by source: {sources}")
    prompt_tokens = sum(len(p) for p in prompts)
    assert sources["prefill0"].get("local_compute") == prompt_tokens
    assert sources["prefill0"].get("external_kv_transfer", 0) == 0
    # the decode prompt is the prompt plus the first token: all of the prompt loaded, the
    # first token computed (the least vLLM's scheduler computes of a request)
    assert sources["attn"].get("external_kv_transfer") == prompt_tokens
    assert sources["attn"].get("local_compute") == len(PROMPTS)
    assert sources["attn"].get("local_cache_hit", 0) == 0
