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

__all__ = [
    "CpuPlacement",
    "Layout",
    "Prediction",
    "Workload",
    "cpu_placement",
    "experts_hit",
    "predict",
]


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
    #: CPU hosts: the spec gives the roles CPUs of their own (``[attention] cpus`` /
    #: ``[ffn] cpus``, split as the launcher would), so 1A1F with one micro-batch does not
    #: take turns on every CPU (how ``afd plan --calibrate`` measures one core per role).
    own_cpus: bool = False

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
    #: CPU hosts: where the launcher puts the role processes (the model's view of it).
    placement: CpuPlacement | None = None


def experts_hit(tokens: float, experts: int, top_k: int) -> float:
    """Expected distinct experts that ``tokens`` tokens choose, ``top_k`` each, when the
    router spreads them uniformly: ``E * (1 - (1 - k/E)^T)``."""
    if tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def _roof(flops: float, bytes_: float, peak: float, bw: float) -> float:
    return max(flops / peak, bytes_ / bw)


@dataclass(frozen=True)
class CpuPlacement:
    """Where ``afd launch`` puts a layout's role processes on a CPU host
    (:func:`afd.launch.placement.plan_cpus`, vLLM's own binding where the launcher sets
    none), as the model needs it. See docs/plan.md, "CPU hosts"."""

    #: Cores one attention worker computes on while the attention blocks run, and the
    #: busiest FFN rank while the FFN blocks run; below 1: a CPU that processes of the
    #: same phase take turns on (the OS time-slices it).
    attention_cores: float
    ffn_cores: float
    #: Whether role processes share CPUs: a woken role waits for the CPUs another one has
    #: just used (the exchange costs ``shared_exchange_s``), instead of finding its own idle.
    shared: bool
    #: CPUs the attention server's scheduler / API processes may use.
    server_cores: int
    #: What the launcher does, for the printout: "attn=0, ffn0=1".
    text: str = ""
    #: The role processes outnumber the CPUs they run on: a woken role also waits for a
    #: CPU another process holds (the exchange costs ``crowded_exchange_s``).
    crowded: bool = False


def cpu_placement(cores: int, layout: Layout) -> CpuPlacement:
    """The placement of ``layout``'s role processes on ``cores`` CPUs, by the launcher's
    own rules (afd.launch.placement.plan_cpus with no CPUs given in the spec):

    * 1 attention worker + 1 FFN rank, one micro-batch (the roles take turns): both on
      every CPU, their OpenMP threads sleeping soon after work;
    * otherwise, with at least one CPU per process, each its own block
      (:func:`~afd.launch.cpus.split_cpus`);
    * fewer CPUs than processes with attention TP: one CPU each, round robin, the FFN
      ranks from the last CPU (:func:`~afd.launch.cpus.share_cpus`);
    * fewer CPUs than processes otherwise: the launcher leaves the binding to vLLM,
      whose automatic binding puts every attention worker's OpenMP threads on the same
      CPUs (all but one reserved CPU of the first NUMA node), while an FFN server (its
      worker in its own process) binds nothing: vLLM cuts its torch threads to one
      ("Reducing Torch threads ... for serving"), which floats over every CPU.
    """
    from afd.launch.cpus import parse_cpu_list, share_cpus, split_cpus

    lay = layout
    workers = lay.num_attention * lay.attention_tp
    nf = lay.num_ffn
    usable = list(range(cores))
    every = f"0-{cores - 1}" if cores > 1 else "0"
    if (workers, nf, lay.micro_batches) == (1, 1, 1) and cores >= 2 and not lay.own_cpus:
        return CpuPlacement(cores, cores, True, cores, f"attn={every}, ffn0={every} (turns)")
    split = split_cpus(usable, workers, nf)
    if split is not None:
        attn = [parse_cpu_list(v) for v in split["attn"].split("|")]
        ffn = [parse_cpu_list(split[f"ffn{f}"]) for f in range(nf)]
        text = ", ".join(f"{k}={v}" for k, v in split.items())
        server = len({c for block in attn for c in block})
        return CpuPlacement(len(attn[0]), min(len(b) for b in ffn), False, server, text)
    if lay.attention_tp > 1:
        shared = share_cpus(usable, workers, nf)
        attn_ids = [int(c) for c in shared["attn"].split("|")]
        ffn_ids = [int(shared[f"ffn{f}"]) for f in range(nf)]
        # a phase's processes on one CPU take turns on it
        a = 1.0 / max(attn_ids.count(c) for c in attn_ids)
        f = 1.0 / max(ffn_ids.count(c) for c in ffn_ids)
        text = ", ".join(f"{k}={v}" for k, v in shared.items())
        return CpuPlacement(a, f, True, len(set(attn_ids)), text, crowded=True)
    # vLLM's automatic binding: every attention worker on the same cores - 1 CPUs;
    # each FFN rank one thread, floating over every CPU
    bound = max(1, cores - 1)
    a = bound / workers if workers > 1 else float(bound)
    f = min(1.0, cores / nf)
    text = f"attn workers on CPU 0-{bound - 1} (vLLM auto), ffn ranks unbound"
    if bound == 1:
        text = "attn workers on CPU 0 (vLLM auto), ffn ranks unbound"
    return CpuPlacement(a, f, True, cores, text, crowded=True)


def _speed(cores: float, thread_eff: float) -> float:
    """How much faster than on one core a block's variable part runs on ``cores``
    (>= 1: OpenMP threads, each further one adding ``thread_eff`` of a core)."""
    if cores >= 1:
        return 1.0 + thread_eff * (cores - 1.0)
    return cores


def _on_cores(t0: float, variable: float, cores: float, thread_eff: float) -> float:
    """A block of fixed time ``t0`` and one-core variable time ``variable`` on ``cores``:
    more threads speed up the variable part; a time-sliced CPU (< 1) stretches both."""
    if cores >= 1:
        return t0 + variable / _speed(cores, thread_eff)
    return (t0 + variable) / cores


def _attention_s(
    shape: ModelShape, hw: Hardware, tokens: float, context: float, tp: int, cores: float
) -> float:
    """One layer's attention block for ``tokens`` decode tokens on one TP worker
    (``cores``: a CPU host's cores for it, see :class:`CpuPlacement`; else 1)."""
    if tokens <= 0:
        return 0.0
    peak = hw.dense_flops(shape.weight_bytes) * hw.attention_flops_eff
    bw = hw.mem_bw * hw.bw_eff
    kv_split = min(tp, shape.kv_heads) if not shape.kv_latent else 1
    flops = tokens * shape.attention_flops_per_token(context) / tp
    bytes_ = (
        shape.attention_params * shape.weight_bytes / tp
        + tokens * context * shape.kv_elems_per_token * 2.0 / kv_split
    )
    t = _on_cores(
        hw.attention_layer_s, _roof(flops, bytes_, peak, bw), cores, hw.attention_thread_eff
    )
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
    peak = hw.dense_flops(shape.weight_bytes) * hw.ffn_flops_eff
    bw = hw.mem_bw * hw.bw_eff
    if dense:
        flops = 2.0 * rows * shape.dense_mlp_params
        bytes_ = shape.dense_mlp_params * shape.weight_bytes
        return _on_cores(hw.ffn_layer_s, _roof(flops, bytes_, peak, bw), cores, hw.ffn_thread_eff)
    share = experts_held / shape.experts
    pairs = routed_tokens * shape.top_k * share
    hit = experts_hit(routed_tokens, shape.experts, shape.top_k) * share
    shared = shape.shared_params if rank0 else 0
    flops = 2.0 * (pairs * shape.expert_params + rows * (shared + shape.router_params))
    bytes_ = (hit * shape.expert_params + shared + shape.router_params) * shape.weight_bytes
    return _on_cores(hw.ffn_layer_s, _roof(flops, bytes_, peak, bw), cores, hw.ffn_thread_eff)


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
    place = cpu_placement(hw.cores, lay) if hw.cores > 0 else None
    ca, cf = (place.attention_cores, place.ffn_cores) if place else (1.0, 1.0)
    ta = _attention_s(shape, hw, tokens, workload.context, lay.attention_tp, ca)
    held = shape.experts // lay.num_ffn if lay.ffn_ep else shape.experts
    _, rows, routed = _rows(shape, lay, tokens)
    tf = _ffn_s(shape, hw, rows, routed, held, True, cf)
    tc = _transfer_s(shape, hw, lay, tokens)
    x = hw.exchange_fixed_s(place.shared, place.crowded) if place else hw.exchange_s
    if place is not None and place.shared and lay.ffn_ep:
        # EP: an attention rank serves its FFN peers' planes one after the other; on
        # shared CPUs each further one wakes a process that needs a CPU another holds
        x += (lay.num_ffn - 1) * hw.peer_exchange_s(place.shared, place.crowded)
    layer, bound = _overlap(ta, tf, tc, x, m)
    # dense layers: their MLP runs on FFN rank 0 for every token (exchange as well)
    dense_rows = tokens * lay.num_attention / (1 if lay.ffn_ep else lay.num_ffn)
    tfd = _ffn_s(shape, hw, dense_rows, dense_rows, 0, True, cf, dense=True)
    dense, _ = _overlap(ta, tfd, tc, x, m)
    if hw.cores > 0:
        # The role processes share the host's cores: the layer also takes at least the
        # cores' whole work (each process's busy time x the cores it holds) over the cores.
        procs_a = lay.num_attention * lay.attention_tp
        work = m * (procs_a * ta * ca + lay.num_ffn * tf * cf)
        pool = work / hw.cores
        if pool > layer:
            layer, bound = pool, "cores"
        work_d = m * (procs_a * ta * ca + tfd * cf)
        dense = max(dense, work_d / hw.cores)
    # LM head on each attention TP worker's vocabulary shard
    head = _on_cores(
        0.0,
        _roof(
            2.0 * batch * shape.vocab * shape.hidden / lay.attention_tp,
            shape.vocab * shape.hidden * shape.weight_bytes / lay.attention_tp,
            hw.dense_flops(shape.weight_bytes) * hw.attention_flops_eff,
            hw.mem_bw * hw.bw_eff,
        ),
        ca,
        hw.attention_thread_eff,
    )
    step_s, step_token_s = hw.step_figures(place.server_cores > 1 if place else False)
    tpot = (
        shape.moe_layers * layer + shape.dense_layers * dense + head + step_s + step_token_s * batch
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
        placement=place,
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
