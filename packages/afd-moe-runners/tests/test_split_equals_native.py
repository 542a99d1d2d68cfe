"""Contract: an MoE block split across the roles computes the native block's output exactly.

The FFN side is the native vLLM block (seeded random weights) behind
``FFNLayerCompute``; the Attention side is the same vLLM block class built with the
AFD runner through ``FusedMoEFactory``, loaded from the same checkpoint. Both run in
one process over the loopback connector (FFN side in a thread). Equality is
``torch.equal`` (rtol=0, atol=0) against the unsplit native block.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm

LAYER_IDX = 3
FAMILIES = ["deepseek", "deepseek_scale_on_output", "qwen3"]
DTYPES = ["float32", "bfloat16"]
PLACEMENTS = ["gate_on_ffn", "gate_on_attention_topk", "gate_on_attention_logits"]


def afd_config(placement: str) -> Any:
    from afd_core.config import AFDConfig, AFDRole, RoutingPayload

    return AFDConfig(
        role=AFDRole.ATTENTION,
        connector="LoopbackAFDConnector",
        compute_gate_on_attention=placement != "gate_on_ffn",
        routing_payload=(
            RoutingPayload.ROUTER_LOGITS
            if placement == "gate_on_attention_logits"
            else RoutingPayload.TOPK
        ),
    )


class Blocks:
    """Native blocks, their FFN-side computes and Attention twins, built once each."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self._native: dict[tuple[str, str], tuple[Any, Any, dict[str, Any]]] = {}
        self._twins: dict[tuple[str, str, str], Any] = {}

    def native(self, family: str, dtype_name: str) -> tuple[Any, Any, dict[str, Any]]:
        """(native block, FFNLayerCompute serving it, checkpoint)."""
        import torch

        from afd_moe_runners import FFNLayerCompute

        key = (family, dtype_name)
        if key not in self._native:
            dtype = getattr(torch, dtype_name)
            block = self.env.build_block(
                family, dtype, prefix=f"ffn_{family}_{dtype_name}.layers.{LAYER_IDX}.mlp"
            )
            checkpoint = self.env.checkpoint_for(block, seed=1234)
            self.env.load(block, checkpoint)
            compute = FFNLayerCompute({LAYER_IDX: block}, vllm_config=self.env.vllm_config)
            self._native[key] = (block, compute, checkpoint)
        return self._native[key]

    def twin(self, family: str, dtype_name: str, placement: str) -> Any:
        """The Attention-side block: same class, AFD runner, same checkpoint (what it has)."""
        import torch

        from afd_moe_runners import afd_moe_factory

        key = (family, dtype_name, placement)
        if key not in self._twins:
            _, _, checkpoint = self.native(family, dtype_name)
            block = self.env.build_block(
                family,
                getattr(torch, dtype_name),
                prefix=f"attn_{family}_{dtype_name}_{placement}.layers.{LAYER_IDX}.mlp",
                factory=afd_moe_factory(afd_config(placement)),
            )
            self._twins[key] = self.env.load(block, checkpoint)
        return self._twins[key]


@pytest.fixture(scope="module")
def blocks(moe_env: Any) -> Blocks:
    return Blocks(moe_env)


@pytest.mark.parametrize("num_tokens", [1, 7, 64])
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_split_block_output_equals_native_bit_for_bit(
    blocks: Blocks, family: str, dtype_name: str, placement: str, num_tokens: int
) -> None:
    import torch

    native, ffn_compute, _ = blocks.native(family, dtype_name)
    twin = blocks.twin(family, dtype_name, placement)
    generator = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 64, generator=generator).to(getattr(torch, dtype_name))

    expected = blocks.env.native_forward(native, x)
    actual = blocks.env.split_forward(twin, ffn_compute, x)

    assert expected.abs().sum() > 0
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    diff = (actual.float() - expected.float()).abs().max().item()
    assert torch.equal(actual, expected), f"max |split - native| = {diff}"


def test_attention_block_holds_no_expert_weights(blocks: Blocks) -> None:
    from afd_moe_runners import RemoteRoutedExperts

    for placement in PLACEMENTS:
        twin = blocks.twin("deepseek", "float32", placement)
        runner = twin.experts
        assert isinstance(runner.routed_experts, RemoteRoutedExperts)
        assert list(runner.routed_experts.parameters()) == []
        names = {name for name, _ in twin.named_parameters()}
        assert not any("routed_experts" in name for name in names), names
        runner_names = {name for name, _ in runner.named_parameters()}
        if placement == "gate_on_ffn":
            assert runner_names == set()
        else:
            # Only the gate (+ its correction bias) runs on Attention; the shared
            # experts stay on the FFN role.
            assert runner_names == {"gate.weight", "gate.e_score_correction_bias"}


def test_native_block_has_the_expert_weights_the_twin_lacks(blocks: Blocks) -> None:
    native, _, _ = blocks.native("qwen3", "float32")
    twin = blocks.twin("qwen3", "float32", "gate_on_ffn")
    native_names = {name for name, _ in native.named_parameters()}
    twin_names = {name for name, _ in twin.named_parameters()}
    assert native_names - twin_names == {
        "experts.routed_experts.w13_weight",
        "experts.routed_experts.w2_weight",
    }


def test_ffn_side_picks_the_moe_runner_from_the_block_structure(blocks: Blocks) -> None:
    from afd_moe_runners import find_moe_runner

    for family in FAMILIES:
        native, ffn_compute, _ = blocks.native(family, "float32")
        assert ffn_compute.runners[LAYER_IDX] is native.experts
        assert find_moe_runner(native) is native.experts


def test_micro_batch_yield_runs_once_between_send_and_receive(blocks: Blocks) -> None:
    import torch

    _, ffn_compute, _ = blocks.native("deepseek", "float32")
    twin = blocks.twin("deepseek", "float32", "gate_on_attention_topk")
    calls: list[tuple[int, int]] = []
    original = twin.experts.micro_batch_yield
    twin.experts.micro_batch_yield = lambda layer, mb: calls.append((layer, mb))
    try:
        x = torch.randn(5, 64)
        blocks.env.split_forward(twin, ffn_compute, x, micro_batch_idx=1, num_micro_batches=2)
    finally:
        twin.experts.micro_batch_yield = original
    assert calls == [(LAYER_IDX, 1)]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("family", ["deepseek", "qwen3"])
def test_compiled_twin_keeps_the_exchange_as_one_op_and_equals_native(
    blocks: Blocks, family: str, placement: str
) -> None:
    """Dynamo traces the Attention-side block in one graph (``fullgraph``: a graph break
    fails) with the exchange as the opaque ``afd::exchange`` op; the compiled twin still
    computes the native block's output exactly, and its runs go through the op."""
    import torch

    from afd_moe_runners import exchange_op

    native, ffn_compute, _ = blocks.native(family, "float32")
    twin = blocks.twin(family, "float32", placement)
    graphs: list[Any] = []

    def backend(gm: Any, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(twin, backend=backend, fullgraph=True, dynamic=True)
    for num_tokens in (5, 9):  # one trace serves both sizes
        x = torch.randn(num_tokens, 64, generator=torch.Generator().manual_seed(num_tokens))
        before = exchange_op.compiled_calls()
        actual = blocks.env.split_forward(compiled, ffn_compute, x)
        assert exchange_op.compiled_calls() == before + 1
        assert torch.equal(actual, blocks.env.native_forward(native, x))
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count("afd.exchange") == 1, targets


def test_eager_forward_does_not_go_through_the_op(blocks: Blocks) -> None:
    import torch

    from afd_moe_runners import exchange_op

    native, ffn_compute, _ = blocks.native("qwen3", "float32")
    twin = blocks.twin("qwen3", "float32", "gate_on_ffn")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    before = exchange_op.compiled_calls()
    assert torch.equal(
        blocks.env.split_forward(twin, ffn_compute, x), blocks.env.native_forward(native, x)
    )
    assert exchange_op.compiled_calls() == before


def test_the_op_writes_into_the_output_the_graph_allocated() -> None:
    """vLLM's splitting-op contract: the traced code allocates the output and the op
    writes into it (a captured graph piece reads that address again on every replay).
    A connector may answer with a view of its receive buffer (valid until its next
    receive), so what the graph holds must never be that buffer."""
    import torch

    from afd_moe_runners import exchange_op

    class BufferedLayer:  # answers from one persistent receive buffer, as shm does
        def __init__(self) -> None:
            self.buffer = torch.zeros(16, 8)

        def afd_exchange(self, x: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
            view = self.buffer[: x.shape[0]]
            view.copy_(x * 2)
            return view

    layer = BufferedLayer()
    exchange_op.register_layer("test.layers.0.mlp", layer)
    x = torch.randn(5, 8)
    out = torch.full((5, 8), float("nan"))
    address = out.data_ptr()
    assert torch.ops.afd.exchange(x, None, out, "test.layers.0.mlp") is None
    assert out.data_ptr() == address
    assert torch.equal(out, x * 2)
    layer.afd_exchange(torch.ones(5, 8), None)  # the connector's next receive
    assert torch.equal(out, x * 2)
