"""Which runner a layer gets, and the layers the Attention role refuses to build."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

_prefixes = iter(range(100, 10_000))


def attention_config(**overrides: Any) -> Any:
    from afd_core.config import AFDConfig, AFDRole

    values: dict[str, Any] = {"role": AFDRole.ATTENTION, "connector": "P2pGlooAFDConnector"}
    values.update(overrides)
    return AFDConfig(**values)


def build(vllm_config: Any, afd_config: Any, **factory_kwargs: Any) -> Any:
    """A small MoE layer built through the AFD factory (unique prefix per call)."""
    from afd_moe_runners import build_afd_moe

    kwargs: dict[str, Any] = {
        "num_experts": 8,
        "top_k": 2,
        "hidden_size": 32,
        "intermediate_size": 16,
        "prefix": f"builder.layers.{next(_prefixes)}.mlp.experts",
    }
    kwargs.update(factory_kwargs)
    return build_afd_moe(afd_config, platform="cpu", **kwargs)


@contextlib.contextmanager
def routed_expert_capture(vllm_config: Any) -> Iterator[None]:
    aux = vllm_config.aux_output_config
    previous = aux.enable_return_routed_experts
    aux.enable_return_routed_experts = True
    try:
        yield
    finally:
        aux.enable_return_routed_experts = previous


def test_gate_on_ffn_picks_the_remote_experts_runner(vllm_config: Any) -> None:
    from afd_moe_runners import RemoteExpertsRunner, RemoteRoutedExperts, afd_runner_kwargs

    kwargs = afd_runner_kwargs(attention_config(), platform="cpu")
    assert kwargs["runner_cls"] is RemoteExpertsRunner
    assert kwargs["routed_experts_cls"] is RemoteRoutedExperts
    runner = build(vllm_config, attention_config())
    assert isinstance(runner, RemoteExpertsRunner)
    assert runner.afd_layer_idx == int(runner.layer_name.split(".")[2])
    assert list(runner.parameters()) == []


def test_gate_on_attention_picks_the_external_routing_runner(vllm_config: Any) -> None:
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    from afd_core.config import RoutingPayload
    from afd_moe_runners import ExternalRoutingRunner, afd_runner_kwargs

    config = attention_config(
        compute_gate_on_attention=True, routing_payload=RoutingPayload.ROUTER_LOGITS
    )
    kwargs = afd_runner_kwargs(config, platform="cpu")
    assert kwargs["runner_cls"] is ExternalRoutingRunner
    assert kwargs["runner_args"]["routing_payload"] is RoutingPayload.ROUTER_LOGITS
    gate = GateLinear(32, 8, prefix="builder.gate")
    runner = build(vllm_config, config, gate=gate)
    assert isinstance(runner, ExternalRoutingRunner)
    assert runner.gate is gate
    assert {name for name, _ in runner.named_parameters()} == {"gate.weight"}
    assert not any(p.dim() == 3 for p in runner.parameters())


def test_ffn_role_gets_the_native_factory() -> None:
    from afd_core.config import AFDConfig, AFDRole
    from afd_moe_runners import afd_runner_kwargs

    assert afd_runner_kwargs(AFDConfig(role=AFDRole.FFN), platform="cpu") == {}
    assert afd_runner_kwargs(attention_config(), role="ffn", platform="cpu") == {}


@pytest.mark.parametrize(
    ("platform", "connector", "message"),
    [
        ("cpu", "P2pNcclAFDConnector", "not supported on platform 'cpu' (it supports cuda)"),
        ("cuda", "P2pGlooAFDConnector", "not supported on platform 'cuda' (it supports cpu)"),
        ("npu", "P2pNcclAFDConnector", "(it supports cuda)"),
        ("npu", "P2pShmAFDConnector", "(it supports cpu)"),
        ("cpu", "CAMP2pAFDConnector", "not supported on platform 'cpu' (it supports npu)"),
        ("tpu", "P2pGlooAFDConnector", "not supported on platform 'tpu'"),
    ],
)
def test_unsupported_platform_connector_pairs_are_rejected(
    platform: str, connector: str, message: str
) -> None:
    from afd_core.errors import AFDConfigError
    from afd_moe_runners import afd_runner_kwargs

    with pytest.raises(AFDConfigError, match="AFD MoE runners") as info:
        afd_runner_kwargs(attention_config(connector=connector), platform=platform)
    assert message in str(info.value)


def test_a_connector_refuses_a_gate_placement_it_does_not_declare() -> None:
    from afd_core.config import AFDConfig
    from afd_core.connector import ConnectorCapabilities
    from afd_core.errors import AFDConfigError
    from afd_core.registry import register_connector, unregister_connector
    from afd_core.testing.loopback import LoopbackAFDConnector
    from afd_moe_runners import afd_runner_kwargs

    class GateOnAttentionOnly(LoopbackAFDConnector):
        name = "GateOnAttentionOnlyConnector"
        capabilities = ConnectorCapabilities(gate_placements=frozenset({"attention"}))

    register_connector(GateOnAttentionOnly.name, GateOnAttentionOnly)
    try:
        config = attention_config(connector=GateOnAttentionOnly.name)
        with pytest.raises(AFDConfigError, match="does not support the gate on ffn") as info:
            afd_runner_kwargs(config, platform="cpu")
        assert "it supports the gate on attention" in str(info.value)
        on_attention = AFDConfig(**{**config.to_dict(), "compute_gate_on_attention": True})
        assert afd_runner_kwargs(on_attention, platform="cpu")["runner_cls"] is not None
    finally:
        unregister_connector(GateOnAttentionOnly.name)


def test_loopback_connector_is_accepted_on_every_platform() -> None:
    from afd_moe_runners import afd_runner_kwargs

    for platform in ("cpu", "cuda", "npu"):
        config = attention_config(connector="LoopbackAFDConnector")
        assert afd_runner_kwargs(config, platform=platform)["runner_cls"] is not None


@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_attention_side_eplb_is_rejected_at_build_time(
    vllm_config: Any, gate_on_attention: bool
) -> None:
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    from afd_core.errors import AFDConfigError

    gate = GateLinear(32, 8, prefix="builder.gate") if gate_on_attention else None
    config = attention_config(compute_gate_on_attention=gate_on_attention)
    with pytest.raises(AFDConfigError, match="EPLB is enabled on the Attention role") as info:
        build(vllm_config, config, enable_eplb=True, gate=gate)
    assert "configure EPLB on the FFN role" in str(info.value)


def test_redundant_experts_are_rejected_at_build_time(vllm_config: Any) -> None:
    from afd_core.errors import AFDConfigError

    with pytest.raises(AFDConfigError, match="redundant experts") as info:
        build(vllm_config, attention_config(), enable_eplb=True, num_redundant_experts=2)
    assert "num_redundant_experts=0" in str(info.value)


def test_routed_expert_capture_is_rejected_at_build_time(vllm_config: Any) -> None:
    from afd_core.errors import AFDConfigError

    with (
        routed_expert_capture(vllm_config),
        pytest.raises(AFDConfigError, match="routed-expert capture") as info,
    ):
        build(vllm_config, attention_config())
    assert "turn it off for the Attention engine" in str(info.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("on_output", [False, True])
def test_non_finite_routed_scaling_factor_is_rejected(
    vllm_config: Any, value: float, on_output: bool
) -> None:
    from afd_core.errors import AFDConfigError

    with pytest.raises(AFDConfigError, match="routed_scaling_factor=") as info:
        build(
            vllm_config,
            attention_config(),
            routed_scaling_factor=value,
            apply_routed_scale_to_output=on_output,
        )
    assert "not a finite number" in str(info.value)


def test_gate_on_attention_without_a_gate_routes_the_models_logits(vllm_config: Any) -> None:
    """A block that applies its gate itself (Mixtral-style: ``self.gate(x)`` then
    ``self.experts(x, router_logits)``) passes no ``gate=``: the runner routes the logits
    it is given, as vLLM's own runner does."""
    import torch

    runner = build(vllm_config, attention_config(compute_gate_on_attention=True))
    assert runner.gate is None
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 32, generator=gen)
    logits = torch.randn(5, 8, generator=gen)
    payload = runner.route(x, logits)
    weights, ids = runner.router.select_experts(hidden_states=x, router_logits=logits)
    assert torch.equal(payload.topk_ids, ids.to(torch.int32))
    assert torch.equal(payload.topk_weights, weights.to(torch.float32))
    other = runner.route(x, torch.randn(5, 8, generator=gen))
    assert not torch.equal(other.topk_ids, payload.topk_ids)


def test_caller_chosen_runner_is_refused_by_build_afd_moe(vllm_config: Any) -> None:
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    from afd_core.errors import AFDConfigError

    with pytest.raises(AFDConfigError, match="chosen by AFD"):
        build(vllm_config, attention_config(), runner_cls=MoERunner)


def test_attention_experts_refuse_checkpoint_tensors(vllm_config: Any) -> None:
    import torch

    from afd_core.errors import AFDConfigError

    runner = build(vllm_config, attention_config())
    with pytest.raises(AFDConfigError, match="belong to the FFN role"):
        list(runner.load_weights([("experts.0.gate_proj.weight", torch.zeros(16, 32))]))


def test_attention_experts_refuse_to_run_a_kernel(vllm_config: Any) -> None:
    import torch

    runner = build(vllm_config, attention_config())
    with pytest.raises(RuntimeError, match="hold no weights"):
        runner.routed_experts.forward_modular(
            x=torch.zeros(1, 32),
            topk_weights=torch.ones(1, 2),
            topk_ids=torch.zeros(1, 2, dtype=torch.int32),
        )


@pytest.mark.vllm
def test_attention_runners_refuse_experts_that_hold_weights() -> None:
    from afd_core.errors import AFDConfigError
    from afd_moe_runners.remote_experts import require_remote_experts

    with pytest.raises(AFDConfigError, match=r"layer 3: needs parameter-free experts.*object"):
        require_remote_experts("layer 3", object())


# -- platform npu ----------------------------------------------------------------------
@pytest.fixture
def moe_runner_as_ascend_base(monkeypatch: pytest.MonkeyPatch, vllm_config: Any) -> Iterator[None]:
    """vLLM's MoERunner in place of vLLM-Ascend's AscendMoERunner (hardware boundary).

    The current model reports DeepSeek-V4, the model CAMP2p's Attention-side gate
    supports, so the connector's start-up check in the builder accepts the deployment.
    """
    import types

    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    from afd_moe_runners.npu import runners
    from afd_moe_runners.npu.runners import AscendRunnerSeams

    monkeypatch.setattr(runners, "ascend_runner_seams", lambda: AscendRunnerSeams(MoERunner))
    previous = vllm_config.model_config
    import torch

    stand_in = types.SimpleNamespace(
        architectures=["DeepseekV4ForCausalLM"], dtype=torch.float32, hf_text_config=None
    )
    object.__setattr__(vllm_config, "model_config", stand_in)
    try:
        yield
    finally:
        object.__setattr__(vllm_config, "model_config", previous)


@pytest.mark.parametrize(
    ("connector", "gate_on_attention", "runner_name"),
    [
        ("CAMP2pAFDConnector", False, "AFDNPURemoteExpertsRunner"),
        ("CAMP2pAFDConnector", True, "AFDNPUAttentionGateRunner"),
        ("CAMAsyncAFDConnector", True, "AFDNPUAttentionGateRunner"),
    ],
)
def test_npu_connectors_pick_the_npu_runners(
    moe_runner_as_ascend_base: None, connector: str, gate_on_attention: bool, runner_name: str
) -> None:
    from afd_core.config import RoutingPayload
    from afd_moe_runners import RemoteRoutedExperts, afd_runner_kwargs

    config = attention_config(connector=connector, compute_gate_on_attention=gate_on_attention)
    kwargs = afd_runner_kwargs(config, platform="npu")
    assert kwargs["runner_cls"].__name__ == runner_name
    assert issubclass(kwargs["routed_experts_cls"], RemoteRoutedExperts)
    if gate_on_attention:
        assert kwargs["runner_args"]["routing_payload"] is RoutingPayload.TOPK


def test_cam_async_with_the_gate_on_ffn_is_rejected(moe_runner_as_ascend_base: None) -> None:
    from afd_core.errors import AFDConfigError
    from afd_moe_runners import afd_runner_kwargs

    config = attention_config(connector="CAMAsyncAFDConnector")
    with pytest.raises(AFDConfigError, match="compute_gate_on_attention is false") as info:
        afd_runner_kwargs(config, platform="npu")
    assert "set afd.compute_gate_on_attention=true" in str(info.value)


def test_npu_router_logits_payload_is_rejected(moe_runner_as_ascend_base: None) -> None:
    from afd_core.config import RoutingPayload
    from afd_core.errors import AFDConfigError
    from afd_moe_runners import afd_runner_kwargs

    config = attention_config(
        connector="CAMP2pAFDConnector",
        compute_gate_on_attention=True,
        routing_payload=RoutingPayload.ROUTER_LOGITS,
    )
    with pytest.raises(AFDConfigError, match="routing_payload='topk'"):
        afd_runner_kwargs(config, platform="npu")


def test_npu_runners_without_vllm_ascend_name_the_fix(vllm_config: Any) -> None:
    import importlib.util

    from afd_moe_runners import afd_runner_kwargs

    if importlib.util.find_spec("vllm_ascend") is not None:
        pytest.skip("vllm_ascend is installed here")
    config = attention_config(connector="CAMP2pAFDConnector")
    with pytest.raises(ImportError, match=r"install vllm-ascend for vLLM 0\.32"):
        afd_runner_kwargs(config, platform="npu")


@pytest.mark.parametrize(
    ("platform", "connector", "gate_on_attention", "expected"),
    [
        ("npu", "CAMP2pAFDConnector", True, True),
        ("npu", "CAMAsyncAFDConnector", True, True),
        ("npu", "CAMP2pAFDConnector", False, False),
        ("npu", "LoopbackAFDConnector", True, False),
        ("cpu", "P2pGlooAFDConnector", True, False),
        ("cuda", "P2pNcclAFDConnector", True, False),
    ],
)
def test_shared_experts_run_on_attention_only_on_npu_with_the_gate_there(
    platform: str, connector: str, gate_on_attention: bool, expected: bool
) -> None:
    from afd_moe_runners.builder import shared_experts_on_attention

    config = attention_config(connector=connector, compute_gate_on_attention=gate_on_attention)
    assert shared_experts_on_attention(config, platform=platform) is expected


@pytest.mark.parametrize(
    ("connector", "gate_on_attention", "expected"),
    [
        ("CAMAsyncAFDConnector", True, True),  # top-k dispatches only
        ("CAMP2pAFDConnector", True, False),
        ("CAMP2pAFDConnector", False, False),
        ("P2pGlooAFDConnector", True, False),
        ("P2pNcclAFDConnector", False, False),
        ("LoopbackAFDConnector", True, False),
    ],
)
def test_dense_layers_stay_on_attention_only_where_the_connector_carries_no_hidden_payload(
    connector: str, gate_on_attention: bool, expected: bool
) -> None:
    from afd_moe_runners.builder import dense_layers_on_attention

    config = attention_config(
        connector=connector,
        compute_gate_on_attention=gate_on_attention,
    )
    assert dense_layers_on_attention(config) is expected


def test_dense_placement_follows_declared_payload_kinds_not_the_name() -> None:
    from afd_core.connector import ConnectorCapabilities
    from afd_core.registry import register_connector, unregister_connector
    from afd_core.testing.loopback import LoopbackAFDConnector
    from afd_core.transfer import PayloadKind
    from afd_moe_runners.builder import dense_layers_on_attention

    class TopKOnly(LoopbackAFDConnector):
        name = "TopKOnlyConnector"
        capabilities = ConnectorCapabilities(payload_kinds=frozenset({PayloadKind.HIDDEN_TOPK}))

    register_connector(TopKOnly.name, TopKOnly)
    try:
        config = attention_config(connector=TopKOnly.name, compute_gate_on_attention=True)
        assert dense_layers_on_attention(config) is True
    finally:
        unregister_connector(TopKOnly.name)


@pytest.mark.parametrize(
    ("platform", "connector", "role", "forbidden", "allowed"),
    [
        # cpu / cuda: dense layers and shared experts belong to the FFN role.
        ("cpu", "P2pGlooAFDConnector", "attention", {"dense_mlp", "shared_experts"}, set()),
        ("cpu", "P2pGlooAFDConnector", "ffn", set(), {"dense_mlp", "shared_experts"}),
        # npu, CAMAsync (gate on Attention): both on Attention.
        ("npu", "CAMAsyncAFDConnector", "attention", set(), {"dense_mlp", "shared_experts"}),
        ("npu", "CAMAsyncAFDConnector", "ffn", {"dense_mlp", "shared_experts"}, set()),
        # npu, CAMP2p with the gate on Attention: shared experts on Attention, dense on FFN.
        ("npu", "CAMP2pAFDConnector", "attention", {"dense_mlp"}, {"shared_experts"}),
        ("npu", "CAMP2pAFDConnector", "ffn", {"shared_experts"}, {"dense_mlp"}),
    ],
)
def test_each_role_may_own_only_the_modules_it_computes(
    monkeypatch: pytest.MonkeyPatch,
    platform: str,
    connector: str,
    role: str,
    forbidden: set[str],
    allowed: set[str],
) -> None:
    from afd_core.config import AFDRole
    from afd_moe_runners import deployment_plan
    from afd_moe_runners.inventory import forbidden_categories

    monkeypatch.setattr(deployment_plan, "current_platform_name", lambda: platform)
    config = attention_config(
        role=AFDRole(role), connector=connector, compute_gate_on_attention=True
    )
    # The FFN role's plan (the Attention role's on npu would run CAM's deployment check).
    plan = deployment_plan.resolve_plan(config, role=AFDRole.FFN)
    if role == "attention":
        plan = dataclasses.replace(plan, role=AFDRole.ATTENTION)
    categories = set(forbidden_categories(plan))
    assert forbidden <= categories
    assert not allowed & categories


@pytest.mark.parametrize(("platform", "connector"), [("npu", "CAMP2pAFDConnector"), ("cpu", None)])
def test_build_keeps_shared_experts_on_attention_only_on_npu(
    vllm_config: Any, moe_runner_as_ascend_base: None, platform: str, connector: str | None
) -> None:
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    from afd_moe_runners import build_afd_moe

    overrides = {"compute_gate_on_attention": True}
    if connector is not None:
        overrides["connector"] = connector
    config = attention_config(**overrides)
    shared = torch_mlp()
    runner = build_afd_moe(
        config,
        platform=platform,
        num_experts=8,
        top_k=2,
        hidden_size=32,
        intermediate_size=16,
        prefix=f"builder.layers.{next(_prefixes)}.mlp.experts",
        gate=GateLinear(32, 8, prefix="builder.gate"),
        shared_experts=shared,
    )
    if platform == "npu":
        assert runner.shared_experts is not None
    else:
        assert runner.shared_experts is None


def torch_mlp() -> Any:
    import torch

    return torch.nn.Linear(32, 32, bias=False)


@pytest.mark.parametrize(
    ("platform", "connector", "gate_on_attention"),
    [
        ("cpu", "P2pGlooAFDConnector", True),
        ("cuda", "P2pNcclAFDConnector", True),
        ("npu", "CAMP2pAFDConnector", False),
        ("npu", "CAMAsyncAFDConnector", True),
    ],
)
def test_ffn_external_routing_is_only_for_camp2p_with_the_gate_on_attention(
    platform: str, connector: str, gate_on_attention: bool
) -> None:
    from afd_core.config import AFDConfig, AFDRole
    from afd_moe_runners.builder import ffn_external_routing

    config = AFDConfig(
        role=AFDRole.FFN, connector=connector, compute_gate_on_attention=gate_on_attention
    )
    assert ffn_external_routing(config, {0: object()}, platform=platform) is None


def test_ffn_external_routing_builds_one_component_per_moe_layer_on_npu(
    moe_env: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from afd_core.config import AFDConfig, AFDRole
    from afd_moe_runners.builder import ffn_external_routing
    from afd_moe_runners.npu import ascend

    moe = moe_env.build_block("deepseek", torch.float32, prefix="ffn_ext.layers.5.mlp")
    dense = torch.nn.Linear(4, 4)
    seen: list[dict[int, Any]] = []

    def fake_layers(runners: dict[int, Any]) -> dict[int, str]:  # vLLM-Ascend stand-in
        seen.append(dict(runners))
        return {idx: f"component {idx}" for idx, r in runners.items() if r is not None}

    monkeypatch.setattr(ascend, "ascend_external_routing_layers", fake_layers)
    config = AFDConfig(
        role=AFDRole.FFN, connector="CAMP2pAFDConnector", compute_gate_on_attention=True
    )
    result = ffn_external_routing(config, {5: moe, 0: dense}, platform="npu")
    assert result == {5: "component 5"}
    assert seen == [{5: moe.experts, 0: None}]


def test_ffn_external_routing_without_vllm_ascend_names_the_fix() -> None:
    import importlib.util

    from afd_core.config import AFDConfig, AFDRole
    from afd_moe_runners.builder import ffn_external_routing

    if importlib.util.find_spec("vllm_ascend") is not None:
        pytest.skip("vllm_ascend is installed here")
    config = AFDConfig(
        role=AFDRole.FFN, connector="CAMP2pAFDConnector", compute_gate_on_attention=True
    )
    with pytest.raises(ImportError, match=r"install vllm-ascend for vLLM 0\.32"):
        ffn_external_routing(config, {}, platform="npu")
