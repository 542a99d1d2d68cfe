"""FFN role: compute one layer's output from an A->F payload, for any factory-built block.

The FFN role builds each layer's FFN half exactly as vLLM does (a native MoE block
whose experts come from ``FusedMoEFactory``, or a dense MLP) and hands the modules to
:class:`FFNLayerCompute`. What to run is decided from two facts only, never from the
model family:

* the block's structure: the single ``MoERunnerInterface`` inside it (found by walking
  its submodules) makes it an MoE block, none makes it a dense MLP;
* the payload kind the Attention role sent (``AttentionToFFN.kind``):

  ``HIDDEN`` (gate on FFN)
      the block's own ``forward`` (gate + routing + routed + shared experts, routed
      scaling, reductions): the native computation, bit for bit;
  ``HIDDEN_TOPK`` (gate on Attention, top-k payload)
      the routed experts only, fed with the received ids/weights (the router is
      skipped: the weights already carry top-k weighting and routed scaling);
  ``HIDDEN_ROUTER_LOGITS`` (gate on Attention, logits payload)
      the block's own router on the received logits, then the routed experts only.

In the two routed-only cases the shared experts, the shared add and
``apply_routed_scale_to_output`` happen on the Attention role; the routed output is
reduced over the FFN role's tensor-parallel ranks here, once.

Before it serves, the FFN role runs every layer once on a dummy batch of the payload kind
it will receive (:meth:`FFNLayerCompute.warm_up`), so that first-call costs (oneDNN
packing and allocator growth on CPU, kernel JIT and autotuning on CUDA) are paid before
the Attention role's profiling run, not inside it.

Over 400 lines on purpose: one class, its dispatch per payload kind and the warm-up that
must build exactly those payloads.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import tensor_model_parallel_all_reduce
from vllm.forward_context import is_forward_context_available, set_forward_context
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.model_executor.layers.fused_moe.runner.moe_runner_interface import MoERunnerInterface
from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder

from afd_core.config import RoutingPayload
from afd_core.connector import AFDConnector, FFNBatch
from afd_core.errors import AFDConfigError, AFDTransferMismatchError
from afd_core.profiling import recorder
from afd_core.topology import expert_shard
from afd_core.transfer import AttentionToFFN, FFNToAttention, PayloadKind
from afd_moe_runners._vllm_compat import check_vllm_version
from afd_moe_runners.metrics import FFNMetrics
from afd_moe_runners.npu.external_routing import ExternalRouting

check_vllm_version()

__all__ = [
    "FFNLayerCompute",
    "WarmUpReport",
    "find_moe_runner",
    "routed_experts_output",
    "shared_experts_output",
]


def find_moe_runner(block: torch.nn.Module) -> MoERunner | None:
    """The one MoE runner inside ``block`` (None for a dense MLP)."""
    runners = [m for m in block.modules() if isinstance(m, MoERunnerInterface)]
    if len(runners) > 1:
        names = [n for n, m in block.named_modules() if isinstance(m, MoERunnerInterface)]
        raise AFDConfigError(
            f"{type(block).__name__} holds {len(runners)} MoE runners ({names}); give "
            "FFNLayerCompute the FFN block of one decoder layer"
        )
    if not runners:
        return None
    runner = runners[0]
    if not isinstance(runner, MoERunner):
        raise AFDConfigError(
            f"{type(block).__name__}: its MoE runner {type(runner).__name__} is not a vLLM "
            "MoERunner; the FFN role only serves blocks built with vLLM's FusedMoEFactory"
        )
    return runner


def routed_experts_output(runner: MoERunner, payload: AttentionToFFN) -> torch.Tensor:
    """Routed experts only, from routing decided on the Attention role."""
    where = f"FFN-role MoE layer {runner.layer_name!r}"
    x = payload.hidden_states
    assert isinstance(x, torch.Tensor)
    if runner.routed_input_transform is not None or runner.routed_output_transform is not None:
        raise AFDConfigError(
            f"{where}: latent MoE (routed input/output transform) cannot take routing from "
            "the Attention role; set compute_gate_on_attention=false"
        )
    if runner.router.eplb_state is not None:
        raise AFDConfigError(
            f"{where}: EPLB on the FFN role maps logical to physical experts inside its "
            "router, which external routing bypasses; disable EPLB or set "
            "compute_gate_on_attention=false"
        )
    if runner.do_naive_dispatch_combine:
        raise AFDConfigError(
            f"{where}: data- or sequence-parallel expert dispatch is not supported with "
            "external routing; set compute_gate_on_attention=false"
        )
    if runner.moe_config.hidden_dim != x.shape[-1]:
        raise AFDConfigError(
            f"{where}: the experts run on a padded hidden size {runner.moe_config.hidden_dim} "
            f"!= {x.shape[-1]}; external routing does not pad, set "
            "compute_gate_on_attention=false"
        )
    experts = runner.routed_experts
    method = experts.quant_method
    # Private in 0.32 (see _vllm_compat): what MoERunner._forward_impl does first.
    experts._ensure_moe_quant_config_init()
    if payload.topk_ids is not None:
        if method.is_monolithic:
            raise AFDConfigError(
                f"{where}: the expert kernel {method.method_name} routes internally and "
                "cannot take top-k ids; set routing_payload='router_logits'"
            )
        topk_ids = payload.topk_ids
        assert isinstance(topk_ids, torch.Tensor)
        if method.topk_indices_dtype is not None:
            topk_ids = topk_ids.to(method.topk_indices_dtype)
        out = experts.forward_modular(x=x, topk_weights=payload.topk_weights, topk_ids=topk_ids)
    elif payload.router_logits is not None:
        if method.is_monolithic:
            out = experts.forward_monolithic(x=x, router_logits=payload.router_logits)
        else:
            topk_weights, topk_ids = runner.router.select_experts(
                hidden_states=x,
                router_logits=payload.router_logits,
                topk_indices_dtype=method.topk_indices_dtype,
            )
            out = experts.forward_modular(x=x, topk_weights=topk_weights, topk_ids=topk_ids)
    else:
        raise AFDTransferMismatchError(f"{where}: payload {payload.kind.name} carries no routing")
    if not isinstance(out, torch.Tensor):
        raise AFDConfigError(
            f"{where}: the expert kernel returned a deferred output ({type(out).__name__}); "
            "set compute_gate_on_attention=false"
        )
    config = runner.moe_config
    kernel = method.moe_kernel
    already_reduced = kernel is not None and kernel.output_is_reduced()
    if (
        not config.is_sequence_parallel
        and (config.tp_size > 1 or config.ep_size > 1)
        and not already_reduced
    ):
        out = tensor_model_parallel_all_reduce(out)
    return out


def shared_experts_output(runner: MoERunner, hidden: torch.Tensor) -> torch.Tensor | None:
    """The block's shared experts on ``hidden`` (None if it has none), reduced once.

    With the gate on Attention the shared experts still live on the FFN role; their
    output travels back separately so the Attention role combines it with the routed
    output exactly as the native runner does (shared + routed, scaling applied once).
    """
    shared = runner.shared_experts
    if shared is None:
        return None
    shared(hidden, SharedExpertsOrder.NO_OVERLAP)
    out = shared.output
    assert isinstance(out, torch.Tensor)
    config = runner.moe_config
    if config.tp_size > 1 and not config.is_sequence_parallel:
        out = tensor_model_parallel_all_reduce(out)
    return out


@dataclass(frozen=True)
class WarmUpReport:
    """What :meth:`FFNLayerCompute.warm_up` ran: the payload kind per layer, the dummy
    batch's size and the time it took."""

    kinds: dict[int, PayloadKind]
    num_tokens: int
    seconds: float

    def summary(self) -> str:
        """One log line: how many layers of each kind, on how many tokens, how long."""
        counts: dict[str, int] = {}
        for kind in self.kinds.values():
            counts[kind.name] = counts.get(kind.name, 0) + 1
        per_kind = ", ".join(f"{n} x {name}" for name, n in sorted(counts.items()))
        return (
            f"warmed up {len(self.kinds)} FFN layers ({per_kind or 'none'}) on "
            f"{self.num_tokens} dummy tokens in {self.seconds:.2f} s"
        )


class FFNLayerCompute:
    """The FFN role's per-layer computation, independent of the model family.

    ``layers`` maps a decoder-layer index to that layer's FFN block as vLLM builds it
    (e.g. ``model.layers[i].mlp``): an MoE block holding one factory-built runner, or a
    dense MLP. ``vllm_config`` is the configuration the blocks were built under (it
    holds vLLM's layer registry the MoE custom op looks runners up in); default: the
    current one at construction.

    ``shared_experts_on_attention``: the Attention role computes the shared experts
    itself (Ascend with the gate on Attention, see
    ``afd_moe_runners.builder.shared_experts_on_attention``); routing payloads then get
    the routed output alone, so the shared term is never added by both roles, and a
    hidden-only payload (which would need the whole block here) is refused.

    ``external_routing`` maps a layer index to the callable that computes its routed
    experts from a top-k payload (``(hidden, ExternalRouting) -> routed output``), in
    place of vLLM's routed-experts path: on Ascend an
    :class:`~afd_moe_runners.npu.external_routing.ExternalRoutingMoE` (see
    :func:`afd_moe_runners.builder.ffn_external_routing`).
    """

    def __init__(
        self,
        layers: Mapping[int, torch.nn.Module],
        *,
        vllm_config: VllmConfig | None = None,
        shared_experts_on_attention: bool = False,
        external_routing: Mapping[int, Callable[[torch.Tensor, ExternalRouting], torch.Tensor]]
        | None = None,
    ) -> None:
        self.layers = dict(layers)
        self.external_routing = dict(external_routing or {})
        self.runners = {idx: find_moe_runner(block) for idx, block in self.layers.items()}
        self.vllm_config = vllm_config if vllm_config is not None else get_current_vllm_config()
        self.shared_experts_on_attention = shared_experts_on_attention

    def block(self, layer_idx: int) -> torch.nn.Module:
        try:
            return self.layers[layer_idx]
        except KeyError:
            raise AFDTransferMismatchError(
                f"received layer {layer_idx}, but this FFN rank serves layers "
                f"{sorted(self.layers)}; do both roles load the same model and layer split?"
            ) from None

    @contextlib.contextmanager
    def _forward_context(self, num_tokens: int) -> Iterator[None]:
        if is_forward_context_available():
            yield
        else:
            with set_forward_context(None, self.vllm_config, num_tokens=num_tokens):
                yield

    @torch.no_grad()
    def compute(self, layer_idx: int, payload: AttentionToFFN) -> FFNToAttention:
        """The F->A result of ``payload`` for decoder layer ``layer_idx``."""
        block = self.block(layer_idx)
        runner = self.runners[layer_idx]
        kind = payload.kind
        hidden = payload.hidden_states
        assert isinstance(hidden, torch.Tensor)
        if hidden.shape[0] == 0:
            return self._empty_result(layer_idx, runner, payload)
        if kind is PayloadKind.HIDDEN:
            if runner is not None and self.shared_experts_on_attention:
                raise AFDTransferMismatchError(
                    f"layer {layer_idx}: received hidden states only (gate on FFN), but this "
                    "FFN role was built with shared_experts_on_attention=True (gate on "
                    "Attention); both roles must use the same compute_gate_on_attention"
                )
            if runner is None:
                return FFNToAttention(_as_tensor(block(hidden), layer_idx))
            with self._forward_context(hidden.shape[0]):
                return FFNToAttention(_as_tensor(block(hidden), layer_idx))
        if kind in (PayloadKind.HIDDEN_TOPK, PayloadKind.HIDDEN_ROUTER_LOGITS):
            if runner is None:
                raise AFDTransferMismatchError(
                    f"layer {layer_idx}: received routing ({kind.name}) for a dense MLP block "
                    f"({type(block).__name__}); the roles disagree on which layers are MoE"
                )
            with self._forward_context(hidden.shape[0]):
                external = self.external_routing.get(layer_idx)
                if external is not None and kind is PayloadKind.HIDDEN_TOPK:
                    assert isinstance(payload.topk_ids, torch.Tensor)
                    assert isinstance(payload.topk_weights, torch.Tensor)
                    routing = ExternalRouting(payload.topk_ids, payload.topk_weights)
                    routed = external(hidden, routing)
                else:
                    routed = routed_experts_output(runner, payload)
                if self.shared_experts_on_attention:
                    return FFNToAttention(routed)
                return FFNToAttention(routed, shared_output=shared_experts_output(runner, hidden))
        raise AFDConfigError(
            f"layer {layer_idx}: payload kind {kind.name} is not supported by FFNLayerCompute"
        )

    def warm_up(
        self,
        *,
        compute_gate_on_attention: bool,
        routing_payload: RoutingPayload | str = RoutingPayload.TOPK,
        expert_parallel: tuple[int, int] | None = None,
        num_tokens: int = 8,
        hidden_size: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> WarmUpReport:
        """Run every layer once through :meth:`compute` on a dummy batch of the payload
        kind the Attention role will send it, and drop the answers.

        The kind per layer is the deployment's: hidden states for every layer with the
        gate on FFN and for dense layers; with the gate on Attention, MoE layers get
        top-k ids and weights (``routing_payload="topk"``) or router logits. Top-k ids
        are valid expert ids of the layer as a real dispatch sends them: every row has
        one expert this rank holds, the others with zero weight; ``expert_parallel``
        ``(rank, size)`` names this FFN rank's shard (``afd_core.topology.expert_shard``),
        None means every expert. Nothing that affects later results changes: the blocks
        keep no state between calls (no KV cache; MoE is stateless), the dummy values
        come from a private generator (torch's global RNG is untouched), and each call
        opens its own vLLM forward context as serving does.

        ``hidden_size`` / ``dtype``: of the hidden states (default: the model config's,
        else the MoE layers' own).
        """
        if num_tokens < 1:
            raise AFDConfigError(f"warm_up: num_tokens must be >= 1, got {num_tokens}")
        routing = RoutingPayload(routing_payload)
        generator = torch.Generator().manual_seed(0)
        hidden_size, dtype = self._hidden_spec(hidden_size, dtype)
        kinds: dict[int, PayloadKind] = {}
        t0 = time.perf_counter()
        for layer_idx in sorted(self.layers):
            block = self.layers[layer_idx]
            runner = self.runners[layer_idx]
            device = next((p.device for p in block.parameters()), torch.device("cpu"))
            hidden = torch.randn(num_tokens, hidden_size, generator=generator) * 0.1
            hidden = hidden.to(device=device, dtype=dtype)
            if runner is None or not compute_gate_on_attention:
                payload = AttentionToFFN(hidden)
            elif routing is RoutingPayload.ROUTER_LOGITS:
                experts = runner.moe_config.num_logical_experts
                logits_dtype = runner.moe_config.router_logits_dtype or dtype
                logits = torch.randn(num_tokens, experts, generator=generator)
                payload = AttentionToFFN(hidden, router_logits=logits.to(logits_dtype).to(device))
            else:
                ids, weights = _warm_up_topk(runner, num_tokens, expert_parallel)
                payload = AttentionToFFN(
                    hidden, topk_ids=ids.to(device), topk_weights=weights.to(device)
                )
            self.compute(layer_idx, payload)
            kinds[layer_idx] = payload.kind
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return WarmUpReport(kinds, num_tokens, time.perf_counter() - t0)

    def _hidden_spec(
        self, hidden_size: int | None, dtype: torch.dtype | None
    ) -> tuple[int, torch.dtype]:
        model = self.vllm_config.model_config
        moe = [r.moe_config for r in self.runners.values() if r is not None]
        if hidden_size is None:
            if model is not None:
                hidden_size = int(model.get_hidden_size())
            elif moe:
                hidden_size = moe[0].hidden_dim_unpadded or moe[0].hidden_dim
            else:
                raise AFDConfigError(
                    "warm_up: no model config and no MoE layer to read the hidden size "
                    "from; pass hidden_size"
                )
        if dtype is None:
            if model is not None:
                dtype = model.dtype
            elif moe:
                dtype = moe[0].in_dtype
            else:
                dtype = torch.get_default_dtype()
        return hidden_size, dtype

    def _empty_result(
        self, layer_idx: int, runner: MoERunner | None, payload: AttentionToFFN
    ) -> FFNToAttention:
        """The answer to a zero-token message (a shadow micro-batch of every attention
        peer at once): nothing to compute, but the kinds must match a real answer."""
        hidden = payload.hidden_states
        assert isinstance(hidden, torch.Tensor)
        if payload.kind is PayloadKind.HIDDEN or runner is None:
            return FFNToAttention(hidden.new_empty((0, hidden.shape[1])))
        out = hidden.new_empty((0, hidden.shape[1]))
        if self.shared_experts_on_attention or runner.shared_experts is None:
            return FFNToAttention(out)
        return FFNToAttention(out, shared_output=hidden.new_empty((0, hidden.shape[1])))

    def serve_one(
        self,
        connector: AFDConnector,
        *,
        timeout_s: float | None = None,
        metrics: FFNMetrics | None = None,
    ) -> FFNBatch:
        """Receive one layer from the Attention peers, compute it, send the result back
        (recorded in ``metrics`` when given)."""
        rec = recorder("ffn", connector.rank)
        if rec is None and metrics is None:
            batch = connector.recv_from_attention(timeout_s=timeout_s)
            connector.send_to_attention(batch, self.compute(batch.layer_idx, batch.payload))
            return batch
        t0 = time.perf_counter_ns()
        batch = connector.recv_from_attention(timeout_s=timeout_s)
        t1 = time.perf_counter_ns()
        result = self.compute(batch.layer_idx, batch.payload)
        t2 = time.perf_counter_ns()
        connector.send_to_attention(batch, result)
        t3 = time.perf_counter_ns()
        if metrics is not None:
            metrics.served(batch, result, t2 - t1)
        if rec is not None:
            where = {"layer": batch.layer_idx, "mb": batch.micro_batch_idx}
            rec.span("recv", t0, t1, tokens=batch.header.num_tokens, **where)
            rec.span("compute", t1, t2, **where)
            rec.span("return", t2, t3, **where)
        return batch


def _warm_up_topk(
    runner: MoERunner, num_tokens: int, expert_parallel: tuple[int, int] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids (int32) and weights (float32) of ``num_tokens`` rows as the Attention
    role sends them to this rank: distinct valid ids per row, the first one held here
    (cycling through the held experts), the others weighted zero when not held (as
    ``expert_parallel.shard_payload`` does)."""
    experts = runner.moe_config.num_logical_experts
    top_k = runner.moe_config.experts_per_token
    held = range(experts)
    if expert_parallel is not None:
        rank, size = expert_parallel
        held = expert_shard(experts, size, rank)
    first = torch.tensor([held[r % len(held)] for r in range(num_tokens)], dtype=torch.int64)
    ids = (first[:, None] + torch.arange(top_k)[None, :]) % experts
    mine = (ids >= held.start) & (ids < held.stop)
    weights = torch.where(mine, torch.full(ids.shape, 1.0 / top_k), torch.zeros(ids.shape))
    return ids.to(torch.int32), weights.to(torch.float32)


def _as_tensor(output: Any, layer_idx: int) -> torch.Tensor:
    if not isinstance(output, torch.Tensor):
        raise AFDConfigError(
            f"layer {layer_idx}: the FFN block returned {type(output).__name__}, expected a "
            "tensor [tokens, hidden]"
        )
    return output
