"""The performance model of ``afd plan`` (docs/plan.md states it as formulas).

:func:`predict` gives, for a model shape, a device and a layout, the per-layer times of
the attention block, the FFN block and the exchange, the decode step (TPOT), the
throughput per device and the memory per device, and whether the layout fits in memory.
Everything is a closed-form function of the inputs: no measurement happens here (the
figures of :class:`~afd.plan.hardware.Hardware` carry what a calibration measured).
"""

from __future__ import annotations

from dataclasses import dataclass

from afd.plan.hardware import Hardware
from afd.plan.shapes import ModelShape

__all__ = ["Layout", "Prediction", "Workload", "experts_hit", "predict"]


@dataclass(frozen=True)
class Layout:
    num_attention: int = 1
    attention_tp: int = 1
    num_ffn: int = 1
    ffn_ep: bool = False
    micro_batches: int = 1
    #: The router runs on the attention rank and sends top-k with the hidden states
    #: (EP dispatch: each token only to the FFN ranks of its experts).
    gate_on_attention: bool = False

    @property
    def devices(self) -> int:
        return self.num_attention * self.attention_tp + self.num_ffn

    @property
    def processes(self) -> int:
        return self.devices

    def label(self) -> str:
        ep = f" EP{self.num_ffn}" if self.ffn_ep else ""
        tp = f" TP{self.attention_tp}" if self.attention_tp > 1 else ""
        return f"{self.num_attention}A{tp} {self.num_ffn}F{ep} m={self.micro_batches}"


@dataclass(frozen=True)
class Workload:
    #: Decoding requests per attention (DP) rank.
    batch: float
    #: Mean cached tokens a decode token attends to (KV read per token and layer).
    context: float
    #: Tokens reserved per request in the KV cache (memory); default ``context``.
    max_context: float = 0.0


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    batch: float
    #: One MoE layer, one micro-batch: attention block, FFN block (the busiest FFN
    #: rank), one direction of the exchange (latency + bytes).
    attention_s: float
    ffn_s: float
    transfer_s: float
    #: One MoE layer with all micro-batches (overlap applied), and one dense layer.
    layer_s: float
    dense_layer_s: float
    tpot_s: float
    #: Output tokens per second per device (a CPU host counts its cores).
    throughput_per_device: float
    throughput: float
    mem_attention_bytes: float
    mem_ffn_bytes: float
    mem_limit_bytes: float
    fits: bool
    why_not: str = ""
    #: What bounds the MoE layer: "attention", "ffn", "exchange" or "cores".
    bound: str = ""


def experts_hit(tokens: float, experts: int, top_k: int) -> float:
    """Expected distinct experts that ``tokens`` tokens choose, ``top_k`` each, when the
    router spreads them uniformly: ``E * (1 - (1 - k/E)^T)``."""
    if tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def _roof(flops: float, bytes_: float, peak: float, bw: float) -> float:
    return max(flops / peak, bytes_ / bw)


def _threads(hw: Hardware, layout: Layout) -> tuple[float, float]:
    """(cores per attention worker, cores per FFN rank) on a CPU host, as
    ``afd launch`` places the roles (afd.launch.placement.plan_cpus): 1A1F with one
    micro-batch takes turns on every core; otherwise the cores are split between the
    processes, and processes beyond the cores share them (the pool bound in
    :func:`predict` charges that)."""
    if hw.cores <= 0:
        return 1.0, 1.0
    lay = layout
    if (lay.num_attention, lay.attention_tp, lay.num_ffn, lay.micro_batches) == (1, 1, 1, 1):
        return float(hw.cores), float(hw.cores)
    each = max(1.0, float(hw.cores // lay.processes))
    return each, each


def _attention_s(
    shape: ModelShape, hw: Hardware, tokens: float, context: float, tp: int, cores: float
) -> float:
    """One layer's attention block for ``tokens`` decode tokens on one TP worker."""
    if tokens <= 0:
        return 0.0
    peak = hw.dense_flops(shape.weight_bytes) * hw.attention_flops_eff * cores
    bw = hw.mem_bw * hw.bw_eff * cores
    kv_split = min(tp, shape.kv_heads) if not shape.kv_latent else 1
    flops = tokens * shape.attention_flops_per_token(context) / tp
    bytes_ = (
        shape.attention_params * shape.weight_bytes / tp
        + tokens * context * shape.kv_elems_per_token * 2.0 / kv_split
    )
    t = hw.attention_layer_s + _roof(flops, bytes_, peak, bw)
    if tp > 1:
        # the o_proj all-reduce, and TP worker 0's broadcast of the FFN's answer
        msg = tokens * shape.hidden * shape.act_bytes
        t += 2 * hw.tp_latency_s + (2 * (tp - 1) / tp + 1) * msg / hw.tp_bw
    return t


def _ffn_s(
    shape: ModelShape,
    hw: Hardware,
    rows: float,
    routed_tokens: float,
    experts_held: int,
    rank0: bool,
    cores: float,
    dense: bool = False,
) -> float:
    """One layer's FFN block on one FFN rank: ``rows`` tokens arrive, ``routed_tokens``
    tokens (of every attention rank it serves) choose among all experts, the rank
    holds ``experts_held`` of them (rank 0 runs the shared experts on every row)."""
    if rows <= 0:
        return 0.0
    peak = hw.dense_flops(shape.weight_bytes) * hw.ffn_flops_eff * cores
    bw = hw.mem_bw * hw.bw_eff * cores
    if dense:
        flops = 2.0 * rows * shape.dense_mlp_params
        bytes_ = shape.dense_mlp_params * shape.weight_bytes
        return hw.ffn_layer_s + _roof(flops, bytes_, peak, bw)
    share = experts_held / shape.experts
    pairs = routed_tokens * shape.top_k * share
    hit = experts_hit(routed_tokens, shape.experts, shape.top_k) * share
    shared = shape.shared_params if rank0 else 0
    flops = 2.0 * (pairs * shape.expert_params + rows * (shared + shape.router_params))
    bytes_ = (hit * shape.expert_params + shared + shape.router_params) * shape.weight_bytes
    return hw.ffn_layer_s + _roof(flops, bytes_, peak, bw)


def _rows(shape: ModelShape, layout: Layout, tokens: float) -> tuple[float, float, float]:
    """(rows one attention rank sends per layer and micro-batch over all its FFN peers,
    rows the busiest FFN rank receives, tokens whose routing that rank serves)."""
    lay = layout
    if not lay.ffn_ep:
        served = tokens * lay.num_attention / lay.num_ffn
        return tokens, served, served
    all_tokens = tokens * lay.num_attention
    if lay.gate_on_attention:
        # dispatch: a token goes to every FFN rank holding one of its top-k experts;
        # rank 0 takes every token when there are shared experts
        frac = 1.0 - (1.0 - 1.0 / lay.num_ffn) ** shape.top_k
        rank0 = 1.0 if shape.shared_params else frac
        sent = tokens * (rank0 + (lay.num_ffn - 1) * frac)
        return sent, all_tokens * rank0, all_tokens
    return tokens * lay.num_ffn, all_tokens, all_tokens


def _transfer_s(shape: ModelShape, hw: Hardware, layout: Layout, tokens: float) -> float:
    """One direction of one layer's exchange: latency + the larger of what an attention
    rank sends and what the busiest FFN rank receives, over the link."""
    sent, received, _ = _rows(shape, layout, tokens)
    per_row = shape.hidden * shape.act_bytes
    if layout.gate_on_attention:
        per_row += shape.top_k * 8  # int32 ids + float32 weights
    return hw.link_latency_s + max(sent, received) * per_row / hw.link_bw


def _overlap(ta: float, tf: float, tc: float, x: float, m: int) -> tuple[float, str]:
    """One layer with ``m`` micro-batches ping-ponging between the roles: each role
    computes its m blocks back to back while the others travel or run on the other
    role, unless one micro-batch's round trip (A + F + two transfers) is longer."""
    terms = {"attention": m * ta, "ffn": m * tf, "exchange": ta + tf + 2 * tc + x}
    bound = max(terms, key=lambda k: terms[k])
    return terms[bound], bound


def predict(shape: ModelShape, hw: Hardware, layout: Layout, workload: Workload) -> Prediction:
    """The model: see docs/plan.md."""
    lay = layout
    m = lay.micro_batches
    batch = workload.batch
    tokens = batch / m
    ca, cf = _threads(hw, lay)
    ta = _attention_s(shape, hw, tokens, workload.context, lay.attention_tp, ca)
    held = shape.experts // lay.num_ffn if lay.ffn_ep else shape.experts
    _, rows, routed = _rows(shape, lay, tokens)
    tf = _ffn_s(shape, hw, rows, routed, held, True, cf)
    tc = _transfer_s(shape, hw, lay, tokens)
    x = hw.exchange_s
    layer, bound = _overlap(ta, tf, tc, x, m)
    # dense layers: their MLP runs on FFN rank 0 for every token (exchange as well)
    dense_rows = tokens * lay.num_attention / (1 if lay.ffn_ep else lay.num_ffn)
    tfd = _ffn_s(shape, hw, dense_rows, dense_rows, 0, True, cf, dense=True)
    dense, _ = _overlap(ta, tfd, tc, x, m)
    if hw.cores > 0:
        # The role processes share the host's cores: the layer also takes at least the
        # cores' whole work (each process's busy time x its cores) over the cores.
        procs_a = lay.num_attention * lay.attention_tp
        work = m * (procs_a * ta * ca + lay.num_ffn * tf * cf)
        pool = work / hw.cores
        if pool > layer:
            layer, bound = pool, "cores"
        work_d = m * (procs_a * ta * ca + tfd * cf)
        dense = max(dense, work_d / hw.cores)
    # LM head on each attention TP worker's vocabulary shard
    peak = hw.dense_flops(shape.weight_bytes) * hw.attention_flops_eff * ca
    head = _roof(
        2.0 * batch * shape.vocab * shape.hidden / lay.attention_tp,
        shape.vocab * shape.hidden * shape.weight_bytes / lay.attention_tp,
        peak,
        hw.mem_bw * hw.bw_eff * ca,
    )
    tpot = (
        shape.moe_layers * layer
        + shape.dense_layers * dense
        + head
        + hw.step_s
        + hw.step_token_s * batch
    )
    total_tokens_s = lay.num_attention * batch / tpot
    devices = hw.cores if hw.cores > 0 else lay.devices
    # memory per device
    max_ctx = workload.max_context or workload.context
    kv_split = 1 if shape.kv_latent else min(lay.attention_tp, shape.kv_heads)
    buffers_a = 2 * m * tokens * shape.hidden * shape.act_bytes * (lay.num_ffn if lay.ffn_ep else 1)
    mem_a = (
        shape.attention_bytes_total / lay.attention_tp
        + batch * max_ctx * shape.kv_bytes_per_token / kv_split
        + buffers_a
        + hw.reserve_bytes
    )
    buffers_f = 2 * m * rows * shape.hidden * shape.act_bytes
    mem_f = shape.ffn_bytes_total(held, rank0=True) + buffers_f + hw.reserve_bytes
    limit = hw.mem_bytes * hw.mem_usable
    why = ""
    if hw.cores > 0:
        used = lay.num_attention * lay.attention_tp * mem_a + lay.num_ffn * mem_f
        if used > limit:
            why = f"host memory: {used / 2**30:.1f} GiB > {limit / 2**30:.1f} GiB"
    elif mem_a > limit:
        why = f"attention device: {mem_a / 2**30:.1f} GiB > {limit / 2**30:.1f} GiB"
    elif mem_f > limit:
        why = f"FFN device: {mem_f / 2**30:.1f} GiB > {limit / 2**30:.1f} GiB"
    return Prediction(
        layout=lay,
        batch=batch,
        attention_s=ta,
        ffn_s=tf,
        transfer_s=tc,
        layer_s=layer,
        dense_layer_s=dense,
        tpot_s=tpot,
        throughput_per_device=total_tokens_s / devices,
        throughput=total_tokens_s,
        mem_attention_bytes=mem_a,
        mem_ffn_bytes=mem_f,
        mem_limit_bytes=limit,
        fits=not why,
        why_not=why,
        bound=bound,
    )


def valid_layout(shape: ModelShape, hw: Hardware, layout: Layout) -> str:
    """Why ``layout`` cannot run (empty when it can): the rules the launcher's spec
    validator and the roles apply."""
    lay = layout
    if min(lay.num_attention, lay.attention_tp, lay.num_ffn, lay.micro_batches) < 1:
        return "every count must be >= 1"
    if shape.heads % lay.attention_tp:
        return f"attention TP {lay.attention_tp} does not divide {shape.heads} heads"
    if lay.attention_tp > hw.devices_per_node and hw.cores <= 0:
        return f"attention TP {lay.attention_tp} > {hw.devices_per_node} devices per node"
    if lay.ffn_ep:
        if lay.num_ffn < 2:
            return "FFN EP needs 2 or more FFN ranks"
        if shape.experts % lay.num_ffn:
            return f"{lay.num_ffn} FFN ranks do not split {shape.experts} experts evenly"
    elif lay.num_ffn > lay.num_attention:
        return "num_ffn > num_attention without FFN EP leaves FFN ranks without peers"
    return ""
