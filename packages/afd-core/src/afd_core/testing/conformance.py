"""Conformance suite every AFD connector must pass.

A connector package supplies a :class:`ConnectorHarness` (how to start one
connector per rank, threads or processes) and parametrises a test over
:data:`SCENARIOS` x :data:`TOPOLOGIES`::

    import pytest
    from afd_core.testing.conformance import conformance_cases, run_scenario

    @pytest.mark.parametrize(("scenario", "topology"), conformance_cases())
    def test_conformance(scenario, topology):
        run_scenario(MyHarness(), scenario, topology)

Each scenario's ``run_rank`` is a module-level function (picklable, so a
multi-process harness can ship it) that drives one connector and returns
picklable data; its ``check`` runs in the test process over the results of all
ranks. The FFN side computes ``out = hidden * 2 + layer_idx`` so that any
mix-up of layers, micro-batches or attention ranks changes the numbers. Needs
torch.

Over 400 lines on purpose: the scenarios are the suite; each scenario's rank function
stays next to its check.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

import torch

from afd_core.config import AFDRole
from afd_core.connector import AFDConnector, FFNBatch
from afd_core.errors import (
    AFDConnectorClosedError,
    AFDPeerLostError,
    AFDTimeoutError,
    AFDTransferMismatchError,
)
from afd_core.topology import AFDTopology
from afd_core.transfer import AttentionToFFN, FFNToAttention, PayloadKind

__all__ = [
    "RankContext",
    "Scenario",
    "ConnectorHarness",
    "SCENARIOS",
    "TRANSFER_SCENARIOS",
    "TOPOLOGIES",
    "run_scenario",
    "conformance_cases",
    "expected_result_keys",
]

Results = Mapping[tuple[str, int], Any]


@dataclass(frozen=True)
class RankContext:
    """Who a ``run_rank`` call is: its role, its rank within the role, the topology."""

    role: AFDRole
    rank: int
    topology: AFDTopology

    @property
    def is_idle(self) -> bool:
        """An FFN rank with no attention peer (A < F): it only inits and closes."""
        return self.role is AFDRole.FFN and self.rank in self.topology.idle_ffn_ranks

    @property
    def peers(self) -> tuple[int, ...]:
        return self.topology.peers_of(self.role, self.rank)


@dataclass(frozen=True)
class Scenario:
    """One behaviour of the connector contract, checked over every rank's result."""

    name: str
    run_rank: Callable[[AFDConnector, RankContext], Any]
    check: Callable[[Results, AFDTopology], None]
    config_overrides: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    requires: Callable[[AFDTopology], bool] | None = None
    """Optional predicate; topologies it rejects are skipped."""

    def supports(self, topology: AFDTopology) -> bool:
        return self.requires is None or self.requires(topology)


class ConnectorHarness(Protocol):
    def run(self, scenario: Scenario, topology: AFDTopology) -> dict[tuple[str, int], Any]:
        """Run ``scenario`` on one connector per (role, rank); return results by (role, rank).

        One connector per (role, rank) built from ``AFDConfig(role=..., connector=<harness's>,
        num_attention_ranks=A, num_ffn_ranks=F, **scenario.config_overrides, plus harness
        host/port)``, ``init()``-ed, ``scenario.run_rank`` run concurrently on every rank,
        then ``close()``-d. Results are keyed by ``(role.value, rank)``. An exception raised
        in a rank is returned as the value, not raised.
        """
        ...


# ---------------------------------------------------------------------------------
# deterministic data
# ---------------------------------------------------------------------------------


def _seed(*parts: int) -> int:
    seed = 17
    for p in parts:
        seed = (seed * 1_000_003 + p + 1) % (2**31 - 1)
    return seed


def make_hidden(
    rank: int, layer: int, mb: int, num_tokens: int, hidden_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The hidden states attention ``rank`` sends for (layer, micro-batch): distinct per rank."""
    g = torch.Generator().manual_seed(_seed(rank, layer, mb, hidden_size))
    return torch.randn(num_tokens, hidden_size, generator=g).to(dtype)


def ffn_function(hidden: torch.Tensor, layer_idx: int) -> torch.Tensor:
    """What the FFN side of every scenario computes (elementwise: fan-in order cannot hide)."""
    return hidden * 2 + layer_idx


def _routing(rank: int, layer: int, n: int, kind: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(_seed(rank, layer, 7))
    if kind == "topk":
        return {
            "topk_ids": torch.randint(0, 16, (n, 4), generator=g, dtype=torch.int64).to(
                torch.int32
            ),
            "topk_weights": torch.rand(n, 4, generator=g, dtype=torch.float32),
        }
    if kind == "router_logits":
        return {"router_logits": torch.randn(n, 8, generator=g, dtype=torch.float32)}
    if kind == "token_ids":
        return {"token_ids": torch.randint(0, 50_000, (n,), generator=g, dtype=torch.int64)}
    return {}


# ---------------------------------------------------------------------------------
# shared helpers for checks
# ---------------------------------------------------------------------------------


def expected_result_keys(topology: AFDTopology) -> set[tuple[str, int]]:
    return {(role.value, r) for role in AFDRole for r in range(topology.size_of(role))}


def _ok(results: Results, key: tuple[str, int]) -> Any:
    if key not in results:
        raise AssertionError(f"no result for {key[0]} rank {key[1]}")
    value = results[key]
    if isinstance(value, BaseException):
        raise AssertionError(f"{key[0]} rank {key[1]} raised {value!r}") from value
    return value


def _assert_tensor(what: str, got: Any, want: torch.Tensor) -> None:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{what}: expected a tensor, got {type(got).__name__}")
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        raise AssertionError(
            f"{what}: expected {want.dtype} {tuple(want.shape)}, got {got.dtype} {tuple(got.shape)}"
        )
    if not torch.equal(got.cpu(), want):
        diff = (got.cpu().float() - want.float()).abs().max().item() if want.numel() else 0.0
        raise AssertionError(f"{what}: values differ (max abs diff {diff})")


def _serve(
    connector: AFDConnector,
    ctx: RankContext,
    num_batches: int,
    *,
    shared: bool = False,
    keep_tensors: bool = False,
) -> list[dict[str, Any]]:
    """FFN loop: receive, compute ``hidden*2 + layer``, answer; return what was received."""
    seen: list[dict[str, Any]] = []
    if ctx.is_idle:
        return seen
    for _ in range(num_batches):
        batch: FFNBatch = connector.recv_from_attention()
        hidden = batch.payload.hidden_states
        assert isinstance(hidden, torch.Tensor)
        out = ffn_function(hidden, batch.layer_idx)
        connector.send_to_attention(
            batch, FFNToAttention(out, shared_output=hidden + 1 if shared else None)
        )
        record: dict[str, Any] = {
            "layer_idx": batch.layer_idx,
            "micro_batch_idx": batch.micro_batch_idx,
            "kind": batch.header.kind.name,
            "payload_kind": batch.payload.kind.name,
            "num_tokens": batch.header.num_tokens,
            "hidden_size": batch.header.hidden_size,
            "dtype": batch.header.dtype,
            "peer_ranks": tuple(batch.peer_ranks),
            "token_counts": tuple(batch.token_counts),
        }
        if keep_tensors:
            for name in ("hidden_states", "topk_ids", "topk_weights", "router_logits", "token_ids"):
                value = getattr(batch.payload, name)
                record[name] = None if value is None else value.detach().cpu().clone()
        seen.append(record)
    return seen


def _check_ffn_log(
    results: Results,
    topology: AFDTopology,
    expected: Callable[[int], list[dict[str, Any]]],
) -> None:
    """Compare each FFN rank's received log with ``expected(ffn_rank)`` (subset of keys)."""
    for f in range(topology.num_ffn_ranks):
        log = _ok(results, ("ffn", f))
        want = expected(f)
        if len(log) != len(want):
            raise AssertionError(f"ffn rank {f}: received {len(log)} batches, expected {len(want)}")
        for i, (got, exp) in enumerate(zip(log, want, strict=True)):
            for key, value in exp.items():
                if isinstance(value, torch.Tensor) or value is None:
                    if value is None:
                        if got.get(key) is not None:
                            raise AssertionError(f"ffn rank {f} batch {i}: unexpected {key}")
                    else:
                        _assert_tensor(f"ffn rank {f} batch {i} {key}", got.get(key), value)
                elif got.get(key) != value:
                    raise AssertionError(
                        f"ffn rank {f} batch {i}: expected {key}={value!r}, got {got.get(key)!r}"
                    )


# ---------------------------------------------------------------------------------
# scenario: ordering over layers and micro-batches
# ---------------------------------------------------------------------------------

_ORDER_LAYERS = 3
_ORDER_MBS = 2
_ORDER_HIDDEN = 8


def _order_tokens(rank: int, layer: int, mb: int) -> int:
    return (rank + layer + mb) % 3 + 1


def _ordering_run(connector: AFDConnector, ctx: RankContext) -> Any:
    if ctx.role is AFDRole.FFN:
        return _serve(connector, ctx, _ORDER_LAYERS * _ORDER_MBS)
    outs = []
    for layer in range(_ORDER_LAYERS):
        for mb in range(_ORDER_MBS):
            n = _order_tokens(ctx.rank, layer, mb)
            hidden = make_hidden(ctx.rank, layer, mb, n, _ORDER_HIDDEN, torch.float32)
            connector.send_to_ffn(AttentionToFFN(hidden), layer_idx=layer, micro_batch_idx=mb)
        for mb in range(_ORDER_MBS):
            result = connector.recv_from_ffn(layer_idx=layer, micro_batch_idx=mb)
            outs.append((layer, mb, result.output))
    return outs


def _ordering_check(results: Results, topology: AFDTopology) -> None:
    for a in range(topology.num_attention_ranks):
        outs = _ok(results, ("attention", a))
        order = [(layer, mb) for layer in range(_ORDER_LAYERS) for mb in range(_ORDER_MBS)]
        if [(o[0], o[1]) for o in outs] != order:
            raise AssertionError(f"attention rank {a}: results out of order")
        for layer, mb, out in outs:
            n = _order_tokens(a, layer, mb)
            want = ffn_function(make_hidden(a, layer, mb, n, _ORDER_HIDDEN, torch.float32), layer)
            _assert_tensor(f"attention rank {a} layer {layer} micro-batch {mb}", out, want)

    def expected(f: int) -> list[dict[str, Any]]:
        peers = topology.attention_peers_of(f)
        return [
            {
                "layer_idx": layer,
                "micro_batch_idx": mb,
                "peer_ranks": peers,
                "token_counts": tuple(_order_tokens(a, layer, mb) for a in peers),
            }
            for layer in range(_ORDER_LAYERS)
            for mb in range(_ORDER_MBS)
            if peers
        ]

    _check_ffn_log(results, topology, expected)


# ---------------------------------------------------------------------------------
# scenario: shapes and dtypes (0 tokens, 1 token, uneven counts, bf16)
# ---------------------------------------------------------------------------------

# One case per layer: (dtype name, hidden size, tokens(rank) rule).
_SHAPE_CASES: tuple[tuple[str, int, str], ...] = (
    ("float32", 16, "two"),
    ("bfloat16", 64, "uneven"),
    ("float32", 8, "zero"),
    ("bfloat16", 32, "one"),
    ("float32", 24, "uneven_with_zero"),
)


def _shape_tokens(rule: str, rank: int) -> int:
    return {
        "two": 2,
        "zero": 0,
        "one": 1,
        "uneven": rank * 2 + 1,
        "uneven_with_zero": (rank * 5 + 3) % 4,
    }[rule]


def _shapes_run(connector: AFDConnector, ctx: RankContext) -> Any:
    if ctx.role is AFDRole.FFN:
        return _serve(connector, ctx, len(_SHAPE_CASES))
    outs = []
    for layer, (dtype, hidden_size, rule) in enumerate(_SHAPE_CASES):
        n = _shape_tokens(rule, ctx.rank)
        hidden = make_hidden(ctx.rank, layer, 0, n, hidden_size, getattr(torch, dtype))
        connector.send_to_ffn(AttentionToFFN(hidden), layer_idx=layer)
        outs.append(connector.recv_from_ffn(layer_idx=layer).output)
    return outs


def _shapes_check(results: Results, topology: AFDTopology) -> None:
    for a in range(topology.num_attention_ranks):
        outs = _ok(results, ("attention", a))
        for layer, (dtype, hidden_size, rule) in enumerate(_SHAPE_CASES):
            n = _shape_tokens(rule, a)
            hidden = make_hidden(a, layer, 0, n, hidden_size, getattr(torch, dtype))
            _assert_tensor(
                f"attention rank {a} layer {layer} ({dtype}, {n}x{hidden_size})",
                outs[layer],
                ffn_function(hidden, layer),
            )

    def expected(f: int) -> list[dict[str, Any]]:
        peers = topology.attention_peers_of(f)
        if not peers:
            return []
        return [
            {
                "layer_idx": layer,
                "dtype": dtype,
                "hidden_size": hidden_size,
                "token_counts": tuple(_shape_tokens(rule, a) for a in peers),
                "num_tokens": sum(_shape_tokens(rule, a) for a in peers),
            }
            for layer, (dtype, hidden_size, rule) in enumerate(_SHAPE_CASES)
        ]

    _check_ffn_log(results, topology, expected)


# ---------------------------------------------------------------------------------
# scenarios: routing payloads arrive intact, with the right kind
# ---------------------------------------------------------------------------------

_ROUTING_LAYERS = 2
_ROUTING_HIDDEN = 16
_ROUTING_KIND = {
    "topk": PayloadKind.HIDDEN_TOPK,
    "router_logits": PayloadKind.HIDDEN_ROUTER_LOGITS,
    "token_ids": PayloadKind.HIDDEN_TOKEN_IDS,
}


def _routing_tokens(rank: int, layer: int) -> int:
    return (rank + 2 * layer) % 3 + 1


def _routing_run(connector: AFDConnector, ctx: RankContext, kind: str) -> Any:
    if ctx.role is AFDRole.FFN:
        return _serve(connector, ctx, _ROUTING_LAYERS, keep_tensors=True)
    outs = []
    for layer in range(_ROUTING_LAYERS):
        n = _routing_tokens(ctx.rank, layer)
        hidden = make_hidden(ctx.rank, layer, 0, n, _ROUTING_HIDDEN, torch.bfloat16)
        payload = AttentionToFFN(hidden, **_routing(ctx.rank, layer, n, kind))
        connector.send_to_ffn(payload, layer_idx=layer)
        outs.append(connector.recv_from_ffn(layer_idx=layer).output)
    return outs


def _routing_check(results: Results, topology: AFDTopology, kind: str) -> None:
    for a in range(topology.num_attention_ranks):
        outs = _ok(results, ("attention", a))
        for layer in range(_ROUTING_LAYERS):
            hidden = make_hidden(
                a, layer, 0, _routing_tokens(a, layer), _ROUTING_HIDDEN, torch.bfloat16
            )
            _assert_tensor(
                f"attention rank {a} layer {layer}", outs[layer], ffn_function(hidden, layer)
            )

    def expected(f: int) -> list[dict[str, Any]]:
        peers = topology.attention_peers_of(f)
        if not peers:
            return []
        log = []
        for layer in range(_ROUTING_LAYERS):
            counts = [_routing_tokens(a, layer) for a in peers]
            entry: dict[str, Any] = {
                "layer_idx": layer,
                "kind": _ROUTING_KIND[kind].name,
                "payload_kind": _ROUTING_KIND[kind].name,
                "hidden_states": torch.cat(
                    [
                        make_hidden(a, layer, 0, n, _ROUTING_HIDDEN, torch.bfloat16)
                        for a, n in zip(peers, counts, strict=True)
                    ]
                ),
            }
            parts = [_routing(a, layer, n, kind) for a, n in zip(peers, counts, strict=True)]
            for name in ("topk_ids", "topk_weights", "router_logits", "token_ids"):
                entry[name] = torch.cat([p[name] for p in parts]) if name in parts[0] else None
            log.append(entry)
        return log

    _check_ffn_log(results, topology, expected)


def _routing_topk_run(connector: AFDConnector, ctx: RankContext) -> Any:
    return _routing_run(connector, ctx, "topk")


def _routing_topk_check(results: Results, topology: AFDTopology) -> None:
    _routing_check(results, topology, "topk")


def _routing_logits_run(connector: AFDConnector, ctx: RankContext) -> Any:
    return _routing_run(connector, ctx, "router_logits")


def _routing_logits_check(results: Results, topology: AFDTopology) -> None:
    _routing_check(results, topology, "router_logits")


def _routing_token_ids_run(connector: AFDConnector, ctx: RankContext) -> Any:
    return _routing_run(connector, ctx, "token_ids")


def _routing_token_ids_check(results: Results, topology: AFDTopology) -> None:
    _routing_check(results, topology, "token_ids")


# ---------------------------------------------------------------------------------
# scenario: fan-in concatenation / split back per attention rank
# ---------------------------------------------------------------------------------

_FANIN_LAYERS = 2
_FANIN_HIDDEN = 12


def _fanin_tokens(rank: int, layer: int) -> int:
    return (2 * rank + layer) % 4  # includes ranks that send 0 tokens


def _fanin_run(connector: AFDConnector, ctx: RankContext) -> Any:
    if ctx.role is AFDRole.FFN:
        return _serve(connector, ctx, _FANIN_LAYERS, keep_tensors=True)
    outs = []
    for layer in range(_FANIN_LAYERS):
        n = _fanin_tokens(ctx.rank, layer)
        hidden = make_hidden(ctx.rank, layer, 0, n, _FANIN_HIDDEN, torch.float32)
        connector.send_to_ffn(AttentionToFFN(hidden), layer_idx=layer)
        outs.append(connector.recv_from_ffn(layer_idx=layer).output)
    return outs


def _fanin_check(results: Results, topology: AFDTopology) -> None:
    for a in range(topology.num_attention_ranks):
        outs = _ok(results, ("attention", a))
        for layer in range(_FANIN_LAYERS):
            hidden = make_hidden(a, layer, 0, _fanin_tokens(a, layer), _FANIN_HIDDEN, torch.float32)
            _assert_tensor(
                f"attention rank {a} layer {layer} (its own rows)",
                outs[layer],
                ffn_function(hidden, layer),
            )

    def expected(f: int) -> list[dict[str, Any]]:
        peers = topology.attention_peers_of(f)
        if not peers:
            return []
        return [
            {
                "layer_idx": layer,
                "peer_ranks": peers,
                "token_counts": tuple(_fanin_tokens(a, layer) for a in peers),
                "hidden_states": torch.cat(
                    [
                        make_hidden(
                            a, layer, 0, _fanin_tokens(a, layer), _FANIN_HIDDEN, torch.float32
                        )
                        for a in peers
                    ]
                ),
            }
            for layer in range(_FANIN_LAYERS)
        ]

    _check_ffn_log(results, topology, expected)


# ---------------------------------------------------------------------------------
# scenario: shared_output round trip
# ---------------------------------------------------------------------------------


def _shared_run(connector: AFDConnector, ctx: RankContext) -> Any:
    if ctx.role is AFDRole.FFN:
        return _serve(connector, ctx, 1, shared=True)
    hidden = make_hidden(ctx.rank, 0, 0, ctx.rank + 2, 8, torch.float32)
    connector.send_to_ffn(AttentionToFFN(hidden), layer_idx=0)
    result = connector.recv_from_ffn(layer_idx=0)
    return {"kind": result.kind.name, "output": result.output, "shared": result.shared_output}


def _shared_check(results: Results, topology: AFDTopology) -> None:
    for a in range(topology.num_attention_ranks):
        got = _ok(results, ("attention", a))
        hidden = make_hidden(a, 0, 0, a + 2, 8, torch.float32)
        if got["kind"] != PayloadKind.OUTPUT_WITH_SHARED.name:
            raise AssertionError(
                f"attention rank {a}: expected OUTPUT_WITH_SHARED, got {got['kind']}"
            )
        _assert_tensor(f"attention rank {a} output", got["output"], ffn_function(hidden, 0))
        _assert_tensor(f"attention rank {a} shared_output", got["shared"], hidden + 1)
    for f in range(topology.num_ffn_ranks):
        _ok(results, ("ffn", f))


# ---------------------------------------------------------------------------------
# scenario: header mismatch is detected by the receiver
# ---------------------------------------------------------------------------------


def _mismatch_run(connector: AFDConnector, ctx: RankContext) -> Any:
    if ctx.role is AFDRole.FFN:
        return _serve(connector, ctx, 1)
    hidden = make_hidden(ctx.rank, 0, 0, 2, 8, torch.float32)
    connector.send_to_ffn(AttentionToFFN(hidden), layer_idx=0, micro_batch_idx=0)
    # Even ranks ask for the wrong layer, odd ranks for the wrong micro-batch.
    wrong = {"layer_idx": 1} if ctx.rank % 2 == 0 else {"layer_idx": 0, "micro_batch_idx": 1}
    try:
        connector.recv_from_ffn(**wrong, timeout_s=10.0)
    except AFDTransferMismatchError as exc:
        return {"error": exc}
    return {"error": None}


def _mismatch_check(results: Results, topology: AFDTopology) -> None:
    for a in range(topology.num_attention_ranks):
        got = _ok(results, ("attention", a))
        if not isinstance(got["error"], AFDTransferMismatchError):
            what = "layer" if a % 2 == 0 else "micro-batch"
            raise AssertionError(
                f"attention rank {a}: recv_from_ffn for the wrong {what} did not raise "
                "AFDTransferMismatchError"
            )
    for f in range(topology.num_ffn_ranks):
        _ok(results, ("ffn", f))


# ---------------------------------------------------------------------------------
# scenario: receive timeout
# ---------------------------------------------------------------------------------

_TIMEOUT_S = 0.5
_TIMEOUT_HOLD_S = 1.0


def _timed(fn: Callable[[], Any]) -> dict[str, Any]:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return {"error": exc, "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start}


def _timeout_run(connector: AFDConnector, ctx: RankContext, receiver: AFDRole) -> Any:
    # Only one role receives; the other stays open and silent for longer than the
    # timeout. (Both timing out at once would race: a transport may tear the link
    # down on a timeout, and the other side would then see a legitimate peer loss.)
    if ctx.is_idle:
        return None
    if ctx.role is not receiver:
        time.sleep(_TIMEOUT_S + _TIMEOUT_HOLD_S)
        return None
    if ctx.role is AFDRole.FFN:
        # An explicit timeout_s bounds the FFN's wait (without one it waits for the next
        # step as long as the peers live: see the ffn_idle_wait scenario).
        return _timed(lambda: connector.recv_from_attention(timeout_s=_TIMEOUT_S))
    return _timed(lambda: connector.recv_from_ffn(layer_idx=0))


def _timeout_check(results: Results, topology: AFDTopology, receiver: AFDRole) -> None:
    for rank in range(topology.size_of(receiver)):
        key = (receiver.value, rank)
        if receiver is AFDRole.FFN and rank in topology.idle_ffn_ranks:
            continue
        got = _ok(results, key)
        if not isinstance(got["error"], AFDTimeoutError):
            raise AssertionError(
                f"{key[0]} rank {key[1]}: expected AFDTimeoutError after "
                f"transfer_timeout_s={_TIMEOUT_S}, got {got['error']!r}"
            )
        if not 0.8 * _TIMEOUT_S <= got["elapsed"] <= _TIMEOUT_S + 2.5:
            raise AssertionError(
                f"{key[0]} rank {key[1]}: timed out after {got['elapsed']:.2f} s, expected "
                f"about {_TIMEOUT_S} s"
            )
    other = AFDRole.FFN if receiver is AFDRole.ATTENTION else AFDRole.ATTENTION
    for rank in range(topology.size_of(other)):
        _ok(results, (other.value, rank))


def _timeout_attention_run(connector: AFDConnector, ctx: RankContext) -> Any:
    return _timeout_run(connector, ctx, AFDRole.ATTENTION)


def _timeout_attention_check(results: Results, topology: AFDTopology) -> None:
    _timeout_check(results, topology, AFDRole.ATTENTION)


def _timeout_ffn_run(connector: AFDConnector, ctx: RankContext) -> Any:
    return _timeout_run(connector, ctx, AFDRole.FFN)


def _timeout_ffn_check(results: Results, topology: AFDTopology) -> None:
    _timeout_check(results, topology, AFDRole.FFN)


# ---------------------------------------------------------------------------------
# scenario: the FFN side waits for the next step without a deadline
# ---------------------------------------------------------------------------------

_IDLE_S = 4 * _TIMEOUT_S


def _idle_run(connector: AFDConnector, ctx: RankContext) -> Any:
    # transfer_timeout_s is _TIMEOUT_S; the attention side stays silent for several times
    # that before its first layer. Waiting for the next step is not a transfer.
    if ctx.role is AFDRole.FFN:
        start = time.monotonic()
        seen = _serve(connector, ctx, 1, keep_tensors=True)
        return {"seen": seen, "elapsed": time.monotonic() - start}
    time.sleep(_IDLE_S)
    hidden = make_hidden(ctx.rank, 3, 0, 2 + ctx.rank, 8, torch.float32)
    connector.send_to_ffn(AttentionToFFN(hidden), layer_idx=3)
    return connector.recv_from_ffn(layer_idx=3).output


def _idle_check(results: Results, topology: AFDTopology) -> None:
    for a in range(topology.num_attention_ranks):
        want = ffn_function(make_hidden(a, 3, 0, 2 + a, 8, torch.float32), 3)
        _assert_tensor(
            f"attention rank {a} after an idle wait", _ok(results, ("attention", a)), want
        )
    for f in range(topology.num_ffn_ranks):
        if f in topology.idle_ffn_ranks:
            continue
        got = _ok(results, ("ffn", f))
        if len(got["seen"]) != 1 or got["elapsed"] < 0.9 * _IDLE_S:
            raise AssertionError(
                f"ffn rank {f}: expected one batch after waiting about {_IDLE_S} s, got "
                f"{len(got['seen'])} after {got['elapsed']:.2f} s"
            )


# ---------------------------------------------------------------------------------
# scenario: once a step started (one peer's message arrived), the rest is bounded
# ---------------------------------------------------------------------------------


def _first_peer_of_fan_in(ctx: RankContext) -> bool | None:
    """For an attention rank: True if it is the first of >= 2 peers of its FFN rank, False
    if it is a later one, None if its FFN rank serves it alone."""
    peers = ctx.topology.attention_peers_of(ctx.topology.ffn_peer_of(ctx.rank))
    if len(peers) < 2:
        return None
    return peers[0] == ctx.rank


def _started_run(connector: AFDConnector, ctx: RankContext) -> Any:
    if ctx.role is AFDRole.FFN:
        if ctx.is_idle:
            return None
        if len(ctx.peers) < 2:
            return {"served": _serve(connector, ctx, 1), "error": None}
        return _timed(lambda: connector.recv_from_attention())
    role = _first_peer_of_fan_in(ctx)
    if role is False:  # a later peer stays silent past the timeout: the step is stuck
        time.sleep(_TIMEOUT_S + _TIMEOUT_HOLD_S)
        return None
    hidden = make_hidden(ctx.rank, 0, 0, 2, 8, torch.float32)
    connector.send_to_ffn(AttentionToFFN(hidden), layer_idx=0)
    if role is None:
        return connector.recv_from_ffn(layer_idx=0).output
    time.sleep(_TIMEOUT_S + _TIMEOUT_HOLD_S)  # no answer will come
    return None


def _started_check(results: Results, topology: AFDTopology) -> None:
    for f in range(topology.num_ffn_ranks):
        if f in topology.idle_ffn_ranks:
            continue
        got = _ok(results, ("ffn", f))
        if len(topology.attention_peers_of(f)) < 2:
            continue
        if not isinstance(got["error"], AFDTimeoutError):
            raise AssertionError(
                f"ffn rank {f}: one peer sent, another stayed silent; expected "
                f"AFDTimeoutError after transfer_timeout_s={_TIMEOUT_S}, got {got['error']!r}"
            )
        if got["elapsed"] > _TIMEOUT_S + 2.5:
            raise AssertionError(
                f"ffn rank {f}: the started step timed out only after {got['elapsed']:.2f} s"
            )


def _has_fan_in(topology: AFDTopology) -> bool:
    return any(len(topology.attention_peers_of(f)) >= 2 for f in range(topology.num_ffn_ranks))


# ---------------------------------------------------------------------------------
# scenario: close() from another thread unblocks a pending receive
# ---------------------------------------------------------------------------------

_CLOSE_AFTER_S = 0.3
_CLOSE_BOUND_S = 2.0


def _close_run(connector: AFDConnector, ctx: RankContext) -> Any:
    if ctx.is_idle:
        return None
    timer = threading.Timer(_CLOSE_AFTER_S, connector.close)
    timer.daemon = True
    timer.start()
    try:
        if ctx.role is AFDRole.FFN:
            return _timed(lambda: connector.recv_from_attention(timeout_s=30.0))
        return _timed(lambda: connector.recv_from_ffn(layer_idx=0, timeout_s=30.0))
    finally:
        timer.join()


def _close_check(results: Results, topology: AFDTopology) -> None:
    for key in sorted(expected_result_keys(topology)):
        if key[0] == "ffn" and key[1] in topology.idle_ffn_ranks:
            continue
        got = _ok(results, key)
        if not isinstance(got["error"], AFDConnectorClosedError | AFDPeerLostError):
            raise AssertionError(
                f"{key[0]} rank {key[1]}: a receive pending during close() must raise "
                f"AFDConnectorClosedError (or AFDPeerLostError), got {got['error']!r}"
            )
        if got["elapsed"] > _CLOSE_AFTER_S + _CLOSE_BOUND_S:
            raise AssertionError(
                f"{key[0]} rank {key[1]}: close() unblocked the receive only after "
                f"{got['elapsed']:.2f} s (bound {_CLOSE_BOUND_S} s)"
            )


# ---------------------------------------------------------------------------------
# scenarios: low-precision transfer dtypes (afd.transfer_dtype / transfer_dtype_return)
# ---------------------------------------------------------------------------------

# One case per layer: (hidden size, tokens(rank) rule). 40 is not a multiple of the MX
# block (a last, shorter block); "uneven_with_zero" gives some ranks empty messages.
_TRANSFER_CASES: tuple[tuple[int, str], ...] = (
    (40, "uneven"),
    (64, "uneven_with_zero"),
    (16, "one"),
)


def _round_trip(x: torch.Tensor, name: str) -> torch.Tensor:
    """What a receiver gets for ``x`` sent in transfer dtype ``name`` (``model``: ``x``)."""
    from afd_core.quantize import dequantize, quantize, transfer_format

    fmt = transfer_format(name)
    if not fmt.quantized:
        return x
    elements, scales = quantize(x, fmt)
    return dequantize(elements, scales, fmt, x.dtype)


def _transfer_hidden(rank: int, layer: int) -> torch.Tensor:
    hidden_size, rule = _TRANSFER_CASES[layer]
    n = _shape_tokens(rule, rank)
    # Rows of very different magnitudes: a per-tensor scale would lose the small ones.
    scale = torch.logspace(-2, 2, max(n, 1))[:n, None]
    return (make_hidden(rank, layer, 0, n, hidden_size, torch.float32) * scale).to(torch.bfloat16)


def _transfer_run(connector: AFDConnector, ctx: RankContext) -> Any:
    if ctx.role is AFDRole.FFN:
        return _serve(connector, ctx, len(_TRANSFER_CASES), keep_tensors=True)
    outs = []
    for layer in range(len(_TRANSFER_CASES)):
        hidden = _transfer_hidden(ctx.rank, layer)
        payload = AttentionToFFN(hidden, **_routing(ctx.rank, layer, hidden.shape[0], "topk"))
        connector.send_to_ffn(payload, layer_idx=layer)
        outs.append(connector.recv_from_ffn(layer_idx=layer).output)
    return outs


def _transfer_check(results: Results, topology: AFDTopology, *, to_ffn: str, back: str) -> None:
    """The FFN side receives exactly the dequantized hidden states (model dtype, routing
    untouched) and each attention rank exactly the dequantized answer to them: a transport
    that drops, reorders or truncates the elements or their scales changes the values."""
    for a in range(topology.num_attention_ranks):
        outs = _ok(results, ("attention", a))
        for layer in range(len(_TRANSFER_CASES)):
            received = _round_trip(_transfer_hidden(a, layer), to_ffn)
            want = _round_trip(ffn_function(received, layer), back)
            _assert_tensor(f"attention rank {a} layer {layer} ({to_ffn}/{back})", outs[layer], want)

    def expected(f: int) -> list[dict[str, Any]]:
        peers = topology.attention_peers_of(f)
        if not peers:
            return []
        log = []
        for layer, (hidden_size, _) in enumerate(_TRANSFER_CASES):
            hidden = [_transfer_hidden(a, layer) for a in peers]
            routing = [
                _routing(a, layer, h.shape[0], "topk") for a, h in zip(peers, hidden, strict=True)
            ]
            log.append(
                {
                    "layer_idx": layer,
                    "dtype": "bfloat16",
                    "hidden_size": hidden_size,
                    "kind": PayloadKind.HIDDEN_TOPK.name,
                    "token_counts": tuple(h.shape[0] for h in hidden),
                    "hidden_states": torch.cat([_round_trip(h, to_ffn) for h in hidden]),
                    "topk_ids": torch.cat([r["topk_ids"] for r in routing]),
                    "topk_weights": torch.cat([r["topk_weights"] for r in routing]),
                }
            )
        return log

    _check_ffn_log(results, topology, expected)


def _transfer_scenario(to_ffn: str, back: str) -> Scenario:
    name = f"transfer_{to_ffn}" if to_ffn == back else f"transfer_{to_ffn}_return_{back}"
    return Scenario(
        name,
        _transfer_run,
        functools.partial(_transfer_check, to_ffn=to_ffn, back=back),
        MappingProxyType(
            {
                "compute_gate_on_attention": True,
                "routing_payload": "topk",
                "transfer_dtype": to_ffn,
                "transfer_dtype_return": back,
            }
        ),
    )


#: One scenario per quantized transfer dtype both ways, and one with each direction in
#: its own setting (mxfp8 to the FFN, answers in the model dtype).
TRANSFER_SCENARIOS: tuple[Scenario, ...] = (
    _transfer_scenario("fp8", "fp8"),
    _transfer_scenario("mxfp8", "mxfp8"),
    _transfer_scenario("int8", "int8"),
    _transfer_scenario("mxfp8", "model"),
)

# ---------------------------------------------------------------------------------

SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "message_ordering",
        _ordering_run,
        _ordering_check,
        MappingProxyType({"num_micro_batches": _ORDER_MBS}),
    ),
    Scenario("shapes_and_dtypes", _shapes_run, _shapes_check),
    Scenario(
        "routing_topk",
        _routing_topk_run,
        _routing_topk_check,
        MappingProxyType({"compute_gate_on_attention": True, "routing_payload": "topk"}),
    ),
    Scenario(
        "routing_router_logits",
        _routing_logits_run,
        _routing_logits_check,
        MappingProxyType({"compute_gate_on_attention": True, "routing_payload": "router_logits"}),
    ),
    Scenario("routing_token_ids", _routing_token_ids_run, _routing_token_ids_check),
    Scenario("fan_in_split", _fanin_run, _fanin_check),
    Scenario("shared_output", _shared_run, _shared_check),
    Scenario(
        "header_mismatch",
        _mismatch_run,
        _mismatch_check,
        MappingProxyType({"num_micro_batches": 2}),
    ),
    Scenario(
        "receive_timeout_attention",
        _timeout_attention_run,
        _timeout_attention_check,
        MappingProxyType({"transfer_timeout_s": _TIMEOUT_S}),
    ),
    Scenario(
        "receive_timeout_ffn",
        _timeout_ffn_run,
        _timeout_ffn_check,
        MappingProxyType({"transfer_timeout_s": _TIMEOUT_S}),
    ),
    Scenario(
        "ffn_idle_wait",
        _idle_run,
        _idle_check,
        MappingProxyType({"transfer_timeout_s": _TIMEOUT_S}),
    ),
    Scenario(
        "started_step_is_bounded",
        _started_run,
        _started_check,
        MappingProxyType({"transfer_timeout_s": _TIMEOUT_S}),
        requires=_has_fan_in,
    ),
    Scenario("close_unblocks_receive", _close_run, _close_check),
    *TRANSFER_SCENARIOS,
)

TOPOLOGIES: tuple[AFDTopology, ...] = (
    AFDTopology(1, 1),
    AFDTopology(2, 1),
    AFDTopology(3, 2),
    AFDTopology(1, 2),
)


def run_scenario(harness: ConnectorHarness, scenario: Scenario, topology: AFDTopology) -> None:
    """Run ``scenario`` through ``harness`` and check it (pytest-skips unsupported topologies)."""
    import pytest

    if not scenario.supports(topology):
        pytest.skip(f"scenario {scenario.name} does not apply to topology {topology.label}")
    results = harness.run(scenario, topology)
    missing = expected_result_keys(topology) - set(results)
    if missing:
        raise AssertionError(f"{scenario.name}: harness returned no result for {sorted(missing)}")
    for f in topology.idle_ffn_ranks:
        value = results[("ffn", f)]
        if isinstance(value, BaseException):
            raise AssertionError(
                f"{scenario.name}: idle ffn rank {f} must only init/close, but raised {value!r}"
            ) from value
    scenario.check(results, topology)


def conformance_cases() -> list[Any]:
    """``pytest.param(scenario, topology)`` for every pair, with ids like ``fan_in_split-3A2F``."""
    import pytest

    return [pytest.param(s, t, id=f"{s.name}-{t.label}") for s in SCENARIOS for t in TOPOLOGIES]
