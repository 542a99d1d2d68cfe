"""Compiled execution (vLLM's default compile mode): greedy tokens equal native vLLM
compiled (10 prompts x 32 tokens).

**Served, float32** (``afd launch``, one request at a time, against native vLLM compiled
served the same way: ``afd launch --native``): each family runs both gate placements and
both topologies (1A1F, 2A1F with two data-parallel attention ranks), crossed:
DeepSeek-V3-style (grouped top-k, correction bias, routed scaling, shared experts, a dense
first layer) gate on FFN 1A1F and gate on Attention 2A1F with m=2 micro-batches;
Qwen3-MoE gate on Attention 1A1F and gate on FFN 2A1F. The deployments use the
launcher's defaults (shared-memory connector, own cores per role), so the Attention role
compiles (Dynamo, inductor) and the FFN role runs eager. Every attention rank proves it
ran the compiled graph: the exchange op logs its first call, which an eager forward never
reaches. Where native compiled and native eager differ (measured: every prompt of the
tiny DeepSeek-V3 in float32), AFD compiled equals native compiled.

**Batched, bfloat16**: the exchange op is a graph boundary that native vLLM's graph does
not have, and in bfloat16 inductor's rounding around the FFN blocks then differs (plain
native compiled equals AFD on 4 of 10 prompts of the tiny DeepSeek-V3). The native-only
experiment with the same boundaries (``python -m afd.reference --ffn-behind-op``,
``afd.runtime.opaque_ffn``) is the reference here: AFD compiled (offline ``vllm.LLM``
Attention role + FFN server) equals it, both gate placements; a test of its own
(``extended``) records that plain native compiled differs from it on this checkpoint
(else the case would prove no more than plain parity). Both sides run the same offline
engine settings: in compiled mode vLLM's engine settings (batch-size limits) shape the
compiled code, so a served deployment is compared with a served reference only.

CI (``nox -s tests-matrix``) runs DeepSeek-V3 gate on Attention 2A1F m=2 and the bfloat16
case with the gate on Attention; the others are ``extended`` for CI's time budget
(2026-12-06: `.ci/run` measured 42.4 min), each with what covers its path in CI (the two
compiled layouts of test_parallel_roles.py, Qwen3-MoE TP2 + EP2 and DeepSeek-V3 FFN EP2,
and install-smoke's `afd demo`, DeepSeek-V2 1A1F gate on FFN, run compiled in CI).
"""

from __future__ import annotations

import importlib.util
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from afd_processes import afd_settings, assert_same_tokens, run_offline_afd
from afd_references import COMPILED, COMPILED_BOUNDARIES, COMPILED_SERVED, batch, singles

from afd.tools.reference import FIXED_PROMPTS

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.matrix,
    pytest.mark.compiled,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

PROMPTS = list(FIXED_PROMPTS[:10])

CASES = [
    # Out of CI for its budget (`nox -s tests-extended`): gate on FFN 1A1F compiled is
    # install-smoke's `afd demo` (DeepSeek-V2), DeepSeek-V3 gate on FFN compiled runs with
    # FFN EP2 (test_parallel_roles.py), DeepSeek-V3 compiled in the 2A1F m=2 case below.
    pytest.param(
        "deepseek_v3", False, 1, id="deepseek_v3-gate_ffn-1A1F", marks=pytest.mark.extended
    ),
    pytest.param("deepseek_v3", True, 2, id="deepseek_v3-gate_attention-2A1F-m2"),
    # Out of CI for its budget (`nox -s tests-extended`): Qwen3-MoE gate on Attention
    # compiled runs in CI as Attention TP2 + FFN EP2 (test_parallel_roles.py).
    pytest.param(
        "qwen3_moe", True, 1, id="qwen3_moe-gate_attention-1A1F", marks=pytest.mark.extended
    ),
    # Out of CI for its budget (`nox -s tests-extended`): Qwen3-MoE compiled runs in CI
    # as Attention TP2 + FFN EP2, gate on FFN compiled in `afd demo` and with FFN EP2
    # (test_parallel_roles.py), data-parallel attention ranks compiled in the 2A1F m=2 case.
    pytest.param("qwen3_moe", False, 2, id="qwen3_moe-gate_ffn-2A1F", marks=pytest.mark.extended),
]


@pytest.mark.timeout(1200)  # compile warm-ups: the native reference's and the roles'
@pytest.mark.parametrize(("arch", "gate_on_attention", "num_attention"), CASES)
def test_compiled_served_tokens_equal_native_compiled(
    tiny_model_of: Callable[[str], Path],
    native_references: Any,
    tmp_path: Path,
    arch: str,
    gate_on_attention: bool,
    num_attention: int,
) -> None:
    from afd.launch import Deployment, DeploymentSpec
    from afd.tools.client import complete_each
    from afd_moe_runners.exchange_op import COMPILED_LOG

    model = tiny_model_of(arch)
    native = native_references.tokens(
        model, singles(PROMPTS), dtype="float32", llm_kwargs=COMPILED_SERVED
    )
    micro_batches = {"num_micro_batches": 2} if arch == "deepseek_v3" and gate_on_attention else {}
    spec = DeploymentSpec(
        model=str(model),
        num_attention=num_attention,
        compute_gate_on_attention=gate_on_attention,
        dtype="float32",
        max_model_len=512,
        log_dir=str(tmp_path / "logs"),
        afd={"connect_timeout_s": 300, "transfer_timeout_s": 120, **micro_batches},
    )
    assert not spec.enforce_eager  # the launcher's default: compiled
    console = io.StringIO()
    with Deployment(spec, echo=False, console=console, name="compiled") as dep:
        got, _ = complete_each(dep.url, PROMPTS, 32)
    assert_same_tokens(got, native, PROMPTS, f"native vLLM compiled ({arch}, float32)")
    attention_log = (tmp_path / "logs" / "attn.log").read_text()
    assert attention_log.count(COMPILED_LOG) == num_attention, attention_log[-3000:]
    ffn_log = (tmp_path / "logs" / "ffn0.log").read_text()
    assert "AFD FFN role: vLLM eager settings" in ffn_log, ffn_log[-2000:]
    assert "attn: compile warm-up started" in console.getvalue(), console.getvalue()[-3000:]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize(
    "gate",
    [
        # Out of CI for its budget (`nox -s tests-extended`): gate on FFN compiled runs
        # served in float32 above; the bfloat16 boundary case runs with the gate on Attention.
        pytest.param("ffn", marks=pytest.mark.extended),
        "attention-topk",
    ],
)
def test_compiled_bfloat16_equals_native_with_the_same_graph_boundaries(
    tiny_models: dict[str, Path], native_references: Any, tmp_path: Path, gate: str
) -> None:
    from afd_moe_runners.exchange_op import COMPILED_LOG

    model = tiny_models["deepseek_v3"]
    bounded = native_references.tokens(model, batch(PROMPTS), llm_kwargs=COMPILED_BOUNDARIES)
    result, _ = run_offline_afd(
        model, "AFDDeepseekV3ForCausalLM", afd_settings(gate), tmp_path, prompts=PROMPTS,
        compiled=True,
    )  # fmt: skip
    assert_same_tokens(result["token_ids"], bounded, PROMPTS, "native compiled, AFD's boundaries")
    assert result["log"].count(COMPILED_LOG) == 1, result["log"][-3000:]


@pytest.mark.extended  # out of CI for its budget (one compiled native engine, ~70 s)
@pytest.mark.timeout(1200)
def test_the_exchange_boundary_changes_native_bfloat16_tokens(
    tiny_models: dict[str, Path], native_references: Any
) -> None:
    """Why the bfloat16 case above compares with native behind AFD's boundaries: on this
    checkpoint plain native compiled answers differently (else that case would prove no
    more than plain parity)."""
    model = tiny_models["deepseek_v3"]
    bounded = native_references.tokens(model, batch(PROMPTS), llm_kwargs=COMPILED_BOUNDARIES)
    plain = native_references.tokens(model, batch(PROMPTS), llm_kwargs=COMPILED)
    assert bounded != plain, "the graph boundary changed no token: the case proves nothing"
