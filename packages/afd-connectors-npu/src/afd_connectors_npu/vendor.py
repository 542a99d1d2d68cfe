"""The Ascend binding of :class:`~afd_connectors_npu.ops.CAMOps` (hardware-gated, lazy imports).

**Status: this binding has never run.** It was written without Ascend hardware; the
CPU tests use :class:`afd_connectors_npu.testing.FakeCAMFabric` instead. What it does:

1. imports ``torch_npu`` and checks that an Ascend device is visible;
2. imports the CAM operator library named by ``connector_extra_config["cam_op_library"]``
   (if set; a module whose import registers the operators with torch);
3. resolves one operator per CAM operation in ``torch.ops.<cam_op_namespace>``
   (default namespace :data:`DEFAULT_NAMESPACE`, names :data:`DEFAULT_OP_NAMES`, each
   overridable through ``connector_extra_config["cam_op_names"]``);
4. returns :class:`VendorCAMOps`, whose rendezvous is afd-core's TCP store at
   ``afd.host:afd.port`` (attention rank 0 hosts it; the connector runs admission over
   it), which carries each message's ``meta`` under the admitted session prefix, and
   which hands the tensors to the operators.

Assumed operator call convention (unverified; the upstream ``afd_ascend`` operators take
extra sizing and HCCL-group arguments, so a deployment registers thin adapters with
these signatures under its own namespace)::

    a2e_send(hidden, ids, scales, ffn_rank)            -> ()
    a2e_recv(attention_rank)                           -> (hidden, ids, scales)
    e2a_send(output, extra, attention_rank)            -> ()
    e2a_recv(ffn_rank)                                 -> (output, extra)
    dispatch_send(hidden, topk_ids, topk_weights, ffn_rank) -> () (asynchronous on the stream)
    dispatch_recv(attention_rank)                      -> (hidden, topk_ids, topk_weights)
    combine_send(output, attention_rank)               -> ()
    combine_recv(ffn_rank)                             -> output

Empty ``ids``/``scales``/``extra`` travel as empty tensors.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from afd_connectors_npu.ops import (
    A2EMessage,
    CAMHandle,
    CAMOps,
    CAMUnavailableError,
    E2AMessage,
    RankKey,
)
from afd_connectors_npu.routing import IdsChannel
from afd_core.config import AFDConfig, AFDRole
from afd_core.connect import RendezvousBackend, TCPRendezvous
from afd_core.errors import AFDConfigError, AFDConnectorClosedError, AFDTimeoutError
from afd_core.topology import AFDTopology
from afd_core.transfer import PayloadKind, TransferHeader

__all__ = ["DEFAULT_NAMESPACE", "DEFAULT_OP_NAMES", "load_vendor_cam_ops", "VendorCAMOps"]

DEFAULT_NAMESPACE = "afd_cam"
DEFAULT_OP_NAMES: Mapping[str, str] = {
    "a2e_send": "a2e_send",
    "a2e_recv": "a2e_recv",
    "e2a_send": "e2a_send",
    "e2a_recv": "e2a_recv",
    "dispatch_send": "async_dispatch_send",
    "dispatch_recv": "async_dispatch_recv",
    "combine_send": "async_combine_send",
    "combine_recv": "async_combine_recv",
}

_INSTALL = (
    "install torch_npu matching your torch, the Ascend CANN toolkit, and the CAM operator "
    "library (name its module in connector_extra_config['cam_op_library']); on CPU the "
    "tests use afd_connectors_npu.testing.FakeCAMFabric instead"
)


def load_vendor_cam_ops(config: AFDConfig, rank: int) -> CAMOps:
    """The Ascend :class:`CAMOps` of ``(config.role, rank)``; raises :class:`CAMUnavailableError`.

    Never run on hardware so far (see the module docstring).
    """
    import importlib

    if config.transfer_dtype != "model" or config.transfer_dtype_return != "model":
        # The adapters' signatures (above) carry no activation scales; a quantized
        # message would lose them. The fake operators carry them (A2EMessage.hidden_scales,
        # E2AMessage.output_scales): the conformance suite runs every transfer dtype there.
        raise AFDConfigError(
            f"{config.connector}: the Ascend CAM binding moves no activation scales, so "
            f"afd.transfer_dtype={config.transfer_dtype!r} / transfer_dtype_return="
            f"{config.transfer_dtype_return!r} cannot travel over it; set both to 'model'"
        )
    extra = config.connector_extra_config
    try:
        import torch
        import torch_npu  # type: ignore[import-not-found]  # noqa: F401  (registers torch.npu)
    except ImportError as exc:
        raise CAMUnavailableError(
            f"{config.connector} needs torch_npu ({exc}); {_INSTALL}"
        ) from exc
    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available() or npu.device_count() < 1:
        raise CAMUnavailableError(
            f"{config.connector} needs an Ascend device, torch_npu sees none; check the "
            f"driver and ASCEND_RT_VISIBLE_DEVICES; {_INSTALL}"
        )
    library = extra.get("cam_op_library")
    if library:
        try:
            importlib.import_module(library)
        except ImportError as exc:
            raise CAMUnavailableError(
                f"connector_extra_config['cam_op_library']={library!r} cannot be imported "
                f"({exc}); {_INSTALL}"
            ) from exc
    namespace = extra.get("cam_op_namespace", DEFAULT_NAMESPACE)
    names = {**DEFAULT_OP_NAMES, **dict(extra.get("cam_op_names", {}))}
    unknown = sorted(set(names) - set(DEFAULT_OP_NAMES))
    if unknown:
        raise CAMUnavailableError(
            f"connector_extra_config['cam_op_names'] has unknown operations {unknown}; "
            f"allowed: {sorted(DEFAULT_OP_NAMES)}"
        )
    ops_ns = getattr(torch.ops, namespace)
    resolved: dict[str, Any] = {}
    missing: list[str] = []
    for op, name in names.items():
        try:
            resolved[op] = getattr(ops_ns, name)
        except (AttributeError, RuntimeError):
            missing.append(f"torch.ops.{namespace}.{name}")
    if missing:
        raise CAMUnavailableError(
            f"CAM operators not registered: {', '.join(missing)} (set "
            "connector_extra_config['cam_op_namespace'] / ['cam_op_names'] to where the "
            f"library registers them); {_INSTALL}"
        )
    return VendorCAMOps(config, rank, resolved)


class _DoneHandle:
    """Dispatch handle: the operator was enqueued on the NPU stream; ``wait`` syncs it."""

    def __init__(self, event: Any) -> None:
        self._event = event

    def done(self) -> bool:
        return bool(self._event.query())

    def wait(self, timeout_s: float) -> None:
        self._event.synchronize()


class VendorCAMOps:
    """CAM operators of one rank on Ascend (see the module docstring; never run here)."""

    def __init__(self, config: AFDConfig, rank: int, ops: Mapping[str, Any]) -> None:
        self.config = config
        self.key: RankKey = (config.role, rank)
        self.topology = AFDTopology(config.num_attention_ranks, config.num_ffn_ranks)
        self._ops = dict(ops)
        self._global = self.topology.global_rank(config.role, rank)
        # The admitted session store (afd-core's connect phase over rendezvous()): each
        # message's meta travels there, under the deployment's secret session prefix.
        self._store: Any = None
        self._seq: dict[tuple[str, int, int], int] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- meta side channel ------------------------------------------------------------------
    def _next(self, family: str, src: int, dst: int, *, advance: bool = True) -> str:
        with self._lock:
            n = self._seq.get((family, src, dst), 0)
            if advance:
                self._seq[(family, src, dst)] = n + 1
        return f"afd-cam/{family}/{src}->{dst}/{n}"

    def _put_meta(self, family: str, peer: int, meta: tuple[int, ...]) -> None:
        dst = self.topology.global_rank(_other(self.key[0]), peer)
        self._store.set(self._next(family, self._global, dst), json.dumps(list(meta)))

    def _get_meta(self, family: str, peer: int, timeout_s: float) -> tuple[int, ...]:
        if self._closed:
            raise AFDConnectorClosedError(f"CAM {family}: receive after close()")
        src = self.topology.global_rank(_other(self.key[0]), peer)
        # The sequence number advances only once the message is here: a receive that timed
        # out can be retried (the FFN side re-arms its wait for the next step).
        key = self._next(family, src, self._global, advance=False)
        try:
            self._store.wait([key], timedelta(seconds=timeout_s))
        except Exception as exc:  # TCPStore raises a plain RuntimeError/DistStoreError on timeout
            raise AFDTimeoutError(
                f"CAM {family}: nothing from {_other(self.key[0]).value} rank {peer} within "
                f"{timeout_s:g} s ({exc})"
            ) from exc
        self._next(family, src, self._global)
        value = self._store.get(key)
        self._store.delete_key(key)
        return tuple(int(v) for v in json.loads(value))

    # -- CAMOps ---------------------------------------------------------------------------
    def rendezvous(self) -> RendezvousBackend:
        """The TCP store at ``afd.host:afd.port`` that attention rank 0 hosts."""
        return TCPRendezvous(self.config)

    def join(self, store: Any, *, timeout_s: float) -> None:
        self._store = store

    def a2e_send(self, ffn_rank: int, message: A2EMessage, *, timeout_s: float) -> None:
        self._put_meta("a2e", ffn_rank, message.meta)
        self._ops["a2e_send"](
            message.hidden_states,
            _or_empty(message.ids, message.hidden_states, "int32"),
            _or_empty(message.scales, message.hidden_states, "float32"),
            ffn_rank,
        )

    def a2e_recv(self, attention_rank: int, *, timeout_s: float) -> A2EMessage:
        meta = self._get_meta("a2e", attention_rank, timeout_s)
        hidden, ids, scales = self._ops["a2e_recv"](attention_rank)
        routed = meta[TransferHeader.WIRE_LEN] != IdsChannel.NONE
        return A2EMessage(meta, hidden, ids if routed else None, scales if routed else None)

    def e2a_send(self, attention_rank: int, message: E2AMessage, *, timeout_s: float) -> None:
        self._put_meta("e2a", attention_rank, message.meta)
        extra = message.extra if message.extra is not None else message.output[:0]
        self._ops["e2a_send"](message.output, extra, attention_rank)

    def e2a_recv(self, ffn_rank: int, *, timeout_s: float) -> E2AMessage:
        meta = self._get_meta("e2a", ffn_rank, timeout_s)
        output, extra = self._ops["e2a_recv"](ffn_rank)
        shared = meta[5] == PayloadKind.OUTPUT_WITH_SHARED  # TransferHeader.encode()[5]: kind
        return E2AMessage(meta, output, extra if shared else None)

    def dispatch_send(self, ffn_rank: int, message: A2EMessage) -> CAMHandle:
        import torch

        self._put_meta("dispatch", ffn_rank, message.meta)
        self._ops["dispatch_send"](message.hidden_states, message.ids, message.scales, ffn_rank)
        event = getattr(torch, "npu").Event()  # noqa: B009  (torch.npu exists only with torch_npu)
        event.record()
        return _DoneHandle(event)

    def dispatch_recv(self, attention_rank: int, *, timeout_s: float) -> A2EMessage:
        meta = self._get_meta("dispatch", attention_rank, timeout_s)
        hidden, ids, weights = self._ops["dispatch_recv"](attention_rank)
        return A2EMessage(meta, hidden, ids, weights)

    def combine_send(self, attention_rank: int, message: E2AMessage, *, timeout_s: float) -> None:
        self._put_meta("combine", attention_rank, message.meta)
        self._ops["combine_send"](message.output, attention_rank)

    def combine_recv(self, ffn_rank: int, *, timeout_s: float) -> E2AMessage:
        meta = self._get_meta("combine", ffn_rank, timeout_s)
        return E2AMessage(meta, self._ops["combine_recv"](ffn_rank))

    def close(self) -> None:
        # A receive blocked in TCPStore.wait ends at its timeout, not at close(): the
        # store has no cancel. Bounded by transfer_timeout_s; unverified on hardware.
        self._closed = True


def _other(role: AFDRole) -> AFDRole:
    return AFDRole.FFN if role is AFDRole.ATTENTION else AFDRole.ATTENTION


def _or_empty(t: Any, like: Any, dtype: str) -> Any:
    import torch

    if t is not None:
        return t
    return torch.empty((like.shape[0], 0), dtype=getattr(torch, dtype), device=like.device)
