"""The Attention role's per-layer AFD exchange as one opaque torch custom op.

vLLM compiles the model by default (on CPU: Dynamo traced once, inductor). The AFD
exchange of a layer is Python that Dynamo cannot trace (connector calls, locks,
polling, the micro-batch scheduler's turn-taking), so every Attention-side AFD layer
(the two MoE runners and the dense stand-in) enters it through ``afd::exchange``, a
``torch.library`` custom op with a fake implementation, the way vLLM's attention
enters ``vllm::unified_attention``. In a compiled graph the op is one extern call:
inductor fuses everything around it and never looks inside; at run time the op finds
its layer by name and runs the layer's eager exchange (route, send, yield, receive,
combine), which reads this step's connector from vLLM's forward context.

The op keeps vLLM's splitting-op contract (as ``vllm::unified_attention_with_output``):
the traced code allocates the output and the op writes into it, returning nothing (see
:func:`_exchange_op`). Eager mode calls the layer directly (:func:`exchange`), without the
dispatcher and without the copy.

On CUDA the op is also the graph-splitting point for piecewise CUDA graphs
(:data:`SPLITTING_OP`, see :func:`afd_moe_runners.role_model.compiled_graph_problem`).
"""

from __future__ import annotations

import logging
import weakref
from typing import Protocol

import torch

__all__ = [
    "ExchangeLayer",
    "OP_NAME",
    "SPLITTING_OP",
    "COMPILED_LOG",
    "compiled_calls",
    "exchange",
    "register_layer",
]

logger = logging.getLogger(__name__)

#: Log line of the first call of the op in a process: proof that the role runs a
#: compiled graph (eager forwards never reach the op).
COMPILED_LOG = "AFD: the compiled model runs the exchange as the custom op"

OP_NAME = "afd::exchange"
#: The name vLLM's ``compilation_config.splitting_ops`` takes for the op.
SPLITTING_OP = OP_NAME


class ExchangeLayer(Protocol):
    """An Attention-side AFD layer: what the op runs at run time."""

    def afd_exchange(
        self, hidden_states: torch.Tensor, router_logits: torch.Tensor | None
    ) -> torch.Tensor: ...


# Layer name -> layer. One model per Attention process; a rebuilt model (tests build
# several in one process) replaces the entries of the old one.
_LAYERS: dict[str, weakref.ReferenceType[ExchangeLayer]] = {}
_CALLS = [0]


def compiled_calls() -> int:
    """How often compiled graphs of this process have called the op."""
    return _CALLS[0]


def register_layer(name: str, layer: ExchangeLayer) -> None:
    """Make ``layer`` reachable from the op under ``name`` (its vLLM layer prefix)."""
    _LAYERS[name] = weakref.ref(layer)


def _layer(name: str) -> ExchangeLayer:
    ref = _LAYERS.get(name)
    layer = ref() if ref is not None else None
    if layer is None:
        raise RuntimeError(
            f"{OP_NAME}: no AFD layer named {name!r} is alive in this process (known: "
            f"{sorted(k for k, r in _LAYERS.items() if r() is not None)})"
        )
    return layer


@torch.library.custom_op(OP_NAME, mutates_args=("output",))
def _exchange_op(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor | None,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    if _CALLS[0] == 0:
        logger.info("%s %s (first call: %s)", COMPILED_LOG, OP_NAME, layer_name)
    _CALLS[0] += 1
    # vLLM's splitting-op contract (as ``vllm::unified_attention_with_output``): the
    # traced code allocates ``output`` and the op writes into it, returning nothing. A
    # piecewise CUDA graph replays the piece after the op with the input addresses it
    # saw at capture and copies no inputs (``CUDAGraphWrapper``), so a fresh tensor
    # returned from here would be read from a stale address on every replay. Writing
    # into ``output`` also keeps the graph's memory apart from the connector's: a
    # received tensor may be a view of a receive buffer that the next receive
    # overwrites (shared memory, the NCCL pool).
    output.copy_(_layer(layer_name).afd_exchange(hidden_states, router_logits))


@_exchange_op.register_fake
def _exchange_fake(
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor | None,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    return None


def exchange(
    layer: ExchangeLayer,
    name: str,
    hidden_states: torch.Tensor,
    router_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """The layer's exchange: through the op while Dynamo traces, directly otherwise."""
    if torch.compiler.is_compiling():
        output = torch.empty_like(hidden_states)
        torch.ops.afd.exchange(hidden_states, router_logits, output, name)
        return output
    return layer.afd_exchange(hidden_states, router_logits)
