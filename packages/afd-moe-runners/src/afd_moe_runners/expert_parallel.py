"""FFN expert parallelism: every attention rank exchanges with every FFN rank (M2N).

With ``afd.ffn_expert_parallel`` the ``nF`` FFN ranks share one expert set: FFN rank f
holds the routed experts :func:`afd_core.topology.expert_shard` ``(E, nF, f)`` and only
those (its MoE layers allocate and load nothing else:
:mod:`afd_moe_runners.expert_shard`); FFN rank 0 alone computes the shared experts and
the dense MLPs (zero on the others, :func:`zero_foreign_experts`). Every FFN block is
then the sum over the FFN ranks of what each computes with its own weights, so an
attention rank sends a layer to the FFN ranks and sums their partial answers:

* gate on Attention (top-k payload): dispatch. FFN rank f gets only the tokens with at
  least one of their top-k experts in its shard (:func:`dispatch_rows`), with the
  weights of the other experts zeroed; FFN rank 0 also gets every token when the model
  has shared experts or dense layers (they run there). The partial outputs are added
  into the rows they answer (combine, :func:`combine`).
* gate on FFN (hidden states, or router logits): every FFN rank gets every token and runs
  the native block, router included (replicated: each rank routes the same tokens to the
  same experts, cheaper than routing on one rank and shipping the routing), with its
  weights; the partial outputs are summed.

The attention rank adds the partial answers in float32 and rounds the sum once to the
dtype it sent (:func:`combine`); each partial arrives in that dtype (the wire contract:
an FFN answer has the dtype of the hidden states sent), rounded once by its FFN rank
(:mod:`afd_moe_runners.expert_shard`).

Each exchange with FFN rank f uses its own connector, the *expert plane* f
(:meth:`afd_core.config.AFDConfig.expert_plane`: the attention ranks and FFN rank f on
port ``port + f``), so the transports are the ordinary 1-FFN-rank connectors.

Tests can record the dispatch (:data:`RECORD_DISPATCH_ENV`, :class:`DispatchRecorder`):
off unless the environment names a folder when the exchange is built.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from afd_core.config import AFDConfig
from afd_core.connector import AFDConnector, FFNBatch
from afd_core.errors import AFDConfigError, AFDConnectorError
from afd_core.topology import expert_shard
from afd_core.transfer import AttentionToFFN, FFNToAttention
from afd_moe_runners.exchange import pop_sent

__all__ = [
    "RECORD_DISPATCH_ENV",
    "DispatchRecorder",
    "ExpertParallelExchange",
    "shard_checkpoint",
    "has_shared_experts",
    "routed_experts_of",
    "combine",
    "dispatch_rows",
    "shard_payload",
    "zero_foreign_experts",
]


def dispatch_rows(topk_ids: torch.Tensor, shard: range, *, every_row: bool = False) -> torch.Tensor:
    """Row indices (int64, ascending) of the tokens FFN rank of ``shard`` must compute:
    those with at least one top-k expert in ``shard`` (all rows with ``every_row``)."""
    if every_row:
        return torch.arange(topk_ids.shape[0], device=topk_ids.device)
    mine = (topk_ids >= shard.start) & (topk_ids < shard.stop)
    return mine.any(dim=1).nonzero().flatten()


def shard_payload(payload: AttentionToFFN, rows: torch.Tensor, shard: range) -> AttentionToFFN:
    """The part of a top-k ``payload`` for the FFN rank of ``shard``: ``rows`` only, the
    weights of experts outside ``shard`` zeroed (they are zero on that rank anyway; zero
    weights keep its answer exactly its own experts' sum)."""
    hidden, ids, weights = payload.hidden_states, payload.topk_ids, payload.topk_weights
    assert isinstance(hidden, torch.Tensor)
    assert isinstance(ids, torch.Tensor) and isinstance(weights, torch.Tensor)
    ids, weights = ids[rows], weights[rows]
    mine = (ids >= shard.start) & (ids < shard.stop)
    return AttentionToFFN(
        hidden[rows].contiguous(),
        topk_ids=ids.contiguous(),
        topk_weights=torch.where(mine, weights, torch.zeros_like(weights)).contiguous(),
    )


RECORD_DISPATCH_ENV = "AFD_RECORD_DISPATCH"


class DispatchRecorder:
    """Test-only record of an attention rank's dispatch under FFN expert parallelism: one
    JSON line per ``send_to_ffn`` in ``<dir>/attention<rank>-<pid>.jsonl``, written and
    flushed at once (a stopped role loses nothing)::

        {"layer": 3, "mb": 0, "rows": 7, "topk": [[ids of row 0], ...] | null,
         "planes": [[row indices sent to FFN rank 0] | null, ...]}

    ``topk``: the top-k ids the Attention gate produced for every row (null without a
    top-k payload); ``planes[f]``: the rows FFN rank f got (null: every row, unsplit).
    Made by :class:`ExpertParallelExchange` when :data:`RECORD_DISPATCH_ENV`
    (``AFD_RECORD_DISPATCH``) names a folder at its construction; otherwise absent, and
    the exchange's only cost is one ``is None`` test per layer. On: two ``tolist()``
    calls and one small file write per layer and micro-batch (test deployments only).
    """

    def __init__(self, out_dir: Path, rank: int) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / f"attention{rank}-{os.getpid()}.jsonl"

    @classmethod
    def from_env(cls, rank: int) -> DispatchRecorder | None:
        out = os.environ.get(RECORD_DISPATCH_ENV, "")
        return cls(Path(out), rank) if out else None

    def record(
        self,
        layer: int,
        micro_batch: int,
        rows: int,
        topk_ids: torch.Tensor | None,
        planes: Sequence[torch.Tensor | None],
    ) -> None:
        line = {
            "layer": layer,
            "mb": micro_batch,
            "rows": rows,
            "topk": None if topk_ids is None else topk_ids.tolist(),
            "planes": [None if p is None else p.tolist() for p in planes],
        }
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line, separators=(",", ":")) + "\n")


def combine(
    rows: int,
    parts: Sequence[tuple[torch.Tensor | None, FFNToAttention]],
    dtype: torch.dtype | None = None,
) -> FFNToAttention:
    """Sum the partial answers into ``rows`` rows: ``(row indices or None for all rows,
    answer)`` per FFN rank. A shared output is summed the same way where sent.

    The sum is taken in float32 (or wider) and rounded once to ``dtype`` (default: the
    first answer's), not after each FFN rank's part: with three or more bfloat16 partials
    rounding each running sum would add one rounding per rank."""
    first = parts[0][1].output
    assert isinstance(first, torch.Tensor)
    dtype = first.dtype if dtype is None else dtype
    acc = torch.promote_types(dtype, torch.float32)
    out = first.new_zeros((rows, first.shape[1]), dtype=acc)
    shared: torch.Tensor | None = None
    for index, answer in parts:
        for name in ("output", "shared_output"):
            part = getattr(answer, name)
            if part is None:
                continue
            assert isinstance(part, torch.Tensor)
            if name == "output":
                target = out
            else:
                if shared is None:
                    shared = out.new_zeros(out.shape)
                target = shared
            part = part.to(acc)
            if index is None:
                target += part
            else:
                target.index_add_(0, index, part)
    return FFNToAttention(out.to(dtype), shared_output=None if shared is None else shared.to(dtype))


class ExpertParallelExchange(AFDConnector):
    """The Attention-side connector of one attention rank under FFN expert parallelism:
    one inner connector per FFN rank (``planes[f]``, the expert plane f).

    ``num_experts``: routed experts of the model; ``rank0_gets_every_row``: FFN rank 0
    computes something for every token (shared experts or dense layers).
    """

    name = "ExpertParallelExchange"

    def __init__(
        self,
        config: AFDConfig,
        *,
        rank: int,
        planes: Sequence[AFDConnector],
        num_experts: int,
        rank0_gets_every_row: bool,
    ) -> None:
        super().__init__(config, rank=rank)
        if len(planes) != config.num_ffn_ranks:
            raise AFDConfigError(
                f"ExpertParallelExchange: {len(planes)} expert planes for "
                f"{config.num_ffn_ranks} FFN ranks"
            )
        self.planes = list(planes)
        self.shards = [
            expert_shard(num_experts, config.num_ffn_ranks, f) for f in range(len(planes))
        ]
        self.rank0_gets_every_row = rank0_gets_every_row
        # (layer, micro-batch) -> (rows sent, their dtype, row indices per FFN rank or
        # None for all)
        self._sent: dict[tuple[int, int], tuple[int, torch.dtype, list[torch.Tensor | None]]] = {}
        #: Tokens sent to each FFN rank (the dispatch; read by tests and metrics).
        self.tokens_sent = [0] * len(planes)
        self._recorder = DispatchRecorder.from_env(rank)

    #: Each plane's connector checks the extra config (the same mapping).
    extra_schema = None

    # -- lifecycle -----------------------------------------------------------
    def init(self) -> None:
        for plane in self.planes:
            plane.init()

    @property
    def is_initialized(self) -> bool:
        return all(plane.is_initialized for plane in self.planes)

    def close(self) -> None:
        for plane in self.planes:
            plane.close()

    # -- Attention side ------------------------------------------------------
    def send_to_ffn(
        self, payload: AttentionToFFN, *, layer_idx: int, micro_batch_idx: int = 0
    ) -> None:
        hidden = payload.hidden_states
        assert isinstance(hidden, torch.Tensor)
        indices: list[torch.Tensor | None] = []
        rows = int(hidden.shape[0])
        dense = payload.topk_ids is None and payload.router_logits is None
        for f, (plane, shard) in enumerate(zip(self.planes, self.shards, strict=True)):
            index: torch.Tensor | None
            if isinstance(payload.topk_ids, torch.Tensor):
                index = dispatch_rows(
                    payload.topk_ids, shard, every_row=f == 0 and self.rank0_gets_every_row
                )
                part = shard_payload(payload, index, shard)
            elif dense and self.config.compute_gate_on_attention and f > 0:
                # A dense layer (the gate runs here, so a payload without routing is a
                # dense MLP's): FFN rank 0 holds it, the others get no token.
                index = torch.zeros(0, dtype=torch.int64, device=hidden.device)
                part = AttentionToFFN(hidden[:0])
            else:
                # Gate on FFN (or router logits): every rank routes every token itself.
                index, part = None, payload
            indices.append(index)
            self.tokens_sent[f] += rows if index is None else int(index.shape[0])
            plane.send_to_ffn(part, layer_idx=layer_idx, micro_batch_idx=micro_batch_idx)
        self._sent[(layer_idx, micro_batch_idx)] = (int(hidden.shape[0]), hidden.dtype, indices)
        if self._recorder is not None:
            ids = payload.topk_ids if isinstance(payload.topk_ids, torch.Tensor) else None
            self._recorder.record(layer_idx, micro_batch_idx, rows, ids, indices)

    def recv_from_ffn(
        self, *, layer_idx: int, micro_batch_idx: int = 0, timeout_s: float | None = None
    ) -> FFNToAttention:
        if (layer_idx, micro_batch_idx) not in self._sent:
            # No send of this layer: as the exchange protocol does, every plane receives
            # anyway, to say which answer really arrived (getting past it, so the planes'
            # streams stay in step) or to time out; the first plane's error is raised.
            errors: list[AFDConnectorError] = []
            for plane in self.planes:
                try:
                    plane.recv_from_ffn(
                        layer_idx=layer_idx, micro_batch_idx=micro_batch_idx, timeout_s=timeout_s
                    )
                except AFDConnectorError as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]
        rows, dtype, indices = pop_sent(self._sent, self.label, layer_idx, micro_batch_idx)
        parts = [
            (index, plane.recv_from_ffn(
                layer_idx=layer_idx, micro_batch_idx=micro_batch_idx, timeout_s=timeout_s
            ))
            for plane, index in zip(self.planes, indices, strict=True)
        ]  # fmt: skip
        return combine(rows, parts, dtype)

    # -- FFN side (never on this connector) ------------------------------------
    def recv_from_attention(self, *, timeout_s: float | None = None) -> FFNBatch:
        raise AFDConfigError(f"{self.label}: recv_from_attention() is an FFN-side call")

    def send_to_attention(self, batch: FFNBatch, result: FFNToAttention) -> None:
        raise AFDConfigError(f"{self.label}: send_to_attention() is an FFN-side call")


_EXPERT_PARAMS = ("w13_weight", "w2_weight", "w13_bias", "w2_bias")


def zero_foreign_experts(
    blocks: dict[int, nn.Module], moe_layers: Sequence[int], ep_rank: int, ep_size: int
) -> dict[str, int]:
    """The after-load pass of an FFN rank under FFN expert parallelism; returns what its
    MoE layers hold, read from their tensors (``routed_experts_held`` /
    ``routed_experts_absent``, summed over the layers).

    The routed experts are already a shard (:class:`afd_moe_runners.expert_shard.
    ExpertShardRoutedExperts` allocated only this rank's; the checkpoint's others were
    never loaded). On FFN ranks other than 0 this zeroes what rank 0 alone computes:
    the shared experts and the dense MLPs (their checkpoint tensors were zeroed before
    loading already, :func:`shard_checkpoint`; this covers tensors named otherwise).
    """
    from afd_moe_runners.expert_shard import held_experts

    moe = set(moe_layers)
    with torch.no_grad():
        for idx, block in blocks.items():
            if ep_rank == 0:
                continue
            routed = {
                id(t)
                for module in block.modules()
                for t in (getattr(module, n, None) for n in _EXPERT_PARAMS)
                if isinstance(t, torch.Tensor)
            }
            for name, p in block.named_parameters():
                if id(p) in routed or (idx in moe and _is_router(name)):
                    continue
                p.zero_()
    return held_experts({idx: block for idx, block in blocks.items() if idx in moe})


def _is_router(name: str) -> bool:
    # The router (gate) and its score-correction bias stay on every FFN rank: with the
    # gate on FFN each rank routes every token itself. Shared-expert gates do not.
    if "shared_expert" in name:
        return False
    return "gate" in name.split(".") or "e_score_correction_bias" in name


# Config attribute names, first present wins (as afd_moe_runners.identity reads them).
_NUM_EXPERTS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
_SHARED = ("n_shared_experts", "num_shared_experts", "shared_expert_intermediate_size")


def routed_experts_of(text_config: Any) -> int:
    """Routed experts per MoE layer of a model's text config."""
    for name in _NUM_EXPERTS:
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise AFDConfigError(
        "afd.ffn_expert_parallel: the model config names no routed expert count "
        f"({', '.join(_NUM_EXPERTS)}); expert parallelism needs a MoE model"
    )


def has_shared_experts(text_config: Any) -> bool:
    """Whether the model has shared experts (they run on FFN rank 0 for every token)."""
    return any(bool(getattr(text_config, name, 0) or 0) for name in _SHARED)


_EXPERT_ID = re.compile(r"\.experts\.(\d+)\.")
_LAYER_MLP = re.compile(r"layers\.(\d+)\.mlp\.")
_DENSE_LEAVES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "fc1", "fc2")


def shard_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]], num_experts: int, ep_rank: int, ep_size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The FFN role's checkpoint tensors for FFN rank ``ep_rank`` of ``ep_size``, before
    loading: the per-expert tensors of routed experts outside its shard are dropped
    (``...experts.<id>....``: never read into memory by the loader; fused tensors holding
    every expert pass, vLLM's loader skips the foreign experts of them, see
    :class:`afd_moe_runners.expert_shard.ExpertShardRoutedExperts`), and on ranks > 0 the
    shared experts and the dense MLPs are replaced by zeros (rank 0 computes them).

    Zeroing before the load matters: vLLM CPU repacks Linear weights after loading
    (oneDNN), so zeroing a loaded ``weight`` afterwards would not reach the kernels.
    """
    shard = expert_shard(num_experts, ep_size, ep_rank)
    for name, tensor in weights:
        expert = _EXPERT_ID.search(name)
        if expert is not None:
            if int(expert[1]) in shard:
                yield name, tensor
            continue
        if "shared_expert" in name:
            foreign = ep_rank != 0
        elif _LAYER_MLP.search(name) and name.rsplit(".", 2)[-2] in _DENSE_LEAVES:
            foreign = ep_rank != 0  # a dense layer's MLP
        else:
            foreign = False
        yield name, torch.zeros_like(tensor) if foreign else tensor
