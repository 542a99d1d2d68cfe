"""The role's deployment plan: resolved once, and each of its fields decides what is built."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm


def afd_config(**overrides: Any) -> Any:
    from afd_core.config import AFDConfig, AFDRole

    values: dict[str, Any] = {"role": AFDRole.ATTENTION, "connector": "P2pGlooAFDConnector"}
    values.update(overrides)
    return AFDConfig(**values)


class RecordingFactory:
    """Stands in for ``FusedMoEFactory``: records the keyword arguments of each layer."""

    def __init__(self) -> None:
        self.layers: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> dict[str, Any]:
        self.layers.append(kwargs)
        return kwargs


@pytest.fixture
def resolutions(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every plan the builder resolves (its resolver wrapped)."""
    from afd_moe_runners import builder

    seen: list[Any] = []
    resolve = builder.resolve_plan

    def counting(*args: Any, **kwargs: Any) -> Any:
        plan = resolve(*args, **kwargs)
        seen.append(plan)
        return plan

    monkeypatch.setattr(builder, "resolve_plan", counting)
    return seen


def build_layers(factory: Any, n: int) -> None:
    for i in range(n):
        factory(prefix=f"model.layers.{i}.mlp.experts", num_experts=8, shared_experts=object())


@pytest.mark.parametrize("gate_on_attention", [False, True])
def test_a_model_factory_resolves_the_plan_once_for_all_its_layers(
    resolutions: list[Any], gate_on_attention: bool
) -> None:
    from afd_moe_runners import afd_moe_factory
    from afd_moe_runners.external_routing_runner import ExternalRoutingRunner
    from afd_moe_runners.remote_runner import RemoteExpertsRunner

    native = RecordingFactory()
    factory = afd_moe_factory(
        afd_config(compute_gate_on_attention=gate_on_attention), platform="cpu", factory=native
    )
    build_layers(factory, 6)
    assert len(resolutions) == 1
    assert len(native.layers) == 6
    want = ExternalRoutingRunner if gate_on_attention else RemoteExpertsRunner
    assert all(layer["runner_cls"] is want for layer in native.layers)


def test_a_factory_handed_a_plan_resolves_nothing(resolutions: list[Any]) -> None:
    from afd_moe_runners import afd_moe_factory
    from afd_moe_runners.deployment_plan import resolve_plan

    plan = resolve_plan(afd_config(), platform="cpu")  # the start-up's one resolution
    native = RecordingFactory()
    build_layers(afd_moe_factory(plan, factory=native), 5)
    assert resolutions == [] and len(native.layers) == 5


def test_a_plan_for_another_role_or_platform_is_refused() -> None:
    from afd_core.errors import AFDConfigError
    from afd_moe_runners import afd_moe_factory
    from afd_moe_runners.deployment_plan import resolve_plan

    plan = resolve_plan(afd_config(), platform="cpu")
    with pytest.raises(AFDConfigError, match="plan of the attention role"):
        afd_moe_factory(plan, role="ffn")
    with pytest.raises(AFDConfigError, match="resolved for 'cpu'"):
        afd_moe_factory(plan, platform="cuda")


@pytest.mark.parametrize(
    ("role", "gate_on_attention", "runner"),
    [
        ("attention", False, "remote-experts"),
        ("attention", True, "external-routing"),
        ("ffn", False, "native"),
        ("ffn", True, "native"),
    ],
)
def test_the_runner_kind_follows_the_gate_placement(
    role: str, gate_on_attention: bool, runner: str
) -> None:
    from afd_core.config import AFDRole, RoutingPayload
    from afd_moe_runners.deployment_plan import RunnerKind, resolve_plan

    config = afd_config(
        role=AFDRole(role),
        compute_gate_on_attention=gate_on_attention,
        routing_payload=RoutingPayload.ROUTER_LOGITS if gate_on_attention else RoutingPayload.TOPK,
    )
    plan = resolve_plan(config, platform="cpu")
    assert plan.runner is RunnerKind(runner)
    assert plan.gate is (AFDRole.ATTENTION if gate_on_attention else AFDRole.FFN)
    assert plan.routing_payload is (RoutingPayload.ROUTER_LOGITS if gate_on_attention else None)


def test_the_builder_takes_the_runner_from_the_plan_not_the_config() -> None:
    from afd_core.config import RoutingPayload
    from afd_moe_runners.builder import runner_kwargs
    from afd_moe_runners.deployment_plan import RunnerKind, resolve_plan
    from afd_moe_runners.external_routing_runner import ExternalRoutingRunner
    from afd_moe_runners.remote_runner import RemoteExpertsRunner

    plan = resolve_plan(afd_config(compute_gate_on_attention=False), platform="cpu")
    assert runner_kwargs(plan)["runner_cls"] is RemoteExpertsRunner
    assert "routing_payload" not in runner_kwargs(plan)["runner_args"]
    flipped = dataclasses.replace(
        plan, runner=RunnerKind.EXTERNAL_ROUTING, routing_payload=RoutingPayload.TOPK
    )
    kwargs = runner_kwargs(flipped)
    assert kwargs["runner_cls"] is ExternalRoutingRunner
    assert kwargs["runner_args"]["routing_payload"] is RoutingPayload.TOPK
    assert runner_kwargs(dataclasses.replace(plan, runner=RunnerKind.NATIVE)) == {}


@pytest.mark.parametrize("shared_on_attention", [False, True])
def test_the_shared_expert_placement_decides_whether_the_layer_gets_them(
    shared_on_attention: bool,
) -> None:
    from afd_core.config import AFDRole
    from afd_moe_runners.builder import build_planned_moe
    from afd_moe_runners.deployment_plan import resolve_plan

    plan = resolve_plan(afd_config(compute_gate_on_attention=True), platform="cpu")
    assert plan.shared_experts is AFDRole.FFN  # cpu: the FFN role computes them
    plan = dataclasses.replace(
        plan, shared_experts=AFDRole.ATTENTION if shared_on_attention else AFDRole.FFN
    )
    shared = object()
    layer = build_planned_moe(plan, factory=RecordingFactory(), prefix="p", shared_experts=shared)
    assert layer["shared_experts"] is (shared if shared_on_attention else None)


@pytest.mark.parametrize("role", ["attention", "ffn"])
def test_the_dense_and_shared_placements_decide_what_a_role_may_own(role: str) -> None:
    from afd_core.config import AFDRole
    from afd_moe_runners.deployment_plan import resolve_plan
    from afd_moe_runners.inventory import forbidden_categories

    plan = resolve_plan(afd_config(role=AFDRole(role)), platform="cpu")
    assert plan.dense_layers is AFDRole.FFN and plan.shared_experts is AFDRole.FFN
    on_ffn = set(forbidden_categories(plan))
    on_attention = set(
        forbidden_categories(
            dataclasses.replace(
                plan, dense_layers=AFDRole.ATTENTION, shared_experts=AFDRole.ATTENTION
            )
        )
    )
    parts = {"dense_mlp", "shared_experts"}
    if role == "attention":
        assert parts <= on_ffn and not parts & on_attention
    else:
        assert not parts & on_ffn and parts <= on_attention


def test_dense_layers_go_to_attention_for_a_connector_without_hidden_payloads() -> None:
    from afd_core.config import AFDRole
    from afd_moe_runners.deployment_plan import resolve_plan

    plan = resolve_plan(
        afd_config(
            role=AFDRole.FFN, connector="CAMAsyncAFDConnector", compute_gate_on_attention=True
        ),
        platform="npu",
    )
    assert plan.dense_layers is AFDRole.ATTENTION
    assert plan.shared_experts is AFDRole.ATTENTION
    assert not plan.ffn_external_routing  # CAMAsync: no comm-framework routing


def engine(*, eager: bool, mode: str, graphs: str, splitting_ops: Any = None) -> Any:
    return SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=eager),
        compilation_config=SimpleNamespace(
            mode=SimpleNamespace(name=mode),
            cudagraph_mode=SimpleNamespace(name=graphs),
            splitting_ops=splitting_ops,
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, data_parallel_size=2, data_parallel_rank=1
        ),
    )


@pytest.mark.parametrize(
    ("platform", "eager", "mode", "graphs", "expected"),
    [
        ("cpu", True, "NONE", "NONE", "eager"),
        ("cpu", False, "NONE", "NONE", "eager"),
        ("cpu", False, "DYNAMO_TRACE_ONCE", "NONE", "compiled"),
        ("cuda", False, "VLLM_COMPILE", "PIECEWISE", "piecewise"),
        ("cuda", False, "VLLM_COMPILE", "FULL_AND_PIECEWISE", "full"),
        ("npu", False, "VLLM_COMPILE", "PIECEWISE", "platform"),
    ],
)
def test_the_graph_mode_is_the_engines_and_splits_graphs_only_when_piecewise(
    monkeypatch: pytest.MonkeyPatch,
    platform: str,
    eager: bool,
    mode: str,
    graphs: str,
    expected: str,
) -> None:
    from afd_core.config import AFDRole
    from afd_moe_runners.deployment_plan import GraphMode, resolve_plan
    from afd_moe_runners.exchange_op import SPLITTING_OP
    from afd_moe_runners.start_up import compiled_graph_problem

    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")
    config = engine(eager=eager, mode=mode, graphs=graphs)
    plan = resolve_plan(afd_config(connector="LoopbackAFDConnector"), config, platform=platform)
    assert plan.graph_mode is GraphMode(expected)
    assert f"graphs {expected}" in plan.describe()
    assert (plan.rank, plan.data_parallel_size) == (1, 2)  # the engine's layout
    ffn = resolve_plan(afd_config(role=AFDRole.FFN), config, platform=platform)
    assert ffn.graph_mode is GraphMode.EAGER  # the FFN role's server runs eagerly
    # The start-up check acts on that mode: refuses a full graph, splits piecewise ones.
    problem = compiled_graph_problem(config, platform, "M")
    assert (problem is not None) is (expected == "full")
    split = config.compilation_config.splitting_ops or []
    assert (SPLITTING_OP in split) is (expected == "piecewise")


def test_start_up_logs_the_plan_once(caplog: pytest.LogCaptureFixture) -> None:
    from afd_moe_runners.start_up import start_role

    config = engine(eager=True, mode="NONE", graphs="NONE")
    config.additional_config = {
        "afd": {"role": "attention", "connector": "LoopbackAFDConnector", "num_micro_batches": 1}
    }
    config.use_v2_model_runner = False
    config.parallel_config.pipeline_parallel_size = 1
    config.parallel_config.enable_eplb = False
    config.speculative_config = None
    config.lora_config = None
    with caplog.at_level(logging.INFO, logger="afd_moe_runners"):
        plan = start_role(config, "AFDToyForCausalLM")
    lines = [r.getMessage() for r in caplog.records if "plan:" in r.getMessage()]
    assert lines == [f"{plan.describe()} (AFDToyForCausalLM)"]
    assert "runner remote-experts" in lines[0] and "graphs eager" in lines[0]
    assert "\n" not in lines[0]
