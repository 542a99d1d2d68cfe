"""afd-core's conformance suite over both CAM connectors, on the fake CAM operators.

Each connector runs every scenario whose payload kinds it carries; the others are
skipped with the reason. CAMAsync runs with ``compute_gate_on_attention=true`` (it
refuses to start otherwise).
"""

from __future__ import annotations

from typing import Any

import pytest

from afd_connectors_npu.camasync import CAMAsyncAFDConnector
from afd_connectors_npu.camp2p import CAMP2pAFDConnector
from afd_connectors_npu.testing import CAMThreadHarness

conformance = pytest.importorskip("afd_core.testing.conformance")

_NO_LOGITS = "CAM carries no router_logits (set afd.routing_payload='topk')"
_TOPK_ONLY = "CAMAsync carries only top-k routing payloads (HIDDEN_TOPK); this scenario sends "
UNSUPPORTED: dict[str, dict[str, str]] = {
    "camp2p": {"routing_router_logits": _NO_LOGITS},
    "camasync": {
        "routing_router_logits": _NO_LOGITS,
        "routing_token_ids": _TOPK_ONLY + "token ids",
        "message_ordering": _TOPK_ONLY + "hidden states only",
        "shapes_and_dtypes": _TOPK_ONLY + "hidden states only",
        "fan_in_split": _TOPK_ONLY + "hidden states only",
        "header_mismatch": _TOPK_ONLY + "hidden states only (covered in test_camasync.py)",
        "ffn_idle_wait": _TOPK_ONLY + "hidden states only (the idle wait is CAMConnector's, "
        "which camp2p runs)",
        "started_step_is_bounded": _TOPK_ONLY + "hidden states only (CAMConnector's fan-in, "
        "which camp2p runs)",
        "shared_output": "CAMAsync runs shared experts on the Attention role; the FFN role "
        "must not send shared_output (covered in test_camasync.py)",
    },
}

HARNESSES: dict[str, Any] = {
    "camp2p": lambda: CAMThreadHarness(CAMP2pAFDConnector),
    "camasync": lambda: CAMThreadHarness(
        CAMAsyncAFDConnector, config={"compute_gate_on_attention": True}
    ),
}

CASES = [
    pytest.param(c, s, t, id=f"{c}-{s.name}-{t.label}")
    for c in HARNESSES
    for t in conformance.TOPOLOGIES
    for s in conformance.SCENARIOS
]


@pytest.mark.parametrize(("connector", "scenario", "topology"), CASES)
def test_connector_conforms(connector: str, scenario: Any, topology: Any) -> None:
    reason = UNSUPPORTED[connector].get(scenario.name)
    if reason is not None:
        pytest.skip(reason)
    conformance.run_scenario(HARNESSES[connector](), scenario, topology)


def test_every_skip_names_an_existing_scenario() -> None:
    names = {s.name for s in conformance.SCENARIOS}
    for table in UNSUPPORTED.values():
        assert set(table) <= names
