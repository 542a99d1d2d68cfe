"""Joining the AFD data-plane process group without touching torch's global state.

All ranks of both roles meet at ``config.host:config.port``: global rank 0
(attention rank 0) hosts a ``torch.distributed.TCPStore`` there. Every other rank first
passes the host's admission desk (:mod:`afd_core.admission`: token, rank, deployment
fingerprint), then all ranks continue under the deployment's session prefix: every rank
announces itself under a key, waits for all the others (so a missing peer is reported by
name instead of as an opaque gloo timeout) and then builds a gloo backend (and, for
NCCL, a second backend) from the same store. The host keeps answering late hellos
(refusing them) until its connector closes.

This does what ``vllm.distributed.utils.stateless_init_torch_distributed_process_group``
does (a process group that never becomes torch's default group, so it coexists
with the world group vLLM sets up in its workers), but it builds the gloo backend
directly from torch: importing vLLM costs ~4 s per process, which the connector
does not need, and the join step above wants the store itself. (Over 400 lines: the
store, admission, join and barrier steps read as one sequence.)
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from afd_core.admission import AdmissionDesk, apply_for_admission, resolve_token
from afd_core.config import AFDConfig
from afd_core.errors import AFDConfigError, AFDTimeoutError
from afd_core.topology import AFDTopology

__all__ = [
    "A2F",
    "F2A",
    "DataPlaneGroup",
    "barrier",
    "check_distinct_devices",
    "describe_global_rank",
    "join_data_plane",
    "join_store",
    "wait_for_keys",
]

_POLL_S = 0.02
# How long attention rank 0 keeps the store up for the other ranks to read the device
# list when it refuses the deployment (they are reading it at that moment).
_REFUSAL_GRACE_S = 5.0

#: Directions of tensor traffic; with NCCL each has a communicator (a stream) of its own.
A2F = "a2f"
F2A = "f2a"


def describe_global_rank(topology: AFDTopology, global_rank: int) -> str:
    role, rank = topology.role_rank_of(global_rank)
    return f"{role.value} rank {rank}"


@dataclass
class DataPlaneGroup:
    """The store and the backends of one connector's data plane.

    ``nccl`` maps a direction (:data:`A2F`, :data:`F2A`) to its NCCL process group; it
    is empty when tensors travel over gloo.
    """

    store: Any
    gloo: Any
    nccl: dict[str, Any] = field(default_factory=dict)
    desk: AdmissionDesk | None = None
    """Attention rank 0's admission desk (answers late hellos until the connector closes)."""


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


def _listen(host: str, port: int, where: str) -> int:
    """A socket listening on ``host:port`` only, as a file descriptor for the TCPStore.

    torch's TCPStore alone listens on every address of the machine whatever ``host``
    says; the rendezvous must be reachable only where the deployment said (loopback by
    default). The descriptor is handed over to the store.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise AFDConfigError(
            f"AFD rendezvous: afd.host {host!r} does not resolve to an address of this "
            f"machine ({exc}); set afd.host to attention rank 0's address"
        ) from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(512)
    except OSError as exc:
        sock.close()
        why = exc.strerror or exc
        raise AFDConfigError(
            f"AFD rendezvous: attention rank 0 could not listen on {where} ({why}); choose "
            "a free afd.port, and an afd.host that is an address of this machine"
        ) from exc
    return sock.detach()


def _wait_for_listener(host: str, port: int, deadline: float) -> None:
    """Wait until something listens at ``host:port`` (polling every 50 ms).

    torch's TCPStore client retries a refused connection with a growing backoff (seconds
    apart), so a rank that starts long before attention rank 0 would join several seconds
    after it; polling here makes the join follow the host's start within 0.1 s. At the
    deadline the TCPStore client below reports the failure.
    """
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1.0) as sock:
                # On loopback a connect to a port nobody listens on can pick that very
                # port as its source and connect to itself (TCP simultaneous open),
                # holding the port attention rank 0 is about to bind: not a listener.
                if sock.getsockname() != sock.getpeername():
                    return
        except OSError:
            pass
        time.sleep(0.05)


def join_store(
    *,
    config: AFDConfig,
    global_rank: int,
    label: str,
    prefix: str = "afd-p2p",
    device_identity: str | None = None,
    identity: Mapping[str, str] | None = None,
) -> tuple[Any, Any, float, AdmissionDesk | None]:
    """Open (attention rank 0: host) the TCPStore, pass admission and wait until every
    rank has joined.

    Returns ``(store, session store, deadline, desk)``: the session store holds this
    deployment's keys under ``prefix`` and its session prefix; ``deadline`` is the
    monotonic time at which the connect timeout of this rendezvous expires (a rank still
    missing then is named in the :class:`AFDTimeoutError`); ``desk`` is the host's
    admission desk, answering late hellos from a thread (None on the other ranks; the
    caller stops it when it closes). Every rank announces ``device_identity`` (its
    accelerator, or None): two ranks on one device are refused on every rank
    (:func:`check_distinct_devices`) before any backend is built. ``identity`` is this
    rank's deployment fingerprint (:mod:`afd_core.identity`), compared by the host.
    """
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore

    host, port = config.host, config.port
    topology = config.topology
    connect_timeout_s = config.connect_timeout_s
    where = f"{host}:{port}"
    world = topology.world_size
    deadline = time.monotonic() + connect_timeout_s
    is_master = global_rank == 0
    token = resolve_token(config)
    listen_fd = None
    if is_master:
        listen_fd = _listen(host, port, where)
    else:
        _wait_for_listener(host, port, deadline)
    try:
        store = TCPStore(
            host,
            port,
            world,
            is_master,
            timeout=timedelta(seconds=connect_timeout_s),
            wait_for_workers=False,
            master_listen_fd=listen_fd,
        )
    except (RuntimeError, dist.DistError) as exc:  # DistStoreError / DistNetworkError
        if is_master:
            raise AFDConfigError(
                f"AFD rendezvous: attention rank 0 could not listen on {where} "
                f"({exc}); choose a free afd.port"
            ) from exc
        raise AFDTimeoutError(
            f"AFD rendezvous: could not reach the store at {where} hosted by attention "
            f"rank 0 within {connect_timeout_s:g} s ({type(exc).__name__}: {exc}); "
            "is attention rank 0 running with the same afd.host/afd.port?"
        ) from exc

    desk: AdmissionDesk | None = None
    if is_master:
        desk = AdmissionDesk(store, config=config, token=token, identity=identity, where=where)
        session = desk.prefix
    else:
        session = apply_for_admission(
            store,
            config=config,
            rank=topology.role_rank_of(global_rank)[1],
            token=token,
            identity=identity,
            deadline=deadline,
            where=where,
            label=label,
        )
    afd_store = PrefixStore(f"{session}/{prefix}", store)
    ranks = list(range(world))
    afd_store.set(f"join/{global_rank}", device_identity or "")
    wait_for_keys(
        afd_store,
        [f"join/{g}" for g in ranks],
        ranks,
        deadline,
        "joining",
        topology,
        where,
        poll=desk.service if desk is not None else None,
    )
    if desk is not None:
        desk.start()
    devices = [afd_store.get(f"join/{g}").decode() for g in ranks]
    afd_store.set(f"devices-read/{global_rank}", "1")
    try:
        check_distinct_devices(topology, devices)
    except AFDConfigError:
        if is_master:  # the others are reading the list from this rank's store
            with contextlib.suppress(AFDTimeoutError):
                wait_for_keys(
                    afd_store,
                    [f"devices-read/{g}" for g in ranks],
                    ranks,
                    time.monotonic() + _REFUSAL_GRACE_S,
                    "refusing the deployment",
                    topology,
                    where,
                )
        if desk is not None:
            desk.stop()
        raise
    return store, afd_store, deadline, desk


def barrier(
    store: Any,
    name: str,
    *,
    topology: AFDTopology,
    global_rank: int,
    deadline: float,
    where: str,
    what: str,
) -> None:
    """Every rank sets ``name/<rank>`` and waits for all the others (missing ones named)."""
    ranks = list(range(topology.world_size))
    store.set(f"{name}/{global_rank}", "1")
    wait_for_keys(store, [f"{name}/{g}" for g in ranks], ranks, deadline, what, topology, where)


def join_data_plane(
    *,
    config: AFDConfig,
    global_rank: int,
    label: str,
    nccl_device: Any | None = None,
    nccl_timeout_s: float | None = None,
    device_identity: str | None = None,
    identity: Mapping[str, str] | None = None,
) -> DataPlaneGroup:
    """Rendezvous with every rank of ``topology`` and build the backends.

    With ``nccl_device`` two NCCL process groups are built, one per direction
    (:data:`A2F`, :data:`F2A`), with ``nccl_timeout_s`` as torch's own watchdog timeout.
    """
    topology = config.topology
    connect_timeout_s = config.connect_timeout_s
    transfer_timeout_s = config.transfer_timeout_s
    where = f"{config.host}:{config.port}"
    world = topology.world_size
    is_master = global_rank == 0
    ranks = list(range(world))
    store, afd_store, deadline, desk = join_store(
        config=config,
        global_rank=global_rank,
        label=label,
        device_identity=device_identity,
        identity=identity,
    )
    try:
        return _build_backends(
            store,
            afd_store,
            desk,
            topology=topology,
            global_rank=global_rank,
            deadline=deadline,
            connect_timeout_s=connect_timeout_s,
            transfer_timeout_s=transfer_timeout_s,
            nccl_device=nccl_device,
            nccl_timeout_s=nccl_timeout_s,
            where=where,
            is_master=is_master,
            ranks=ranks,
        )
    except BaseException:
        if desk is not None:
            desk.stop()
        raise


def _build_backends(
    store: Any,
    afd_store: Any,
    desk: AdmissionDesk | None,
    *,
    topology: AFDTopology,
    global_rank: int,
    deadline: float,
    connect_timeout_s: float,
    transfer_timeout_s: float,
    nccl_device: Any | None,
    nccl_timeout_s: float | None,
    where: str,
    is_master: bool,
    ranks: list[int],
) -> DataPlaneGroup:
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    world = topology.world_size
    transfer_timeout = timedelta(seconds=transfer_timeout_s)
    gloo = ProcessGroupGloo(PrefixStore("gloo", afd_store), global_rank, world, transfer_timeout)
    nccl: dict[str, Any] = {}
    if nccl_device is not None:
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        for direction in (A2F, F2A):
            options = ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=nccl_timeout_s or transfer_timeout_s)
            nccl[direction] = ProcessGroupNCCL(
                PrefixStore(f"nccl-{direction}", afd_store), global_rank, world, options
            )
    # Nobody leaves init (and attention rank 0 may not take the store down) before
    # every rank has finished building its backends.
    afd_store.set(f"ready/{global_rank}", "1")
    wait_for_keys(
        afd_store,
        [f"ready/{g}" for g in ranks],
        ranks,
        deadline + connect_timeout_s,
        "building the process group",
        topology,
        where,
    )
    # Attention rank 0 hosts the store: it waits until every rank has seen the
    # barrier above, so closing right after init cannot strand a rank mid-poll.
    afd_store.set(f"seen/{global_rank}", "1")
    if is_master:
        wait_for_keys(
            afd_store,
            [f"seen/{g}" for g in ranks],
            ranks,
            deadline + 2 * connect_timeout_s,
            "leaving the rendezvous",
            topology,
            where,
        )
    return DataPlaneGroup(store=store, gloo=gloo, nccl=nccl, desk=desk)
