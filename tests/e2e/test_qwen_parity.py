"""Qwen3-MoE and Qwen3.5/3.6-MoE under AFD on real processes (vLLM CPU, gloo connector,
eager): greedy tokens identical to native vLLM on the same tiny checkpoints.

* 1A1F batched offline parity: the Attention role is a ``vllm.LLM`` engine with the AFD
  architecture in its own process, a headless FFN server in another; the fixed prompts
  are generated in one batch (32 tokens each), exactly as the native reference does.
  Variants: default, ``no_norm_topk``, ``dense_layers`` x gate on FFN / on Attention.
* 2A1F served parity: one ``afd serve --role attention --data-parallel-size 2`` and one
  FFN rank serving both attention ranks, single-prompt requests compared with native
  ``vllm serve``.
* Qwen3.5/3.6-MoE (the ``qwen3_5_moe_text`` checkpoint) 1A1F batched offline parity,
  gate on FFN / on Attention; vLLM's ``qwen3_5`` file is imported without torchvision in
  every process (afd_models_qwen.qwen3_5_import).

Every case also checks that the FFN role computed the layers (its log's ``served N
layer messages`` with N > 0); the class-identity proof that those layers are vLLM's
native Qwen blocks served through the model-independent ``FFNLayerCompute`` is
tests/integration/test_qwen_role_construction.py::test_qwen3_moe_ffn_compute_is_model_independent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from afd_processes import (
    afd_settings,
    assert_role_inventories,
    assert_same_tokens,
    inventory,
    run_offline_afd,
    run_served_afd,
    served_layers,
)
from afd_references import batch

from afd.tools.reference import FIXED_PROMPTS

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]

ALIAS = "AFDQwen3MoeForCausalLM"
PROMPTS = list(FIXED_PROMPTS[:8])


#: Variants also served (2A1F) below: their native engine answers both references.
SERVED_VARIANTS = (None, "no_norm_topk")


def _native(refs: Any, model: Path, variant: str | None) -> tuple[Any, Any]:
    if variant in SERVED_VARIANTS:
        return refs.served_and_batched(model, FIXED_PROMPTS, PROMPTS)
    return refs.tokens(model, batch(FIXED_PROMPTS)), None


@pytest.fixture(scope="module")
def native_tokens(tiny_qwen_models: dict[str | None, Path], native_references: Any) -> Any:
    """Native vLLM's tokens for the fixed prompts generated in one batch."""

    def get(variant: str | None) -> list[list[int]]:
        return _native(native_references, tiny_qwen_models[variant], variant)[0]

    return get


# Cases marked MATRIX run in `nox -s tests-matrix` (CI runs it after the default run),
# EXTENDED ones by hand.
MATRIX = pytest.mark.matrix
#: Out of CI for its time budget (`nox -s tests-extended`, docs/development.md).
EXTENDED = pytest.mark.extended


@pytest.mark.parametrize(
    ("variant", "gate"),
    [
        # Not in the default run: its 12-minute budget keeps DeepSeek's cases (the
        # same generic path); dense_layers with the gate on Attention in the matrix (CI),
        # the others `extended` (by hand). The default and no_norm_topk variants with the
        # gate on FFN run served, 2A1F (below): each (variant, gate) pair runs once.
        pytest.param(None, "attention-topk", marks=EXTENDED),
        pytest.param("no_norm_topk", "attention-topk", marks=EXTENDED),
        pytest.param("dense_layers", "ffn", marks=EXTENDED),
        pytest.param("dense_layers", "attention-topk", marks=MATRIX),
    ],
)
def test_1a1f_greedy_tokens_equal_native(
    tiny_qwen_models: dict[str | None, Path],
    native_tokens: Any,
    tmp_path: Path,
    variant: str | None,
    gate: str,
) -> None:
    result, ffn_log = run_offline_afd(
        tiny_qwen_models[variant], ALIAS, afd_settings(gate), tmp_path
    )
    assert result["prompts"] == list(FIXED_PROMPTS)
    assert_same_tokens(result["token_ids"], native_tokens(variant), list(FIXED_PROMPTS))
    # The FFN role computed every layer of every step (3 layers per forward step).
    assert served_layers(ffn_log) >= 3 * 32
    assert "peer gone" in ffn_log
    attn = inventory(result["log"], "attention")
    for category in ("routed_experts", "shared_experts", "dense_mlp"):
        assert attn.get(category, 0) == 0, attn
    assert (attn.get("gate", 0) > 0) == gate.startswith("attention"), attn


@pytest.fixture(scope="module")
def native_served(tiny_qwen_models: dict[str | None, Path], native_references: Any) -> Any:
    """Native vLLM's tokens for PROMPTS answered one request at a time (each its own
    batch), as the served deployments are asked."""

    def get(variant: str | None) -> list[list[int]]:
        return _native(native_references, tiny_qwen_models[variant], variant)[1]

    return get


@pytest.mark.parametrize(
    ("variant", "gate"),
    # no_norm_topk in `nox -s tests-matrix` (CI); the default variant `extended`.
    [
        pytest.param(None, "ffn", marks=EXTENDED),
        pytest.param("no_norm_topk", "ffn", marks=MATRIX),
    ],
)
def test_2a1f_served_tokens_equal_native(
    tiny_qwen_models: dict[str | None, Path],
    native_served: Any,
    tmp_path: Path,
    variant: str | None,
    gate: str,
) -> None:
    afd = afd_settings(gate, num_attention_ranks=2, num_ffn_ranks=1)
    got, attention_log, ffn_log = run_served_afd(tiny_qwen_models[variant], afd, tmp_path, PROMPTS)
    assert_role_inventories(attention_log, ffn_log, gate_on_attention=gate != "ffn")
    assert served_layers(ffn_log) > 0
    assert_same_tokens(got, native_served(variant), PROMPTS, "native vLLM, one request at a time")


# ----------------------------------------------------------------- Qwen3.5/3.6-MoE


# vLLM 0.32's qwen3_5 model file imports torchvision (for images only), which this CPU
# environment lacks: native vLLM and both roles import it through afd's seam
# (afd_models_qwen.qwen3_5_import, installed by the afd plugin in every vLLM process).
# In `nox -s tests-matrix`: batched here with the gate on FFN, served with the gate on
# Attention in test_generic_families.py; the default run covers the seam in the
# role-construction and drift tests.
@pytest.mark.parametrize("gate", [pytest.param("ffn", marks=MATRIX)])
def test_qwen3_5_moe_1a1f_greedy_tokens_equal_native(
    tiny_qwen_models: dict[str | None, Path],
    native_tokens: Any,
    tmp_path: Path,
    gate: str,
) -> None:
    """Hybrid Gated-DeltaNet/full-attention layers on Attention, gated shared expert on FFN."""
    result, ffn_log = run_offline_afd(
        tiny_qwen_models["qwen3_5_moe_text"],
        "AFDQwen3_5MoeForCausalLM",
        afd_settings(gate),
        tmp_path,
    )
    native = native_tokens("qwen3_5_moe_text")
    assert result["prompts"] == list(FIXED_PROMPTS)
    assert_same_tokens(result["token_ids"], native, list(FIXED_PROMPTS))
    assert served_layers(ffn_log) >= 4 * 32
    ffn_inv = inventory(ffn_log, "ffn")
    assert ffn_inv.get("attention", 0) == 0 and ffn_inv["shared_experts"] > 0, ffn_inv


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["ffn", "attention-topk"])
def test_qwen3_5_moe_1a1f_on_cuda_greedy_tokens_equal_native(
    tiny_qwen_models: dict[str | None, Path],
    native_tokens: Any,
    tmp_path: Path,
    gate: str,
) -> None:
    """The same parity on CUDA with the NCCL connector (``nox -s tests-gpu``), for
    environments where vLLM's qwen3_5 model file imports (its torchvision dependency).
    Needs 2 CUDA devices: Attention on the first, FFN on the second (docs/gpu.md)."""
    torch = pytest.importorskip("torch")
    need = "requires 2 CUDA devices for 1A1F (NCCL needs one device per rank)"
    if not torch.cuda.is_available():
        pytest.skip(f"{need}; torch.cuda.is_available() is False")
    if (found := torch.cuda.device_count()) < 2:
        pytest.skip(f"{need}, found {found}")
    from afd_models_qwen.availability import qwen3_5_import_error

    if (blocker := qwen3_5_import_error()) is not None:
        pytest.skip(f"vLLM's qwen3_5 model file does not import here: {blocker}")
    result, ffn_log = run_offline_afd(
        tiny_qwen_models["qwen3_5_moe_text"],
        "AFDQwen3_5MoeForCausalLM",
        afd_settings(gate, connector="P2pNcclAFDConnector"),
        tmp_path,
    )
    native = native_tokens("qwen3_5_moe_text")
    assert_same_tokens(result["token_ids"], native, list(FIXED_PROMPTS))
    assert served_layers(ffn_log) >= 4 * 32
