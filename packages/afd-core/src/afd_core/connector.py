"""The connector interface every AFD transport implements.

A connector moves one layer's activations between the Attention role and the
FFN role. It is created per process (one per worker), initialised once
(collectively, idempotently) and closed once (idempotently; closing unblocks
any receive that is waiting).

Attention side, per layer and micro-batch::

    connector.send_to_ffn(AttentionToFFN(hidden), layer_idx=i, micro_batch_idx=m)
    ...  # optional overlap point (micro-batching)
    out = connector.recv_from_ffn(layer_idx=i, micro_batch_idx=m)

FFN side, in a loop::

    batch = connector.recv_from_attention()      # fan-in of all attention peers
    result = compute(batch.header.layer_idx, batch.payload)
    connector.send_to_attention(batch, FFNToAttention(result))  # split per peer
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Self

from afd_core.config import AFDConfig, AFDRole
from afd_core.errors import AFDConfigError, AFDTransferMismatchError, did_you_mean
from afd_core.topology import AFDTopology
from afd_core.transfer import AttentionToFFN, FFNToAttention, PayloadKind, TransferHeader

__all__ = ["AFDConnector", "ConnectorCapabilities", "ExtraKey", "FFNBatch"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class ExtraKey:
    """One ``connector_extra_config`` key a connector accepts: what its value must be
    (``accepts``, described by ``expected`` in the error) and its default (None: the key
    is optional and stays None when absent). A connector declares its keys in
    :attr:`AFDConnector.extra_schema`; :meth:`AFDConnector.validate_extra_config`
    checks them all in one way. Build them with the class methods."""

    accepts: Callable[[Any], bool]
    expected: str
    default: Any = None

    @classmethod
    def integer(cls, *, minimum: int = 1, default: int | None = None) -> ExtraKey:
        return cls(lambda v: _is_int(v) and v >= minimum, f"an int >= {minimum}", default)

    @classmethod
    def flag(cls, *, default: bool = False) -> ExtraKey:
        return cls(lambda v: isinstance(v, bool), "true or false", default)

    @classmethod
    def one_of(cls, choices: tuple[str, ...], *, default: str | None = None) -> ExtraKey:
        return cls(lambda v: v in choices, f"one of {', '.join(choices)}", default)

    @classmethod
    def text(cls) -> ExtraKey:
        return cls(lambda v: isinstance(v, str) and bool(v), "a non-empty string")

    @classmethod
    def text_mapping(cls, what: str) -> ExtraKey:
        def accepts(v: Any) -> bool:
            return isinstance(v, Mapping) and all(
                isinstance(k, str) and isinstance(x, str) for k, x in v.items()
            )

        return cls(accepts, f"a mapping of {what} (strings)")


@dataclass(frozen=True, slots=True)
class ConnectorCapabilities:
    """What a connector class supports and needs, declared by the class
    (:attr:`AFDConnector.capabilities`) and read through the registry, so the runner and
    model layers never decide by a connector's name.
    """

    platforms: frozenset[str] | None = None
    """vLLM device types (``"cpu"``, ``"cuda"``, ``"npu"``...) whose Attention-role
    runners work with it; None: every platform (in-process test connectors)."""
    gate_placements: frozenset[str] = frozenset({"attention", "ffn"})
    """Where the MoE gate may run: ``"attention"`` (``compute_gate_on_attention``) and/or
    ``"ffn"``."""
    platform_runners: bool = False
    """The Attention role uses the platform's own MoE runners (vLLM-Ascend's on
    ``"npu"``) instead of afd's generic ones."""
    shared_experts_on_attention: bool = False
    """With the gate on Attention, the Attention role runs the shared experts (on the
    platform's runners) and the FFN role the routed experts alone."""
    ffn_external_routing: bool = False
    """With the gate on Attention, the FFN role routes the received top-k through the
    platform's communication framework (``platform_runners`` platforms only)."""
    same_host_only: bool = False
    """Every rank must run on one host (shared memory)."""
    payload_kinds: frozenset[PayloadKind] | None = None
    """The Attention -> FFN payload kinds it carries; None: every kind. A connector that
    does not carry ``PayloadKind.HIDDEN`` (hidden states alone) cannot take a dense
    layer's input: the Attention role then computes its dense layers itself."""

    def supports_platform(self, platform: str) -> bool:
        return self.platforms is None or platform in self.platforms

    def carries(self, kind: PayloadKind) -> bool:
        """Whether Attention -> FFN messages of ``kind`` go through this connector."""
        return self.payload_kinds is None or kind in self.payload_kinds

    def describe_platforms(self) -> str:
        return "every platform" if self.platforms is None else ", ".join(sorted(self.platforms))


@dataclass(frozen=True, slots=True)
class FFNBatch:
    """What the FFN side received for one layer of one micro-batch.

    ``payload`` holds the tokens of every attention peer concatenated in
    ``peer_ranks`` order; ``token_counts[i]`` tokens came from ``peer_ranks[i]``.
    ``header.num_tokens`` is the total.
    """

    header: TransferHeader
    payload: AttentionToFFN
    peer_ranks: tuple[int, ...]
    token_counts: tuple[int, ...]

    @property
    def layer_idx(self) -> int:
        return self.header.layer_idx

    @property
    def micro_batch_idx(self) -> int:
        return self.header.micro_batch_idx

    def answers(
        self, result: FFNToAttention, *, serving: tuple[int, ...], who: str
    ) -> list[tuple[int, FFNToAttention]]:
        """``result`` cut into one answer per peer: ``[(peer_rank, rows of that peer)]``.

        ``serving`` is the attention ranks of the connector answering (it must be the
        batch's ``peer_ranks``); ``who`` names that connector in errors. Rows are row
        slices (views) of ``result``, in ``peer_ranks`` order.
        """
        if tuple(self.peer_ranks) != tuple(serving):
            raise AFDTransferMismatchError(
                f"{who}: batch is for attention ranks {list(self.peer_ranks)}, this rank "
                f"serves {list(serving)}"
            )
        total = sum(self.token_counts)
        if result.num_tokens != total:
            raise AFDTransferMismatchError(
                f"{who}: result has {result.num_tokens} tokens, the batch of layer "
                f"{self.layer_idx} micro-batch {self.micro_batch_idx} had {total} "
                f"({dict(zip(self.peer_ranks, self.token_counts, strict=True))})"
            )
        if len(self.peer_ranks) == 1:
            return [(self.peer_ranks[0], result)]
        output: Any = result.output
        shared: Any = result.shared_output
        parts: list[tuple[int, FFNToAttention]] = []
        offset = 0
        for peer, n in zip(self.peer_ranks, self.token_counts, strict=True):
            rows = slice(offset, offset + n)
            parts.append(
                (peer, FFNToAttention(output[rows], None if shared is None else shared[rows]))
            )
            offset += n
        return parts


class AFDConnector(abc.ABC):
    """Base class of all AFD connectors (registered by name, see :mod:`afd_core.registry`)."""

    #: Registry name, e.g. ``"P2pGlooAFDConnector"``.
    name: ClassVar[str] = ""

    #: What the class supports (platforms, gate placements, where shared experts run...).
    capabilities: ClassVar[ConnectorCapabilities] = ConnectorCapabilities()

    #: This rank's deployment fingerprint (:mod:`afd_core.identity`), set by
    #: :func:`~afd_core.registry.create_connector` before :meth:`init`; a connector with
    #: a handshake sends it to be compared with the host's (:mod:`afd_core.admission`).
    identity: Mapping[str, str] | None = None

    def __init__(self, config: AFDConfig, *, rank: int) -> None:
        topology = AFDTopology(config.num_attention_ranks, config.num_ffn_ranks)
        size = topology.size_of(config.role)
        if not 0 <= rank < size:
            raise AFDConfigError(
                f"connector rank {rank} is outside the {config.role.value} role's "
                f"ranks 0..{size - 1} (num_{config.role.value}_ranks={size})"
            )
        self.config = config
        self.rank = rank
        self.topology = topology
        self.extra_config = self.validate_extra_config(config.connector_extra_config)

    @property
    def role(self) -> AFDRole:
        return self.config.role

    @property
    def label(self) -> str:
        """``ClassName(role rank N)``: how errors name this connector."""
        return f"{type(self).__name__}({self.role.value} rank {self.rank})"

    def check_side(self, role: AFDRole, method: str) -> None:
        """Raise :class:`AFDConfigError` unless this connector was created for ``role``."""
        if self.role is not role:
            raise AFDConfigError(
                f"{self.label}: {method}() is a {role.value}-side call; this connector was "
                f"created for the {self.role.value} role"
            )

    #: The ``connector_extra_config`` keys it accepts (:class:`ExtraKey`); empty: none.
    #: None: a wrapper whose inner connector(s) validate the same mapping.
    extra_schema: ClassVar[Mapping[str, ExtraKey] | None] = MappingProxyType({})

    @classmethod
    def validate_extra_config(cls, extra: Mapping[str, Any]) -> Mapping[str, Any]:
        """Check ``connector_extra_config`` against :attr:`extra_schema` (the one way every
        connector's extra config is checked): unknown keys and bad values raise
        :class:`AFDConfigError` naming the key and the allowed keys with what each takes.
        Returns every declared key, absent ones at their default."""
        schema = cls.extra_schema
        if schema is None:
            return dict(extra)
        name = cls.name or cls.__name__
        if not schema:
            if extra:
                raise AFDConfigError(
                    f"connector_extra_config: connector {name!r} takes no extra options, got "
                    f"{sorted(extra)}"
                )
            return {}
        allowed = "; ".join(f"{key}: {spec.expected}" for key, spec in sorted(schema.items()))
        unknown = sorted(set(extra) - set(schema))
        if unknown:
            hint = did_you_mean(unknown[0], sorted(schema)) if len(unknown) == 1 else ""
            raise AFDConfigError(
                f"connector_extra_config of {name}: unknown keys {unknown}"
                f"{f' ({hint})' if hint else ''}; allowed keys: {allowed}"
            )
        out: dict[str, Any] = {}
        for key, spec in schema.items():
            if key not in extra:
                out[key] = spec.default
                continue
            value = extra[key]
            if not spec.accepts(value):
                raise AFDConfigError(
                    f"connector_extra_config[{key!r}] of {name}: expected {spec.expected}, got "
                    f"{value!r} (allowed keys: {allowed})"
                )
            out[key] = value
        return out

    @classmethod
    def check_deployment(
        cls, config: AFDConfig, vllm_config: Any, *, platform: str | None = None
    ) -> None:
        """Reject, at start-up, a deployment this connector cannot serve.

        The AFD runtime calls it in both roles with the engine's ``VllmConfig`` while the
        model is being built, before any connector exists, so an unsupported shape
        (platform, parallelism, batching mode, model) fails early with a message naming
        the setting to change. ``platform`` is vLLM's device type of this process
        (``None``: vLLM's current platform). The default accepts every deployment.
        """
        return None

    # -- lifecycle -----------------------------------------------------------
    @abc.abstractmethod
    def init(self) -> None:
        """Connect to the peers. Collective over both roles; a second call does nothing."""

    @property
    @abc.abstractmethod
    def is_initialized(self) -> bool: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources and unblock pending receives. Idempotent; never hangs."""

    # -- Attention side ------------------------------------------------------
    @abc.abstractmethod
    def send_to_ffn(
        self, payload: AttentionToFFN, *, layer_idx: int, micro_batch_idx: int = 0
    ) -> None:
        """Send one layer's A->F payload to this rank's FFN peer."""

    @abc.abstractmethod
    def recv_from_ffn(
        self, *, layer_idx: int, micro_batch_idx: int = 0, timeout_s: float | None = None
    ) -> FFNToAttention:
        """Receive the F->A result of a payload sent earlier with the same indices.

        Bounded by ``timeout_s`` (default ``transfer_timeout_s``): the step has started.
        """

    # -- FFN side ------------------------------------------------------------
    @abc.abstractmethod
    def recv_from_attention(self, *, timeout_s: float | None = None) -> FFNBatch:
        """Receive the next layer from every attention peer of this rank, concatenated.

        Without ``timeout_s`` this is the FFN side's wait for the next step, which has no
        deadline: it ends when a message arrives, the connector is closed or a peer is
        lost (an idle deployment must not die). Once the first peer's message of the step
        has arrived the step has started, and the rest of it is bounded by
        ``transfer_timeout_s``. With ``timeout_s`` the whole receive is bounded by it.
        """

    @abc.abstractmethod
    def send_to_attention(self, batch: FFNBatch, result: FFNToAttention) -> None:
        """Split ``result`` by ``batch.token_counts`` and send each part to its peer."""

    # -- context manager -----------------------------------------------------
    def __enter__(self) -> Self:
        self.init()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
