"""Native vLLM with AFD's graph boundaries: a native-only experiment for compiled parity.

A compiled AFD Attention role computes everything but the FFN blocks in one inductor
graph, with each FFN block (MoE block or dense MLP) behind the opaque ``afd::exchange``
op; the FFN role computes the blocks eagerly. Native vLLM compiled fuses the blocks into
the graph instead, so in bfloat16 its rounding can differ from AFD's (an intermediate
that inductor keeps in float32 inside a fused kernel is rounded to bfloat16 at an op
boundary). This module builds the native model with the *same* boundaries and nothing
else changed: one process, every weight, each decoder layer's ``mlp`` computed eagerly
behind the same op. AFD compiled must equal it token for token; where plain native
compiled differs from it, the difference is the graph boundary, not the split.

Used by ``python -m afd.reference --ffn-behind-op`` (in-process engine only).
"""

from __future__ import annotations

from typing import Any

__all__ = ["OPAQUE_PREFIX", "opaque_architecture"]

OPAQUE_PREFIX = "AFDOpaqueFFN"


def opaque_architecture(arch: str) -> str:
    """Register ``AFDOpaqueFFN<arch>`` (native ``arch`` with its FFN blocks behind the
    exchange op) in vLLM's model registry of this process; return the name."""
    from vllm import ModelRegistry

    name = f"{OPAQUE_PREFIX}{arch}"
    if name in ModelRegistry.get_supported_archs():
        return name
    from afd_moe_runners.generic import native_model_class

    native = native_model_class(arch)

    def __init__(self: Any, *, vllm_config: Any, prefix: str = "") -> None:
        native.__init__(self, vllm_config=vllm_config, prefix=prefix)
        inner = getattr(self, "language_model", self)
        for idx, layer in enumerate(inner.model.layers):
            mlp = getattr(layer, "mlp", None)
            if mlp is not None:
                _put_behind_op(mlp, f"afd.runtime.opaque_ffn.{idx}")

    cls = type(name, (native,), {"__init__": __init__, "__module__": __name__})
    ModelRegistry.register_model(name, cls)
    return name


def _dispatch_as_eager(mlp: Any) -> None:
    """Point the block's vLLM custom ops at the kernels an eager engine picks (the FFN
    role runs eager: ``custom_ops`` "all", e.g. ``forward_cpu``), not the PyTorch-native
    implementations a compiled engine picks for inductor to fuse."""
    from vllm.config import get_cached_compilation_config
    from vllm.model_executor.custom_op import CustomOp

    config = get_cached_compilation_config()
    saved = list(config.custom_ops)
    config.custom_ops = ["all"]
    try:
        for module in mlp.modules():
            if isinstance(module, CustomOp):
                module._forward_method = module.dispatch_forward(compile_native=False)
    finally:
        config.custom_ops = saved


class _EagerBlock:
    """What the op runs: the block's own forward, eagerly (as the FFN role does)."""

    def __init__(self, forward: Any) -> None:
        self.forward = forward

    def afd_exchange(self, hidden_states: Any, router_logits: Any) -> Any:
        return self.forward(hidden_states)


def _put_behind_op(mlp: Any, name: str) -> None:
    from afd_moe_runners.exchange_op import exchange, register_layer

    _dispatch_as_eager(mlp)
    holder = _EagerBlock(mlp.forward)
    register_layer(name, holder)

    def forward(hidden_states: Any) -> Any:
        return exchange(holder, name, hidden_states)

    mlp._afd_opaque = holder  # keeps the holder alive (the op's registry is weak)
    mlp.forward = forward
