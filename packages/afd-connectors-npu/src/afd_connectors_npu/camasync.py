"""``CAMAsyncAFDConnector``: asynchronous CAM dispatch / combine (Ascend).

The Attention role runs the native gate and expert selection and hands the top-k
routing to :meth:`~CAMAsyncAFDConnector.send_to_ffn`, which enqueues an asynchronous
dispatch (``CAMOps.dispatch_send``) and returns without waiting for it. The ids and
weights reach the dispatch operator unchanged (int32 / float32 ``[tokens, top_k]``).
:meth:`~CAMAsyncAFDConnector.recv_from_ffn` is the combine receive: it returns the
weighted, combined routed output. Shared experts run on the Attention role, so an FFN
answer with a ``shared_output`` is refused.

The FFN role gets a token-major :class:`~afd_core.connector.FFNBatch` (hidden states,
top-k ids and weights; :mod:`afd_connectors_npu.layout` converts it to the
expert-major layout and back) and answers with the weighted, combined result.

Only ``PayloadKind.HIDDEN_TOPK`` is carried: the connector needs
``afd.compute_gate_on_attention=true`` and ``afd.routing_payload='topk'``.
"""

from __future__ import annotations

from typing import ClassVar

from afd_connectors_npu.exchange import CAMConnector, CAMTransport
from afd_connectors_npu.ops import A2EMessage, CAMHandle, CAMOps, E2AMessage
from afd_connectors_npu.routing import A2EMeta, E2AMeta
from afd_core.config import AFDConfig, AFDRole, RoutingPayload
from afd_core.connector import ConnectorCapabilities
from afd_core.errors import AFDConfigError, AFDTransferMismatchError
from afd_core.exchange import ExchangeConnector, Transport
from afd_core.transfer import AttentionToFFN, FFNToAttention, PayloadKind

__all__ = ["CAMAsyncAFDConnector", "CAMAsyncTransport"]

_NEEDS = "CAMAsync needs afd.compute_gate_on_attention=true and afd.routing_payload='topk'"


class CAMAsyncTransport(CAMTransport):
    """Dispatch (non-blocking, settled when its answer arrives) and combine operators."""

    def __init__(self, connector: ExchangeConnector) -> None:
        super().__init__(connector)
        # (layer, micro-batch) -> dispatch in flight, settled when its answer arrives.
        self._inflight: dict[tuple[int, int], CAMHandle] = {}

    def _post_a2f(self, ops: CAMOps, peer: int, message: A2EMessage, key: tuple[int, int]) -> None:
        self._inflight[key] = ops.dispatch_send(peer, message)

    def _take_a2f(self, ops: CAMOps, peer: int, timeout: float) -> A2EMessage:
        return ops.dispatch_recv(peer, timeout_s=timeout)

    def _post_f2a(self, ops: CAMOps, peer: int, message: E2AMessage) -> None:
        ops.combine_send(peer, message, timeout_s=self.connector.config.transfer_timeout_s)

    def _take_f2a(self, ops: CAMOps, peer: int, timeout: float) -> E2AMessage:
        return ops.combine_recv(peer, timeout_s=timeout)

    def _settle_send(self, key: tuple[int, int], timeout: float) -> None:
        handle = self._inflight.pop(key, None)
        if handle is not None:
            handle.wait(timeout)


class CAMAsyncAFDConnector(CAMConnector):
    """Asynchronous CAM connector: dispatch (non-blocking) and combine receive."""

    name: ClassVar[str] = "CAMAsyncAFDConnector"
    capabilities: ClassVar[ConnectorCapabilities] = ConnectorCapabilities(
        platforms=frozenset({"npu"}),
        gate_placements=frozenset({"attention"}),
        platform_runners=True,
        shared_experts_on_attention=True,
        # No hidden-only messages: dense layers stay on the Attention role.
        payload_kinds=frozenset({PayloadKind.HIDDEN_TOPK}),
    )

    transport_class: ClassVar[type[Transport]] = CAMAsyncTransport
    transport: CAMAsyncTransport

    def _check_config(self, config: AFDConfig) -> None:
        if not config.compute_gate_on_attention:
            raise AFDConfigError(
                f"afd.compute_gate_on_attention is false; {_NEEDS} (set "
                "afd.compute_gate_on_attention=true on both roles)"
            )
        if config.routing_payload is not RoutingPayload.TOPK:
            raise AFDConfigError(
                f"afd.routing_payload is {config.routing_payload.value!r}; {_NEEDS} (set "
                "afd.routing_payload='topk')"
            )

    def _check_a2f(self, payload: AttentionToFFN) -> None:
        if payload.kind is not PayloadKind.HIDDEN_TOPK:
            raise AFDConfigError(
                f"{self.label}: send_to_ffn carries only top-k routing (HIDDEN_TOPK), got "
                f"{payload.kind.name}; {_NEEDS}"
            )

    def _check_a2f_received(self, meta: A2EMeta) -> None:
        if meta.header.kind is not PayloadKind.HIDDEN_TOPK:
            raise AFDTransferMismatchError(
                f"{self.label}: dispatch from attention rank {meta.sender} is "
                f"{meta.header.kind.name}, expected HIDDEN_TOPK; {_NEEDS} on both roles"
            )

    def _check_f2a(self, result: FFNToAttention) -> None:
        if result.shared_output is not None:
            raise AFDConfigError(
                f"{self.label}: send_to_attention got a shared_output; with CAMAsync the shared "
                "experts run on the Attention role, send the weighted routed output only"
            )

    def _check_f2a_received(self, meta: E2AMeta) -> None:
        if meta.header.kind is not PayloadKind.OUTPUT:
            raise AFDTransferMismatchError(
                f"{self.label}: combine from ffn rank {meta.sender} is {meta.header.kind.name}, "
                "expected OUTPUT (shared experts run on the Attention role with CAMAsync)"
            )

    def pending_dispatches(self) -> int:
        """Dispatches sent whose combined answer has not been received yet."""
        if self.role is not AFDRole.ATTENTION:
            return 0
        return len(self.transport._inflight)
