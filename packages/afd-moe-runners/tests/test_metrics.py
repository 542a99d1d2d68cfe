"""AFD exchange metrics: what one layer exchange records on each role, and when the
Attention role records nothing at all."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from afd_moe_runners import metrics as afd_metrics

pytestmark = pytest.mark.vllm


def _sample(registry: Any, name: str) -> float | None:
    value = registry.get_sample_value(name, {"rank": "0"})
    return None if value is None else float(value)


@pytest.fixture
def attention_registry(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Rank 0's Attention metrics on a private registry, for this test only."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    monkeypatch.setitem(
        afd_metrics._attention, 0, afd_metrics.AttentionMetrics(0, registry=registry)
    )
    return registry


def test_attention_metrics_are_off_without_a_multiprocess_dir(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(afd_metrics.MULTIPROC_DIR_ENV, raising=False)
    monkeypatch.setattr(afd_metrics, "_attention", {})
    assert afd_metrics.attention_metrics(3) is None
    afd_metrics.attention_step_ended(3)  # no-op, no error
    assert afd_metrics._attention == {3: None}  # decided once per rank


def test_one_exchange_records_latency_bytes_and_the_step_wait(
    moe_env: Any, attention_registry: Any
) -> None:
    import torch

    from afd_moe_runners import FFNLayerCompute, RemoteDenseMLP

    compute = FFNLayerCompute({0: torch.nn.Identity()}, vllm_config=moe_env.vllm_config)
    x = torch.randn(5, 64)
    out = moe_env.split_forward(RemoteDenseMLP(0), compute, x)
    assert torch.equal(out, x)
    reg = attention_registry
    assert _sample(reg, "afd_exchange_latency_seconds_count") == 1
    assert 0 < _sample(reg, "afd_exchange_latency_seconds_sum") < 60  # type: ignore[operator]
    # Bytes and the step's wait are written once the step is over.
    assert _sample(reg, "afd_attention_sent_bytes_total") == 0
    assert _sample(reg, "afd_attention_ffn_wait_seconds_count") == 0
    afd_metrics.attention_step_ended(0)
    assert _sample(reg, "afd_attention_sent_bytes_total") == x.nbytes
    assert _sample(reg, "afd_attention_received_bytes_total") == x.nbytes
    assert _sample(reg, "afd_attention_ffn_wait_seconds_count") == 1
    wait = _sample(reg, "afd_attention_ffn_wait_seconds_sum")
    latency = _sample(reg, "afd_exchange_latency_seconds_sum")
    assert wait is not None and latency is not None and 0 < wait <= latency
    afd_metrics.attention_step_ended(0)  # a step without AFD layers is not observed
    assert _sample(reg, "afd_attention_ffn_wait_seconds_count") == 1


def test_only_the_rows_sent_are_counted(moe_env: Any, attention_registry: Any) -> None:
    import torch

    from afd_moe_runners import FFNLayerCompute, RemoteDenseMLP

    compute = FFNLayerCompute({0: torch.nn.Identity()}, vllm_config=moe_env.vllm_config)
    x = torch.randn(8, 64)
    moe_env.split_forward(RemoteDenseMLP(0), compute, x, num_tokens=3)  # 5 padding rows
    afd_metrics.attention_step_ended(0)
    sent = _sample(attention_registry, "afd_attention_sent_bytes_total")
    assert sent == x[:3].nbytes


def test_families_belong_to_their_registry_and_go_with_it() -> None:
    """A registry made after another one was dropped gets its own metric families (an
    id()-keyed cache once handed it the dead registry's, so its samples were missing)."""
    import gc

    from prometheus_client import CollectorRegistry

    before = len(afd_metrics._registered)
    for _ in range(3):
        registry = CollectorRegistry()
        afd_metrics.AttentionMetrics(0, registry=registry).peers.set(2)
        assert _sample(registry, "afd_attention_peers_connected") == 2
        assert len(afd_metrics._registered) == before + 1
        del registry
        gc.collect()
        assert len(afd_metrics._registered) == before


def test_peers_gauge_follows_the_connector(attention_registry: Any) -> None:
    from afd_core.topology import AFDTopology

    class Connector:
        topology = AFDTopology(num_attention_ranks=2, num_ffn_ranks=1)

    afd_metrics.attention_peers_changed(Connector(), 0, connected=True)
    assert _sample(attention_registry, "afd_attention_peers_connected") == 1
    afd_metrics.attention_peers_changed(Connector(), 0, connected=False)
    assert _sample(attention_registry, "afd_attention_peers_connected") == 0


def test_the_ffn_side_counts_layers_tokens_compute_and_bytes(moe_env: Any) -> None:
    import torch
    from prometheus_client import CollectorRegistry

    from afd_core.transfer import AttentionToFFN
    from afd_moe_runners import FFNLayerCompute

    registry = CollectorRegistry()
    metrics = afd_metrics.FFNMetrics(0, registry=registry)
    compute = FFNLayerCompute({0: torch.nn.Identity()}, vllm_config=moe_env.vllm_config)
    attention, ffn = moe_env.connector_pair()
    received: list[Any] = []
    try:
        for tokens in (4, 2):
            x = torch.randn(tokens, 64)

            def ask(x: Any = x) -> None:
                attention.send_to_ffn(AttentionToFFN(x), layer_idx=0)
                received.append(attention.recv_from_ffn(layer_idx=0).output)

            asker = threading.Thread(target=ask, daemon=True)
            asker.start()
            compute.serve_one(ffn, timeout_s=60, metrics=metrics)
            asker.join(60)
    finally:
        attention.close()
        ffn.close()
    assert [tuple(r.shape) for r in received] == [(4, 64), (2, 64)]
    assert _sample(registry, "afd_ffn_layers_served_total") == 2
    assert _sample(registry, "afd_ffn_tokens_served_total") == 6
    assert _sample(registry, "afd_ffn_compute_seconds_count") == 2
    assert _sample(registry, "afd_ffn_received_bytes_total") == 6 * 64 * 4
    assert _sample(registry, "afd_ffn_sent_bytes_total") == 6 * 64 * 4


def test_families_are_registered_once_per_registry() -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    first = afd_metrics.FFNMetrics(0, registry=registry)
    second = afd_metrics.FFNMetrics(1, registry=registry)  # no "Duplicated timeseries"
    first.layers.inc()
    second.layers.inc(2)
    assert registry.get_sample_value("afd_ffn_layers_served_total", {"rank": "1"}) == 2


def _mb_sample(registry: Any, micro_batch: int) -> float | None:
    value = registry.get_sample_value(
        "afd_attention_exchanges_total", {"rank": "0", "micro_batch": str(micro_batch)}
    )
    return None if value is None else float(value)


def test_steps_and_exchanges_per_micro_batch_are_written_at_the_step_end(
    moe_env: Any, attention_registry: Any
) -> None:
    """Each exchange counts for the micro-batch of its step metadata; the step counter
    and the exchange counters move together when the step ends."""
    import torch

    from afd_moe_runners import FFNLayerCompute, RemoteDenseMLP

    reg = attention_registry
    compute = FFNLayerCompute({0: torch.nn.Identity()}, vllm_config=moe_env.vllm_config)
    x = torch.randn(4, 64)
    assert _sample(reg, "afd_attention_steps_total") == 0
    for mb in (0, 1, 1):
        moe_env.split_forward(
            RemoteDenseMLP(0), compute, x, micro_batch_idx=mb, num_micro_batches=2
        )
    assert (_mb_sample(reg, 0), _mb_sample(reg, 1)) == (None, None)  # not before the end
    afd_metrics.attention_step_ended(0)
    assert _sample(reg, "afd_attention_steps_total") == 1
    assert (_mb_sample(reg, 0), _mb_sample(reg, 1)) == (1, 2)
    afd_metrics.attention_step_ended(0)  # a step without AFD layers is still a step
    assert _sample(reg, "afd_attention_steps_total") == 2
    assert (_mb_sample(reg, 0), _mb_sample(reg, 1)) == (1, 2)
    # Eager exchanges never reach the compiled op. The counter takes the op's
    # process-wide call count (one attention rank per process), so what compiled tests
    # of this pytest process ran before counts in it; the eager steps here add nothing.
    from afd_moe_runners.exchange_op import compiled_calls

    assert (_sample(reg, "afd_attention_compiled_exchanges_total") or 0) == compiled_calls()
    afd_metrics.attention_step_ended(0)
    assert (_sample(reg, "afd_attention_compiled_exchanges_total") or 0) == compiled_calls()


def test_exchanges_outside_a_forward_count_as_micro_batch_0(attention_registry: Any) -> None:
    import torch

    from afd_core.transfer import FFNToAttention

    metrics = afd_metrics.attention_metrics(0)
    assert metrics is not None
    metrics.received(FFNToAttention(torch.zeros(2, 4)), started_ns=1, wait_ns=1, end_ns=2)
    metrics.end_step()
    assert _mb_sample(attention_registry, 0) == 1


def test_compiled_exchanges_are_the_op_calls_of_each_step(
    monkeypatch: pytest.MonkeyPatch, attention_registry: Any
) -> None:
    """The compiled-exchange counter adds, at each step's end, the op calls since the
    previous step's end (the op counts its calls in the process)."""
    from afd_moe_runners import exchange_op

    metrics = afd_metrics.attention_metrics(0)
    assert metrics is not None
    monkeypatch.setattr(exchange_op, "_CALLS", [exchange_op.compiled_calls()])
    metrics._op_calls_seen = exchange_op.compiled_calls()
    for calls in (3, 0, 5):
        exchange_op._CALLS[0] += calls
        metrics.end_step()
    assert _sample(attention_registry, "afd_attention_compiled_exchanges_total") == 8
    assert _sample(attention_registry, "afd_attention_steps_total") == 3


def test_the_compiled_op_counts_one_call_per_exchange(moe_env: Any) -> None:
    """What the compiled counter reads: the op's process-wide call count grows by one per
    exchange it runs (a compiled graph calls it once per AFD layer)."""
    import torch

    from afd_moe_runners import exchange_op

    class Layer(torch.nn.Module):
        def afd_exchange(self, hidden: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
            return hidden * 2

    layer = Layer()
    exchange_op.register_layer("test_metrics.layer", layer)
    before = exchange_op.compiled_calls()
    x = torch.ones(3, 4)
    out = torch.empty_like(x)
    for _ in range(2):
        torch.ops.afd.exchange(x, None, out, "test_metrics.layer")
    assert exchange_op.compiled_calls() == before + 2
    assert torch.equal(out, x * 2)
