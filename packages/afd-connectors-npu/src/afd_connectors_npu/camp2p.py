"""``CAMP2pAFDConnector``: synchronous CAM point-to-point exchange (Ascend).

Attention -> FFN goes through the CAM A2E operator, FFN -> Attention through E2A.
Carries hidden states alone (gate on FFN), hidden states plus top-k routing (the
Attention-side gate, ``afd.compute_gate_on_attention=true``: ids int32 in the ids
channel, weights float32 in the scales slot) or hidden states plus token ids
(hash-routed layers), and a separate shared-expert output on the way back. Router
logits are not carried. An FFN rank serves ``topology.attention_peers_of(rank)``
(fan-in) and splits its answer back per attention rank.

Deployment limits are checked by :func:`afd_connectors_npu.validation.validate_npu_deployment`.
"""

from __future__ import annotations

from typing import ClassVar

from afd_connectors_npu.exchange import CAMConnector, CAMTransport
from afd_connectors_npu.ops import A2EMessage, CAMOps, E2AMessage
from afd_core.config import AFDConfig, RoutingPayload
from afd_core.connector import ConnectorCapabilities
from afd_core.errors import AFDConfigError
from afd_core.exchange import Transport
from afd_core.transfer import AttentionToFFN, PayloadKind

__all__ = ["CAMP2pAFDConnector", "CAMP2pTransport"]


class CAMP2pTransport(CAMTransport):
    """A2E / E2A operators, both blocking."""

    def _post_a2f(self, ops: CAMOps, peer: int, message: A2EMessage, key: tuple[int, int]) -> None:
        ops.a2e_send(peer, message, timeout_s=self.connector.config.transfer_timeout_s)

    def _take_a2f(self, ops: CAMOps, peer: int, timeout: float) -> A2EMessage:
        return ops.a2e_recv(peer, timeout_s=timeout)

    def _post_f2a(self, ops: CAMOps, peer: int, message: E2AMessage) -> None:
        ops.e2a_send(peer, message, timeout_s=self.connector.config.transfer_timeout_s)

    def _take_f2a(self, ops: CAMOps, peer: int, timeout: float) -> E2AMessage:
        return ops.e2a_recv(peer, timeout_s=timeout)


class CAMP2pAFDConnector(CAMConnector):
    """Synchronous CAM connector: A2E / E2A operators, one message each way per layer."""

    name: ClassVar[str] = "CAMP2pAFDConnector"
    transport_class: ClassVar[type[Transport]] = CAMP2pTransport
    capabilities: ClassVar[ConnectorCapabilities] = ConnectorCapabilities(
        platforms=frozenset({"npu"}),
        platform_runners=True,
        shared_experts_on_attention=True,
        ffn_external_routing=True,
        # Router logits are not carried.
        payload_kinds=frozenset(
            {PayloadKind.HIDDEN, PayloadKind.HIDDEN_TOPK, PayloadKind.HIDDEN_TOKEN_IDS}
        ),
    )

    def _check_config(self, config: AFDConfig) -> None:
        if config.routing_payload is not RoutingPayload.TOPK:
            raise AFDConfigError(
                f"{self.name} does not carry router_logits (afd.routing_payload="
                f"{config.routing_payload.value!r}); set afd.routing_payload='topk'"
            )

    def _check_a2f(self, payload: AttentionToFFN) -> None:
        if payload.topk_ids is not None and not self.config.compute_gate_on_attention:
            raise AFDConfigError(
                f"{self.label}: send_to_ffn got top-k routing but afd.compute_gate_on_attention "
                "is false (the FFN role runs the gate); set afd.compute_gate_on_attention=true "
                "on both roles or send hidden states only"
            )
