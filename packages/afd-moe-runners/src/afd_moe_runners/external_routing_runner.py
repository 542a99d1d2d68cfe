"""Gate on Attention: route natively, ship hidden states + routing, combine the routed result.

:class:`ExternalRoutingRunner` is the Attention-role ``runner_cls`` when
``compute_gate_on_attention`` is true. It keeps the gate and router vLLM built for
the layer and uses them exactly as ``MoERunner`` does (``gate(x)`` then
``router.select_experts``: grouped top-k, ``e_score_correction_bias``, scoring,
renormalisation and, unless ``apply_routed_scale_to_output``, the routed scaling
factor folded into the top-k weights). It then sends the hidden states plus either
the top-k ids/weights or the raw router logits, runs the shared experts locally
while the FFN role computes the routed experts, receives the routed output and
combines:

* routed scaling: in the weights (router) or once here via the native
  ``_maybe_apply_routed_scale_to_output`` when ``apply_routed_scale_to_output``;
* shared experts: added once here (``shared + routed``, the native order);
* reductions: the FFN role reduces the routed output over its own ranks; the shared
  output, computed tensor-parallel here, is all-reduced here, once.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed import tensor_model_parallel_all_reduce
from vllm.model_executor.layers.fused_moe.router.zero_expert_router import ZeroExpertRouter
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExpertsOrder

from afd_core.config import RoutingPayload
from afd_core.errors import AFDConfigError, AFDTransferMismatchError
from afd_core.transfer import AttentionToFFN
from afd_moe_runners.exchange import MicroBatchYield, send_to_ffn
from afd_moe_runners.exchange_op import exchange
from afd_moe_runners.remote_experts import check_attention_moe_layer, require_remote_experts
from afd_moe_runners.remote_runner import AttentionRunnerForward, reject_unsupported_inputs

__all__ = ["ExternalRoutingForward", "ExternalRoutingRunner"]


class ExternalRoutingForward(AttentionRunnerForward):
    """Gate-on-Attention behaviour, independent of the runner base class.

    Mixed in before a ``MoERunner`` subclass: vLLM's own (:class:`ExternalRoutingRunner`)
    or vLLM-Ascend's ``AscendMoERunner`` (``afd_moe_runners.npu.runners``). It uses
    only members every ``MoERunner`` has (``gate``, ``router.select_experts``,
    ``shared_experts``, ``moe_config``, ``_maybe_apply_routed_scale_to_output``).
    """

    gate: torch.nn.Module | None
    router: Any
    moe_config: Any
    shared_experts: Any
    _maybe_apply_routed_scale_to_output: Any

    def __init__(
        self,
        layer_name: str,
        moe_config: Any,
        router: Any,
        routed_experts: Any,
        enable_dbo: bool = False,
        gate: torch.nn.Module | None = None,
        shared_experts: torch.nn.Module | None = None,
        shared_expert_gate: torch.nn.Module | None = None,
        routed_input_transform: torch.nn.Module | None = None,
        routed_output_transform: torch.nn.Module | None = None,
        routed_scaling_factor: float = 1.0,
        *,
        routing_payload: RoutingPayload | str = RoutingPayload.TOPK,
        micro_batch_yield: MicroBatchYield | None = None,
    ) -> None:
        where = f"AFD Attention-role MoE layer {layer_name!r} (compute_gate_on_attention=true)"
        require_remote_experts(where, routed_experts)
        unsupported = {
            "shared_expert_gate": shared_expert_gate,
            "routed_input_transform": routed_input_transform,
            "routed_output_transform": routed_output_transform,
        }
        for name, module in unsupported.items():
            if module is not None:
                raise AFDConfigError(
                    f"{where}: {name} is not supported with the gate on Attention; set "
                    "compute_gate_on_attention=false (the FFN role then runs the whole "
                    "native block)"
                )
        if isinstance(router, ZeroExpertRouter):
            raise AFDConfigError(
                f"{where}: zero-expert routing is not supported with the gate on Attention; "
                "set compute_gate_on_attention=false"
            )
        check_attention_moe_layer(
            layer_name, moe_config, routed_scaling_factor=routed_scaling_factor, router=router
        )
        super().__init__(  # type: ignore[call-arg]
            layer_name=layer_name,
            moe_config=moe_config,
            router=router,
            routed_experts=routed_experts,
            enable_dbo=enable_dbo,
            gate=gate,
            shared_experts=shared_experts,
            routed_scaling_factor=routed_scaling_factor,
        )
        self.routing_payload = RoutingPayload(routing_payload)
        self._init_exchange(layer_name, micro_batch_yield)

    def route(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor | None = None
    ) -> AttentionToFFN:
        """Apply the native gate (and router, for top-k payloads): the A->F payload.

        As vLLM's ``MoERunner``: a runner given ``gate=`` applies it; without one the
        model applied its gate itself and passed ``router_logits``.
        """
        gate = self.gate
        if gate is not None:
            router_logits, _ = gate(hidden_states)
        assert router_logits is not None, "no gate and no router_logits"
        if self.routing_payload is RoutingPayload.ROUTER_LOGITS:
            return AttentionToFFN(hidden_states, router_logits=router_logits)
        topk_weights, topk_ids = self.router.select_experts(
            hidden_states=hidden_states, router_logits=router_logits
        )
        return AttentionToFFN(
            hidden_states,
            topk_ids=topk_ids.to(torch.int32),
            topk_weights=topk_weights.to(torch.float32),
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # router_logits: a placeholder when the runner owns the gate (most 0.32 models),
        # else the logits of the model's own gate call.
        reject_unsupported_inputs(self.layer_name, input_ids, shared_experts_input)
        logits = None if self.gate is not None else router_logits
        return exchange(self, self.layer_name, hidden_states, logits)

    def afd_exchange(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor | None
    ) -> torch.Tensor:
        """Route, send, run the shared experts, yield, receive, combine (eager; compiled
        graphs reach it through the op)."""
        pending = send_to_ffn(
            self.route(hidden_states, router_logits), layer_idx=self.afd_layer_idx
        )

        # The shared experts overlap with the FFN role's routed experts.
        shared = self.shared_experts
        launched_async = False
        if shared is not None:
            launched_async = shared.maybe_forward_async(hidden_states)
            if not launched_async:
                shared(hidden_states, SharedExpertsOrder.NO_OVERLAP)

        self.micro_batch_yield(pending.layer_idx, pending.micro_batch_idx)
        result = pending.receive()
        if result.shared_output is not None and shared is not None:
            raise AFDTransferMismatchError(
                f"{self.layer_name}: the FFN role sent a shared-expert output, but this "
                "Attention-side layer computes its shared experts itself; the shared term "
                "would be added twice"
            )
        fused_output = result.output
        assert isinstance(fused_output, torch.Tensor)

        shared_output: torch.Tensor | None = None
        if result.shared_output is not None:
            # Computed (and reduced) by the FFN role next to the routed experts.
            assert isinstance(result.shared_output, torch.Tensor)
            shared_output = result.shared_output
        elif shared is not None:
            if launched_async:
                shared.wait()
            shared_output = shared.output
            if self.moe_config.tp_size > 1 and not self.moe_config.is_sequence_parallel:
                # The shared MLP runs tensor-parallel here with reduce_results=False; the
                # routed output arrives already reduced by the FFN role.
                shared_output = tensor_model_parallel_all_reduce(shared_output)

        # Private in 0.32 (see _vllm_compat): applies apply_routed_scale_to_output once.
        shared_output, fused_output = self._maybe_apply_routed_scale_to_output(
            shared_output, fused_output
        )
        if shared_output is not None:
            return shared_output + fused_output
        return fused_output


class ExternalRoutingRunner(ExternalRoutingForward, MoERunner):
    """Attention-role ``runner_cls`` for gate on Attention (external routing)."""
