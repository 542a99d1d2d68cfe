"""Gate on FFN: the Attention role's MoE runner ships hidden states and returns the answer.

:class:`RemoteExpertsRunner` is what ``FusedMoEFactory(runner_cls=...)`` builds on
the Attention role when ``compute_gate_on_attention`` is false. The FFN role runs the
whole native block (gate, routing, routed and shared experts, routed scaling and its
own reductions) and sends back the final block output, so this runner overrides the
public ``MoERunner.forward`` and returns that output untouched. Overriding only
``_forward_impl`` would let the native ``forward`` post-processing (routed scaling,
shared-expert add, TP all-reduce) run a second time on an already final result.

In vLLM 0.32 the runner owns the gate (models pass ``gate=`` to the factory and call
the runner with ``router_logits=hidden_states`` as a placeholder); this runner drops
the gate, the shared experts and the routed transforms it is given, so it holds no
parameters at all.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.model_executor.models.utils import extract_layer_index

from afd_core.errors import AFDConfigError, AFDTransferMismatchError
from afd_core.transfer import AttentionToFFN
from afd_moe_runners.exchange import MicroBatchYield, scheduler_yield, send_to_ffn
from afd_moe_runners.exchange_op import exchange, register_layer
from afd_moe_runners.remote_experts import check_attention_moe_layer, require_remote_experts

__all__ = [
    "AttentionRunnerForward",
    "RemoteExpertsForward",
    "RemoteExpertsRunner",
    "reject_unsupported_inputs",
]


def reject_unsupported_inputs(
    layer_name: str, input_ids: torch.Tensor | None, shared_experts_input: torch.Tensor | None
) -> None:
    if input_ids is not None:
        raise AFDConfigError(
            f"{layer_name}: the model passed input_ids (hash-routed MoE); AFD runners do not "
            "transfer token ids yet, so this layer cannot be disaggregated"
        )
    if shared_experts_input is not None:
        raise AFDConfigError(
            f"{layer_name}: the model passed shared_experts_input (a routed input transform "
            "applied outside the runner); AFD runners expect the plain block input"
        )


class AttentionRunnerForward:
    """What every Attention-role AFD forward sets up: the layer index, the yield hook,
    the layer's entry in the exchange op (:mod:`afd_moe_runners.exchange_op`), and
    ``is_internal_router`` (the runner applies the gate itself, or the FFN role does)."""

    layer_name: str

    def _init_exchange(self, layer_name: str, micro_batch_yield: MicroBatchYield | None) -> None:
        self.afd_layer_idx = extract_layer_index(layer_name)
        self.micro_batch_yield: MicroBatchYield = micro_batch_yield or scheduler_yield
        register_layer(layer_name, self)  # type: ignore[arg-type]

    @property
    def is_internal_router(self) -> bool:
        # vLLM 0.32 never reads this; vLLM-Ascend's model code does, and must not call
        # a gate outside the runner (there is none on the Attention role with the gate on
        # FFN; with the gate on Attention the runner applies it).
        return True


class RemoteExpertsForward(AttentionRunnerForward):
    """Gate-on-FFN behaviour, independent of the runner base class.

    Mixed in before a ``MoERunner`` subclass: vLLM's own (:class:`RemoteExpertsRunner`)
    or vLLM-Ascend's ``AscendMoERunner`` (``afd_moe_runners.npu.runners``). It only
    calls the base's ``__init__`` with the keyword arguments every ``MoERunner``
    accepts, so the concrete classes differ by their base class alone.
    """

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
        micro_batch_yield: MicroBatchYield | None = None,
    ) -> None:
        require_remote_experts(f"{layer_name}: RemoteExpertsRunner", routed_experts)
        check_attention_moe_layer(
            layer_name, moe_config, routed_scaling_factor=routed_scaling_factor, router=router
        )
        # Everything that computes (gate, shared experts, transforms, scaling) runs on
        # the FFN role; none of it is kept here.
        super().__init__(  # type: ignore[call-arg]
            layer_name=layer_name,
            moe_config=moe_config,
            router=router,
            routed_experts=routed_experts,
            enable_dbo=enable_dbo,
        )
        self._init_exchange(layer_name, micro_batch_yield)

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_logits: torch.Tensor,
        input_ids: torch.Tensor | None = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # router_logits is the models' placeholder (the hidden states): unused here.
        reject_unsupported_inputs(self.layer_name, input_ids, shared_experts_input)
        return exchange(self, self.layer_name, hidden_states)

    def afd_exchange(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor | None
    ) -> torch.Tensor:
        """Send, yield, receive (eager; compiled graphs reach it through the op)."""
        pending = send_to_ffn(AttentionToFFN(hidden_states), layer_idx=self.afd_layer_idx)
        self.micro_batch_yield(pending.layer_idx, pending.micro_batch_idx)
        result = pending.receive()
        if result.shared_output is not None:
            raise AFDTransferMismatchError(
                f"{self.layer_name}: with the gate on FFN the FFN role must send the final "
                "block output, but it sent a separate shared-expert output"
            )
        output = result.output
        assert isinstance(output, torch.Tensor)
        return output


class RemoteExpertsRunner(RemoteExpertsForward, MoERunner):
    """Attention-role ``runner_cls`` for gate on FFN: send, yield, receive, return."""
