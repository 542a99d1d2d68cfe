"""The connect phase every AFD transport goes through: store, admission, join.

Before any tensor moves, every rank of a deployment meets at the rendezvous store that
attention rank 0 (the *host*) runs, and :func:`connect_phase` does, for every transport
(gloo, NCCL, shared memory, CAM) alike:

1. **store join**: the host opens the store, the other ranks connect to it (how is the
   transport's :class:`RendezvousBackend`: :class:`TCPRendezvous` at ``afd.host:afd.port``
   by default; the fake CAM world of the tests brings an in-memory one);
2. **admission** (:mod:`afd_core.admission`): the host's desk checks each joining rank's
   token proof, its rank claim (in range, not taken) and its deployment fingerprint
   (:mod:`afd_core.identity`, plus any ``settings`` the transport needs both roles to
   agree on); admitted ranks continue under the deployment's secret session prefix;
3. **join**: every rank announces itself (with its device, when it has one) and waits for
   all the others, a missing one named; two ranks on one device are refused on every
   rank (:func:`check_distinct_devices`). When the host stops the deployment while it
   assembles (a fingerprint mismatch, a rank claimed twice), the ranks already admitted
   stop too, with the host's reason, instead of waiting out ``afd.connect_timeout_s``.

The :class:`Session` it returns holds the session store (keys under the session prefix
and the transport's own prefix) on which the transport sets up what moves its bytes
(gloo/NCCL process groups, shared-memory rings, the CAM operators' side channel), and
the host's desk, which keeps refusing late strangers until :meth:`Session.close`.

Nothing here imports torch at module level (:class:`~afd_core.tcp_store.TCPRendezvous`,
the default backend, does when used).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from afd_core.admission import AdmissionDesk, KeyValueStore, apply_for_admission, resolve_token
from afd_core.config import AFDConfig
from afd_core.errors import (
    AFDAdmissionError,
    AFDConfigError,
    AFDFingerprintMismatchError,
    AFDTimeoutError,
)
from afd_core.tcp_store import TCPRendezvous
from afd_core.topology import AFDTopology

__all__ = [
    "RendezvousBackend",
    "Session",
    "TCPRendezvous",
    "check_distinct_devices",
    "connect_phase",
    "describe_global_rank",
    "wait_for_keys",
]

_POLL_S = 0.02
# How long the host keeps the store up, after it refused the deployment, for the ranks
# already admitted to read why (they are polling for it at that moment).
_REFUSAL_GRACE_S = 5.0
_ABORT = "abort"


class RendezvousBackend(Protocol):
    """Where the ranks of one deployment meet: a transport's store, as afd-core uses it."""

    def open(self, *, host: bool, deadline: float) -> KeyValueStore:
        """The store: opened by the host (attention rank 0), joined by every other rank
        (waiting for the host until ``deadline``, a ``time.monotonic()`` value)."""
        ...

    def scoped(self, store: KeyValueStore, prefix: str) -> KeyValueStore:
        """A view of ``store`` whose keys all start with ``prefix``."""
        ...


def describe_global_rank(topology: AFDTopology, global_rank: int) -> str:
    role, rank = topology.role_rank_of(global_rank)
    return f"{role.value} rank {rank}"


def check_distinct_devices(topology: AFDTopology, devices: Sequence[str]) -> None:
    """Refuse two ranks on one device: ``devices[g]`` is global rank g's device identity
    (``""``: no device to check). Raises :class:`AFDConfigError` naming both ranks."""
    seen: dict[str, int] = {}
    for g, ident in enumerate(devices):
        if not ident:
            continue
        if ident in seen:
            first = seen[ident]
            raise AFDConfigError(
                f"AFD data plane: {describe_global_rank(topology, first)} (global rank "
                f"{first}) and {describe_global_rank(topology, g)} (global rank {g}) are "
                f"both on device {ident}; every rank needs a device of its own (NCCL "
                "refuses two ranks on one GPU). Give each role its own GPUs with "
                "CUDA_VISIBLE_DEVICES (afd launch does this; see docs/gpu.md) or set "
                "connector_extra_config['device'] per rank"
            )
        seen[ident] = g


def wait_for_keys(
    store: Any,
    keys: Sequence[str],
    ranks: Sequence[int],
    deadline: float,
    what: str,
    topology: AFDTopology,
    where: str,
    poll: Callable[[], None] | None = None,
) -> None:
    """Wait until every key of ``keys`` (set by global rank ``ranks[i]``) is in ``store``;
    at ``deadline`` raise :class:`AFDTimeoutError` naming the ranks still missing.
    ``poll`` runs before every look (the host's desk answers hellos meanwhile)."""
    while True:
        if poll is not None:
            poll()
        if store.check(list(keys)):
            return
        if time.monotonic() >= deadline:
            missing = [
                describe_global_rank(topology, g)
                for key, g in zip(keys, ranks, strict=True)
                if not store.check([key])
            ]
            raise AFDTimeoutError(
                f"AFD rendezvous at {where}: {what} timed out; still missing: "
                f"{', '.join(missing) or '(none)'} of {topology.label}. Start every attention "
                "and FFN process with the same afd.host/afd.port and rank counts, or raise "
                "afd.connect_timeout_s"
            )
        time.sleep(_POLL_S)


@dataclass
class Session:
    """A rank's place in an admitted deployment (what :func:`connect_phase` returns)."""

    config: AFDConfig
    global_rank: int
    store: Any
    """The rendezvous store itself (a transport building torch process groups needs it)."""
    keys: Any
    """The session store: this deployment's keys, under its session prefix and the
    transport's prefix (a stranger without the token can neither read nor write them)."""
    deadline: float
    """When this connect phase's ``afd.connect_timeout_s`` runs out (monotonic)."""
    desk: AdmissionDesk | None
    """The host's admission desk, refusing late strangers from a thread (None elsewhere)."""
    devices: tuple[str, ...] = ()
    """Every global rank's device identity, as announced (``""``: none)."""

    @property
    def topology(self) -> AFDTopology:
        return self.config.topology

    @property
    def where(self) -> str:
        return f"{self.config.host}:{self.config.port}"

    @property
    def is_host(self) -> bool:
        return self.global_rank == 0

    def wait_for(
        self, keys: Sequence[str], ranks: Sequence[int], what: str, *, deadline: float | None = None
    ) -> None:
        """:func:`wait_for_keys` on the session store (default deadline: the session's)."""
        wait_for_keys(
            self.keys,
            keys,
            ranks,
            self.deadline if deadline is None else deadline,
            what,
            self.topology,
            self.where,
        )

    def barrier(self, name: str, what: str, *, deadline: float | None = None) -> None:
        """Every rank sets ``name/<rank>`` and waits for all the others (missing ones named)."""
        ranks = list(range(self.topology.world_size))
        self.keys.set(f"{name}/{self.global_rank}", "1")
        self.wait_for([f"{name}/{g}" for g in ranks], ranks, what, deadline=deadline)

    def leave(self, *, deadline: float | None = None) -> None:
        """The host waits until every rank has passed the connect phase's last barrier
        (``seen``), so closing right after ``init()`` cannot strand a rank mid-poll."""
        ranks = list(range(self.topology.world_size))
        self.keys.set(f"seen/{self.global_rank}", "1")
        if self.is_host:
            self.wait_for(
                [f"seen/{g}" for g in ranks],
                ranks,
                "leaving the rendezvous",
                deadline=self.deadline + self.config.connect_timeout_s
                if deadline is None
                else deadline,
            )

    def close(self) -> None:
        """Stop the host's desk (idempotent; nothing to do on the other ranks)."""
        if self.desk is not None:
            self.desk.stop()


def connect_phase(
    config: AFDConfig,
    *,
    global_rank: int,
    label: str,
    backend: RendezvousBackend | None = None,
    prefix: str = "afd",
    identity: Mapping[str, str] | None = None,
    settings: Mapping[str, str] | None = None,
    device_identity: str | None = None,
) -> Session:
    """Open or join the store, pass admission, wait until every rank joined.

    ``backend``: where the ranks meet (default :class:`TCPRendezvous` of ``config``).
    ``prefix``: the transport's own prefix under the session prefix. ``identity``: this
    rank's deployment fingerprint (the model package's fields); ``settings``: further
    fields the transport needs every rank to agree on (compared as fingerprint fields).
    ``device_identity``: this rank's accelerator (None: no device check).

    Raises :class:`AFDAdmissionError` / :class:`AFDFingerprintMismatchError` (refused, or
    the host stopped the deployment), :class:`AFDTimeoutError` (a rank missing at the
    deadline, named), :class:`AFDConfigError` (two ranks on one device).
    """
    topology = config.topology
    where = f"{config.host}:{config.port}"
    world = topology.world_size
    deadline = time.monotonic() + config.connect_timeout_s
    is_host = global_rank == 0
    token = resolve_token(config)
    fingerprint = {**(identity or {}), **(settings or {})}
    backend = backend if backend is not None else TCPRendezvous(config)
    store = backend.open(host=is_host, deadline=deadline)
    desk: AdmissionDesk | None = None
    if is_host:
        desk = AdmissionDesk(store, config=config, token=token, identity=fingerprint, where=where)
        session_prefix = desk.prefix
    else:
        session_prefix = apply_for_admission(
            store,
            config=config,
            rank=topology.role_rank_of(global_rank)[1],
            token=token,
            identity=fingerprint,
            deadline=deadline,
            where=where,
            label=label,
        )
    keys = backend.scoped(store, f"{session_prefix}/{prefix}/")
    session = Session(config, global_rank, store, keys, deadline, desk)
    ranks = list(range(world))
    keys.set(f"join/{global_rank}", device_identity or "")
    try:
        wait_for_keys(
            keys,
            [f"join/{g}" for g in ranks],
            ranks,
            deadline,
            "joining",
            topology,
            where,
            poll=desk.service
            if desk is not None
            else _joiner_poll(keys, global_rank, label, where),
        )
    except (AFDAdmissionError, AFDFingerprintMismatchError) as exc:
        if desk is not None:
            _tell_admitted(keys, desk, exc)
            desk.stop()
        raise
    if desk is not None:
        desk.start()
    devices = tuple(keys.get(f"join/{g}").decode() for g in ranks)
    session.devices = devices
    keys.set(f"devices-read/{global_rank}", "1")
    try:
        check_distinct_devices(topology, devices)
    except AFDConfigError:
        if is_host:  # the others are reading the list from this rank's store
            with contextlib.suppress(AFDTimeoutError):
                session.wait_for(
                    [f"devices-read/{g}" for g in ranks],
                    ranks,
                    "refusing the deployment",
                    deadline=time.monotonic() + _REFUSAL_GRACE_S,
                )
        session.close()
        raise
    return session


def _joiner_poll(keys: Any, global_rank: int, label: str, where: str) -> Callable[[], None]:
    """An admitted rank's look, while it waits for the others, at whether the host
    stopped the deployment (then it stops too, with the host's reason)."""

    def poll() -> None:
        if not keys.check([_ABORT]):
            return
        body = json.loads(keys.get(_ABORT))
        keys.set(f"abort-read/{global_rank}", "1")
        message = (
            f"{label}: attention rank 0 at {where} stopped the deployment while it assembled: "
            f"{body.get('reason', '?')}"
        )
        if body.get("kind") == "fingerprint":
            raise AFDFingerprintMismatchError(message)
        raise AFDAdmissionError(message)

    return poll


def _tell_admitted(keys: Any, desk: AdmissionDesk, exc: BaseException) -> None:
    """The host stops the deployment: publish why for the ranks it already admitted, and
    give them a moment to read it before its store goes away."""
    kind = "fingerprint" if isinstance(exc, AFDFingerprintMismatchError) else "admission"
    with contextlib.suppress(Exception):
        keys.set(_ABORT, json.dumps({"kind": kind, "reason": str(exc)}))
        topology = desk.topology
        waiting = [g for g in range(1, topology.world_size) if keys.check([f"join/{g}"])]
        end = time.monotonic() + _REFUSAL_GRACE_S
        while waiting and time.monotonic() < end:
            waiting = [g for g in waiting if not keys.check([f"abort-read/{g}"])]
            time.sleep(_POLL_S)
