"""A plan as an ``afd launch`` spec file (TOML text), checked by the launcher's loader."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

from afd.plan.hardware import Hardware
from afd.plan.model import Prediction
from afd.plan.shapes import ModelShape

__all__ = ["plan_toml", "validate_toml"]

MIB = 2**20


def plan_toml(
    p: Prediction, shape: ModelShape, hw: Hardware, model: str, max_context: float
) -> str:
    """The spec of plan ``p`` for ``model`` (a checkpoint directory or a hub id)."""
    lay = p.layout
    batch = max(1, math.ceil(p.batch))
    max_len = max(16, int(max_context))
    kv_split = 1 if shape.kv_latent else min(lay.attention_tp, shape.kv_heads)
    kv = batch * max_len * shape.kv_bytes_per_token / kv_split
    kv_bytes = max(64 * MIB, math.ceil(kv / MIB) * MIB)
    gpu = hw.kind != "cpu"
    lines = [
        f"# afd plan: {lay.label()}, batch {batch} per attention rank, predicted TPOT "
        f"{p.tpot_s * 1e3:.1f} ms, {p.throughput_per_device:.1f} tok/s per device on {hw.name}",
        f"model = {_quote(model)}",
        f"num_attention = {lay.num_attention}",
        f"attention_tensor_parallel_size = {lay.attention_tp}",
        f"num_ffn = {lay.num_ffn}",
        f"ffn_expert_parallel = {str(lay.ffn_ep).lower()}",
        f"compute_gate_on_attention = {str(lay.gate_on_attention).lower()}",
        'dtype = "bfloat16"',
        f"max_model_len = {max_len}",
        f"kv_cache_memory_bytes = {kv_bytes}",
        f"gpu_memory_utilization = {hw.mem_usable if gpu else 0.1}",
        f'vllm_args = ["--max-num-seqs", "{batch}"]',
        "",
        "[afd]",
        f"num_micro_batches = {lay.micro_batches}",
    ]
    if gpu:
        lines.append('connector = "P2pNcclAFDConnector"')
    return "\n".join(lines) + "\n"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def validate_toml(text: str) -> None:
    """Load ``text`` through the launcher's spec loader (``DeploymentSpec.from_toml``,
    what ``afd launch SPEC`` reads); raises its error when the spec is refused."""
    from afd.launch.spec import DeploymentSpec

    fd, name = tempfile.mkstemp(suffix=".toml", prefix="afd-plan-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        DeploymentSpec.from_toml(name)
    finally:
        Path(name).unlink(missing_ok=True)
