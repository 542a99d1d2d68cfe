"""FFN expert parallelism, dispatch proven row by row (issue 41): real vLLM MoE blocks, the
gate on Attention, one attention rank and nF FFN ranks in one process over the loopback
connector (one expert plane per FFN rank, each served by a thread).

The Attention side is the block's AFD twin (its own gate) behind
:class:`~afd_moe_runners.expert_parallel.ExpertParallelExchange`; FFN rank f serves the
block built for its expert shard (:func:`~afd_moe_runners.role_model.expert_shard_factory`,
loaded as the FFN role loads it, :func:`~afd_moe_runners.expert_parallel.shard_checkpoint`).
Recorded: the top-k ids and weights the Attention gate handed to the exchange, and, per
FFN plane, the rows it received. Each received hidden row is matched to the row of the
layer input it equals (the rows are distinct random vectors), so the check is which rows
went where, not how many: FFN rank f got exactly the tokens with a top-k expert in
``expert_shard(E, nF, f)``, in token order, with their ids and the weights of the other
ranks' experts zeroed; FFN rank 0 got every row when the model has shared experts, and a
dense layer goes to FFN rank 0 alone. The expected rows are computed here from the gate's
ids with plain sets, not with :func:`~afd_moe_runners.expert_parallel.dispatch_rows`: the
last test breaks that function (every row to every rank) and the check must fail.
The combined answer equals the native block (float32, up to the order of the sums).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

EXPERTS = 16  # the "qwen3" / "deepseek" test blocks (afd_models_*.testing)
LAYER, DENSE_LAYER = 2, 0
TOKENS = 40
_ports = iter(range(44100, 44600))


class Blocks:
    """Native blocks, Attention twins (gate on Attention) and FFN shard blocks, built once."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self._native: dict[str, tuple[Any, dict[str, Any]]] = {}
        self._twins: dict[str, Any] = {}
        self._shards: dict[tuple[str, int, int], Any] = {}

    def native(self, family: str) -> tuple[Any, dict[str, Any]]:
        import torch

        if family not in self._native:
            block = self.env.build_block(
                family, torch.float32, prefix=f"epd_native_{family}.layers.{LAYER}.mlp"
            )
            checkpoint = self.env.checkpoint_for(block, seed=41)
            self._native[family] = (self.env.load(block, checkpoint), checkpoint)
        return self._native[family]

    def twin(self, family: str) -> Any:
        import torch

        from afd_core.config import AFDConfig, AFDRole
        from afd_moe_runners import afd_moe_factory

        if family not in self._twins:
            _, checkpoint = self.native(family)
            config = AFDConfig(
                role=AFDRole.ATTENTION,
                connector="LoopbackAFDConnector",
                compute_gate_on_attention=True,
            )
            block = self.env.build_block(
                family,
                torch.float32,
                prefix=f"epd_attn_{family}.layers.{LAYER}.mlp",
                factory=afd_moe_factory(config),
            )
            self._twins[family] = self.env.load(block, checkpoint)
        return self._twins[family]

    def shard(self, family: str, rank: int, ep: int) -> Any:
        """FFN rank ``rank`` of ``ep``: its shard's experts, the shared expert zero on
        ranks > 0 (as the FFN role loads it)."""
        import torch
        from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

        from afd_core.config import AFDConfig, AFDRole
        from afd_core.topology import expert_shard
        from afd_moe_runners.expert_parallel import shard_checkpoint
        from afd_moe_runners.role_model import expert_shard_factory

        key = (family, rank, ep)
        if key not in self._shards:
            _, full = self.native(family)
            checkpoint = dict(shard_checkpoint(full.items(), EXPERTS, rank, ep))
            shard = expert_shard(EXPERTS, ep, rank)
            for name in ("w13_weight", "w2_weight"):
                name = f"experts.routed_experts.{name}"
                checkpoint[name] = checkpoint[name][shard.start : shard.stop]
            config = AFDConfig(
                role=AFDRole.FFN,
                connector="LoopbackAFDConnector",
                num_ffn_ranks=ep,
                rank=rank,
                ffn_expert_parallel=True,
                compute_gate_on_attention=True,
            )
            block = self.env.build_block(
                family,
                torch.float32,
                prefix=f"epd_shard_{family}_{rank}of{ep}.layers.{LAYER}.mlp",
                factory=expert_shard_factory(config, self.env.vllm_config, FusedMoEFactory),
            )
            self._shards[key] = self.env.load(block, checkpoint)
        return self._shards[key]


@pytest.fixture(scope="module")
def blocks(moe_env: Any) -> Blocks:
    return Blocks(moe_env)


class Run:
    """One exchange of an MoE layer (then a dense layer) through the expert planes."""

    output: Any
    gate_ids: Any
    gate_weights: Any
    #: FFN rank -> [(layer, hidden, topk_ids, topk_weights)] as received, in order.
    received: dict[int, list[tuple[int, Any, Any, Any]]]


def run_dispatch(blocks: Blocks, family: str, ep: int, x: Any) -> Run:
    import torch
    from vllm.forward_context import get_forward_context

    from afd_core.config import AFDConfig, AFDRole
    from afd_core.forward_context import AFDStepMetadata, set_step_metadata
    from afd_core.testing.loopback import LoopbackAFDConnector
    from afd_core.transfer import AttentionToFFN, FFNToAttention
    from afd_moe_runners import FFNLayerCompute
    from afd_moe_runners.expert_parallel import ExpertParallelExchange

    env = blocks.env
    run = Run()
    run.received = {f: [] for f in range(ep)}

    class Recording(ExpertParallelExchange):
        """Keeps the payload the Attention gate produced (before the dispatch)."""

        def send_to_ffn(self, payload: Any, *, layer_idx: int, micro_batch_idx: int = 0) -> None:
            if layer_idx == LAYER:
                run.gate_ids = payload.topk_ids.clone()
                run.gate_weights = payload.topk_weights.clone()
            super().send_to_ffn(payload, layer_idx=layer_idx, micro_batch_idx=micro_batch_idx)

    port = next(_ports)
    common = dict(
        connector="LoopbackAFDConnector", host="ep-dispatch", port=port, num_ffn_ranks=ep,
        ffn_expert_parallel=True, compute_gate_on_attention=True, transfer_timeout_s=60.0,
    )  # fmt: skip
    attn = AFDConfig(role=AFDRole.ATTENTION, rank=0, **common)
    ffns = [
        LoopbackAFDConnector(AFDConfig(role=AFDRole.FFN, rank=f, **common).expert_plane(f), rank=0)
        for f in range(ep)
    ]
    for c in ffns:
        c.init()
    computes = [FFNLayerCompute({LAYER: blocks.shard(family, f, ep)}) for f in range(ep)]
    # vLLM's CPU kernels must not run from two threads at once: the FFN threads compute
    # one at a time, once the Attention side waits (its micro-batch yield point).
    attention_idle = threading.Event()
    kernel = threading.Lock()
    failures: list[BaseException] = []

    def serve(f: int) -> None:
        try:
            for _ in range(2):  # the MoE layer, then the dense layer
                batch = ffns[f].recv_from_attention(timeout_s=60.0)
                p = batch.payload
                run.received[f].append(
                    (batch.layer_idx, p.hidden_states.clone(), p.topk_ids, p.topk_weights)
                )
                if batch.layer_idx != LAYER:  # dense: rank 0's MLP (a stand-in here)
                    out = FFNToAttention(p.hidden_states * (2.0 if f == 0 else 0.0))
                else:
                    assert attention_idle.wait(60.0), "the Attention side never yielded"
                    with kernel, env.forward_context(max(1, p.hidden_states.shape[0])):
                        out = computes[f].compute(batch.layer_idx, p)
                ffns[f].send_to_attention(batch, out)
        except BaseException as exc:  # re-raised in the test thread
            failures.append(exc)

    threads = [threading.Thread(target=serve, args=(f,), daemon=True) for f in range(ep)]
    for t in threads:
        t.start()
    planes = [LoopbackAFDConnector(attn.expert_plane(f), rank=0) for f in range(ep)]
    exchange = Recording(
        attn, rank=0, planes=planes, num_experts=EXPERTS,
        rank0_gets_every_row=family.startswith("deepseek"),
    )  # fmt: skip
    exchange.init()
    twin = blocks.twin(family)
    hooked = [m for m in twin.modules() if hasattr(m, "micro_batch_yield")]
    assert len(hooked) == 1
    original = hooked[0].micro_batch_yield

    def yield_point(layer_idx: int, mb: int) -> None:
        original(layer_idx, mb)
        attention_idle.set()

    hooked[0].micro_batch_yield = yield_point
    try:
        with torch.no_grad(), env.forward_context(x.shape[0]):
            set_step_metadata(
                get_forward_context(), AFDStepMetadata(connector=exchange, num_tokens=None)
            )
            run.output = twin(x.clone())
        exchange.send_to_ffn(AttentionToFFN(x.clone()), layer_idx=DENSE_LAYER)
        dense = exchange.recv_from_ffn(layer_idx=DENSE_LAYER, timeout_s=60.0)
        assert torch.equal(dense.output, x * 2.0)
    finally:
        hooked[0].micro_batch_yield = original
        for t in threads:
            t.join(60.0)
        for c in (exchange, *ffns):
            c.close()
    if failures:
        raise failures[0]
    return run


def dispatch_problems(run: Run, x: Any, ep: int, every_row_to_rank0: bool) -> list[str]:
    """What differs between the rows each FFN rank received and the rows the gate's ids
    route to it (empty: the dispatch is exact)."""
    import torch

    from afd_core.topology import expert_shard

    index = {tuple(row.tolist()): t for t, row in enumerate(x)}
    assert len(index) == x.shape[0], "the test's rows must be distinct"
    gate = [set(map(int, ids)) for ids in run.gate_ids.tolist()]
    problems = []
    for f in range(ep):
        shard = set(expert_shard(EXPERTS, ep, f))
        layers = [m[0] for m in run.received[f]]
        if layers != [LAYER, DENSE_LAYER]:
            problems.append(f"FFN rank {f}: layers {layers}")
            continue
        for layer, hidden, ids, weights in run.received[f]:
            got = [index.get(tuple(row.tolist()), -1) for row in hidden]
            if layer == DENSE_LAYER:
                want = list(range(x.shape[0])) if f == 0 else []
                if got != want:
                    problems.append(f"FFN rank {f}, dense layer: rows {got}, expected {want}")
                continue
            every = f == 0 and every_row_to_rank0
            want = [t for t, e in enumerate(gate) if every or e & shard]
            if got != want:
                extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
                problems.append(
                    f"FFN rank {f}: {len(got)} rows, expected {len(want)} (not routed here: "
                    f"{extra}, routed here but absent: {missing})"
                )
                continue
            rows = torch.tensor(want, dtype=torch.int64)
            mine = torch.tensor([[int(e) in shard for e in r] for r in run.gate_ids[rows].tolist()])
            expected_w = torch.where(mine, run.gate_weights[rows], 0.0).reshape(-1, ids.shape[1])
            if not torch.equal(ids, run.gate_ids[rows]):
                problems.append(f"FFN rank {f}: top-k ids differ from the gate's")
            if not torch.equal(weights, expected_w):
                problems.append(f"FFN rank {f}: weights not the gate's with foreign ones zeroed")
    return problems


def _input(seed: int) -> Any:
    import torch

    return torch.randn(TOKENS, 64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("family", "ep"), [("qwen3", 2), ("qwen3", 3), ("deepseek", 2), ("deepseek", 4)]
)
def test_each_ffn_rank_receives_exactly_the_rows_routed_to_its_shard(
    blocks: Blocks, family: str, ep: int, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    import torch

    from afd_moe_runners.expert_parallel import RECORD_DISPATCH_ENV

    # The exchange's opt-in record (what tests/e2e/test_parallel_roles.py reads from a
    # deployment) must say what the FFN ranks received.
    monkeypatch.setenv(RECORD_DISPATCH_ENV, str(tmp_path))
    x = _input(seed=ep)
    shared = family == "deepseek"  # a shared expert: FFN rank 0 computes it for every row
    run = run_dispatch(blocks, family, ep, x)
    assert dispatch_problems(run, x, ep, every_row_to_rank0=shared) == []
    # The routing is informative: some rank was skipped by some token (else "every row
    # everywhere" would pass too; DeepSeek's grouped top-k gave every token both halves
    # of the experts here), and every rank got some.
    counts = [len(run.received[f][0][1]) for f in range(ep)]
    assert min(counts[1:] if shared else counts) < TOKENS or ep == 2, counts
    assert min(counts) > 0, counts
    native, _ = blocks.native(family)
    torch.testing.assert_close(
        run.output, blocks.env.native_forward(native, x), rtol=1e-5, atol=1e-5
    )
    (path,) = tmp_path.glob("attention0-*.jsonl")
    moe, dense = (json.loads(line) for line in path.read_text().splitlines())
    index = {tuple(row.tolist()): t for t, row in enumerate(x)}
    for record, (want_layer, want_topk) in (
        (moe, (LAYER, run.gate_ids)),
        (dense, (DENSE_LAYER, None)),
    ):
        assert record["layer"] == want_layer and record["rows"] == TOKENS
        assert record["topk"] == (None if want_topk is None else want_topk.tolist())
        for f in range(ep):
            layer, hidden, _, _ = run.received[f][0 if record is moe else 1]
            got = [index[tuple(row.tolist())] for row in hidden]
            planned = record["planes"][f]
            assert (list(range(TOKENS)) if planned is None else planned) == got, (layer, f)


def test_the_row_check_fails_when_every_row_goes_to_every_rank(
    blocks: Blocks, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broken dispatch computes the same answer (foreign weights are zero), so only
    the row check sees it: it must name the rows a rank got without being routed there."""
    import torch

    from afd_moe_runners import expert_parallel

    def every_row(topk_ids: Any, shard: range, *, every_row: bool = False) -> Any:
        return torch.arange(topk_ids.shape[0], device=topk_ids.device)

    monkeypatch.setattr(expert_parallel, "dispatch_rows", every_row)
    x = _input(seed=2)
    run = run_dispatch(blocks, "qwen3", 2, x)
    problems = dispatch_problems(run, x, 2, every_row_to_rank0=False)
    assert problems and all("not routed here" in p for p in problems), problems
