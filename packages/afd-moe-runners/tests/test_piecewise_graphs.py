"""Contract: the Attention role under vLLM's own piecewise backend keeps the CUDA-graph
contract of a splitting op, proven on CPU.

On CUDA, ``afd serve`` runs the Attention role compiled with piecewise CUDA graphs split
at ``afd::exchange`` (:func:`afd_moe_runners.role_model.compiled_graph_problem`); on CPU
vLLM never splits its graph. Here vLLM's ``VllmBackend`` (``split_graph``,
``PiecewiseBackend``) compiles a small Attention-role model in
``CompilationMode.VLLM_COMPILE`` with ``splitting_ops=["afd::exchange"]`` and
``cudagraph_mode=PIECEWISE``, and every piece is wrapped in
:class:`~afd_moe_runners.testing.PiecewiseGraphStandIn` instead of ``CUDAGraphWrapper``:
it captures on a batch descriptor's first call and then replays the way a CUDA graph
does (inputs read at the captured addresses, outputs written at the captured ones).

The model has one layer per Attention-side AFD layer kind: the gate-on-FFN MoE runner,
the gate-on-Attention runner (top-k payload) and the dense stand-in, each after a traced
"attention" stand-in (a Linear). The FFN role is the real ``FFNLayerCompute`` over the
loopback connector, served in the layers' yield hook (one thread, as the roles take
turns). The steps follow vLLM's GPU model runner: warm-up and capture are dummy runs
(every row padding), a real step is padded to a captured size and ``is_padding`` marks
the padding.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm

HIDDEN = 64  # the MoEEnv blocks' hidden size


class Harness:
    """The model, its compiled twin under the piecewise backend, and the FFN side."""

    def __init__(self, env: Any, backend: str, tag: str) -> None:
        import torch
        from vllm.compilation.backends import VllmBackend

        from afd_core.config import AFDConfig, AFDRole
        from afd_moe_runners import FFNLayerCompute, afd_moe_factory
        from afd_moe_runners.dense import RemoteDenseMLP
        from afd_moe_runners.exchange_op import register_layer

        self.env = env
        natives: dict[int, Any] = {}
        twins: list[Any] = []
        for idx, gate_on_attention in ((0, False), (1, True)):
            native = env.build_block("qwen3", torch.float32, prefix=f"{tag}_ffn.layers.{idx}.mlp")
            checkpoint = env.checkpoint_for(native, seed=100 + idx)
            env.load(native, checkpoint)
            afd = AFDConfig(
                role=AFDRole.ATTENTION,
                connector="LoopbackAFDConnector",
                compute_gate_on_attention=gate_on_attention,
            )
            twin = env.build_block(
                "qwen3", torch.float32, prefix=f"{tag}_attn.layers.{idx}.mlp",
                factory=afd_moe_factory(afd),
            )  # fmt: skip
            twins.append(env.load(twin, checkpoint))
            natives[idx] = native
        torch.manual_seed(7)
        natives[2] = torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.SiLU())
        dense = RemoteDenseMLP(2)
        dense.afd_layer_name = f"{tag}.dense_mlp.2"  # unique in this process's op registry
        register_layer(dense.afd_layer_name, dense)
        twins.append(dense)
        self.ffn = FFNLayerCompute(natives, vllm_config=env.vllm_config)
        self.attention, self.ffn_connector = env.connector_pair()
        #: (layer, tokens, every value finite) of each message the FFN role served
        self.served: list[tuple[int, int, bool]] = []
        for block in twins:
            layer = next(m for m in block.modules() if hasattr(m, "micro_batch_yield"))
            layer.micro_batch_yield = self._serving_yield(layer.micro_batch_yield)
        self.model = role_model(twins)
        self.compiled = torch.compile(
            self.model, backend=VllmBackend(env.vllm_config, prefix=tag), fullgraph=True
        )
        self.inputs = torch.zeros(32, HIDDEN)  # the runner's persistent input buffer

    def _serving_yield(self, scheduler_yield: Any) -> Any:
        import torch

        def serve_then_yield(layer_idx: int, micro_batch_idx: int) -> None:
            batch = self.ffn.serve_one(self.ffn_connector)
            hidden = batch.payload.hidden_states
            finite = bool(torch.isfinite(hidden).all())
            self.served.append((batch.layer_idx, batch.header.num_tokens, finite))
            scheduler_yield(layer_idx, micro_batch_idx)

        return serve_then_yield

    def context(self, rows: int, real: int, mode: Any, **changes: Any) -> Any:
        import torch
        from vllm.forward_context import BatchDescriptor, set_forward_context

        graphs = mode.name != "NONE"
        return set_forward_context(
            None,
            self.env.vllm_config,
            num_tokens=rows,
            cudagraph_runtime_mode=mode,
            batch_descriptor=BatchDescriptor(num_tokens=rows) if graphs else None,
            is_padding=torch.arange(rows) >= real,
            **changes,
        )

    def step(self, rows: int, real: int, mode: Any) -> Any:
        """One forward of the compiled model over the first ``rows`` rows of the input
        buffer, of which ``real`` carry tokens, the step metadata set as the Attention
        role sets it (``RoleRuntime._run_forward``)."""
        import torch
        from vllm.forward_context import get_forward_context

        from afd_core.forward_context import AFDStepMetadata, set_step_metadata
        from afd_moe_runners.role_model import real_token_count

        with torch.no_grad(), self.context(rows, real, mode):
            ctx = get_forward_context()
            set_step_metadata(
                ctx, AFDStepMetadata(connector=self.attention, num_tokens=real_token_count(ctx))
            )
            x = self.inputs[:rows]
            torch._dynamo.mark_dynamic(x, 0)
            return self.compiled(x).clone()

    def eager(self, x: Any, rows: int | None = None) -> Any:
        """The uncompiled model on ``x`` (every row a token), padded with zero rows to
        ``rows`` as the compiled step was: the traced layers' kernels may depend on the
        row count (CPU GEMMs without AMX pick their blocking by it), so "equals eager"
        compares the same batch. Only ``x``'s rows are returned (and sent to the FFN)."""
        import torch
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import get_forward_context

        from afd_core.forward_context import AFDStepMetadata, set_step_metadata

        real = x.shape[0]
        n = real if rows is None else rows
        padded = torch.zeros(n, x.shape[1], dtype=x.dtype)
        padded[:real] = x
        with torch.no_grad(), self.context(n, real, CUDAGraphMode.NONE):
            set_step_metadata(
                get_forward_context(), AFDStepMetadata(connector=self.attention, num_tokens=real)
            )
            return self.model(padded)[:real]

    def close(self) -> None:
        self.attention.close()
        self.ffn_connector.close()


def role_model(twins: list[Any]) -> Any:
    """Decoder layers of a traced stand-in for attention (a Linear), then an AFD layer."""
    import torch

    class RoleModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mix = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, HIDDEN) for _ in twins)
            self.blocks = torch.nn.ModuleList(twins)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x
            for mix, block in zip(self.mix, self.blocks, strict=True):
                h = h + torch.tanh(mix(h))
                h = h + block(h)
            return h

    torch.manual_seed(11)
    return RoleModel()


@pytest.fixture
def piecewise(vllm_config: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The session's VllmConfig switched to vLLM's CUDA default compile mode with
    piecewise graphs split at the exchange op, and the stand-in as the platform's graph
    wrapper; everything is restored after the test."""
    import torch
    from vllm.config import CompilationMode, CUDAGraphMode
    from vllm.platforms import current_platform

    from afd_moe_runners.exchange_op import SPLITTING_OP
    from afd_moe_runners.testing import PiecewiseGraphStandIn

    cc = vllm_config.compilation_config
    for name, value in (
        ("mode", CompilationMode.VLLM_COMPILE),
        ("cudagraph_mode", CUDAGraphMode.PIECEWISE),
        ("splitting_ops", [SPLITTING_OP]),
        ("compile_sizes", []),
        ("cache_dir", cc.cache_dir),
        ("local_cache_dir", cc.local_cache_dir),
    ):
        monkeypatch.setattr(cc, name, value)
    monkeypatch.setattr(
        type(current_platform),
        "get_static_graph_wrapper_cls",
        classmethod(lambda cls: "afd_moe_runners.testing.PiecewiseGraphStandIn"),
    )
    PiecewiseGraphStandIn.instances.clear()
    torch._dynamo.reset()
    yield cc
    torch._dynamo.reset()
    PiecewiseGraphStandIn.instances.clear()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_piecewise_graphs_replay_the_exchange_at_the_captured_addresses(
    moe_env: Any, piecewise: Any, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """Capture sizes 8 and 16 (dummy runs: the FFN role gets zero tokens, nothing
    uninitialised), then real steps of 5 tokens padded to 8 and 16 unpadded, twice
    each with new data: every piece sees its inputs at the captured addresses, only
    real tokens travel, and the output equals the eager model's on the same padded batch
    (bit for bit with the eager backend; inductor fuses the traced ops, so within float32
    rounding)."""
    import torch
    from vllm.config import CUDAGraphMode

    from afd_moe_runners.testing import PiecewiseGraphStandIn

    monkeypatch.setattr(piecewise, "backend", backend)
    harness = Harness(moe_env, backend, f"piecewise_{backend}")
    try:
        harness.step(8, 0, CUDAGraphMode.NONE)  # warm-up: Dynamo traces, vLLM compiles
        pieces = PiecewiseGraphStandIn.instances
        assert len(pieces) == 4, "3 exchanges split the model into 4 captured pieces"
        for size in (16, 8):  # vLLM captures the large sizes first
            harness.step(size, 0, CUDAGraphMode.PIECEWISE)
        assert all(len(p.entries) == 2 for p in pieces)
        assert {tokens for _, tokens, _ in harness.served} == {0}, harness.served
        assert len(harness.served) == 3 * 3

        generator = torch.Generator().manual_seed(3)
        for rows, real in ((8, 5), (16, 16), (8, 5), (16, 16)):
            harness.served.clear()
            x = torch.randn(real, HIDDEN, generator=generator)
            harness.inputs[:real] = x
            harness.inputs[real:rows] = float("nan")  # padding rows never reach the FFN
            got = harness.step(rows, real, CUDAGraphMode.PIECEWISE)
            assert [p.mismatches for p in pieces] == [[], [], [], []]
            assert harness.served == [(layer, real, True) for layer in range(3)]
            want = harness.eager(x, rows)
            if backend == "eager":
                assert torch.equal(got[:real], want)
            else:
                torch.testing.assert_close(got[:real], want, rtol=1e-5, atol=1e-5)
        assert all(p.modes.count("PIECEWISE") == 2 + 4 for p in pieces)
    finally:
        harness.close()


def test_micro_batches_run_their_pieces_without_the_whole_batch_graph(
    moe_env: Any, piecewise: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of 16 tokens (a captured size) split into two micro-batches of 8: each
    micro-batch runs its pieces without graphs (vLLM's mode NONE, no batch descriptor),
    so no piece replays the 16-token graph on 8 rows; outputs equal the eager model
    per micro-batch; the FFN role gets 8 real tokens per message."""
    import torch
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context
    from vllm.v1.worker.ubatch_utils import UBatchSlice

    from afd_moe_runners.micro_batching import run_micro_batches
    from afd_moe_runners.testing import PiecewiseGraphStandIn

    monkeypatch.setattr(piecewise, "backend", "eager")
    harness = Harness(moe_env, "eager", "piecewise_micro_batches")
    try:
        harness.step(16, 0, CUDAGraphMode.NONE)
        harness.step(16, 0, CUDAGraphMode.PIECEWISE)  # capture 16
        pieces = PiecewiseGraphStandIn.instances
        harness.served.clear()
        for p in pieces:
            p.modes.clear()

        x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(5))
        harness.inputs[:16] = x
        plan = [
            UBatchSlice(request_slice=slice(0, 2), token_slice=slice(0, 8)),
            UBatchSlice(request_slice=slice(2, 4), token_slice=slice(8, 16)),
        ]

        def forward(input_ids: Any, positions: Any, intermediate: Any, embeds: Any) -> Any:
            return harness.compiled(embeds)

        context = harness.context(16, 16, CUDAGraphMode.PIECEWISE, slot_mapping=[{}, {}])
        with torch.no_grad(), context:
            ctx = get_forward_context()
            ctx.attn_metadata = [{}, {}]  # vLLM's per-micro-batch metadata (no attention here)
            got = run_micro_batches(
                forward, ctx, harness.attention, 2, plan, None, torch.arange(16),
                harness.inputs[:16],
            )  # fmt: skip
        assert [p.mismatches for p in pieces] == [[], [], [], []]
        assert all(p.modes == ["NONE", "NONE"] for p in pieces), [p.modes for p in pieces]
        assert sorted(harness.served) == sorted(
            (layer, 8, True) for layer in range(3) for _ in "ab"
        )
        want = torch.cat([harness.eager(x[:8]), harness.eager(x[8:])])
        assert torch.equal(got, want)
    finally:
        harness.close()
