"""``additional_config["afd"]``: parsed and validated into a frozen :class:`AFDConfig`.

(Field set fixed here; parsing/validation details are completed in this module.)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["AFDRole", "RoutingPayload", "AFDConfig"]


class AFDRole(str, enum.Enum):
    ATTENTION = "attention"
    FFN = "ffn"


class RoutingPayload(str, enum.Enum):
    """What the Attention role sends as routing when the gate runs on Attention."""

    TOPK = "topk"
    """top-k expert ids (int32) + weights (float32)."""
    ROUTER_LOGITS = "router_logits"
    """raw router logits; the FFN role runs the router (top-k selection)."""


@dataclass(frozen=True, slots=True)
class AFDConfig:
    role: AFDRole
    connector: str = "P2pGlooAFDConnector"
    host: str = "127.0.0.1"
    port: int = 29700
    num_attention_ranks: int = 1
    num_ffn_ranks: int = 1
    rank: int | None = None
    """This process's index within its role; None = derived by the runtime."""
    compute_gate_on_attention: bool = False
    routing_payload: RoutingPayload = RoutingPayload.TOPK
    num_micro_batches: int = 1
    connect_timeout_s: float = 300.0
    transfer_timeout_s: float = 600.0
    connector_extra_config: Mapping[str, Any] = field(
        default_factory=lambda: MappingProxyType({})
    )
