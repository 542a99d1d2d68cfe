"""Tiny checkpoint generator (afd.tools.models.tiny) and the native vLLM reference runner.

Over 400 lines on purpose: the module-scoped fixtures (``ckpts``, ``bench_ckpts``)
generate every tiny and bench checkpoint once for all the checks here (determinism,
invariants, each family's structure, bench sizes); split modules would generate them
again each. The recipes themselves (data) are tested in the model packages
(``packages/afd-models-*/tests/test_recipes.py``) and in ``test_tiny_recipes.py``."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from afd.tools.models.tiny import (
    GENERATOR_VERSION,
    STAMP_FILE,
    TINY_ARCHS,
    TINY_SIZES,
    checkpoint_name,
    generate_tiny_checkpoint,
    tiny_config,
    tiny_variants,
)

ALL = [(arch, variant) for arch in TINY_ARCHS for variant in tiny_variants(arch)]


def _id(av: tuple[str, str | None]) -> str:
    return checkpoint_name(av[0], av[1])


def _hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _config(d: Path) -> dict[str, Any]:
    return dict(json.loads((d / "config.json").read_text()))


def _tensors(d: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return dict(load_file(str(d / "model.safetensors")))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str | None], Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        (a, v): generate_tiny_checkpoint(a, root / checkpoint_name(a, v), variant=v) for a, v in ALL
    }


# ---------------------------------------------------------------------- determinism


def test_same_seed_gives_identical_bytes(
    ckpts: dict[tuple[str, str | None], Path], tmp_path: Path
) -> None:
    again = generate_tiny_checkpoint("deepseek_v2", tmp_path / "again")
    assert _hashes(again) == _hashes(ckpts[("deepseek_v2", None)])


def test_different_seed_gives_different_weights(
    ckpts: dict[tuple[str, str | None], Path], tmp_path: Path
) -> None:
    other = generate_tiny_checkpoint("deepseek_v2", tmp_path / "s1", seed=1)
    base = _hashes(ckpts[("deepseek_v2", None)])
    new = _hashes(other)
    assert new["model.safetensors"] != base["model.safetensors"]
    assert new["tokenizer.json"] == base["tokenizer.json"]  # tokenizer is seed-independent
    assert json.loads((other / STAMP_FILE).read_text())["seed"] == 1


def test_idempotent_skip_and_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "q"
    generate_tiny_checkpoint("qwen3_moe", out)
    st = out / "model.safetensors"
    st_mtime, st_ino = st.stat().st_mtime_ns, st.stat().st_ino
    stamp = json.loads((out / STAMP_FILE).read_text())
    assert stamp["arch"] == "qwen3_moe" and stamp["variant"] is None and stamp["seed"] == 0
    assert stamp["generator_version"] == GENERATOR_VERSION
    assert set(stamp["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}

    generate_tiny_checkpoint("qwen3_moe", out)  # matching stamp: nothing rewritten
    assert (st.stat().st_mtime_ns, st.stat().st_ino) == (st_mtime, st_ino)

    generate_tiny_checkpoint("qwen3_moe", out, overwrite=True)
    assert (out / "model.safetensors").stat().st_ino != st_ino  # a new file was moved in
    assert json.loads((out / STAMP_FILE).read_text())["files"] == stamp["files"]

    generate_tiny_checkpoint("qwen3_moe", out, variant="no_norm_topk")  # stamp mismatch
    assert _config(out)["norm_topk_prob"] is False
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_unknown_arch_and_variant() -> None:
    with pytest.raises(ValueError, match="unknown tiny arch"):
        tiny_config("llama")
    with pytest.raises(ValueError, match="no variants"):
        tiny_config("deepseek_v2", "dense_layers")
    with pytest.raises(ValueError, match="unknown qwen3_moe variant"):
        tiny_config("qwen3_moe", "nope")


# ---------------------------------------------------------------- config invariants


@pytest.mark.parametrize("av", ALL, ids=_id)
def test_common_invariants(ckpts: dict[tuple[str, str | None], Path], av: Any) -> None:
    from transformers import AutoTokenizer

    d = ckpts[av]
    cfg = _config(d)
    assert cfg["model_type"] == av[0]
    assert cfg["architectures"] == [TINY_ARCHS[av[0]].model_cls]
    assert 2 <= cfg["num_hidden_layers"] <= 4
    assert 64 <= cfg["hidden_size"] <= 256
    assert cfg.get("num_experts_per_tok", cfg.get("moe_k")) == 2  # ERNIE: moe_k
    assert cfg["max_position_embeddings"] == 512 and cfg["tie_word_embeddings"] is False
    tok = AutoTokenizer.from_pretrained(str(d))
    assert len(tok) == cfg["vocab_size"]
    assert 512 <= cfg["vocab_size"] <= 1024
    assert tok.eos_token_id == cfg["eos_token_id"] and tok.bos_token_id == cfg["bos_token_id"]
    text = "Hello, world! The capital of France is Paris."
    assert tok.decode(tok(text)["input_ids"]) == text
    tensors = _tensors(d)
    gate = next(v for k, v in tensors.items() if k.endswith(ROUTERS))
    # O(1) router logits: the gate is scaled 1/sqrt(hidden), not 0.02.
    assert 0.5 < float(gate.float().std()) * cfg["hidden_size"] ** 0.5 < 2.0
    import torch

    # bf16 weights (as real checkpoints); only router correction biases stay fp32.
    for k, v in tensors.items():
        want = torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16
        assert v.dtype == want, k
    # Linear biases (attention, GPT-OSS's router): small but not zero.
    for k, v in tensors.items():
        if k.endswith(".bias") and v.ndim == 1:
            assert 0.03 < float(v.float().std()) < 0.3 and float(v.float().abs().mean()) < 0.3, k


#: Router weight names (Mixtral-style ``block_sparse_moe``, GPT-OSS's ``router``).
ROUTERS = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight")


def _layer_kinds(tensors: dict[str, Any], n_layers: int) -> list[str]:
    kinds = []
    for i in range(n_layers):
        p = f"model.layers.{i}.mlp."
        if {
            f"{p}experts.0.gate_proj.weight",
            f"model.layers.{i}.block_sparse_moe.experts.0.w1.weight",  # Mixtral, MiniMax-M2
            f"{p}experts.gate_up_proj",  # GPT-OSS (fused experts)
        } & set(tensors):
            kinds.append("moe")
        elif f"{p}gate_proj.weight" in tensors:
            kinds.append("dense")
        else:
            kinds.append("?")
    return kinds


def test_deepseek_v2(ckpts: dict[tuple[str, str | None], Path]) -> None:
    d = ckpts[("deepseek_v2", None)]
    cfg = _config(d)
    assert cfg["kv_lora_rank"] == 512 and cfg["qk_rope_head_dim"] == 64  # CPU MLA: 576
    assert cfg["q_lora_rank"] is None
    assert cfg["topk_method"] == "greedy" and cfg.get("scoring_func", "softmax") == "softmax"
    assert cfg["n_group"] == 1 and cfg["topk_group"] == 1
    assert cfg["first_k_dense_replace"] == 1
    assert cfg["n_routed_experts"] == 8 and cfg["n_shared_experts"] == 1
    tensors = _tensors(d)
    assert _layer_kinds(tensors, cfg["num_hidden_layers"]) == ["dense", "moe", "moe"]
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in tensors
    assert not any("e_score_correction_bias" in k for k in tensors)
    assert tensors["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].shape[0] == 576


def test_deepseek_v3(ckpts: dict[tuple[str, str | None], Path]) -> None:
    import torch

    d = ckpts[("deepseek_v3", None)]
    cfg = _config(d)
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576
    assert cfg["q_lora_rank"] is not None
    assert cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sigmoid"
    assert cfg["n_group"] > 1 and 1 < cfg["topk_group"] < cfg["n_group"]
    assert cfg["n_routed_experts"] % cfg["n_group"] == 0
    assert cfg["routed_scaling_factor"] == 2.5
    assert cfg["n_shared_experts"] == 1 and cfg["norm_topk_prob"] is True
    tensors = _tensors(d)
    assert _layer_kinds(tensors, cfg["num_hidden_layers"]) == ["dense", "moe", "moe"]
    biases = [tensors[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] for i in (1, 2)]
    for b in biases:
        assert b.dtype == torch.float32 and b.shape == (cfg["n_routed_experts"],)
        assert float(b.abs().min()) > 0 and float(b.std()) > 0.01
    assert not torch.equal(biases[0], biases[1])


def test_deepseek_v3_mtp_variant_carries_one_mtp_layer(
    ckpts: dict[tuple[str, str | None], Path],
) -> None:
    """As DeepSeek-V3 ships its MTP layer: layer ``num_hidden_layers`` has every tensor of
    an MoE decoder layer plus enorm/hnorm/eh_proj/shared_head (in ``mtp.safetensors``);
    the main model's tensors are those of the variant without MTP."""
    import torch
    from safetensors.torch import load_file

    from afd.tools.models.tiny import MTP_FILE

    d, plain = ckpts[("deepseek_v3", "mtp")], ckpts[("deepseek_v3", None)]
    cfg = _config(d)
    last, mtp_idx = cfg["num_hidden_layers"] - 1, cfg["num_hidden_layers"]
    assert cfg["num_nextn_predict_layers"] == 1 and _config(plain)["num_nextn_predict_layers"] == 0
    assert _hashes(d)["model.safetensors"] == _hashes(plain)["model.safetensors"]
    assert not (plain / MTP_FILE).exists()
    main, mtp = _tensors(d), dict(load_file(str(d / MTP_FILE)))
    block = {k.split(".", 3)[3] for k in main if k.startswith(f"model.layers.{last}.")}
    extra = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
             "shared_head.head.weight"}  # fmt: skip
    assert {k.split(".", 3)[3] for k in mtp} == block | extra
    assert all(k.startswith(f"model.layers.{mtp_idx}.") for k in mtp)
    h = cfg["hidden_size"]
    assert mtp[f"model.layers.{mtp_idx}.eh_proj.weight"].shape == (h, 2 * h)
    bias = mtp[f"model.layers.{mtp_idx}.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and float(bias.std()) > 0.01
    assert mtp[f"model.layers.{mtp_idx}.mlp.experts.0.gate_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(
        mtp[f"model.layers.{mtp_idx}.shared_head.head.weight"], main["lm_head.weight"]
    )
    own = f"model.layers.{mtp_idx}.mlp.experts.0.down_proj.weight"
    assert not torch.equal(mtp[own], main[f"model.layers.{last}.mlp.experts.0.down_proj.weight"])


@pytest.mark.parametrize(
    ("variant", "norm", "kinds"),
    [
        (None, True, ["moe", "moe", "moe"]),
        ("no_norm_topk", False, ["moe", "moe", "moe"]),
        ("dense_layers", True, ["moe", "dense", "moe"]),
    ],
)
def test_qwen3_moe(
    ckpts: dict[tuple[str, str | None], Path],
    variant: str | None,
    norm: bool,
    kinds: list[str],
) -> None:
    d = ckpts[("qwen3_moe", variant)]
    cfg = _config(d)
    assert cfg["norm_topk_prob"] is norm
    assert cfg.get("num_experts", cfg.get("num_local_experts")) == 8
    assert _layer_kinds(_tensors(d), cfg["num_hidden_layers"]) == kinds


def test_weights_differ_between_variants(ckpts: dict[tuple[str, str | None], Path]) -> None:
    # Same seed, same shapes: no_norm_topk only flips a config flag.
    a = _hashes(ckpts[("qwen3_moe", None)])
    b = _hashes(ckpts[("qwen3_moe", "no_norm_topk")])
    assert a["model.safetensors"] == b["model.safetensors"]
    assert a["config.json"] != b["config.json"]


# ------------------------------------------------------------ more MoE families

#: Per arch: the kind of each layer and tensors of layer 1 that carry the family's
#: structural features (what an attention/FFN split has to place).
FAMILIES: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "mixtral": (
        ["moe"] * 3,
        ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.7.w3.weight"),
    ),
    "glm4_moe": (
        ["dense", "moe", "moe"],
        (
            "mlp.gate.e_score_correction_bias",
            "mlp.shared_experts.gate_proj.weight",
            "self_attn.q_proj.bias",
            "self_attn.q_norm.weight",
        ),
    ),
    "ernie4_5_moe": (
        ["dense", "moe", "moe"],
        ("mlp.moe_statics.e_score_correction_bias", "mlp.shared_experts.gate_proj.weight"),
    ),
    "qwen3_next": (
        ["moe"] * 4,
        (
            "linear_attn.in_proj_qkvz.weight",
            "linear_attn.A_log",
            "mlp.shared_expert.gate_proj.weight",
            "mlp.shared_expert_gate.weight",
        ),
    ),
    "gpt_oss": (
        ["moe"] * 4,
        (
            "mlp.router.bias",
            "mlp.experts.gate_up_proj_bias",
            "mlp.experts.down_proj_bias",
            "self_attn.sinks",
        ),
    ),
    "minimax_m2": (
        ["moe"] * 3,
        ("block_sparse_moe.e_score_correction_bias", "self_attn.q_norm.weight"),
    ),
    "olmoe": (["moe"] * 3, ("self_attn.q_norm.weight", "self_attn.k_norm.weight")),
    "qwen2_moe": (
        ["moe"] * 3,
        (
            "mlp.shared_expert.gate_proj.weight",
            "mlp.shared_expert_gate.weight",
            "self_attn.q_proj.bias",
        ),
    ),
}


def _n_experts(cfg: dict[str, Any]) -> int:
    keys = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    return int(next(cfg[k] for k in keys if k in cfg))


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_family_structure(ckpts: dict[tuple[str, str | None], Path], arch: str) -> None:
    d = ckpts[(arch, None)]
    cfg = _config(d)
    tensors = _tensors(d)
    kinds, keys = FAMILIES[arch]
    assert _layer_kinds(tensors, cfg["num_hidden_layers"]) == kinds
    for k in keys:
        assert f"model.layers.1.{k}" in tensors, k
    assert _n_experts(cfg) == 8
    router = next(v for k, v in tensors.items() if k.endswith(ROUTERS))
    assert tuple(router.shape) == (8, cfg["hidden_size"])


@pytest.mark.parametrize(
    ("arch", "name", "shape"),
    [
        ("glm4_moe", "mlp.gate.e_score_correction_bias", (8,)),
        ("ernie4_5_moe", "mlp.moe_statics.e_score_correction_bias", (1, 8)),
        ("minimax_m2", "block_sparse_moe.e_score_correction_bias", (8,)),
    ],
)
def test_router_correction_bias(
    ckpts: dict[tuple[str, str | None], Path], arch: str, name: str, shape: tuple[int, ...]
) -> None:
    import torch

    tensors = _tensors(ckpts[(arch, None)])
    first_moe = 0 if arch == "minimax_m2" else 1
    biases = [tensors[f"model.layers.{i}.{name}"] for i in (first_moe, 2)]
    for b in biases:  # small, non-zero, fp32 (a buffer in transformers, or ERNIE's parameter)
        assert b.dtype == torch.float32 and tuple(b.shape) == shape
        assert float(b.abs().min()) > 0 and 0.01 < float(b.std()) < 0.2
    assert not torch.equal(biases[0], biases[1])


def test_glm4_moe(ckpts: dict[tuple[str, str | None], Path]) -> None:
    cfg = _config(ckpts[("glm4_moe", None)])
    assert cfg["first_k_dense_replace"] == 1 and cfg["n_shared_experts"] == 1
    assert cfg["n_group"] > 1 and 1 < cfg["topk_group"] < cfg["n_group"]
    assert cfg["n_routed_experts"] % cfg["n_group"] == 0
    assert cfg["norm_topk_prob"] is True and cfg["routed_scaling_factor"] == 2.5
    rope = cfg.get("rope_parameters") or {}
    assert rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) == 0.5
    assert cfg["attention_bias"] is True and cfg["use_qk_norm"] is True
    assert cfg["head_dim"] == 32


def test_ernie4_5_moe(ckpts: dict[tuple[str, str | None], Path]) -> None:
    d = ckpts[("ernie4_5_moe", None)]
    cfg = _config(d)
    assert cfg["moe_layer_start_index"] == 1 and cfg["moe_num_shared_experts"] == 2
    shared = _tensors(d)["model.layers.1.mlp.shared_experts.gate_proj.weight"]
    assert tuple(shared.shape) == (2 * cfg["moe_intermediate_size"], cfg["hidden_size"])


def test_qwen3_next(ckpts: dict[tuple[str, str | None], Path]) -> None:
    d = ckpts[("qwen3_next", None)]
    cfg = _config(d)
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg["linear_key_head_dim"] == cfg["linear_value_head_dim"] == 128  # CPU GDN
    tensors = _tensors(d)
    for i, kind in enumerate(cfg["layer_types"]):
        attn = "linear_attn" if kind == "linear_attention" else "self_attn"
        other = "self_attn" if kind == "linear_attention" else "linear_attn"
        assert any(k.startswith(f"model.layers.{i}.{attn}.") for k in tensors)
        assert not any(k.startswith(f"model.layers.{i}.{other}.") for k in tensors)
        assert f"model.layers.{i}.mlp.shared_expert_gate.weight" in tensors


def test_gpt_oss(ckpts: dict[tuple[str, str | None], Path]) -> None:
    d = ckpts[("gpt_oss", None)]
    cfg = _config(d)
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert cfg["head_dim"] == 64 and cfg["attention_bias"] is True
    assert cfg["rope_parameters"]["rope_type"] == "yarn"
    tensors = _tensors(d)
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    gate_up = tensors["model.layers.1.mlp.experts.gate_up_proj"]
    down = tensors["model.layers.1.mlp.experts.down_proj"]
    # Stored (experts, in, out): the init scales by the fan-in, shape[-2].
    assert tuple(gate_up.shape) == (8, h, 2 * i) and tuple(down.shape) == (8, i, h)
    assert 0.8 < float(gate_up.float().std()) * h**0.5 < 1.2
    assert 0.8 < float(down.float().std()) * i**0.5 < 1.2
    assert tuple(tensors["model.layers.1.self_attn.sinks"].shape) == (cfg["num_attention_heads"],)


def test_minimax_m2(ckpts: dict[tuple[str, str | None], Path]) -> None:
    d = ckpts[("minimax_m2", None)]
    cfg = _config(d)
    # The released config.json's fields that vLLM reads.
    assert cfg["scoring_func"] == "sigmoid" and cfg["use_routing_bias"] is True
    assert cfg["rotary_dim"] == cfg["head_dim"] // 2
    q_norm = _tensors(d)["model.layers.0.self_attn.q_norm.weight"]
    assert tuple(q_norm.shape) == (cfg["num_attention_heads"] * cfg["head_dim"],)  # per layer


# ------------------------------------------------------------------- native vLLM


def _run_reference(model: Path, out: Path, tmpdir: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env["TMPDIR"] = str(tmpdir)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "afd.reference",
            str(model),
            "--json",
            str(out),
            "--max-tokens",
            "16",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(json.loads(out.read_text()))


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.matrix  # runs in `nox -s tests-matrix` (CI runs it too)
def test_native_greedy_deepseek_v2_deterministic(
    ckpts: dict[tuple[str, str | None], Path], tmp_path: Path
) -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    model = ckpts[("deepseek_v2", None)]
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    first = _run_reference(model, tmp_path / "a.json", tmpdir)
    second = _run_reference(model, tmp_path / "b.json", tmpdir)

    ids = first["token_ids"]
    assert len(ids) == len(first["prompts"]) >= 8
    assert all(len(t) == 16 for t in ids)
    assert ids == second["token_ids"], "greedy decoding is not deterministic run to run"
    # Not degenerate: different prompts continue differently, with many distinct tokens.
    assert len({tuple(t) for t in ids}) == len(ids)
    assert len({t[0] for t in ids}) >= len(ids) // 2
    assert len({x for t in ids for x in t}) > 50


#: The other families on native vLLM 0.32 CPU. MiniMax-M2 does not run there: the CPU
#: router (CPURouter) takes sigmoid scoring only through grouped top-k, which MiniMax-M2
#: does not use ("assert self.scoring_func == 'softmax'"); GPU routers handle it.
#: Families whose native run is the reference of an end-to-end parity test
#: (tests/e2e/test_generic_families.py, which checks the same "loads, generates, not
#: degenerate" on it): not started a second time here.
NATIVE_IN_E2E = frozenset({"mixtral", "glm4_moe", "ernie4_5_moe", "qwen3_next", "gpt_oss"})
NATIVE_FAMILIES = [
    *(a for a in sorted(FAMILIES) if a != "minimax_m2" and a not in NATIVE_IN_E2E),
    # A record of vLLM 0.32 CPU's refusal, not of afd: out of CI for its budget
    # (`nox -s tests-extended`; a strict xfail, so it fails once vLLM runs it).
    pytest.param(
        "minimax_m2",
        marks=[
            pytest.mark.xfail(
                strict=True, reason="vLLM 0.32 CPU router: sigmoid scoring needs grouped top-k"
            ),
            pytest.mark.extended,
        ],
    ),
]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.parametrize("arch", NATIVE_FAMILIES)
def test_native_greedy_family(
    ckpts: dict[tuple[str, str | None], Path], tmp_path: Path, arch: str
) -> None:
    """One native bf16 run per family without an end-to-end parity test (the others:
    ``NATIVE_IN_E2E``): loads, generates, not degenerate.

    (Determinism run to run is checked on DeepSeek-V2 above; these were all checked by
    hand twice in bf16 and, except Qwen3-Next whose CPU GDN kernel needs bf16, in fp32.)
    """
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    ids = _run_reference(ckpts[(arch, None)], tmp_path / "a.json", tmpdir)["token_ids"]
    assert len(ids) >= 8 and all(len(t) == 16 for t in ids)
    assert len({tuple(t) for t in ids}) == len(ids)
    assert len({t[0] for t in ids}) >= len(ids) // 2
    assert len({x for t in ids for x in t}) > 50


# ---------------------------------------------------------------- bench size

BENCH_ARCHS = [a for a, s in TINY_ARCHS.items() if s.bench is not None]


@pytest.fixture(scope="module")
def bench_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bench")
    return {
        a: generate_tiny_checkpoint(a, root / checkpoint_name(a, size="bench"), size="bench")
        for a in BENCH_ARCHS
    }


def test_bench_archs_and_names() -> None:
    assert {"qwen3_moe", "deepseek_v3"} <= set(BENCH_ARCHS)
    assert TINY_SIZES == ("tiny", "bench")
    # Tiny names are unchanged; bench names are distinct.
    assert checkpoint_name("qwen3_moe") == "qwen3_moe-s0"
    assert checkpoint_name("qwen3_moe", size="tiny") == "qwen3_moe-s0"
    assert checkpoint_name("qwen3_moe", size="bench") == "qwen3_moe-s0-bench"
    assert checkpoint_name("qwen3_moe", "no_norm_topk", 3, "bench") == (
        "qwen3_moe-no_norm_topk-s3-bench"
    )
    with pytest.raises(ValueError, match="unknown checkpoint size"):
        tiny_config("qwen3_moe", size="huge")
    with pytest.raises(ValueError, match="no bench size"):
        tiny_config("deepseek_v2", size="bench")


def _moe_layers(tensors: dict[str, Any], cfg: dict[str, Any]) -> list[int]:
    kinds = _layer_kinds(tensors, cfg["num_hidden_layers"])
    assert "?" not in kinds
    return [i for i, k in enumerate(kinds) if k == "moe"]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_bench_config_shape(bench_ckpts: dict[str, Path], arch: str) -> None:
    import torch

    d = bench_ckpts[arch]
    cfg = _config(d)
    assert cfg["model_type"] == arch
    assert cfg["hidden_size"] >= 512
    n_experts = next(
        cfg[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in cfg
    )
    assert n_experts >= 16
    assert cfg["num_experts_per_tok"] >= 4
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    assert cfg["max_position_embeddings"] >= 2048
    tensors = _tensors(d)
    moe = _moe_layers(tensors, cfg)
    assert len(moe) >= 8
    assert f"model.layers.{moe[0]}.mlp.experts.{n_experts - 1}.down_proj.weight" in tensors
    assert f"model.layers.{moe[0]}.mlp.experts.{n_experts}.down_proj.weight" not in tensors
    gate = tensors[f"model.layers.{moe[0]}.mlp.gate.weight"]
    assert tuple(gate.shape) == (n_experts, cfg["hidden_size"])
    assert 0.5 < float(gate.float().std()) * cfg["hidden_size"] ** 0.5 < 2.0
    # bf16 weights; only router correction biases stay fp32.
    for k, v in tensors.items():
        want = torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16
        assert v.dtype == want, k
    n_params = sum(v.numel() for v in tensors.values())
    assert 45e6 < n_params < 65e6, n_params
    if arch == "qwen3_moe":  # the team's reference shape
        assert (cfg["hidden_size"], cfg["num_hidden_layers"], len(moe)) == (512, 8, 8)
        assert (n_experts, cfg["num_experts_per_tok"]) == (16, 4)
        assert 55e6 < n_params < 60e6
    else:
        assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576  # CPU MLA
        assert cfg["n_routed_experts"] % cfg["n_group"] == 0
        assert cfg["topk_group"] * n_experts // cfg["n_group"] > cfg["num_experts_per_tok"]
    stamp = json.loads((d / STAMP_FILE).read_text())
    assert stamp["size"] == "bench" and stamp["arch"] == arch and stamp["seed"] == 0


def test_bench_same_tokenizer(
    ckpts: dict[tuple[str, str | None], Path], bench_ckpts: dict[str, Path]
) -> None:
    tiny = _hashes(ckpts[("qwen3_moe", None)])
    for arch in BENCH_ARCHS:
        bench = _hashes(bench_ckpts[arch])
        assert bench["tokenizer.json"] == tiny["tokenizer.json"]
        assert (
            _config(bench_ckpts[arch])["vocab_size"] == _config(ckpts[(arch, None)])["vocab_size"]
        )


def test_bench_same_seed_gives_identical_bytes(
    bench_ckpts: dict[str, Path], tmp_path: Path
) -> None:
    again = generate_tiny_checkpoint("qwen3_moe", tmp_path / "again", size="bench")
    assert _hashes(again) == _hashes(bench_ckpts["qwen3_moe"])
    other = generate_tiny_checkpoint("qwen3_moe", tmp_path / "s1", seed=1, size="bench")
    assert _hashes(other)["model.safetensors"] != _hashes(again)["model.safetensors"]


def test_size_never_reuses_other_cache(
    ckpts: dict[tuple[str, str | None], Path], tmp_path: Path
) -> None:
    out = tmp_path / "ckpt"
    tiny_hashes = _hashes(generate_tiny_checkpoint("qwen3_moe", out))
    assert tiny_hashes == _hashes(ckpts[("qwen3_moe", None)])
    assert "size" not in json.loads((out / STAMP_FILE).read_text())  # tiny stamp unchanged

    generate_tiny_checkpoint("qwen3_moe", out, size="bench")  # tiny stamp: regenerated
    assert _config(out)["hidden_size"] == 512
    assert json.loads((out / STAMP_FILE).read_text())["size"] == "bench"
    bench_st = (out / "model.safetensors").stat().st_ino
    generate_tiny_checkpoint("qwen3_moe", out, size="bench")  # matching: kept
    assert (out / "model.safetensors").stat().st_ino == bench_st

    generate_tiny_checkpoint("qwen3_moe", out)  # bench stamp: regenerated as tiny
    assert _config(out)["hidden_size"] == 128
    assert _hashes(out) == tiny_hashes


@pytest.mark.slow
def test_cli_models_tiny_bench(tmp_path: Path) -> None:
    out = tmp_path / "q-bench"
    cmd = [sys.executable, "-m", "afd.cli", "models", "tiny", "--arch", "qwen3_moe"]
    proc = subprocess.run(
        [*cmd, "--size", "bench", "--out", str(out)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == str(out)
    assert _config(out)["hidden_size"] == 512
    assert json.loads((out / STAMP_FILE).read_text())["size"] == "bench"

    bad_cmd = [*cmd[:-1], "deepseek_v2", "--size", "bench", "--out", str(tmp_path / "x")]
    bad = subprocess.run(
        bad_cmd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "no bench size" in bad.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_bench_finite_logits(bench_ckpts: dict[str, Path], arch: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    d = bench_ckpts[arch]
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[_config(d)["bos_token_id"] + 100]])).logits.float()
    assert logits.shape[-1] == _config(d)["vocab_size"]
    assert bool(torch.isfinite(logits).all())
    # O(1) logits (1/sqrt(fan_in) init): far from bf16 overflow, not collapsed either.
    assert 0.3 < float(logits.std()) < 3.0 and float(logits.abs().max()) < 30.0
