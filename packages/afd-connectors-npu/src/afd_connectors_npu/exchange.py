"""What CAMP2p and CAMAsync share: the CAM transport under afd-core's exchange protocol.

:class:`CAMConnector` is afd-core's :class:`~afd_core.exchange.ExchangeConnector`
(guards, headers, fan-in, split, deadlines, errors) over a :class:`CAMTransport`, which
moves each message through a :class:`~afd_connectors_npu.ops.CAMOps` object: a CAM
message carries its tensors and its meta (:mod:`afd_connectors_npu.routing`) at once, so
a received message is decoded whole and its tensors are handed out after the protocol
checked its frame. The subclasses choose which CAM operators move each direction (four
transport methods) and which payloads the connector accepts (four ``_check_*`` hooks).
The ops come from ``ops_factory`` (tests pass :meth:`FakeCAMFabric.ops_factory
<afd_connectors_npu.testing.FakeCAMFabric.ops_factory>`) or, by default, from
:func:`afd_connectors_npu.vendor.load_vendor_cam_ops`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar

from afd_connectors_npu.ops import A2EMessage, CAMOps, CAMOpsFactory, E2AMessage
from afd_connectors_npu.routing import (
    A2E_META_LEN as _A2E_META_LEN,
)
from afd_connectors_npu.routing import (
    E2A_META_LEN as _E2A_META_LEN,
)
from afd_connectors_npu.routing import (
    A2ECodec,
    A2EMeta,
    E2AMeta,
    decode_e2a,
    encode_e2a,
)
from afd_connectors_npu.validation import (
    admission_settings,
    shape_from_vllm_config,
    validate_npu_deployment,
)
from afd_core.config import AFDConfig, AFDRole
from afd_core.connect import Session, connect_phase
from afd_core.connector import ExtraKey
from afd_core.errors import (
    AFDConnectorClosedError,
    AFDTimeoutError,
    AFDTransferMismatchError,
)
from afd_core.exchange import (
    IDLE,
    ExchangeConnector,
    Message,
    Spec,
    TransferContext,
    Transport,
)
from afd_core.transfer import WIRE_DTYPES, AttentionToFFN, FFNToAttention, layout_of
from afd_core.wire import Frame, dtype_from_code, make_frame

__all__ = ["CAMConnector", "CAMTransport", "EXTRA_CONFIG_KEYS"]

EXTRA_CONFIG_KEYS: Mapping[str, ExtraKey] = MappingProxyType(
    {
        "cam_op_namespace": ExtraKey.text(),
        "cam_op_library": ExtraKey.text(),
        "cam_op_names": ExtraKey.text_mapping("operation -> operator name"),
        "token_ids_width": ExtraKey.integer(default=1),
    }
)
"""``connector_extra_config`` keys of the CAM connectors (their :attr:`extra_schema`)."""

# The FFN side's wait for the next step re-arms the CAM receive this often.
_IDLE_POLL_S = 1.0


def _encoded_meta(meta: tuple[int, ...], frame: Frame) -> tuple[int, ...]:
    """A message's meta with the frame's encoding appended: the dtype the elements
    dequantize to (the meta's header names the element dtype, as the operators see the
    tensor), the scale dtype and the scales per row. Unchanged without an encoding."""
    if frame.encoding is None:
        return meta
    _, scales, columns = frame.encoding
    return (*meta, WIRE_DTYPES[frame.header.dtype], WIRE_DTYPES[scales], columns)


def _split_meta(
    meta: tuple[int, ...], plain_len: int
) -> tuple[tuple[int, ...], tuple[str, str, int] | None, str | None]:
    """(the meta a codec decodes, the frame's encoding, the dtype to dequantize to)."""
    if len(meta) != plain_len + 3:
        return meta, None, None
    logical, scales, columns = meta[plain_len:]
    plain = meta[:plain_len]
    elements = dtype_from_code(plain[4])  # the header's dtype word
    return plain, (elements, dtype_from_code(scales), columns), dtype_from_code(logical)


def _default_ops_factory(config: AFDConfig, rank: int) -> CAMOps:
    from afd_connectors_npu.vendor import load_vendor_cam_ops

    return load_vendor_cam_ops(config, rank)


class CAMTransport(Transport):
    """CAM messages through a :class:`CAMOps` (subclasses pick the operators)."""

    connector: CAMConnector

    def __init__(self, connector: ExchangeConnector) -> None:
        super().__init__(connector)
        self.ops: CAMOps | None = None
        #: This rank's admitted session (the host's admission desk runs until close()).
        self.session: Session | None = None
        # Peer global rank -> (frame, tensors) of its message received but not consumed.
        self._current: dict[int, tuple[Frame, list[Any]]] = {}

    # -- the CAM operators of each direction (subclasses) --------------------------------
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

    # -- Transport -----------------------------------------------------------------------
    def connect(self) -> None:
        """afd-core's connect phase (store, admission: token, rank, fingerprint with the
        CAM settings both roles must agree on; join) over the ops' rendezvous, then the
        CAM world's own set-up on the admitted session store."""
        c = self.connector
        ops = c._ops_factory(c.config, c.rank)
        with c._state_lock:
            if c.closed:  # close() may run on another thread meanwhile
                ops.close()
                raise AFDConnectorClosedError(f"{c.label}: closed during init()")
            self.ops = ops
        try:
            session = connect_phase(
                c.config,
                global_rank=c.global_rank,
                label=c.label,
                backend=ops.rendezvous(),
                prefix="afd-cam",
                identity=c.identity,
                settings=admission_settings(c.config),
            )
            self.session = session
            ops.join(session.keys, timeout_s=c.config.connect_timeout_s)
        except BaseException:
            self._close_session()
            ops.close()
            raise
        self.ready = True

    def _close_session(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            session.close()

    def close(self) -> None:
        self._close_session()
        if self.ops is not None:
            self.ops.close()
        self.ready = False

    def send(self, ctx: TransferContext, messages: Iterable[Message]) -> None:
        c = self.connector
        ops = self.ops
        assert ops is not None
        for peer, frame, tensors in messages:
            h = frame.header
            scales = None
            if frame.encoding is not None:  # the main tensor's scales travel last
                *tensors, scales = tensors
            payload = layout_of(h.kind).build(list(tensors))
            rank = c.topology.role_rank_of(peer)[1]
            if isinstance(payload, AttentionToFFN):
                c._check_a2f(payload)
                message = c.codec.encode(
                    payload,
                    layer_idx=h.layer_idx,
                    micro_batch_idx=h.micro_batch_idx,
                    sender=c.rank,
                    token_ids_width=c._token_ids_width,
                )
                if scales is not None:
                    message = dataclasses.replace(
                        message, meta=_encoded_meta(message.meta, frame), hidden_scales=scales
                    )
                self._post_a2f(ops, rank, message, (h.layer_idx, h.micro_batch_idx))
            else:
                assert isinstance(payload, FFNToAttention)
                c._check_f2a(payload)
                message_e2a = encode_e2a(
                    payload, layer_idx=h.layer_idx, micro_batch_idx=h.micro_batch_idx, sender=c.rank
                )  # fmt: skip
                if scales is not None:
                    message_e2a = dataclasses.replace(
                        message_e2a, meta=_encoded_meta(message_e2a.meta, frame),
                        output_scales=scales,
                    )  # fmt: skip
                self._post_f2a(ops, rank, message_e2a)

    def recv_frame(self, ctx: TransferContext) -> Frame:
        current = self._current.get(ctx.peer)
        if current is not None:
            return current[0]
        c = self.connector
        ops = self.ops
        assert ops is not None
        rank = c.topology.role_rank_of(ctx.peer)[1]
        payload: AttentionToFFN | FFNToAttention
        if c.role is AFDRole.FFN:
            a2e = self._take(ctx, lambda t: self._take_a2f(ops, rank, t))
            plain, encoding, logical = _split_meta(a2e.meta, _A2E_META_LEN)
            scales = a2e.hidden_scales
            meta, payload = c.codec.decode(dataclasses.replace(a2e, meta=plain))
            if meta.sender != rank:
                raise AFDTransferMismatchError(
                    f"{c.label}: message from attention rank {rank} says it was sent by "
                    f"attention rank {meta.sender}"
                )
            c._check_a2f_received(meta)
        else:
            message = self._take(ctx, lambda t: self._take_f2a(ops, rank, t))
            plain, encoding, logical = _split_meta(message.meta, _E2A_META_LEN)
            scales = message.output_scales
            e2a, payload = decode_e2a(dataclasses.replace(message, meta=plain))
            self._settle_send((e2a.header.layer_idx, e2a.header.micro_batch_idx), ctx.timeout)
            c._check_f2a_received(e2a)
            meta = e2a
        tensors, aux = layout_of(meta.header.kind).tensors(payload)
        header = meta.header
        if encoding is not None:
            if scales is None:
                raise AFDTransferMismatchError(
                    f"{c.label}: CAM meta announces {encoding[0]} elements with scales, but the "
                    "message carries none"
                )
            assert logical is not None
            header = dataclasses.replace(header, dtype=logical)
            tensors = [*tensors, scales]
        frame = make_frame(header, aux, ctx.peer, encoding)
        self._current[ctx.peer] = (frame, list(tensors))
        return frame

    def _take(self, ctx: TransferContext, take: Any) -> Any:
        """A CAM receive within ``ctx``'s deadline. The CAM operators take a finite
        timeout, so the FFN side's wait for the next step (:data:`IDLE`) re-arms it every
        :data:`_IDLE_POLL_S`; close() and peer loss end it as they end any receive."""
        if ctx.deadline != IDLE:
            # whole milliseconds: a fresh receive asks the operator for its full timeout
            return take(math.ceil(ctx.remaining() * 1000) / 1000)
        c = self.connector
        poll = min(_IDLE_POLL_S, c.config.transfer_timeout_s)
        while True:
            try:
                return take(poll)
            except AFDTimeoutError:
                if c.closed:
                    raise AFDConnectorClosedError(
                        f"{c.label} was closed while waiting for the next step"
                    ) from None

    def recv_tensors(
        self, ctx: TransferContext, parts: Sequence[tuple[int, int]], specs: Sequence[Spec]
    ) -> list[Any]:
        got = [self._current.pop(peer)[1] for peer, _ in parts]
        if len(got) == 1:
            return got[0]
        import torch

        return [torch.cat(rows, dim=0) for rows in zip(*got, strict=True)]


class CAMConnector(ExchangeConnector):
    """Base of the CAM connectors (not registered itself)."""

    #: Maps payloads onto the ids channel / scales slot (a test may swap it).
    codec: ClassVar[A2ECodec] = A2ECodec()
    transport_class: ClassVar[type[Transport]] = CAMTransport
    transport: CAMTransport
    extra_schema: ClassVar[Mapping[str, ExtraKey]] = EXTRA_CONFIG_KEYS

    def __init__(
        self, config: AFDConfig, *, rank: int, ops_factory: CAMOpsFactory | None = None
    ) -> None:
        super().__init__(config, rank=rank)
        self._check_config(config)
        self._ops_factory: CAMOpsFactory = ops_factory or _default_ops_factory
        self._token_ids_width = int(self.extra_config["token_ids_width"])

    # -- configuration -------------------------------------------------------------------
    @classmethod
    def check_deployment(
        cls, config: AFDConfig, vllm_config: Any, *, platform: str | None = None
    ) -> None:
        """Start-up check (see :func:`~afd_connectors_npu.validation.validate_npu_deployment`)."""
        validate_npu_deployment(config, shape_from_vllm_config(vllm_config, platform=platform))

    def _check_config(self, config: AFDConfig) -> None:
        """Reject settings this connector cannot serve (at construction, i.e. start-up)."""

    # -- payload rules (subclasses narrow them) ------------------------------------------
    def _check_a2f(self, payload: AttentionToFFN) -> None:
        """Attention side, before encoding ``payload``."""

    def _check_a2f_received(self, meta: A2EMeta) -> None:
        """FFN side, for each received message."""

    def _check_f2a(self, result: FFNToAttention) -> None:
        """FFN side, before sending ``result``."""

    def _check_f2a_received(self, meta: E2AMeta) -> None:
        """Attention side, for each received answer."""
