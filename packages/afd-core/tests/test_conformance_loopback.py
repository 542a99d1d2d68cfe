"""The conformance suite passes on the loopback connector and catches broken connectors."""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from afd_core.connector import FFNBatch  # noqa: E402
from afd_core.registry import register_connector  # noqa: E402
from afd_core.testing.conformance import (  # noqa: E402
    SCENARIOS,
    TOPOLOGIES,
    Scenario,
    conformance_cases,
    run_scenario,
)
from afd_core.testing.loopback import LoopbackAFDConnector, LoopbackHarness  # noqa: E402
from afd_core.topology import AFDTopology  # noqa: E402
from afd_core.transfer import AttentionToFFN, FFNToAttention  # noqa: E402

# Same target as afd-core's entry point: a no-op when the entry point is installed.
register_connector(LoopbackAFDConnector.name, LoopbackAFDConnector)

SCENARIO = {s.name: s for s in SCENARIOS}


@pytest.mark.parametrize(("scenario", "topology"), conformance_cases())
def test_loopback_connector_passes_conformance(scenario: Scenario, topology: AFDTopology) -> None:
    run_scenario(LoopbackHarness(), scenario, topology)


def test_suite_covers_required_topologies_and_scenarios() -> None:
    labels = {t.label for t in TOPOLOGIES}
    assert {"1A1F", "2A1F", "3A2F", "1A2F"} <= labels
    assert {
        "message_ordering",
        "shapes_and_dtypes",
        "routing_topk",
        "routing_router_logits",
        "routing_token_ids",
        "fan_in_split",
        "shared_output",
        "header_mismatch",
        "receive_timeout_attention",
        "receive_timeout_ffn",
        "close_unblocks_receive",
    } <= set(SCENARIO)


# -- deliberately broken connectors: the suite must reject them ----------------------


class SwappedOrderConnector(LoopbackAFDConnector):
    """Sends every pair of consecutive A->F messages in reverse order."""

    name = "SwappedOrderConnector"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held: tuple[AttentionToFFN, int, int] | None = None

    def send_to_ffn(
        self, payload: AttentionToFFN, *, layer_idx: int, micro_batch_idx: int = 0
    ) -> None:
        if self._held is None:
            self._held = (payload, layer_idx, micro_batch_idx)
            return
        held, self._held = self._held, None
        super().send_to_ffn(payload, layer_idx=layer_idx, micro_batch_idx=micro_batch_idx)
        super().send_to_ffn(held[0], layer_idx=held[1], micro_batch_idx=held[2])


class SwappedRowsConnector(LoopbackAFDConnector):
    """Splits the FFN result back to the attention ranks in reverse peer order."""

    name = "SwappedRowsConnector"

    def send_to_attention(self, batch: FFNBatch, result: FFNToAttention) -> None:
        rows = torch.flip(result.output, dims=[0])  # type: ignore[arg-type]
        super().send_to_attention(batch, FFNToAttention(rows, shared_output=result.shared_output))


class DroppedRoutingConnector(LoopbackAFDConnector):
    """Forgets the routing tensors and ships hidden states only."""

    name = "DroppedRoutingConnector"

    def send_to_ffn(
        self, payload: AttentionToFFN, *, layer_idx: int, micro_batch_idx: int = 0
    ) -> None:
        super().send_to_ffn(
            AttentionToFFN(payload.hidden_states),
            layer_idx=layer_idx,
            micro_batch_idx=micro_batch_idx,
        )


class SlowCloseConnector(LoopbackAFDConnector):
    """close() wakes a pending receive only 3 s later (the contract allows 2 s)."""

    name = "SlowCloseConnector"

    def close(self) -> None:
        timer = threading.Timer(3.0, super().close)
        timer.daemon = True
        timer.start()


@pytest.mark.parametrize("topology", [AFDTopology(1, 1), AFDTopology(3, 2)], ids=lambda t: t.label)
def test_suite_fails_a_connector_that_swaps_message_order(topology: AFDTopology) -> None:
    with pytest.raises(AssertionError, match=r"raised AFD\w+Error|out of order|differ"):
        run_scenario(LoopbackHarness(SwappedOrderConnector), SCENARIO["message_ordering"], topology)


@pytest.mark.parametrize("topology", [AFDTopology(2, 1), AFDTopology(3, 2)], ids=lambda t: t.label)
def test_suite_fails_a_connector_that_mixes_up_attention_ranks_rows(topology: AFDTopology) -> None:
    with pytest.raises(AssertionError):
        run_scenario(LoopbackHarness(SwappedRowsConnector), SCENARIO["fan_in_split"], topology)


@pytest.mark.parametrize("name", ["routing_topk", "routing_router_logits", "routing_token_ids"])
def test_suite_fails_a_connector_that_drops_routing(name: str) -> None:
    with pytest.raises(AssertionError, match="kind"):
        run_scenario(LoopbackHarness(DroppedRoutingConnector), SCENARIO[name], AFDTopology(2, 1))


def test_suite_fails_a_connector_whose_close_unblocks_too_late() -> None:
    with pytest.raises(AssertionError, match="close\\(\\) unblocked the receive only after"):
        run_scenario(
            LoopbackHarness(SlowCloseConnector),
            SCENARIO["close_unblocks_receive"],
            AFDTopology(1, 1),
        )
