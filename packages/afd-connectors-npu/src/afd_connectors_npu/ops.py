"""The only way the CAM connectors reach the Ascend CAM operators: :class:`CAMOps`.

A :class:`CAMOps` object is bound to one (role, rank) of one AFD deployment. The
connectors speak to it in plain messages:

* :class:`A2EMessage` (Attention -> FFN, "A2E"): the hidden states, the *ids channel*
  (int32 ``[tokens, width]``) and the *scales* slot (float32 ``[tokens, width]``);
* :class:`E2AMessage` (FFN -> Attention, "E2A"): the output and an optional second tensor.

Before any message, the connector runs afd-core's connect phase
(:func:`afd_core.connect.connect_phase`: store, admission with token and fingerprint,
join) over :meth:`CAMOps.rendezvous`, then :meth:`CAMOps.join` sets up the CAM world on
the admitted session store.

Both carry ``meta``, a short tuple of ints the connector defines (the transfer header
and a few words, see :mod:`afd_connectors_npu.routing`); the operators move the
tensors, the binding moves ``meta`` beside them.

Synchronous CAMP2p uses :meth:`CAMOps.a2e_send` / :meth:`~CAMOps.a2e_recv` /
:meth:`~CAMOps.e2a_send` / :meth:`~CAMOps.e2a_recv`. CAMAsync uses
:meth:`CAMOps.dispatch_send` (returns a :class:`CAMHandle` at once) /
:meth:`~CAMOps.dispatch_recv` / :meth:`~CAMOps.combine_send` /
:meth:`~CAMOps.combine_recv`. Every receive takes a timeout and raises
:class:`~afd_core.errors.AFDTimeoutError`, :class:`~afd_core.errors.AFDPeerLostError`
or, once :meth:`CAMOps.close` ran, :class:`~afd_core.errors.AFDConnectorClosedError`.

Implementations: :class:`afd_connectors_npu.testing.FakeCAMOps` (in-process fake, what
the CPU tests use) and :func:`afd_connectors_npu.vendor.load_vendor_cam_ops` (the
Ascend binding). Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from afd_core.config import AFDConfig, AFDRole
from afd_core.connect import RendezvousBackend
from afd_core.errors import AFDConnectorError

__all__ = [
    "CAMUnavailableError",
    "A2EMessage",
    "E2AMessage",
    "CAMHandle",
    "CAMOps",
    "CAMOpsFactory",
    "RankKey",
]


class CAMUnavailableError(AFDConnectorError, ImportError):
    """torch_npu, an Ascend device or the CAM operator library is missing."""


RankKey = tuple[AFDRole, int]
"""(role, rank within the role) of one participant."""


@dataclass(frozen=True, slots=True)
class A2EMessage:
    """One Attention -> FFN message as the CAM operators see it.

    ``ids`` and ``scales`` are both ``None`` (hidden states only) or both set.
    """

    meta: tuple[int, ...]
    hidden_states: Any
    ids: Any | None = None
    scales: Any | None = None
    hidden_scales: Any | None = None
    """The scales of ``hidden_states`` sent in a low-precision transfer dtype
    (``afd.transfer_dtype``; ``[tokens, columns]``), or None."""


@dataclass(frozen=True, slots=True)
class E2AMessage:
    """One FFN -> Attention message: the output and an optional second tensor."""

    meta: tuple[int, ...]
    output: Any
    extra: Any | None = None
    output_scales: Any | None = None
    """The scales of ``output`` sent in ``afd.transfer_dtype_return``, or None."""


@runtime_checkable
class CAMHandle(Protocol):
    """An asynchronous dispatch in flight."""

    def done(self) -> bool:
        """True once the dispatch has been handed to the peer (or failed)."""
        ...

    def wait(self, timeout_s: float) -> None:
        """Block until done; raise the dispatch's error, or AFDTimeoutError."""
        ...


@runtime_checkable
class CAMOps(Protocol):
    """CAM operators of one (role, rank). Peers are ranks of the other role."""

    def rendezvous(self) -> RendezvousBackend:
        """Where the ranks meet for afd-core's connect phase (admission included): the
        Ascend binding's TCP store at ``afd.host:afd.port``, the fake world's memory store."""
        ...

    def join(self, store: Any, *, timeout_s: float) -> None:
        """Set up the CAM world of this rank once the deployment admitted it: ``store`` is
        the session store (:attr:`afd_core.connect.Session.keys`), private to the admitted
        ranks, on which the binding may carry its side channel (each message's meta)."""
        ...

    # -- synchronous P2P (CAMP2p) ------------------------------------------------------
    def a2e_send(self, ffn_rank: int, message: A2EMessage, *, timeout_s: float) -> None: ...

    def a2e_recv(self, attention_rank: int, *, timeout_s: float) -> A2EMessage: ...

    def e2a_send(self, attention_rank: int, message: E2AMessage, *, timeout_s: float) -> None: ...

    def e2a_recv(self, ffn_rank: int, *, timeout_s: float) -> E2AMessage: ...

    # -- asynchronous dispatch / combine (CAMAsync) ------------------------------------
    def dispatch_send(self, ffn_rank: int, message: A2EMessage) -> CAMHandle:
        """Enqueue a dispatch and return at once; the handle reports completion."""
        ...

    def dispatch_recv(self, attention_rank: int, *, timeout_s: float) -> A2EMessage: ...

    def combine_send(
        self, attention_rank: int, message: E2AMessage, *, timeout_s: float
    ) -> None: ...

    def combine_recv(self, ffn_rank: int, *, timeout_s: float) -> E2AMessage:
        """The weighted, combined routed output of an earlier dispatch."""
        ...

    # -- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        """Leave the CAM world; unblocks this rank's receives. Idempotent."""
        ...


CAMOpsFactory = Callable[[AFDConfig, int], CAMOps]
"""Builds the :class:`CAMOps` of ``(config.role, rank)``; called by ``connector.init()``."""
