"""AFD on real processes (vLLM CPU, gloo connector, eager) produces the same greedy tokens
as native vLLM on the same tiny checkpoint.

Batched parity: the Attention role runs as a vLLM engine (``vllm.LLM`` with the AFD
architecture and ``additional_config``) in its own process, a headless FFN server in
another, and the ten fixed prompts are generated in one batch (32 tokens each) exactly as
the native reference does, so both see identical batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from afd_processes import FFNServer, free_port, offline_greedy

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]

ALIASES = {"deepseek_v2": "AFDDeepseekV2ForCausalLM", "deepseek_v3": "AFDDeepseekV3ForCausalLM"}


@pytest.fixture(scope="module")
def native_tokens(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    cache: dict[str, Any] = {}

    def get(arch: str) -> Any:
        if arch not in cache:
            tmp = tmp_path_factory.mktemp(f"native-{arch}")
            cache[arch] = offline_greedy(tiny_models[arch], tmp / "native.json", tmp)
        return cache[arch]

    return get  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("arch", "gate"),
    [
        ("deepseek_v2", "ffn"),
        ("deepseek_v2", "attention-topk"),
        ("deepseek_v3", "ffn"),
        ("deepseek_v3", "attention-topk"),
        ("deepseek_v3", "attention-router_logits"),
    ],
)
def test_1a1f_greedy_tokens_equal_native(
    tiny_models: dict[str, Path], native_tokens: Any, tmp_path: Path, arch: str, gate: str
) -> None:
    afd: dict[str, Any] = {"port": free_port(), "connect_timeout_s": 240}
    if gate.startswith("attention"):
        afd["compute_gate_on_attention"] = True
        afd["routing_payload"] = gate.split("-", 1)[1]
    model = tiny_models[arch]
    ffn = FFNServer(model, {**afd, "role": "ffn"}, tmp_path)
    try:
        ffn.wait_ready()
        afd_result = offline_greedy(
            model,
            tmp_path / "afd.json",
            tmp_path,
            {
                "hf_overrides": {"architectures": [ALIASES[arch]]},
                "additional_config": {"afd": {**afd, "role": "attention"}},
            },
        )
        # The FFN server leaves on its own once its attention peer is gone.
        assert ffn.wait_exit(timeout=30) == 0, ffn.output[-3000:]
    finally:
        ffn.kill()
    native = native_tokens(arch)
    assert afd_result["prompts"] == native["prompts"] and len(native["prompts"]) >= 8
    for i, (got, want) in enumerate(zip(afd_result["token_ids"], native["token_ids"], strict=True)):
        assert len(want) == 32
        assert got == want, f"prompt {i} ({native['prompts'][i]!r}) diverged"
    assert "served" in ffn.output and "peer gone" in ffn.output
