"""Prefill/decode disaggregation with AFD on the decode side (issue 43 item 2), with
`afd launch` and a `[prefill]` table.

The same spec is served twice: plainly (`afd launch --native`, which runs one vLLM server
and no prefill instance) and as PD + AFD 1A1F (a native prefill instance, `kv_producer`,
hands each prompt's KV cache to the Attention role, `kv_consumer`, through vLLM's
`ExampleConnector`; the proxy routes prefill -> decode). Float32, eager, greedy, 10
prompts x 32 tokens, one request at a time. Equal: the tokens. Shown from vLLM's own
`vllm:prompt_tokens_by_source` counters: the prefill instance computed every prompt token;
the decode side loaded every whole KV block of each prompt from the connector and computed
only the rest (the prompt's last partial block and the prefill's first token).
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from afd_processes import Launcher, assert_same_tokens, settled_metric_samples

from afd.tools.client import completion_response
from afd.tools.reference import FIXED_PROMPTS

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

# Long enough that every prompt spans whole KV blocks (24-77 tokens).
PROMPTS = [" ".join([p] * 6) for p in FIXED_PROMPTS[:10]]
MAX_TOKENS = 32
STARTUP_S = 420.0
# vLLM CPU attention's smallest KV block (multiples of 32; its default, 128, would hand
# over nothing of these prompts). Qwen3-MoE: vLLM 0.32's ExampleConnector moves the CPU
# MLA cache of the DeepSeek family wrongly (natively too: docs/cli.md, [prefill]).
BLOCK = 32


def _by_source(url: str) -> dict[str, float]:
    samples = settled_metric_samples(f"{url}/metrics")
    out: dict[str, float] = {}
    for (name, labels), value in samples.items():
        if name == "vllm:prompt_tokens_by_source_total":
            source = dict(labels)["source"]
            out[source] = out.get(source, 0.0) + value
    return out


def _serve(spec: Path, tmp: Path, *args: str) -> tuple[list[list[int]], list[list[int]], str]:
    """(generated token ids, prompt token ids, the launcher's output) of PROMPTS."""
    launcher = Launcher(spec, tmp, *args)
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
        if "prefill0" in role_urls:
            tmp.joinpath("sources.json").write_text(json.dumps({
                name: _by_source(role_urls[name]) for name in ("prefill0", "attn")
            }))  # fmt: skip
        return tokens, prompt_ids, launcher.output
    finally:
        launcher.kill_all()


@pytest.mark.extended  # out of CI for its budget (3 + 1 processes; `nox -s tests-extended`)
@pytest.mark.timeout(1200)
def test_prefill_decode_with_afd_decode_equals_native_and_loads_each_whole_prompt_block(
    tiny_qwen_models: dict[str | None, Path], tmp_path: Path
) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(
        f'model = "{tiny_qwen_models[None]}"\ndtype = "float32"\nenforce_eager = true\n'
        f'log_dir = "{tmp_path / "logs"}"\nvllm_args = ["--block-size", "{BLOCK}"]\n'
        "[afd]\nconnect_timeout_s = 600\ntransfer_timeout_s = 120\n"
        "[prefill]\n"
    )
    native, native_prompts, _ = _serve(spec, tmp_path / "native", "--native")
    got, prompts, output = _serve(spec, tmp_path / "pd")
    assert "1A1F (decode) + prefill (ExampleConnector)" in output
    assert prompts == native_prompts
    assert_same_tokens(got, native, PROMPTS, "plain native vLLM", max_tokens=MAX_TOKENS)
    sources = json.loads((tmp_path / "pd" / "sources.json").read_text())
    lengths = [len(p) for p in prompts]
    # ExampleConnector hands over whole blocks of the decode prompt less its last token.
    loaded = [(n - 1) // BLOCK * BLOCK for n in lengths]
    assert sources["prefill0"].get("local_compute") == sum(lengths)
    assert sources["prefill0"].get("external_kv_transfer", 0) == 0
    assert sources["attn"].get("external_kv_transfer") == sum(loaded) > 0
    # the decode prompt is the prompt plus the first token
    assert sources["attn"].get("local_compute") == sum(
        n + 1 - k for n, k in zip(lengths, loaded, strict=True)
    )
