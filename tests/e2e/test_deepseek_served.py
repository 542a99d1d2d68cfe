"""AFD behind vLLM's OpenAI server (``afd serve``), two attention ranks sharing one FFN rank.

The two attention ranks are the data-parallel ranks of one ``afd serve --role attention
--data-parallel-size 2`` (vLLM keeps DP ranks in lock step, idle ranks run dummy
batches), served by one FFN rank that concatenates both ranks' tokens every layer. Each
prompt is sent alone and awaited, so every real batch holds one sequence, exactly as on
the native server it is compared with; the other rank's dummy tokens still cross the FFN
in the same concatenated batch.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from afd_processes import FFNServer, Server, free_port, terminate_all

from afd.reference import FIXED_PROMPTS

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]

PROMPTS = list(FIXED_PROMPTS[:8])


@pytest.fixture(scope="module")
def native_served(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[str, list[list[int]]] = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in cache:
            server = Server.native(tiny_models[arch], tmp_path_factory.mktemp(f"native-{arch}"))
            try:
                server.wait_ready()
                cache[arch] = [server.complete(p) for p in PROMPTS]
            finally:
                server.kill()
        return cache[arch]

    return get


def inventory(log: str, role: str) -> dict[str, int]:
    lines = re.findall(rf"AFD {role} role parameter inventory: ([^;]*);", log)
    assert lines, f"no {role} inventory line in the log:\n{log[-3000:]}"
    return {k: int(v) for k, v in (item.split("=") for item in lines[-1].split())}


@pytest.mark.parametrize(
    ("arch", "gate_on_attention"), [("deepseek_v2", False), ("deepseek_v3", True)]
)
def test_2a1f_served_tokens_equal_native_and_sigterm_stops_everything(
    tiny_models: dict[str, Path],
    native_served: Any,
    tmp_path: Path,
    arch: str,
    gate_on_attention: bool,
) -> None:
    model = tiny_models[arch]
    afd = {
        "port": free_port(),
        "num_attention_ranks": 2,
        "num_ffn_ranks": 1,
        "compute_gate_on_attention": gate_on_attention,
        "connect_timeout_s": 300,
    }
    ffn = FFNServer(model, {**afd, "role": "ffn"}, tmp_path)
    attention = Server.afd_attention(
        model, {**afd, "role": "attention"}, tmp_path, "--data-parallel-size", "2"
    )
    try:
        ffn.wait_ready()
        attention.wait_ready()
        got = [attention.complete(p) for p in PROMPTS]

        # Both roles report what they hold: no experts on Attention, no attention on FFN.
        attn_inv = inventory(attention.output, "attention")
        ffn_inv = inventory(ffn.output, "ffn")
        for category in ("routed_experts", "shared_experts", "dense_mlp"):
            assert attn_inv.get(category, 0) == 0, attn_inv
        assert (attn_inv.get("gate", 0) > 0) == gate_on_attention, attn_inv
        assert attn_inv.get("attention", 0) > 0
        assert ffn_inv.get("attention", 0) == 0 and ffn_inv.get("embedding", 0) == 0, ffn_inv
        assert ffn_inv.get("routed_experts", 0) > 0

        codes = terminate_all([attention.proc, ffn.proc], timeout=10)
        assert codes.pop("leftovers") == {}, "processes survived SIGTERM"
        assert set(codes.values()) == {0}, (codes, attention.output[-2000:], ffn.output[-2000:])
    finally:
        attention.kill()
        ffn.kill()

    want = native_served(arch)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert len(w) == 32
        assert g == w, f"prompt {i} ({PROMPTS[i]!r}) diverged from native vllm serve"
