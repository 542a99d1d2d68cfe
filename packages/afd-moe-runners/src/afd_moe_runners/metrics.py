"""Prometheus metrics of the AFD exchange, for both roles.

The exchange runs in vLLM's worker processes, never in the process that serves
``/metrics`` (vLLM's API server for the Attention role, the FFN server's main process for
the FFN role). So the metrics use prometheus_client's multiprocess mode: every process
writes its values to memory-mapped files in ``PROMETHEUS_MULTIPROC_DIR`` and the serving
process aggregates them (vLLM's ``/metrics`` already does when the variable is set).
``afd serve`` sets the variable for both roles (a fresh folder per server, removed when
it stops).

Attention role: on only when ``PROMETHEUS_MULTIPROC_DIR`` is set, because without it
nothing could serve them; off, nothing here is imported and the exchange pays one dict
lookup per layer. FFN role: always on (the FFN server serves its own ``/metrics``).

Metric names (label ``rank``: the AFD rank of the process):

attention role
    ``afd_exchange_latency_seconds`` (histogram, one observation per layer and
    micro-batch: from the start of ``send_to_ffn`` to the end of ``recv_from_ffn``),
    ``afd_attention_sent_bytes_total`` / ``afd_attention_received_bytes_total``
    (payload bytes, added once per step), ``afd_attention_ffn_wait_seconds``
    (histogram, one observation per forward step with AFD layers: the time spent in
    ``recv_from_ffn``, summed over its layers and micro-batches),
    ``afd_attention_peers_connected`` (gauge: FFN peers of this rank's connector, 0 once
    closed), ``afd_attention_steps_total`` (forward steps of the AFD model: every step
    vLLM runs once the connector is up, its start-up dummy runs and an idle
    data-parallel rank's dummy steps included), ``afd_attention_exchanges_total``
    (label ``micro_batch`` too: layer exchanges of each micro-batch index, shadow
    micro-batches included), ``afd_attention_compiled_exchanges_total`` (exchanges a
    compiled graph ran through the ``afd::exchange`` op; shadow micro-batches never
    do). The three counters are written at the end of each step (one after another),
    so once a step has ended a scrape sees, per rank: with m micro-batches and several
    attention ranks, every micro-batch index counts steps x AFD layers (every step runs
    m micro-batches, real or shadow); compiled, with one micro-batch, the compiled
    exchanges count as many.
FFN role
    ``afd_ffn_layers_served_total``, ``afd_ffn_tokens_served_total``,
    ``afd_ffn_compute_seconds`` (histogram, one observation per layer message: the FFN
    block's computation), ``afd_ffn_received_bytes_total`` / ``afd_ffn_sent_bytes_total``
    (payload bytes), ``afd_ffn_peers_connected`` (gauge: attention peers of this rank,
    0 before they connected and once they are gone).

Nothing here imports torch at import time; prometheus_client is imported when a metrics
object is made, and the Attention role's also reads the exchange op's call count
(:func:`afd_moe_runners.exchange_op.compiled_calls`: one attention rank per process, as
vLLM runs them) and vLLM's forward context (the current micro-batch).

Over 400 lines on purpose: the catalogue above is the one reference for both roles'
metric names and labels, and it sits with the two classes that write them (they share
the buckets, the multiprocess set-up and the per-registry family cache).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

__all__ = [
    "LATENCY_BUCKETS",
    "MULTIPROC_DIR_ENV",
    "AttentionMetrics",
    "FFNMetrics",
    "attention_metrics",
    "ffn_metrics",
    "payload_bytes",
    "result_bytes",
]

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

LATENCY_BUCKETS = (
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    100e-3,
    250e-3,
    1.0,
    5.0,
)
"""Seconds: a layer exchange takes tens of microseconds (shared memory, NCCL) to tens of
milliseconds (gloo, big batches); a step's FFN wait adds up to seconds at worst."""

_PAYLOAD_FIELDS = ("hidden_states", "topk_ids", "topk_weights", "router_logits", "token_ids")

_lock = threading.Lock()
_attention: dict[int, AttentionMetrics | None] = {}
_ffn: dict[int, FFNMetrics] = {}


def _nbytes(t: Any) -> int:
    return 0 if t is None else int(t.numel()) * int(t.element_size())


def payload_bytes(payload: Any) -> int:
    """Bytes of the tensors of an ``AttentionToFFN`` payload."""
    return sum(_nbytes(getattr(payload, name)) for name in _PAYLOAD_FIELDS)


def result_bytes(result: Any) -> int:
    """Bytes of the tensors of an ``FFNToAttention`` result."""
    return _nbytes(result.output) + _nbytes(result.shared_output)


# Metric families per registry and role: a name can be registered once per registry,
# while a process may hold several ranks' label sets (tests; one rank per process else).
# Keyed by the registry object itself, weakly: an id() could be reused by a new registry
# once the old one is gone, which would hand it families registered elsewhere.
_registered: weakref.WeakKeyDictionary[Any, dict[str, dict[str, Any]]] = weakref.WeakKeyDictionary()
_families_lock = threading.Lock()


def _families(registry: Any, role: str, build: Any) -> dict[str, Any]:
    from prometheus_client import REGISTRY

    reg = REGISTRY if registry is None else registry
    with _families_lock:
        by_role = _registered.setdefault(reg, {})
        if role not in by_role:
            by_role[role] = build(reg)
        return by_role[role]


def _attention_families(reg: Any) -> dict[str, Any]:
    from prometheus_client import Counter, Gauge, Histogram

    return {
        "latency": Histogram(
            "afd_exchange_latency_seconds",
            "AFD layer round trip on the Attention role: send_to_ffn start to "
            "recv_from_ffn end, per layer and micro-batch",
            ["rank"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        ),
        "sent_bytes": Counter(
            "afd_attention_sent_bytes",
            "Payload bytes the Attention role sent to the FFN role",
            ["rank"],
            registry=reg,
        ),
        "received_bytes": Counter(
            "afd_attention_received_bytes",
            "Payload bytes the Attention role received from the FFN role",
            ["rank"],
            registry=reg,
        ),
        "step_wait": Histogram(
            "afd_attention_ffn_wait_seconds",
            "Time one forward step of the Attention role spent waiting in recv_from_ffn, "
            "summed over its AFD layers and micro-batches",
            ["rank"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        ),
        "peers": Gauge(
            "afd_attention_peers_connected",
            "FFN peers of this Attention rank's AFD connector (0 once it is closed)",
            ["rank"],
            multiprocess_mode="livesum",
            registry=reg,
        ),
        "steps": Counter(
            "afd_attention_steps",
            "Forward steps the AFD model of this Attention rank ran (profile, warm-up and "
            "dummy steps included)",
            ["rank"],
            registry=reg,
        ),
        "exchanges": Counter(
            "afd_attention_exchanges",
            "Layer exchanges with the FFN role (send and receive) per micro-batch index, "
            "shadow micro-batches included",
            ["rank", "micro_batch"],
            registry=reg,
        ),
        "compiled": Counter(
            "afd_attention_compiled_exchanges",
            "Layer exchanges a compiled graph ran through the afd::exchange custom op",
            ["rank"],
            registry=reg,
        ),
    }


def _ffn_families(reg: Any) -> dict[str, Any]:
    from prometheus_client import Counter, Gauge, Histogram

    return {
        "layers": Counter(
            "afd_ffn_layers_served",
            "Layer messages the FFN role served (one per layer and micro-batch of a step)",
            ["rank"],
            registry=reg,
        ),
        "tokens": Counter(
            "afd_ffn_tokens_served",
            "Tokens in the layer messages the FFN role served (all attention peers)",
            ["rank"],
            registry=reg,
        ),
        "compute": Histogram(
            "afd_ffn_compute_seconds",
            "FFN block computation per layer message",
            ["rank"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        ),
        "received_bytes": Counter(
            "afd_ffn_received_bytes",
            "Payload bytes the FFN role received from its attention peers",
            ["rank"],
            registry=reg,
        ),
        "sent_bytes": Counter(
            "afd_ffn_sent_bytes",
            "Payload bytes the FFN role sent back to its attention peers",
            ["rank"],
            registry=reg,
        ),
        "peers": Gauge(
            "afd_ffn_peers_connected",
            "Attention peers connected to this FFN rank (0 before they connected and "
            "once they are gone)",
            ["rank"],
            multiprocess_mode="livesum",
            registry=reg,
        ),
    }


class AttentionMetrics:
    """The Attention role's AFD metrics of one rank (see the module docstring).

    ``registry``: where to register (default: prometheus_client's global registry, which
    in multiprocess mode only names the metrics; the values go to the mmap files).
    """

    def __init__(self, rank: int, *, registry: Any = None) -> None:
        from afd_moe_runners.exchange_op import compiled_calls

        labels = {"rank": str(rank)}
        families = _families(registry, "attention", _attention_families)
        self.latency = families["latency"].labels(**labels)
        self.sent_bytes = families["sent_bytes"].labels(**labels)
        self.received_bytes = families["received_bytes"].labels(**labels)
        self.step_wait = families["step_wait"].labels(**labels)
        self.peers = families["peers"].labels(**labels)
        self.steps = families["steps"].labels(**labels)
        self.compiled = families["compiled"].labels(**labels)
        self._exchanges_family = families["exchanges"]
        self._rank_label = str(rank)
        self._exchanges: list[Any] = []  # micro-batch index -> its labelled counter
        self._micro_batch = _current_micro_batch_reader()
        self._op_calls = compiled_calls
        self._op_calls_seen = 0
        # Per-step sums, written to the (lock-protected, memory-mapped) metrics once per
        # step: a multiprocess counter increment costs ~1 us, a layer exchange tens.
        self._step_lock = threading.Lock()
        self._step_wait_ns = 0
        self._step_exchanges = 0
        self._step_sent = 0
        self._step_received = 0
        self._step_per_micro_batch = [0, 0]  # grown when a step has more micro-batches

    def exchanges(self, micro_batch: int) -> Any:
        """``afd_attention_exchanges_total`` of this rank and ``micro_batch``."""
        while len(self._exchanges) <= micro_batch:
            self._exchanges.append(
                self._exchanges_family.labels(
                    rank=self._rank_label, micro_batch=str(len(self._exchanges))
                )
            )
        return self._exchanges[micro_batch]

    def sent(self, payload: Any) -> None:
        size = payload_bytes(payload)
        with self._step_lock:
            self._step_sent += size

    def received(self, result: Any, *, started_ns: int, wait_ns: int, end_ns: int) -> None:
        """One exchange ended at ``end_ns``; it started (send) at ``started_ns`` and
        waited ``wait_ns`` in the receive."""
        self.latency.observe((end_ns - started_ns) / 1e9)
        size = result_bytes(result)
        micro_batch = self._micro_batch()
        with self._step_lock:
            self._step_wait_ns += wait_ns
            self._step_exchanges += 1
            self._step_received += size
            per = self._step_per_micro_batch
            if micro_batch >= len(per):
                per.extend([0] * (micro_batch + 1 - len(per)))
            per[micro_batch] += 1

    def end_step(self) -> None:
        """A forward step ended: count it, add its exchanges (per micro-batch, and those
        the compiled op ran) and bytes to the counters and observe its FFN wait (a step
        without AFD layers is not observed)."""
        with self._step_lock:
            exchanges, wait_ns = self._step_exchanges, self._step_wait_ns
            sent, received = self._step_sent, self._step_received
            self._step_exchanges = self._step_wait_ns = self._step_sent = 0
            self._step_received = 0
            per = self._step_per_micro_batch
            self._step_per_micro_batch = [0] * len(per)
            op_calls = self._op_calls()
            compiled, self._op_calls_seen = op_calls - self._op_calls_seen, op_calls
        self.steps.inc()
        for micro_batch, n in enumerate(per):
            if n:
                self.exchanges(micro_batch).inc(n)
        if compiled:
            self.compiled.inc(compiled)
        if sent:
            self.sent_bytes.inc(sent)
        if received:
            self.received_bytes.inc(received)
        if exchanges:
            self.step_wait.observe(wait_ns / 1e9)


class FFNMetrics:
    """The FFN role's metrics of one rank (see the module docstring)."""

    def __init__(self, rank: int, *, registry: Any = None) -> None:
        labels = {"rank": str(rank)}
        families = _families(registry, "ffn", _ffn_families)
        self.layers = families["layers"].labels(**labels)
        self.tokens = families["tokens"].labels(**labels)
        self.compute = families["compute"].labels(**labels)
        self.received_bytes = families["received_bytes"].labels(**labels)
        self.sent_bytes = families["sent_bytes"].labels(**labels)
        self.peers = families["peers"].labels(**labels)

    def served(self, batch: Any, result: Any, compute_ns: int) -> None:
        """One layer message ``batch`` was answered with ``result`` after computing for
        ``compute_ns``."""
        self.layers.inc()
        self.tokens.inc(batch.header.num_tokens)
        self.compute.observe(compute_ns / 1e9)
        self.received_bytes.inc(payload_bytes(batch.payload))
        self.sent_bytes.inc(result_bytes(result))


def _current_micro_batch_reader() -> Any:
    """A function returning the micro-batch index of the current AFD step (vLLM's current
    forward context's step metadata; 0 outside a forward pass or without vLLM). Bound
    once: per exchange it costs two global reads and a dict lookup."""
    try:
        from vllm import forward_context as fc
    except ImportError:  # pragma: no cover - vLLM is there wherever layers exchange
        return lambda: 0
    from afd_core.forward_context import AFD_CONTEXT_KEY

    available, current = fc.is_forward_context_available, fc.get_forward_context

    def micro_batch() -> int:
        if not available():
            return 0
        meta = current().additional_kwargs.get(AFD_CONTEXT_KEY)
        index: int = 0 if meta is None else meta.micro_batch_idx
        return index

    return micro_batch


def attention_metrics(rank: int) -> AttentionMetrics | None:
    """The Attention role's metrics of ``rank`` in this process, or None when metrics are
    off (``PROMETHEUS_MULTIPROC_DIR`` unset or empty)."""
    try:
        return _attention[rank]
    except KeyError:
        pass
    with _lock:
        if rank not in _attention:
            on = bool(os.environ.get(MULTIPROC_DIR_ENV))
            _attention[rank] = AttentionMetrics(rank) if on else None
        return _attention[rank]


def ffn_metrics(rank: int) -> FFNMetrics:
    """The FFN role's metrics of ``rank`` in this process (made on first use)."""
    with _lock:
        if rank not in _ffn:
            _ffn[rank] = FFNMetrics(rank)
        return _ffn[rank]


def attention_peers_changed(connector: Any, rank: int, *, connected: bool) -> None:
    """Set ``afd_attention_peers_connected`` of ``rank`` (no-op when metrics are off):
    the FFN peers of ``connector`` when ``connected``, else 0."""
    metrics = attention_metrics(rank)
    if metrics is not None:
        peers = connector.topology.peers_of("attention", rank) if connected else ()
        metrics.peers.set(len(peers))


def attention_step_ended(rank: int) -> None:
    """A forward step of the Attention role ended (no-op when metrics are off)."""
    metrics = attention_metrics(rank)
    if metrics is not None:
        metrics.end_step()
