"""The generic split plan read off vLLM's own model classes (afd_moe_runners.split_plan):
per-layer kinds, checkpoint-tensor ownership, and `afd models check` on a dense model."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from afd_core.weights import WeightOwner

pytestmark = [pytest.mark.vllm]


def _tensor_names(model_dir: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            names += list(f.keys())
    return sorted(names)


@pytest.fixture(scope="module")
def checks(tiny_models: dict[str, Path], tiny_qwen_models: dict[str | None, Path]) -> Any:
    from afd.tools.models.check import check_model

    cache: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in cache:
            if name in tiny_models:
                path = tiny_models[name]
            elif name == "qwen3_5_moe_text":
                path = tiny_qwen_models[name]
            else:
                path = tiny_qwen_models[name.removeprefix("qwen3_moe-")]
            cache[name] = check_model(str(path))
        return cache[name]

    return get


@pytest.mark.parametrize(
    ("name", "kinds", "extras"),
    [
        ("deepseek_v2", ["dense", "moe", "moe"], {"shared_experts"}),
        ("deepseek_v3", ["dense", "moe", "moe"], {"shared_experts"}),
        ("qwen3_moe-dense_layers", ["moe", "dense", "moe"], set()),
        ("qwen3_5_moe_text", ["moe"] * 4, {"shared_expert", "shared_expert_gate"}),
    ],
)
def test_plan_per_layer(checks: Any, name: str, kinds: list[str], extras: set[str]) -> None:
    result = checks(name)
    plan = result.plan
    assert result.supported, plan.problems
    assert [layer.kind for layer in plan.layers] == kinds
    assert all(layer.attention[0] in ("self_attn", "linear_attn") for layer in plan.layers)
    assert all(len(layer.attention) == 1 and layer.ffn == "mlp" for layer in plan.layers)
    assert plan.gate_attrs == {"gate"}
    assert plan.moe_extra_attrs == extras
    assert plan.embedding_prefixes == ("model.embed_tokens",)
    assert plan.lm_head_prefixes == ("lm_head",)
    assert "splits into Attention and FFN roles" in result.summary()


A, F, B = WeightOwner.ATTENTION, WeightOwner.FFN, WeightOwner.BOTH

#: Checkpoint tensor -> (owner with the gate on FFN, owner with the gate on Attention), per
#: family: the tables the hand-written DeepSeek / Qwen wrappers used (proven by their
#: parity tests before the generic path replaced them), here as the oracle.
OWNERS: dict[str, dict[str, tuple[WeightOwner, WeightOwner]]] = {
    "deepseek_v3": {
        "model.embed_tokens.weight": (A, A),
        "lm_head.weight": (A, A),
        "model.norm.weight": (B, B),
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (A, A),
        "model.layers.0.self_attn.q_a_layernorm.weight": (A, A),
        "model.layers.0.input_layernorm.weight": (B, B),
        "model.layers.0.mlp.gate_proj.weight": (F, F),  # dense layer
        "model.layers.1.mlp.experts.3.down_proj.weight": (F, F),
        "model.layers.1.mlp.shared_experts.up_proj.weight": (F, F),
        "model.layers.1.mlp.gate.weight": (F, B),
        "model.layers.1.mlp.gate.e_score_correction_bias": (F, B),
    },
    "qwen3_moe-dense_layers": {
        "model.embed_tokens.weight": (A, A),
        "lm_head.weight": (A, A),
        "model.norm.weight": (B, B),
        "model.layers.0.self_attn.q_proj.weight": (A, A),
        "model.layers.0.self_attn.q_norm.weight": (A, A),
        "model.layers.0.input_layernorm.weight": (B, B),
        "model.layers.0.post_attention_layernorm.weight": (B, B),
        "model.layers.0.mlp.gate.weight": (F, B),
        "model.layers.0.mlp.experts.7.down_proj.weight": (F, F),
        "model.layers.1.mlp.gate_proj.weight": (F, F),  # dense (mlp_only) layer
        "model.layers.1.mlp.down_proj.weight": (F, F),
    },
    "qwen3_5_moe_text": {
        "model.layers.0.linear_attn.in_proj_qkv.weight": (A, A),
        "model.layers.0.linear_attn.A_log": (A, A),
        "model.layers.0.linear_attn.conv1d.weight": (A, A),
        "model.layers.0.mlp.shared_expert.gate_proj.weight": (F, F),
        "model.layers.0.mlp.shared_expert_gate.weight": (F, F),
        # Text checkpoints that keep the VL stack's prefix (vLLM's mapper strips it).
        "model.language_model.layers.3.self_attn.o_proj.weight": (A, A),
        "model.language_model.layers.3.mlp.gate.weight": (F, B),
        "model.language_model.layers.3.mlp.experts.0.up_proj.weight": (F, F),
        "model.language_model.embed_tokens.weight": (A, A),
        "model.language_model.norm.weight": (B, B),
        "mtp.fc.weight": (B, B),  # dropped by the mapper: both native loaders skip it
    },
}


@pytest.mark.parametrize("name", sorted(OWNERS))
def test_tensor_owners(checks: Any, name: str) -> None:
    from afd_moe_runners.generic import classify_weight, native_model_class

    result = checks(name)
    native = native_model_class(result.architecture)
    for tensor, (gate_on_ffn, gate_on_attention) in OWNERS[name].items():
        assert classify_weight(native, result.plan, tensor, gate_on_attention=False) is (
            gate_on_ffn
        ), tensor
        assert classify_weight(native, result.plan, tensor, gate_on_attention=True) is (
            gate_on_attention
        ), tensor


def test_tensors_of_what_the_attention_role_computes_go_to_attention(checks: Any) -> None:
    """Dense layers (a connector without hidden-only payloads) and shared experts (NPU
    runners, gate on Attention) computed on Attention: their tensors load there only."""
    from afd_moe_runners.generic import classify_weight, native_model_class

    result = checks("deepseek_v3")
    native = native_model_class(result.architecture)

    def owner(tensor: str, **placement: bool) -> WeightOwner:
        return classify_weight(native, result.plan, tensor, gate_on_attention=True, **placement)

    dense = "model.layers.0.mlp.gate_proj.weight"
    shared = "model.layers.1.mlp.shared_experts.up_proj.weight"
    routed = "model.layers.1.mlp.experts.3.down_proj.weight"
    assert (owner(dense), owner(shared)) == (F, F)
    assert owner(dense, dense_on_attention=True) is A
    assert owner(shared, dense_on_attention=True) is F
    assert owner(shared, shared_on_attention=True) is A
    assert owner(dense, shared_on_attention=True) is F
    both = {"dense_on_attention": True, "shared_on_attention": True}
    assert (owner(routed, **both), owner("model.layers.1.mlp.gate.weight", **both)) == (F, B)


def test_every_checkpoint_tensor_has_an_owner(checks: Any, tiny_models: dict[str, Path]) -> None:
    """No tensor of a real checkpoint falls outside the plan's categories unnoticed: each
    is attention, FFN-block or shared (norms), and the FFN-block ones are many."""
    from afd_moe_runners.generic import classify_weight, native_model_class

    result = checks("deepseek_v3")
    native = native_model_class(result.architecture)
    owners = Counter(
        classify_weight(native, result.plan, n, gate_on_attention=False)
        for n in _tensor_names(tiny_models["deepseek_v3"])
    )
    assert set(owners) == {A, F, B}
    assert owners[F] > owners[A] > owners[B]


def test_a_dense_model_is_refused_in_one_line(tmp_path: Path) -> None:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
    )
    config.architectures = ["LlamaForCausalLM"]
    model_dir = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(str(model_dir))
    proc = subprocess.run(
        [sys.executable, "-m", "afd.cli", "models", "check", str(model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    verdict = [ln for ln in proc.stdout.splitlines() if ln.startswith(str(model_dir))]
    assert len(verdict) == 1, proc.stdout
    assert "LlamaForCausalLM cannot be split" in verdict[0]
    assert "no MoE layer" in verdict[0]


def test_sparse_attention_is_refused_on_cpu_as_native_vllm_refuses_it(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """DeepSeek V3.2's sparse attention does not run on vLLM's CPU build (native vLLM
    stops with this error too); the plan cannot be read here, and says why. Fails when
    vLLM CPU gains sparse attention: then V3.2 parity belongs in the e2e suites."""
    from afd.tools.models.check import check_model
    from afd.tools.models.tiny import checkpoint_name, generate_tiny_checkpoint

    root = tmp_path_factory.mktemp("v32")
    model = generate_tiny_checkpoint("deepseek_v32", root / checkpoint_name("deepseek_v32"))
    with pytest.raises(NotImplementedError, match="Sparse Attention is not supported on CPU"):
        check_model(str(model))


@pytest.mark.matrix  # `nox -s tests-matrix` (CI runs it)
def test_an_unreadable_model_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    proc = subprocess.run(
        [sys.executable, "-m", "afd.cli", "models", "check", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "afd models check:" in proc.stderr
