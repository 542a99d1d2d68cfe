"""FFN expert parallelism: each FFN rank's MoE layers hold exactly its expert shard, proven
from the role's own tensors (issue 41), not from its log line.

The FFN role is built and loaded by vLLM's executor from a tiny checkpoint (a process of
its own, forked from the build server of tests/support/afd_role_models.py) as FFN rank 0
and rank 1 of 2 under ``ffn_expert_parallel``, and once without expert parallelism. Its
worker reports, per MoE layer, the shard its routed experts were built for and, per
tensor of them (``w13_weight``, ``w2_weight``, and biases or scales where the model has
them), its shape and one digest per expert: of the bytes as the kernel holds them
(vLLM CPU repacks the experts into its kernel layout after loading) and of the expert's
sorted values (a repacking moves values, it does not change them). Checked per layer:

* the shard is ``afd_core.topology.expert_shard(E, 2, f)`` and every expert tensor's
  (``w13_*``, ``w2_*``) first dimension is its size (the rest of the shape as without
  expert parallelism); the others (DeepSeek's score-correction bias of the router, every
  expert's) equal the role's without expert parallelism;
* expert i of FFN rank f holds the values of the checkpoint's expert ``shard.start + i``
  (``gate_proj``/``up_proj`` for ``w13``, ``down_proj`` for ``w2``; the checkpoint's
  experts all differ, so no other expert matches);
* byte for byte, expert i of FFN rank f is expert ``shard.start + i`` of the role built
  without expert parallelism (same kernel layout, same order).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from afd_role_models import build_role_model

pytestmark = [pytest.mark.vllm]

EP = 2
EXPERT_DIM_TENSORS = ("w13_weight", "w2_weight")


def _build(model: Path, arch: str, tmp_path: Path, rank: int | None) -> dict[str, Any]:
    afd: dict[str, object] = {"role": "ffn", "compute_gate_on_attention": True}
    if rank is not None:
        afd.update(ffn_expert_parallel=True, num_ffn_ranks=EP, rank=rank)
    out = tmp_path / f"rank{rank}"
    out.mkdir()
    experts = build_role_model(model, arch, afd, out, experts=True)["experts"]
    assert experts, "the FFN role reported no MoE layer"
    return dict(experts)


def _checkpoint_values(model: Path) -> dict[tuple[int, str], list[str]]:
    """(decoder layer, tensor) -> the sorted-values digest of each checkpoint expert, in
    the model dtype the role was built with (bfloat16), as the build reports them."""
    import torch
    from safetensors import safe_open

    def digest(t: torch.Tensor) -> str:
        values = t.to(torch.bfloat16).reshape(-1).float().sort().values
        return hashlib.sha256(values.view(torch.uint8).numpy()).hexdigest()

    parts: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
            m = re.search(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$", name)
            if m:
                parts.setdefault((int(m[1]), int(m[2])), {})[m[3]] = f.get_tensor(name)
    out: dict[tuple[int, str], list[str]] = {}
    for (layer, expert), p in sorted(parts.items()):
        w13 = torch.cat([p["gate_proj"], p["up_proj"]])
        for tensor, value in (("w13_weight", w13), ("w2_weight", p["down_proj"])):
            column = out.setdefault((layer, tensor), [])
            assert len(column) == expert, (layer, tensor, expert)
            column.append(digest(value))
    return out


def shard_problems(
    reports: dict[int | None, dict[str, Any]], checkpoint: dict[tuple[int, str], list[str]]
) -> list[str]:
    """What differs from "FFN rank f holds exactly its shard's checkpoint experts" in the
    reports of the builds (rank f of EP; None: without expert parallelism)."""
    from afd_core.topology import expert_shard

    full = reports[None]
    problems: list[str] = []
    for f in range(EP):
        report = reports[f]
        if sorted(report) != sorted(full):
            problems.append(f"FFN rank {f}: MoE layers {sorted(report)}, expected {sorted(full)}")
            continue
        for name, layer in report.items():
            where = f"FFN rank {f} {name}"
            layer_idx = int(re.findall(r"layers\.(\d+)\.", name)[-1])
            experts = layer["experts"]
            shard = expert_shard(experts, EP, f)
            if layer["shard"] != [shard.start, shard.stop]:
                problems.append(f"{where}: built for experts {layer['shard']}, expected {shard}")
            whole = full[name]["tensors"]
            if sorted(layer["tensors"]) != sorted(whole):
                problems.append(f"{where}: tensors {sorted(layer['tensors'])} != {sorted(whole)}")
                continue
            for tensor in EXPERT_DIM_TENSORS:
                if tensor not in layer["tensors"]:
                    problems.append(f"{where}: no {tensor}")
            for tensor, entry in layer["tensors"].items():
                ref = whole[tensor]
                if not tensor.startswith(("w13_", "w2_")):
                    # Not one row per held expert: the router's score-correction bias
                    # (every expert's, replicated on every FFN rank), a per-layer scalar.
                    if (entry["shape"], entry["digest"]) != (ref["shape"], ref["digest"]):
                        problems.append(f"{where}.{tensor}: differs from the whole role's")
                    continue
                if entry["shape"] != [len(shard), *ref["shape"][1:]]:
                    problems.append(
                        f"{where}.{tensor}: shape {entry['shape']}, expected "
                        f"{[len(shard), *ref['shape'][1:]]} (its {len(shard)} experts)"
                    )
                    continue
                if len(set(ref["bytes"])) != experts:
                    problems.append(f"{name}.{tensor}: experts not distinct, proves nothing")
                got = entry.get("bytes", [])
                want = ref["bytes"][shard.start : shard.stop]
                if got != want:
                    held = [ref["bytes"].index(d) if d in ref["bytes"] else None for d in got]
                    problems.append(
                        f"{where}.{tensor}: holds the experts {held}, expected {list(shard)}"
                    )
                values = checkpoint.get((layer_idx, tensor))
                if values is not None and entry["values"] != values[shard.start : shard.stop]:
                    held = [values.index(d) if d in values else None for d in entry["values"]]
                    problems.append(
                        f"{where}.{tensor}: values of checkpoint experts {held}, expected "
                        f"{list(shard)}"
                    )
    return problems


CASES = [
    pytest.param("qwen3_moe", "AFDQwen3MoeForCausalLM", id="qwen3_moe"),
    pytest.param("deepseek_v3", "AFDDeepseekV3ForCausalLM", id="deepseek_v3"),
]


@pytest.mark.parametrize(("family", "arch"), CASES)
def test_each_ffn_rank_holds_exactly_its_checkpoint_experts(
    family: str,
    arch: str,
    tiny_model_of: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    model = tiny_model_of(family)
    reports = {rank: _build(model, arch, tmp_path, rank) for rank in (None, *range(EP))}
    checkpoint = _checkpoint_values(model)
    # Every MoE layer of the model has its checkpoint experts, all distinct.
    layers = {int(re.findall(r"layers\.(\d+)\.", n)[-1]) for n in reports[None]}
    assert {layer for layer, _ in checkpoint} == layers, (sorted(checkpoint), layers)
    for digests in checkpoint.values():
        assert len(set(digests)) == len(digests)
    # Without expert parallelism the role holds every checkpoint expert, in order.
    for name, layer in reports[None].items():
        idx = int(re.findall(r"layers\.(\d+)\.", name)[-1])
        assert layer["shard"] == [0, layer["experts"]]
        for tensor in EXPERT_DIM_TENSORS:
            assert layer["tensors"][tensor]["values"] == checkpoint[(idx, tensor)], name
    assert shard_problems(reports, checkpoint) == []
    # The check fails on a rank holding the other rank's experts (or all of them).
    swapped = {None: reports[None], 0: reports[1], 1: reports[0]}
    assert any("holds the experts" in p for p in shard_problems(swapped, checkpoint))
    every = {None: reports[None], 0: reports[None], 1: reports[1]}
    assert any("experts)" in p for p in shard_problems(every, checkpoint))
