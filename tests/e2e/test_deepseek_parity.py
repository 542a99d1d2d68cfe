"""AFD on real processes (vLLM CPU, eager) produces the same greedy tokens as native vLLM
on the same tiny DeepSeek checkpoints.

Batched parity: the Attention role runs as a vLLM engine (``vllm.LLM`` with the AFD
architecture and ``additional_config``) in its own process, a headless FFN server in
another, and the ten fixed prompts are generated in one batch (32 tokens each) exactly as
the native reference does, so both see identical batches.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
from afd_processes import (
    afd_settings,
    assert_same_tokens,
    inventory,
    run_offline_afd,
    served_layers,
)

from afd.tools.reference import FIXED_PROMPTS

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]

# Cases marked MATRIX run in `nox -s tests-matrix` (CI runs it after the default run),
# EXTENDED ones by hand.
MATRIX = pytest.mark.matrix
#: Out of CI for its time budget (`nox -s tests-extended`, docs/development.md).
EXTENDED = pytest.mark.extended

ALIASES = {"deepseek_v2": "AFDDeepseekV2ForCausalLM", "deepseek_v3": "AFDDeepseekV3ForCausalLM"}


# A connector from a distribution outside the workspace, found through its
# ``afd.connectors`` entry point and accepted by what its class declares (platforms,
# gate placements) rather than by a list of known names. It moves tensors over gloo (it
# subclasses the gloo connector), so the built-in gloo connector stays covered too.
THIRD_PARTY = "ThirdPartyAFDConnector"
THIRD_PARTY_MODULE = textwrap.dedent(
    """
    from typing import ClassVar

    from afd_connectors_gpu.p2p import P2pGlooAFDConnector
    from afd_core.connector import ConnectorCapabilities


    class ThirdPartyAFDConnector(P2pGlooAFDConnector):
        name: ClassVar[str] = "ThirdPartyAFDConnector"
        capabilities: ClassVar[ConnectorCapabilities] = ConnectorCapabilities(
            platforms=frozenset({"cpu"}), gate_placements=frozenset({"ffn"})
        )
    """
)


def _install_third_party(site: Path) -> None:
    """Lay the distribution out in ``site`` as an installer would (package + dist-info)."""
    package = site / "afd_thirdparty_connector"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(THIRD_PARTY_MODULE)
    info = site / "afd_thirdparty_connector-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: afd-thirdparty-connector\nVersion: 0.1.0\n"
    )
    (info / "entry_points.txt").write_text(
        f"[afd.connectors]\n{THIRD_PARTY} = afd_thirdparty_connector:ThirdPartyAFDConnector\n"
    )
    (info / "RECORD").write_text("")


@pytest.mark.parametrize(
    ("arch", "gate", "connector"),
    [
        ("deepseek_v2", "ffn", THIRD_PARTY),
        pytest.param("deepseek_v2", "attention-topk", "P2pGlooAFDConnector", marks=EXTENDED),
        # shm: the default of `afd launch`, served by default in test_launch.py
        pytest.param("deepseek_v2", "ffn", "P2pShmAFDConnector", marks=EXTENDED),
        pytest.param("deepseek_v3", "ffn", "P2pGlooAFDConnector", marks=EXTENDED),
        ("deepseek_v3", "attention-topk", "P2pGlooAFDConnector"),
        pytest.param(
            "deepseek_v3", "attention-router_logits", "P2pGlooAFDConnector", marks=EXTENDED
        ),
    ],
)
def test_1a1f_greedy_tokens_equal_native(
    tiny_models: dict[str, Path],
    native_references: Any,
    tmp_path: Path,
    arch: str,
    gate: str,
    connector: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if connector == THIRD_PARTY:
        _install_third_party(tmp_path / "site")
        path = [str(tmp_path / "site"), *filter(None, [os.environ.get("PYTHONPATH")])]
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    afd = afd_settings(gate, connector=connector)
    result, ffn_log = run_offline_afd(tiny_models[arch], ALIASES[arch], afd, tmp_path)
    assert f"connector {connector} at" in ffn_log
    # (one engine also answers test_deepseek_served's one-at-a-time reference)
    native, _ = native_references.served_and_batched(
        tiny_models[arch], FIXED_PROMPTS, FIXED_PROMPTS[:8]
    )
    assert result["prompts"] == list(FIXED_PROMPTS)
    assert_same_tokens(result["token_ids"], native, list(FIXED_PROMPTS))
    # Every layer of every step crossed to the FFN role (3 layers x >= 32 steps).
    assert served_layers(ffn_log) >= 3 * 32
    assert "peer gone" in ffn_log
    attn = inventory(result["log"], "attention")
    assert attn.get("routed_experts", 0) == 0 and attn.get("shared_experts", 0) == 0
