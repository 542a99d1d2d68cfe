"""Role-aware Qwen wrappers, built and loaded by real vLLM (CPU) from tiny checkpoints.

Each case builds in a process of its own (vLLM keeps process-global state), forked by
tests/support/afd_role_models.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from afd_processes import child_environ
from afd_role_models import build_role_model, run_probe, run_role_model_build

pytestmark = [pytest.mark.vllm]


ATTENTION = {"role": "attention", "connector": "LoopbackAFDConnector", "port": 1}


@pytest.mark.parametrize(
    ("variant", "gate_on_attention"), [("dense_layers", False), ("dense_layers", True)]
)
def test_qwen3_moe_attention_role_holds_no_ffn_parameters(
    tiny_qwen_models: dict[str, Path], tmp_path: Path, variant: str, gate_on_attention: bool
) -> None:
    afd = {**ATTENTION, "compute_gate_on_attention": gate_on_attention}
    result = build_role_model(tiny_qwen_models[variant], "AFDQwen3MoeForCausalLM", afd, tmp_path)
    names = result["names"]
    assert not [n for n in names if ".experts." in n or "shared_expert" in n]
    assert not [n for n in names if ".mlp." in n and ".mlp.gate." not in n]  # dense layer 1
    gates = [n for n in names if ".mlp.gate." in n]
    assert len(gates) == (2 if gate_on_attention else 0), gates  # layers 0 and 2 are MoE
    assert any(".self_attn.q_norm." in n for n in names)
    assert any("embed_tokens" in n for n in names) and any("lm_head" in n for n in names)
    inv = result["inventory"]
    for category in ("routed_experts", "shared_experts", "dense_mlp"):
        assert inv.get(category, 0) == 0, inv


@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_qwen3_moe_ffn_role_holds_no_attention_parameters(
    tiny_qwen_models: dict[str, Path], tmp_path: Path, gate_on_attention: bool
) -> None:
    afd = {"role": "ffn", "compute_gate_on_attention": gate_on_attention}
    result = build_role_model(
        tiny_qwen_models["dense_layers"], "AFDQwen3MoeForCausalLM", afd, tmp_path
    )
    names = result["names"]
    assert not [n for n in names if ".self_attn." in n or "embed_tokens" in n or "lm_head" in n]
    assert any(".mlp.experts." in n for n in names)
    assert any(n.startswith("model.layers.1.mlp.gate_up_proj.") for n in names)  # dense
    assert sum(".mlp.gate.weight" in n for n in names) == 2
    inv = result["inventory"]
    assert inv.get("attention", 0) == 0 and inv.get("embedding", 0) == 0, inv
    assert inv["routed_experts"] > 0 and inv["dense_mlp"] > 0


def test_qwen3_moe_rejects_unsupported_options(
    tiny_qwen_models: dict[str, Path], tmp_path: Path
) -> None:
    proc = run_role_model_build(
        tiny_qwen_models[None],
        "AFDQwen3MoeForCausalLM",
        {"role": "ffn"},
        tmp_path,
        {"enable_lora": True},
    )
    assert proc.returncode != 0
    assert "LoRA is not supported by afd" in proc.stdout + proc.stderr


PROBE = """
import json, sys
import torch
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.executor import Executor

model_dir = sys.argv[1]
cfg = EngineArgs(
    model=model_dir, hf_overrides={"architectures": ["AFDQwen3MoeForCausalLM"]},
    additional_config={"afd": {"role": "ffn"}}, enforce_eager=True, dtype="bfloat16",
    max_model_len=256, gpu_memory_utilization=0.1, distributed_executor_backend="uni",
    worker_extension_cls="afd.runtime.ffn_server.AFDWorkerExtension",
).create_engine_config()


def probe(worker):
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.model_executor.models import qwen3_moe

    from afd_core.transfer import AttentionToFFN
    from afd_moe_runners.ffn_compute import FFNLayerCompute

    model = worker.model_runner.get_model()
    vllm_config = worker.vllm_config
    with set_current_vllm_config(vllm_config):
        compute = FFNLayerCompute(model.afd_ffn_blocks(), vllm_config=vllm_config)
        out = {}
        x = torch.randn(5, model.config.hidden_size, dtype=torch.bfloat16,
                        generator=torch.Generator().manual_seed(0))
        for idx, block in compute.layers.items():
            runner = compute.runners[idx]
            served = compute.compute(idx, AttentionToFFN(x)).output
            with set_forward_context(None, vllm_config, num_tokens=x.shape[0]):
                native = block(x)
            out[idx] = {
                "block_is_native_moe": type(block) is qwen3_moe.Qwen3MoeSparseMoeBlock,
                "block_is_native_mlp": type(block) is qwen3_moe.Qwen3MoeMLP,
                "runner_is_native": runner is not None and type(runner) is MoERunner,
                "runner_is_none": runner is None,
                "equal_to_native_block": bool(torch.equal(served, native)),
            }
    return {
        "compute_module": type(compute).__module__,
        "layers": out,
    }


executor = Executor.get_class(cfg)(cfg)
try:
    print("RESULT " + json.dumps(executor.collective_rpc(probe)[0]))
finally:
    executor.shutdown()
"""


def test_qwen3_moe_ffn_compute_is_model_independent(
    tiny_qwen_models: dict[str, Path], tmp_path: Path
) -> None:
    """The FFN role serves vLLM's own Qwen blocks and runner through FFNLayerCompute."""
    env = {**child_environ(), "TMPDIR": str(tmp_path), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    result = run_probe(PROBE, str(tiny_qwen_models["dense_layers"]), env=env)
    assert result["compute_module"] == "afd_moe_runners.ffn_compute"
    layers = result["layers"]
    assert sorted(layers) == ["0", "1", "2"]
    for idx in ("0", "2"):  # MoE layers: vLLM's block and vLLM's own MoERunner
        assert layers[idx]["block_is_native_moe"] and layers[idx]["runner_is_native"], layers
    assert layers["1"]["block_is_native_mlp"] and layers["1"]["runner_is_none"], layers
    assert all(v["equal_to_native_block"] for v in layers.values()), layers


# ----------------------------------------------------------------- Qwen3.5/3.6-MoE


# vLLM 0.32's qwen3_5 model file imports torchvision (for images only), which this CPU
# environment lacks: these run through afd's import seam (afd_models_qwen.qwen3_5_import,
# installed by the afd plugin in every vLLM process).

INSPECT = """
import json, sys
from vllm.model_executor.models.registry import ModelRegistry

result = {}
for arch in sys.argv[1:]:
    info = ModelRegistry.models[arch].inspect_model_cls()
    result[arch] = {"is_hybrid": info.is_hybrid, "multimodal": info.supports_multimodal}
result["qwen3_5_imported_here"] = "vllm.model_executor.models.qwen3_5" in sys.modules
print("RESULT " + json.dumps(result))
"""


@pytest.mark.matrix  # `nox -s tests-matrix` (CI runs it): the default run's time budget
def test_qwen3_5_moe_is_inspected_in_vllm_registry_subprocess(tmp_path: Path) -> None:
    """vLLM inspects a model class in a subprocess of its own (``python -m
    vllm.model_executor.models.registry``) that imports the model file after loading the
    general plugins; a fresh VLLM_CACHE_ROOT makes it run instead of reading its cache."""
    env = {**child_environ(), "TMPDIR": str(tmp_path), "VLLM_CACHE_ROOT": str(tmp_path / "cache")}
    archs = ["Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"]
    result = run_probe(INSPECT, *archs, env=env)
    assert result == {
        "Qwen3_5MoeForCausalLM": {"is_hybrid": True, "multimodal": False},
        "Qwen3_5MoeForConditionalGeneration": {"is_hybrid": True, "multimodal": True},
        "qwen3_5_imported_here": False,
    }, result
    for arch in archs:
        assert list((tmp_path / "cache" / "modelinfos").glob(f"*qwen3_5-{arch}.json")), arch


@pytest.mark.matrix  # `nox -s tests-matrix`: the generic path's inventories run by default
@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_qwen3_5_moe_role_inventories(
    tiny_qwen_models: dict[str, Path],
    tmp_path: Path,
    gate_on_attention: bool,
) -> None:
    model = tiny_qwen_models["qwen3_5_moe_text"]
    alias = "AFDQwen3_5MoeForCausalLM"
    attn = build_role_model(
        model, alias, {**ATTENTION, "compute_gate_on_attention": gate_on_attention}, tmp_path
    )
    names = attn["names"]
    assert not [n for n in names if ".experts." in n or "shared_expert" in n], names
    gates = [n for n in names if ".mlp.gate." in n]
    assert len(gates) == (4 if gate_on_attention else 0), gates
    assert any(".linear_attn." in n for n in names) and any(".self_attn." in n for n in names)
    assert any("embed_tokens" in n for n in names) and any("lm_head" in n for n in names)
    for category in ("routed_experts", "shared_experts", "dense_mlp"):
        assert attn["inventory"].get(category, 0) == 0, attn["inventory"]

    ffn = build_role_model(
        model, alias, {"role": "ffn", "compute_gate_on_attention": gate_on_attention}, tmp_path
    )
    names = ffn["names"]
    assert not [n for n in names if "_attn." in n or "embed_tokens" in n or "lm_head" in n], names
    assert sum(".mlp.shared_expert.gate_up_proj." in n for n in names) == 4
    assert sum(".mlp.shared_expert_gate." in n for n in names) == 4
    assert sum(".mlp.gate.weight" in n for n in names) == 4
    inv = ffn["inventory"]
    assert inv.get("attention", 0) == 0 and inv.get("embedding", 0) == 0, inv
    assert inv["routed_experts"] > 0 and inv["shared_experts"] > 0, inv
