"""What CAMP2p and CAMAsync share: lifecycle, handshake, fan-in/split, header checks.

:class:`CAMConnector` implements afd-core's :class:`~afd_core.connector.AFDConnector`
over a :class:`~afd_connectors_npu.ops.CAMOps` object. Subclasses choose which CAM
operators move each direction (four hooks) and which payloads they accept. The ops
come from ``ops_factory`` (tests pass :meth:`FakeCAMFabric.ops_factory
<afd_connectors_npu.testing.FakeCAMFabric.ops_factory>`) or, by default, from
:func:`afd_connectors_npu.vendor.load_vendor_cam_ops`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any, ClassVar

from afd_connectors_npu.ops import A2EMessage, CAMOps, CAMOpsFactory, E2AMessage
from afd_connectors_npu.routing import A2ECodec, A2EMeta, E2AMeta, decode_e2a, encode_e2a
from afd_connectors_npu.validation import (
    compare_digests,
    handshake_digest,
    shape_from_vllm_config,
    validate_npu_deployment,
)
from afd_core.config import AFDConfig, AFDRole
from afd_core.connector import AFDConnector, FFNBatch
from afd_core.errors import (
    AFDConfigError,
    AFDConnectorClosedError,
    AFDConnectorError,
    AFDTimeoutError,
    AFDTransferMismatchError,
)
from afd_core.exchange import (
    closed_init_error,
    describe_header,
    disagree_error,
    duplicate_send_error,
    idle_rank_error,
)
from afd_core.transfer import AttentionToFFN, FFNToAttention, PayloadKind, TransferHeader

__all__ = ["CAMConnector", "EXTRA_CONFIG_KEYS"]

EXTRA_CONFIG_KEYS: Mapping[str, type] = {
    "cam_op_namespace": str,
    "cam_op_library": str,
    "cam_op_names": dict,
    "token_ids_width": int,
}
"""``connector_extra_config`` keys of the CAM connectors and their types."""

_F2A_KINDS = frozenset(k for k in PayloadKind if k.is_ffn_to_attention)
# The FFN side's wait for the next step re-arms the CAM receive this often.
_IDLE_POLL_S = 1.0
_A2F_FIELDS = ("hidden_states", "topk_ids", "topk_weights", "router_logits", "token_ids")


def _default_ops_factory(config: AFDConfig, rank: int) -> CAMOps:
    from afd_connectors_npu.vendor import load_vendor_cam_ops

    return load_vendor_cam_ops(config, rank)


class CAMConnector(AFDConnector):
    """Base of the CAM connectors (not registered itself)."""

    #: Maps payloads onto the ids channel / scales slot (a test may swap it).
    codec: ClassVar[A2ECodec] = A2ECodec()

    def __init__(
        self, config: AFDConfig, *, rank: int, ops_factory: CAMOpsFactory | None = None
    ) -> None:
        super().__init__(config, rank=rank)
        self._check_config(config)
        self._ops_factory: CAMOpsFactory = ops_factory or _default_ops_factory
        self._peers = self.topology.peers_of(self.role, rank)
        self._ops: CAMOps | None = None
        self._ready = False
        self._closed = False
        self._state_lock = threading.Lock()
        self._init_lock = threading.Lock()
        # Attention side: (layer, micro-batch) -> header of a send awaiting its answer.
        self._sent: dict[tuple[int, int], TransferHeader] = {}
        width = self.extra_config.get("token_ids_width", 1)
        self._token_ids_width = int(width)

    # -- configuration -------------------------------------------------------------------
    @classmethod
    def check_deployment(
        cls, config: AFDConfig, vllm_config: Any, *, platform: str | None = None
    ) -> None:
        """Start-up check (see :func:`~afd_connectors_npu.validation.validate_npu_deployment`)."""
        validate_npu_deployment(config, shape_from_vllm_config(vllm_config, platform=platform))

    @classmethod
    def validate_extra_config(cls, extra: Mapping[str, Any]) -> Mapping[str, Any]:
        unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS))
        if unknown:
            raise AFDConfigError(
                f"connector_extra_config of {cls.name}: unknown keys {unknown}; "
                f"allowed: {sorted(EXTRA_CONFIG_KEYS)}"
            )
        for key, value in extra.items():
            want = EXTRA_CONFIG_KEYS[key]
            ok = isinstance(value, want) and not isinstance(value, bool)
            if key == "token_ids_width":
                ok = ok and value >= 1
            if key == "cam_op_names":
                ok = ok and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
            if not ok:
                what = {
                    "token_ids_width": "an int >= 1",
                    "cam_op_names": "a mapping of operation -> operator name (strings)",
                }.get(key, "a non-empty string")
                raise AFDConfigError(
                    f"connector_extra_config[{key!r}] of {cls.name}: expected {what}, got {value!r}"
                )
        return dict(extra)

    def _check_config(self, config: AFDConfig) -> None:
        """Reject settings this connector cannot serve (at construction, i.e. start-up)."""

    # -- transport hooks -----------------------------------------------------------------
    def _post_a2f(self, ops: CAMOps, peer: int, message: A2EMessage, key: tuple[int, int]) -> None:
        raise NotImplementedError

    def _take_a2f(self, ops: CAMOps, peer: int, timeout: float) -> A2EMessage:
        raise NotImplementedError

    def _post_f2a(self, ops: CAMOps, peer: int, message: E2AMessage) -> None:
        raise NotImplementedError

    def _take_f2a(self, ops: CAMOps, peer: int, timeout: float) -> E2AMessage:
        raise NotImplementedError

    def _settle_send(self, key: tuple[int, int], timeout: float) -> None:
        """Called once the answer to the send of ``key`` arrived (CAMAsync: its handle)."""

    # -- payload rules (subclasses narrow them) ------------------------------------------
    def _check_a2f(self, payload: AttentionToFFN) -> None:
        """Attention side, before encoding ``payload``."""

    def _check_a2f_received(self, meta: A2EMeta) -> None:
        """FFN side, for each received message."""

    def _check_f2a(self, result: FFNToAttention) -> None:
        """FFN side, before sending ``result``."""

    def _check_f2a_received(self, meta: E2AMeta) -> None:
        """Attention side, for each received answer."""

    # -- lifecycle -----------------------------------------------------------------------
    def init(self) -> None:
        with self._init_lock:
            if self._closed:
                raise closed_init_error(self)
            if self._ready:
                return
            ops = self._ops_factory(self.config, self.rank)
            with self._state_lock:
                if self._was_closed():  # close() may run on another thread meanwhile
                    ops.close()
                    raise AFDConnectorClosedError(f"{self.label}: closed during init()")
                self._ops = ops
            try:
                digests = ops.handshake(
                    handshake_digest(self.config), timeout_s=self.config.connect_timeout_s
                )
                compare_digests((self.role, self.rank), digests)
            except BaseException:
                ops.close()
                raise
            self._ready = True

    @property
    def is_initialized(self) -> bool:
        return self._ready and not self._closed

    def close(self) -> None:
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            ops = self._ops
        if ops is not None:
            ops.close()

    # -- Attention side ------------------------------------------------------------------
    def send_to_ffn(
        self, payload: AttentionToFFN, *, layer_idx: int, micro_batch_idx: int = 0
    ) -> None:
        ops = self._enter(AFDRole.ATTENTION, "send_to_ffn")
        key = (layer_idx, micro_batch_idx)
        if key in self._sent:
            raise duplicate_send_error(self.label, layer_idx, micro_batch_idx)
        self._check_a2f(payload)
        message = self.codec.encode(
            payload,
            layer_idx=layer_idx,
            micro_batch_idx=micro_batch_idx,
            sender=self.rank,
            token_ids_width=self._token_ids_width,
        )
        self._post_a2f(ops, self._peers[0], message, key)
        self._sent[key] = A2EMeta.decode(message.meta).header

    def recv_from_ffn(
        self, *, layer_idx: int, micro_batch_idx: int = 0, timeout_s: float | None = None
    ) -> FFNToAttention:
        ops = self._enter(AFDRole.ATTENTION, "recv_from_ffn")
        timeout = self._timeout(timeout_s)
        peer = self._peers[0]
        sent = self._sent.get((layer_idx, micro_batch_idx))
        meta, result = decode_e2a(self._take_f2a(ops, peer, timeout))
        h = meta.header
        got = (h.layer_idx, h.micro_batch_idx)
        answered = self._sent.pop(got, None)
        if answered is not None:
            self._settle_send(got, timeout)
        try:
            h.expect(
                layer_idx=layer_idx,
                micro_batch_idx=micro_batch_idx,
                kinds=_F2A_KINDS,
                num_tokens=None if sent is None else sent.num_tokens,
                hidden_size=None if sent is None else sent.hidden_size,
            )
        except AFDTransferMismatchError as exc:
            raise AFDTransferMismatchError(
                f"{self.label} <- ffn rank {peer}: recv_from_ffn(layer_idx={layer_idx}, "
                f"micro_batch_idx={micro_batch_idx}) but the answer is for layer {h.layer_idx} "
                f"micro-batch {h.micro_batch_idx} ({h.num_tokens} tokens); {exc}"
            ) from None
        self._check_f2a_received(meta)
        return result

    # -- FFN side ------------------------------------------------------------------------
    def recv_from_attention(self, *, timeout_s: float | None = None) -> FFNBatch:
        import torch

        ops = self._enter(AFDRole.FFN, "recv_from_attention")
        if not self._peers:
            raise idle_rank_error(self)
        timeout = self._timeout(timeout_s)
        received: list[tuple[A2EMeta, AttentionToFFN]] = []
        idle = timeout_s is None
        deadline = time.monotonic() + timeout
        for peer in self._peers:
            if idle:
                # The next step has no deadline; once its first message is here, the rest
                # of the step is bounded by transfer_timeout_s.
                message = self._wait_next_step(ops, peer)
                deadline = time.monotonic() + timeout
                idle = False
            else:
                message = self._take_a2f(ops, peer, max(0.0, deadline - time.monotonic()))
            meta, payload = self.codec.decode(message)
            if meta.sender != peer:
                raise AFDTransferMismatchError(
                    f"{self.label}: message from attention rank {peer} says it was sent by "
                    f"attention rank {meta.sender}"
                )
            self._check_a2f_received(meta)
            received.append((meta, payload))
        first = received[0][0]
        ref = _layer_key(first)
        for peer, (meta, _) in zip(self._peers[1:], received[1:], strict=True):
            if _layer_key(meta) != ref:
                raise disagree_error(
                    self.label,
                    f"attention rank {self._peers[0]} sent {_describe(first)}",
                    f"attention rank {peer} sent {_describe(meta)}",
                )
        fields: dict[str, Any] = {}
        for name in _A2F_FIELDS:
            parts = [getattr(p, name) for _, p in received]
            if parts[0] is None:
                fields[name] = None
            else:
                fields[name] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        counts = tuple(m.header.num_tokens for m, _ in received)
        return FFNBatch(
            header=first.header.with_tokens(sum(counts)),
            payload=AttentionToFFN(**fields),
            peer_ranks=self._peers,
            token_counts=counts,
        )

    def send_to_attention(self, batch: FFNBatch, result: FFNToAttention) -> None:
        ops = self._enter(AFDRole.FFN, "send_to_attention")
        answers = batch.answers(result, serving=self._peers, who=self.label)
        self._check_f2a(result)
        for peer, part in answers:
            message = encode_e2a(
                part,
                layer_idx=batch.layer_idx,
                micro_batch_idx=batch.micro_batch_idx,
                sender=self.rank,
            )
            self._post_f2a(ops, peer, message)

    # -- plumbing ------------------------------------------------------------------------
    def _was_closed(self) -> bool:
        return self._closed

    def _enter(self, role: AFDRole, method: str) -> CAMOps:
        with self._state_lock:
            if self._closed:
                raise AFDConnectorClosedError(f"{self.label}: {method}() after close()")
            self.check_side(role, method)
            if not self._ready or self._ops is None:
                raise AFDConnectorError(
                    f"{self.label}: {method}() before init(); call init() first"
                )
            return self._ops

    def _wait_next_step(self, ops: CAMOps, peer: int) -> A2EMessage:
        """The first message of the next step from ``peer``, however long it takes.

        The CAM operators take a finite timeout, so the wait is re-armed every
        :data:`_IDLE_POLL_S`; close() and peer loss end it as they end any receive.
        """
        poll = min(_IDLE_POLL_S, self.config.transfer_timeout_s)
        while True:
            try:
                return self._take_a2f(ops, peer, poll)
            except AFDTimeoutError:
                if self._closed:
                    raise AFDConnectorClosedError(
                        f"{self.label} was closed while waiting for the next step"
                    ) from None

    def _timeout(self, timeout_s: float | None) -> float:
        return self.config.transfer_timeout_s if timeout_s is None else float(timeout_s)


def _layer_key(meta: A2EMeta) -> tuple[Any, ...]:
    """What every attention peer of one FFN rank must agree on (all but the token count)."""
    h = meta.header
    return (
        h.layer_idx,
        h.micro_batch_idx,
        h.hidden_size,
        h.dtype,
        h.kind,
        h.topk,
        meta.ids,
        meta.token_ids_dtype,
    )


def _describe(meta: A2EMeta) -> str:
    return describe_header(meta.header, token_ids=meta.token_ids_dtype)
