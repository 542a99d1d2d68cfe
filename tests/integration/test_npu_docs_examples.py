"""Every launch example of docs/npu.md, run on CPU against the fake CAM operators.

The examples are read from the guide itself (the fenced ``bash`` blocks of its "Example
launches" section), so the guide cannot show a launch that fails here. For each one:

* the ``afd`` section and each ``afd serve`` command are parsed; a block, a flag or a
  model the test cannot read fails the test (it never skips an example);
* each role's ``AFDConfig`` comes from that section, the two roles must pass the CAM
  connectors' handshake comparison, and each role's engine arguments (tensor / data
  parallel sizes, DBO, ubatching) pass the connector's start-up check on platform
  ``npu``;
* both roles' models are built by afd's generic role-aware path (the one that builds
  them on Ascend) from a tiny DeepSeek-V3 checkpoint: a dense layer 0, then two MoE
  layers with a shared expert (it stands in for DeepSeek-V4 too: vLLM 0.32 has no V4
  model on CPU; the start-up checks are given V4's architecture name), loaded through
  their role-aware loaders, with one model per attention rank and the rank connectors'
  handshake over :class:`~afd_connectors_npu.testing.FakeCAMFabric`;
* every decoder layer's FFN part (dense MLP or MoE block) then runs split across the
  roles, each attention rank on its own tokens, and must equal the native model's same
  layer (the roles' placement of dense layers and shared experts included: with
  CAMAsync the dense layer must run on Attention without any CAM traffic).

Stand-ins, each at a hardware boundary: the CAM operators (the fake), vLLM-Ascend's
``AscendMoERunner`` (vLLM's own ``MoERunner`` as the NPU runners' base) and the device
type (``npu`` where afd asks for it). Not exercised: attention, KV cache and scheduling
(a layer's input is random post-attention hidden states), separate processes, and the
FFN role's external-routing component over vLLM-Ascend's comm (the FFN side uses vLLM's
routed experts; tests/integration/test_cam_paths.py covers the component on CPU).
"""

from __future__ import annotations

import json
import re
import shlex
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from afd_core.config import AFDConfig

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "npu.md"
SECTION = "## Example launches"

#: Checkpoint folder named in an example -> the architecture its start-up check sees.
MODELS = {"DeepSeek-V3": "DeepseekV3ForCausalLM", "DeepSeek-V4": "DeepseekV4ForCausalLM"}
#: ``afd serve`` flags the examples may use: name -> takes a value.
FLAGS = {
    "--role": True,
    "--enforce-eager": False,
    "--port": True,
    "--additional-config": True,
    "--tensor-parallel-size": True,
    "--data-parallel-size": True,
    "--enable-dbo": False,
    "--ubatch-size": True,
}


@dataclass
class Launch:
    model: str
    flags: dict[str, str | bool]

    def int_flag(self, name: str, default: int) -> int:
        value = self.flags.get(name)
        return default if value is None else int(str(value))


@dataclass
class Example:
    title: str
    afd: dict[str, Any]
    roles: dict[str, Launch] = field(default_factory=dict)


def _command(line: str, afd_var: str) -> Launch:
    words = shlex.split(line)
    assert words[:2] == ["afd", "serve"], f"not an afd serve command: {line!r}"
    model: str | None = None
    flags: dict[str, str | bool] = {}
    rest = iter(words[2:])
    for word in rest:
        if not word.startswith("--"):
            assert model is None, f"two positional arguments in {line!r}"
            model = word
            continue
        name, _, inline = word.partition("=")
        assert name in FLAGS, f"flag {name} of {line!r} is not modelled by this test"
        flags[name] = (inline or next(rest)) if FLAGS[name] else True
    assert model is not None, f"no checkpoint in {line!r}"
    assert flags.get("--additional-config") == f"${afd_var}", (
        f'{line!r} must pass the example\'s afd section as --additional-config "${afd_var}"'
    )
    return Launch(model, flags)


def parse_examples(text: str) -> list[Example]:
    """The examples of the guide's launch section (fails on anything it cannot read)."""
    assert SECTION in text, f"{GUIDE} has no {SECTION!r} section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    parts = re.split(r"```bash\n(.*?)```", section, flags=re.S)
    examples: list[Example] = []
    for prose, block in zip(parts[0::2], parts[1::2], strict=False):
        titles = re.findall(r"\*\*(.+?)\*\*", prose)
        assert titles, f"a launch block without a bold title before it:\n{block}"
        assignment = re.search(r"^(\w+)='(.*?)'\s*$", block, flags=re.S | re.M)
        assert assignment, f"no AFD='{{...}}' assignment in the block {titles[-1]!r}"
        var, body = assignment.group(1), assignment.group(2)
        afd = json.loads(body)["afd"]
        example = Example(titles[-1], afd)
        commands = block[assignment.end() :].replace("\\\n", " ")
        for line in filter(None, (c.strip() for c in commands.splitlines())):
            launch = _command(line, var)
            role = str(launch.flags["--role"])
            assert role in ("attention", "ffn") and role not in example.roles, line
            example.roles[role] = launch
        assert set(example.roles) == {"attention", "ffn"}, f"{example.title}: {example.roles}"
        examples.append(example)
    return examples


EXAMPLES = parse_examples(GUIDE.read_text())


def test_the_guide_shows_every_cam_launch() -> None:
    """The parse found the guide's examples (a block it skipped would pass unseen)."""
    assert GUIDE.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0].count("```bash") == len(
        EXAMPLES
    )
    shapes = {(e.afd["connector"], bool(e.afd.get("compute_gate_on_attention"))) for e in EXAMPLES}
    assert shapes == {
        ("CAMP2pAFDConnector", False),
        ("CAMP2pAFDConnector", True),
        ("CAMAsyncAFDConnector", True),
    }
    for example in EXAMPLES:
        assert example.roles["attention"].model == example.roles["ffn"].model, example.title


def role_config(example: Example, role: str, rank: int) -> AFDConfig:
    return AFDConfig.from_additional_config({"afd": {**example.afd, "role": role, "rank": rank}})


def check_start_up(example: Example) -> None:
    """The handshake comparison and each role's start-up check, with the example's flags."""
    from afd_connectors_npu.validation import check_roles_agree
    from afd_core.registry import get_connector_class

    attention, ffn = (role_config(example, role, 0) for role in ("attention", "ffn"))
    check_roles_agree(attention, ffn)
    for role, config in (("attention", attention), ("ffn", ffn)):
        launch = example.roles[role]
        architecture = MODELS.get(Path(launch.model).name)
        assert architecture, f"{example.title}: no stand-in for {launch.model}"
        engine = types.SimpleNamespace(
            model_config=types.SimpleNamespace(architectures=[architecture]),
            parallel_config=types.SimpleNamespace(
                tensor_parallel_size=launch.int_flag("--tensor-parallel-size", 1),
                enable_dbo=bool(launch.flags.get("--enable-dbo", False)),
                ubatch_size=launch.int_flag("--ubatch-size", 0),
            ),
        )
        get_connector_class(config.connector).check_deployment(config, engine, platform="npu")
    # Attention ranks are the data-parallel ranks of the Attention server.
    dp = example.roles["attention"].int_flag("--data-parallel-size", 1)
    assert dp == attention.num_attention_ranks, (
        f"{example.title}: --data-parallel-size {dp} but afd.num_attention_ranks="
        f"{attention.num_attention_ranks}"
    )
    assert example.roles["ffn"].int_flag("--data-parallel-size", 1) == 1


# --------------------------------------------------------------------- split run


@pytest.fixture(scope="module")
def npu_stand_ins() -> Iterator[None]:
    """The device type ``npu`` where afd asks for it, vLLM's MoERunner as the NPU
    runners' base, and one vLLM world for the module."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    from afd_connectors_npu import validation
    from afd_moe_runners import deployment_plan
    from afd_moe_runners.npu import runners as npu_runners
    from afd_moe_runners.npu.runners import AscendRunnerSeams
    from afd_moe_runners.testing import session_vllm_config

    with session_vllm_config(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(deployment_plan, "current_platform_name", lambda: "npu")
        patch.setattr(validation, "_detect_platform", lambda: "npu")
        patch.setattr(npu_runners, "ascend_runner_seams", lambda: AscendRunnerSeams(MoERunner))
        yield


def engine_config(model_dir: Path, afd: dict[str, Any] | None, architecture: str) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    from afd.runtime.environment import CPU_MLA_BACKEND, cpu_mla_backend_needed

    config = EngineArgs(
        model=str(model_dir),
        additional_config={"afd": afd} if afd is not None else {},
        enforce_eager=True,
        dtype="float32",
        max_model_len=128,
        distributed_executor_backend="uni",
        # float32 MLA on a CPU with AMX tiles: vLLM's reference MLA backend, as afd
        # launch and the native references pick it there
        attention_backend=CPU_MLA_BACKEND
        if cpu_mla_backend_needed(str(model_dir), "float32")
        else None,
    ).create_engine_config()
    # The start-up checks read the architecture the example names (V4 stands in as V3).
    object.__setattr__(config.model_config.model_arch_config, "architectures", [architecture])
    return config


def checkpoint(model_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def build(cls: type, config: Any, weights: dict[str, Any]) -> Any:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with set_current_vllm_config(config):
        model = cls(vllm_config=config)
        model.load_weights((name, t.clone()) for name, t in weights.items())
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    return model.eval()


@dataclass
class Deployment:
    native: Any
    native_config: Any
    attention: list[tuple[Any, Any]]  # (model, vllm config) per attention rank
    ffn_model: Any
    ffn_config: Any
    ffn_connectors: list[Any]
    compute: Any
    fabric: Any


def deploy(example: Example, model_dir: Path, patch: pytest.MonkeyPatch) -> Deployment:
    """Both roles built and connected over the fake CAM operators."""
    from afd_connectors_npu.testing import FakeCAMFabric
    from afd_core.registry import get_connector_class
    from afd_moe_runners import role_model, role_runtime
    from afd_moe_runners.builder import shared_experts_on_attention
    from afd_moe_runners.ffn_compute import FFNLayerCompute
    from afd_moe_runners.generic import native_model_class, role_model_class

    native_arch = "DeepseekV3ForCausalLM"
    architecture = MODELS[Path(example.roles["attention"].model).name]
    weights = checkpoint(model_dir)
    fabric = FakeCAMFabric()
    cls = get_connector_class(example.afd["connector"])
    handshakes: list[threading.Thread] = []

    def handshake(connector: Any) -> None:
        thread = threading.Thread(target=connector.init, daemon=True)
        thread.start()
        handshakes.append(thread)

    native_config = engine_config(model_dir, None, architecture)
    native = build(native_model_class(native_arch), native_config, weights)
    role_cls = role_model_class(native_arch)

    ffn_afd = {**example.afd, "role": "ffn", "rank": 0}
    ffn_config = engine_config(model_dir, ffn_afd, architecture)
    ffn_model = build(role_cls, ffn_config, weights)
    afd_ffn = role_config(example, "ffn", 0)
    blocks = ffn_model.afd_ffn_blocks()
    compute = FFNLayerCompute(
        blocks,
        vllm_config=ffn_config,
        shared_experts_on_attention=shared_experts_on_attention(afd_ffn),
    )
    identity = role_model.role_identity(ffn_model, ffn_config, afd_ffn)
    ffn_connectors = []
    for f in range(afd_ffn.num_ffn_ranks):
        connector = cls(role_config(example, "ffn", f), rank=f, ops_factory=fabric.ops_factory)
        connector.identity = dict(identity)
        handshake(connector)
        ffn_connectors.append(connector)

    created: list[Any] = []

    def create_connector(config: AFDConfig, *, rank: int, identity: Any = None) -> Any:
        connector = cls(config, rank=rank, ops_factory=fabric.ops_factory)
        connector.identity = dict(identity or {})
        init = connector.init
        # Each rank is its own process in a deployment: its handshake runs beside the
        # other ranks' builds (a fan-in handshake completes once every rank joined).
        patch.setattr(connector, "init", lambda: handshake(types.SimpleNamespace(init=init)))
        created.append(connector)
        return connector

    patch.setattr(role_runtime, "create_connector", create_connector)
    attention = []
    for r in range(afd_ffn.num_attention_ranks):
        config = engine_config(
            model_dir, {**example.afd, "role": "attention", "rank": r}, architecture
        )
        attention.append((build(role_cls, config, weights), config))
    for thread in handshakes:
        thread.join(timeout=60.0)
    assert all(c.is_initialized for c in (*created, *ffn_connectors)), "handshake failed"
    return Deployment(
        native, native_config, attention, ffn_model, ffn_config, ffn_connectors, compute, fabric
    )


def run_layer(d: Deployment, idx: int, xs: list[Any]) -> list[Any]:
    """Layer ``idx``'s FFN part on every attention rank (rank r on ``xs[r]``), split.

    One Attention thread runs the ranks one after another: a rank's yield point (after
    its send and any local shared experts) starts the next rank, as the ranks of a
    deployment send concurrently; the FFN side computes only once every rank reached its
    yield point (vLLM's CPU kernels must not run in two threads at once)."""
    import torch
    from vllm.forward_context import get_forward_context, set_forward_context

    from afd_core.forward_context import AFDStepMetadata, set_step_metadata

    outs: list[Any] = [None] * len(xs)
    failure: list[BaseException] = []
    idle = threading.Event()
    exchanged = idx in d.compute.layers

    def serve(connector: Any) -> None:
        try:
            batch = connector.recv_from_attention(timeout_s=60.0)
            if not idle.wait(timeout=60.0):
                raise TimeoutError("the Attention ranks never reached their yield points")
            # vLLM's forward context is one per process; here the FFN role's replaces the
            # Attention ranks' while they wait for this answer.
            n = batch.header.num_tokens
            with set_forward_context(None, d.ffn_config, num_tokens=n):
                result = d.compute.compute(batch.layer_idx, batch.payload)
            connector.send_to_attention(batch, result)
        except BaseException as exc:  # re-raised below
            failure.append(exc)
            for model, _ in d.attention:  # unblocks the Attention side's receive
                model.afd_runtime.connector.close()

    servers = [
        threading.Thread(target=serve, args=(c,), daemon=True)
        for c in (d.ffn_connectors if exchanged else [])
    ]
    for server in servers:
        server.start()

    def rank_forward(r: int) -> None:
        model, config = d.attention[r]
        mlp = model.get_submodule(f"model.layers.{idx}.mlp")
        hooked = [m for m in mlp.modules() if hasattr(m, "micro_batch_yield")]
        original: list[Callable[..., None]] = [m.micro_batch_yield for m in hooked]

        def yield_point(layer_idx: int, mb: int) -> None:
            original[0](layer_idx, mb)
            if r + 1 < len(xs):
                rank_forward(r + 1)
            else:
                idle.set()

        for m in hooked:
            m.micro_batch_yield = yield_point
        try:
            with set_forward_context(None, config, num_tokens=xs[r].shape[0]):
                set_step_metadata(
                    get_forward_context(), AFDStepMetadata(connector=model.afd_runtime.connector)
                )
                outs[r] = mlp(xs[r].clone())
        finally:
            for m, fn in zip(hooked, original, strict=True):
                m.micro_batch_yield = fn
        if not hooked and r + 1 < len(xs):  # computed here: no exchange to wait on
            rank_forward(r + 1)

    try:
        with torch.no_grad():
            rank_forward(0)
    except BaseException:
        for connector in d.ffn_connectors:  # unblocks a server still waiting
            connector.close()
        raise
    finally:
        for server in servers:
            server.join(timeout=60.0)
        if failure:
            raise failure[0]
    return outs


def native_layer(d: Deployment, idx: int, x: Any) -> Any:
    import torch
    from vllm.forward_context import set_forward_context

    mlp = d.native.get_submodule(f"model.layers.{idx}.mlp")
    with torch.no_grad(), set_forward_context(None, d.native_config, num_tokens=x.shape[0]):
        return mlp(x.clone())


@pytest.mark.vllm
@pytest.mark.parametrize("example", EXAMPLES, ids=[e.title for e in EXAMPLES])
def test_guide_example_runs_split_over_the_fake_cam_operators(
    example: Example, tiny_models: dict[str, Path], npu_stand_ins: None
) -> None:
    import torch

    from afd_core.errors import AFDTransferMismatchError

    check_start_up(example)
    # Where docs/npu.md's table puts them: dense layers on Attention with CAMAsync (it
    # carries no hidden-only message), shared experts with the gate on Attention.
    dense_here = example.afd["connector"] == "CAMAsyncAFDConnector"
    shared_here = bool(example.afd.get("compute_gate_on_attention"))

    with pytest.MonkeyPatch.context() as patch:
        d = deploy(example, tiny_models["deepseek_v3"], patch)
        try:
            kinds = [layer.kind for layer in d.ffn_model.afd_plan.layers]
            assert kinds == ["dense", "moe", "moe"]

            for idx in range(len(kinds)):
                xs = [
                    torch.randn(n, 128, generator=torch.Generator().manual_seed(77 + idx + n))
                    for n in (5, 3)[: len(d.attention)]
                ]
                before = len(d.fabric.records)
                outs = run_layer(d, idx, xs)
                for r, (x, out) in enumerate(zip(xs, outs, strict=True)):
                    expected = native_layer(d, idx, x)
                    assert expected.abs().sum() > 0
                    torch.testing.assert_close(
                        out, expected, rtol=1e-5, atol=1e-5, msg=f"layer {idx}, rank {r}"
                    )
                if idx == 0 and dense_here:  # computed on Attention: nothing on the wire
                    assert len(d.fabric.records) == before
                else:
                    assert len(d.fabric.records) > before
            # Each role holds what it computes, and nothing else.
            attention_inventory = d.attention[0][0].afd_runtime.inventory
            ffn_inventory = d.ffn_model.afd_runtime.inventory
            assert bool(attention_inventory.get("dense_mlp")) is dense_here
            assert bool(ffn_inventory.get("dense_mlp")) is not dense_here
            assert bool(attention_inventory.get("shared_experts")) is shared_here
            assert bool(ffn_inventory.get("shared_experts")) is not shared_here
            assert sorted(d.compute.layers) == ([1, 2] if dense_here else [0, 1, 2])
            if dense_here:  # the FFN role refuses a dense-layer request
                from afd_core.transfer import AttentionToFFN

                with pytest.raises(AFDTransferMismatchError, match="serves layers"):
                    d.compute.compute(0, AttentionToFFN(xs[0]))
        finally:
            for model, _ in d.attention:
                model.afd_runtime.close()
            for connector in d.ffn_connectors:
                connector.close()
