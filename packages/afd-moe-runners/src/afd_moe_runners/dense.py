"""Attention role: a parameter-free stand-in for a dense (non-MoE) MLP layer."""

from __future__ import annotations

import torch

from afd_core.errors import AFDTransferMismatchError
from afd_core.transfer import AttentionToFFN
from afd_moe_runners.exchange import MicroBatchYield, scheduler_yield, send_to_ffn
from afd_moe_runners.exchange_op import exchange, register_layer

__all__ = ["RemoteDenseMLP"]


class RemoteDenseMLP(torch.nn.Module):
    """Sends the MLP input of decoder layer ``layer_idx`` to the FFN role, returns its output.

    It holds no parameters: the dense MLP weights are loaded by the FFN role only.
    ``forward`` keeps the shape contract of vLLM's dense MLPs (``[tokens, hidden]`` in
    and out, no tuple).
    """

    def __init__(self, layer_idx: int, *, micro_batch_yield: MicroBatchYield | None = None):
        super().__init__()
        self._init_remote(layer_idx, micro_batch_yield)

    def _init_remote(self, layer_idx: int, micro_batch_yield: MicroBatchYield | None) -> None:
        """Everything but ``nn.Module.__init__`` (subclasses mixed with a native MLP class
        call it instead of the native constructor, which would build weights)."""
        self.layer_idx = layer_idx
        self.micro_batch_yield: MicroBatchYield = micro_batch_yield or scheduler_yield
        self.afd_layer_name = f"afd.dense_mlp.{layer_idx}"
        register_layer(self.afd_layer_name, self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exchange(self, self.afd_layer_name, x)

    def afd_exchange(self, x: torch.Tensor, router_logits: torch.Tensor | None) -> torch.Tensor:
        """Send, yield, receive (eager; compiled graphs reach it through the op)."""
        pending = send_to_ffn(AttentionToFFN(x), layer_idx=self.layer_idx)
        self.micro_batch_yield(pending.layer_idx, pending.micro_batch_idx)
        result = pending.receive()
        if result.shared_output is not None:
            raise AFDTransferMismatchError(
                f"dense layer {self.layer_idx}: the FFN role sent a separate shared-expert "
                "output for a dense MLP"
            )
        output = result.output
        assert isinstance(output, torch.Tensor)
        return output

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}"
