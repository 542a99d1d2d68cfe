"""Start-up validation of CAM deployments: one test per rule, each naming the setting to change."""

from __future__ import annotations

import importlib.util
import re
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from afd_connectors_npu.validation import (
    NPUDeploymentShape,
    check_roles_agree,
    shape_from_vllm_config,
    validate_npu_deployment,
)
from afd_core.config import AFDConfig
from afd_core.errors import AFDConfigError

P2P, ASYNC = "CAMP2pAFDConnector", "CAMAsyncAFDConnector"
DSV4 = NPUDeploymentShape(platform="npu", architecture="DeepseekV4ForCausalLM")


def _config(connector: str = P2P, **values: Any) -> AFDConfig:
    return AFDConfig(role="attention", connector=connector, **values)


def _shape(**changes: Any) -> NPUDeploymentShape:
    return NPUDeploymentShape(
        platform=changes.get("platform", "npu"),
        architecture=changes.get("architecture", "DeepseekV4ForCausalLM"),
        tensor_parallel_size=changes.get("tensor_parallel_size", 1),
        enable_dbo=changes.get("enable_dbo", False),
        num_ubatches=changes.get("num_ubatches", 0),
    )


GATE = {"compute_gate_on_attention": True}


@pytest.mark.parametrize(
    ("connector", "config", "shape", "match"),
    [
        (P2P, GATE, {"enable_dbo": True}, "remove --enable-dbo"),
        (P2P, GATE, {"num_ubatches": 2}, "remove --ubatch-size"),
        (P2P, {**GATE, "num_micro_batches": 2}, {}, "set afd.num_micro_batches=1"),
        (P2P, GATE, {"tensor_parallel_size": 2}, "set --tensor-parallel-size=1"),
        (
            P2P,
            GATE,
            {"architecture": "Qwen3MoeForCausalLM"},
            "set afd.compute_gate_on_attention=false",
        ),
        (P2P, {**GATE, "routing_payload": "router_logits"}, {}, r"set afd\.routing_payload='topk'"),
        (ASYNC, {}, {}, "set afd.compute_gate_on_attention=true"),
        (P2P, {}, {"platform": "cpu"}, "needs the Ascend platform.*set afd.connector"),
        (ASYNC, GATE, {"platform": "cuda"}, "needs the Ascend platform.*set afd.connector"),
    ],
    ids=[
        "dbo",
        "ubatching",
        "afd-micro-batches",
        "tp2",
        "wrong-model",
        "wrong-payload",
        "async-gate-on-ffn",
        "cpu-platform",
        "cuda-platform",
    ],
)
def test_unsupported_shape_fails_naming_the_setting(connector, config, shape, match) -> None:
    with pytest.raises(AFDConfigError, match=match) as info:
        validate_npu_deployment(_config(connector, **config), _shape(**shape))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("connector", "config", "shape"),
    [
        (P2P, GATE, {}),
        (P2P, GATE, {"architecture": "AFDDeepseekV4ForCausalLM"}),  # the --hf-overrides wrapper
        (
            P2P,
            {},
            {"architecture": "Qwen3MoeForCausalLM", "tensor_parallel_size": 4, "enable_dbo": True},
        ),  # gate on FFN: no Attention-side-gate limits
        (ASYNC, GATE, {"tensor_parallel_size": 2}),
        ("P2pGlooAFDConnector", {}, {"platform": "cpu"}),  # not a CAM connector
    ],
)
def test_supported_shapes_pass(connector, config, shape) -> None:
    validate_npu_deployment(_config(connector, **config), _shape(**shape))


def test_roles_with_different_gate_settings_are_refused_naming_both_roles() -> None:
    attention = AFDConfig(role="attention", connector=P2P, compute_gate_on_attention=True)
    ffn = AFDConfig(role="ffn", connector=P2P)
    with pytest.raises(
        AFDConfigError,
        match=re.escape(
            "afd.compute_gate_on_attention is true on the attention role but false on the ffn "
            "role; set the same value on both roles"
        ),
    ):
        check_roles_agree(attention, ffn)


@given(
    gate=st.booleans(),
    mbs=st.integers(1, 4),
    ranks=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    port=st.integers(1, 65535),
)
def test_roles_agreeing_on_every_shared_setting_pass(gate, mbs, ranks, port) -> None:
    common = {
        "connector": P2P,
        "compute_gate_on_attention": gate,
        "num_micro_batches": mbs,
        "num_attention_ranks": ranks[0],
        "num_ffn_ranks": ranks[1],
    }
    check_roles_agree(
        AFDConfig(role="attention", port=port, **common), AFDConfig(role="ffn", **common)
    )


def test_shape_is_read_from_a_duck_typed_vllm_config() -> None:
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(
            architectures=None, hf_config=SimpleNamespace(architectures=["DeepseekV4ForCausalLM"])
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=2, enable_dbo=True, ubatch_size=3),
    )
    assert shape_from_vllm_config(vllm_config, platform="npu") == NPUDeploymentShape(
        "npu", "DeepseekV4ForCausalLM", 2, True, 3
    )


@pytest.mark.vllm
def test_shape_reads_the_field_names_of_vllm_0_32_parallel_config() -> None:
    if importlib.util.find_spec("vllm") is None:  # absent by design only (core-no-torch)
        pytest.skip("vLLM is not installed")
    import vllm.config.parallel as parallel

    config = parallel.ParallelConfig(tensor_parallel_size=1, enable_dbo=True, ubatch_size=2)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(architectures=["DeepseekV4ForCausalLM"]),
        parallel_config=config,
    )
    shape = shape_from_vllm_config(vllm_config, platform="npu")
    assert (shape.enable_dbo, shape.num_ubatches, shape.tensor_parallel_size) == (True, 2, 1)
    with pytest.raises(AFDConfigError, match="--enable-dbo"):
        validate_npu_deployment(_config(P2P, **GATE), shape)


def test_the_connectors_start_up_hook_applies_these_rules() -> None:
    from afd_connectors_npu import CAMAsyncAFDConnector, CAMP2pAFDConnector

    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(architectures=["DeepseekV4ForCausalLM"]),
        parallel_config=SimpleNamespace(tensor_parallel_size=2, enable_dbo=False, ubatch_size=0),
    )
    with pytest.raises(AFDConfigError, match="set --tensor-parallel-size=1"):
        CAMP2pAFDConnector.check_deployment(_config(P2P, **GATE), vllm_config, platform="npu")
    with pytest.raises(AFDConfigError, match="needs the Ascend platform"):
        CAMAsyncAFDConnector.check_deployment(_config(ASYNC, **GATE), vllm_config, platform="cpu")
    CAMAsyncAFDConnector.check_deployment(_config(ASYNC, **GATE), vllm_config, platform="npu")


@pytest.mark.parametrize("connector", [P2P, ASYNC])
def test_acl_graphs_are_refused_on_the_attention_role(connector: str) -> None:
    """vllm-ascend captures ACL graphs by default; no CAM transport is known to be
    capturable, so a graph mode on the Attention role is refused naming --enforce-eager
    (an eager engine, or one without graphs, passes; the FFN role runs no graphs)."""
    from afd_connectors_npu import CAMAsyncAFDConnector, CAMP2pAFDConnector

    cls = CAMP2pAFDConnector if connector == P2P else CAMAsyncAFDConnector

    def vllm_config(eager: bool, graphs: str) -> Any:
        return SimpleNamespace(
            model_config=SimpleNamespace(
                architectures=["DeepseekV4ForCausalLM"], enforce_eager=eager
            ),
            parallel_config=SimpleNamespace(
                tensor_parallel_size=1, enable_dbo=False, ubatch_size=0
            ),
            compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name=graphs)),
        )

    for graphs in ("PIECEWISE", "FULL_DECODE_ONLY"):
        with pytest.raises(AFDConfigError, match=f"ACL graphs .*{graphs}.*--enforce-eager"):
            cls.check_deployment(
                _config(connector, **GATE), vllm_config(False, graphs), platform="npu"
            )
        cls.check_deployment(_config(connector, **GATE), vllm_config(True, graphs), platform="npu")
        ffn = AFDConfig(role="ffn", connector=connector, **GATE)
        cls.check_deployment(ffn, vllm_config(False, graphs), platform="npu")
    cls.check_deployment(_config(connector, **GATE), vllm_config(False, "NONE"), platform="npu")
    assert shape_from_vllm_config(vllm_config(False, "PIECEWISE"), platform="npu").graph_mode == (
        "PIECEWISE"
    )
    assert shape_from_vllm_config(vllm_config(True, "PIECEWISE"), platform="npu").graph_mode == (
        "NONE"
    )
