"""Per-step AFD metadata carried in vLLM's forward context.

The AFD runtime attaches an :class:`AFDStepMetadata` to every forward pass in
``ForwardContext.additional_kwargs[AFD_CONTEXT_KEY]`` (a plain ``dict[str, Any]``
field of ``vllm.forward_context.ForwardContext`` in vLLM 0.32, meant for
platform/plugin data). Model code and MoE runners read it back with
:func:`get_step_metadata`; nothing else is stored on the context, so no vLLM
class is patched. vLLM is imported lazily, only when no context is passed.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from afd_core.connector import AFDConnector
from afd_core.errors import AFDMetadataMissingError

__all__ = [
    "AFD_CONTEXT_KEY",
    "AFDStepMetadata",
    "MicroBatchScheduler",
    "set_step_metadata",
    "get_step_metadata",
    "find_step_metadata",
]

AFD_CONTEXT_KEY = "afd"
"""Key of :class:`AFDStepMetadata` in ``ForwardContext.additional_kwargs``."""

_HOW_TO_FIX = (
    "the AFD runtime must attach step metadata with afd_core.forward_context."
    "set_step_metadata(); is the afd plugin loaded and additional_config['afd'] set?"
)


@runtime_checkable
class MicroBatchScheduler(Protocol):
    """What runs the micro-batches of one forward step in turn (ping-pong overlap).

    An AFD layer calls :meth:`on_send` right after it sent its payload to the FFN role
    and :meth:`yield_turn` before it waits for the answer: the scheduler then lets the
    next micro-batch compute (its attention, its own send) while the FFN role computes
    this one, and returns when it is this micro-batch's turn again.
    """

    def on_send(self, layer_idx: int, micro_batch_idx: int, payload: Any) -> None:
        """``payload`` (an ``AttentionToFFN``) was sent for ``layer_idx``."""

    def yield_turn(self, layer_idx: int, micro_batch_idx: int) -> None:
        """Let the other micro-batches run; return when this one may receive."""


@dataclass
class AFDStepMetadata:
    """What an AFD layer needs to know about the current forward step."""

    connector: AFDConnector
    """The live connector of this worker."""
    micro_batch_idx: int = 0
    """Micro-batch being computed (0 without micro-batching)."""
    num_tokens: int | None = None
    """Tokens of this micro-batch as sent over the wire (None: the tensor's rows)."""
    num_micro_batches: int = 1
    is_dummy_run: bool = False
    """Profiling / warm-up step; the FFN role still answers it."""
    scheduler: MicroBatchScheduler | None = None
    """Runs this step's micro-batches in turn (None: one micro-batch, nothing to yield to)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Connector- or model-specific side data (kept out of the common contract)."""

    def __post_init__(self) -> None:
        if not isinstance(self.connector, AFDConnector):
            raise TypeError(
                f"AFDStepMetadata.connector: expected an AFDConnector, got "
                f"{type(self.connector).__name__}"
            )
        if not 0 <= self.micro_batch_idx < self.num_micro_batches:
            raise ValueError(
                f"AFDStepMetadata.micro_batch_idx: expected 0..{self.num_micro_batches - 1}, "
                f"got {self.micro_batch_idx}"
            )
        if self.num_tokens is not None and self.num_tokens < 0:
            raise ValueError(f"AFDStepMetadata.num_tokens: expected >= 0, got {self.num_tokens}")


def _kwargs_of(forward_context: Any) -> MutableMapping[str, Any]:
    kwargs = getattr(forward_context, "additional_kwargs", None)
    if not isinstance(kwargs, MutableMapping):
        raise TypeError(
            f"expected a vLLM ForwardContext (with an additional_kwargs dict), got "
            f"{type(forward_context).__name__} whose additional_kwargs is {type(kwargs).__name__}"
        )
    return kwargs


def _current_forward_context() -> Any:
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available
    except ImportError as exc:
        raise AFDMetadataMissingError(
            f"AFD step metadata: vLLM is not importable ({exc}); pass forward_context= "
            "explicitly outside vLLM"
        ) from exc
    if not is_forward_context_available():
        raise AFDMetadataMissingError(
            "AFD step metadata: no vLLM forward context is set (called outside a model "
            f"forward pass, i.e. outside vllm.forward_context.set_forward_context); {_HOW_TO_FIX}"
        )
    return get_forward_context()


def set_step_metadata(forward_context: Any, meta: AFDStepMetadata) -> None:
    """Attach ``meta`` to ``forward_context`` (replacing the previous step's)."""
    if not isinstance(meta, AFDStepMetadata):
        raise TypeError(f"expected AFDStepMetadata, got {type(meta).__name__}")
    _kwargs_of(forward_context)[AFD_CONTEXT_KEY] = meta


def find_step_metadata(forward_context: Any | None = None) -> AFDStepMetadata | None:
    """Like :func:`get_step_metadata` but returns None when no metadata is attached."""
    ctx = _current_forward_context() if forward_context is None else forward_context
    meta = _kwargs_of(ctx).get(AFD_CONTEXT_KEY)
    if meta is None:
        return None
    if not isinstance(meta, AFDStepMetadata):
        raise AFDMetadataMissingError(
            f"AFD step metadata: additional_kwargs[{AFD_CONTEXT_KEY!r}] holds a "
            f"{type(meta).__name__}, expected AFDStepMetadata; {_HOW_TO_FIX}"
        )
    return meta


def get_step_metadata(forward_context: Any | None = None) -> AFDStepMetadata:
    """The metadata of the current step (of vLLM's current forward context by default)."""
    meta = find_step_metadata(forward_context)
    if meta is None:
        raise AFDMetadataMissingError(
            f"AFD step metadata: the forward context has no "
            f"additional_kwargs[{AFD_CONTEXT_KEY!r}]; {_HOW_TO_FIX}"
        )
    return meta
