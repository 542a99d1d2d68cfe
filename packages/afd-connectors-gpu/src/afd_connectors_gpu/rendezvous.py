"""The gloo / NCCL data plane, built on afd-core's connect phase.

:func:`afd_core.connect.connect_phase` does what every transport shares: the
``torch.distributed.TCPStore`` that attention rank 0 hosts at ``config.host:config.port``,
admission (token, rank, deployment fingerprint: :mod:`afd_core.admission`) and the join
of every rank (a missing peer named instead of an opaque gloo timeout, two ranks on one
device refused). Here only the bytes' set-up is left: a gloo backend (and, for NCCL, two
more backends, one per direction) from the deployment's session store. The host keeps
answering late hellos (refusing them) until its connector closes.

This does what ``vllm.distributed.utils.stateless_init_torch_distributed_process_group``
does (a process group that never becomes torch's default group, so it coexists
with the world group vLLM sets up in its workers), but it builds the gloo backend
directly from torch: importing vLLM costs ~4 s per process, which the connector
does not need, and the join step wants the store itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from afd_core.admission import AdmissionDesk
from afd_core.config import AFDConfig
from afd_core.connect import (
    Session,
    TCPRendezvous,
    check_distinct_devices,
    connect_phase,
    describe_global_rank,
    wait_for_keys,
)
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

#: Directions of tensor traffic; with NCCL each has a communicator (a stream) of its own.
A2F = "a2f"
F2A = "f2a"


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


def join_store(
    *,
    config: AFDConfig,
    global_rank: int,
    label: str,
    prefix: str = "afd-p2p",
    device_identity: str | None = None,
    identity: Mapping[str, str] | None = None,
) -> tuple[Any, Any, float, AdmissionDesk | None]:
    """afd-core's connect phase over the TCP store at ``afd.host:afd.port``
    (:func:`afd_core.connect.connect_phase`), as ``(store, session store, deadline,
    desk)``: the session store holds this deployment's keys under ``prefix`` and its
    session prefix; ``desk`` is the host's admission desk (None on the other ranks; the
    caller stops it when it closes)."""
    session = join_session(
        config=config,
        global_rank=global_rank,
        label=label,
        prefix=prefix,
        device_identity=device_identity,
        identity=identity,
    )
    return session.store, session.keys, session.deadline, session.desk


def join_session(
    *,
    config: AFDConfig,
    global_rank: int,
    label: str,
    prefix: str,
    device_identity: str | None = None,
    identity: Mapping[str, str] | None = None,
) -> Session:
    """:func:`~afd_core.connect.connect_phase` over :class:`~afd_core.connect.TCPRendezvous`."""
    return connect_phase(
        config,
        global_rank=global_rank,
        label=label,
        backend=TCPRendezvous(config),
        prefix=prefix,
        identity=identity,
        device_identity=device_identity,
    )


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
    """afd-core's connect phase, then the backends.

    With ``nccl_device`` two NCCL process groups are built, one per direction
    (:data:`A2F`, :data:`F2A`), with ``nccl_timeout_s`` as torch's own watchdog timeout.
    """
    session = join_session(
        config=config,
        global_rank=global_rank,
        label=label,
        prefix="afd-p2p",
        device_identity=device_identity,
        identity=identity,
    )
    try:
        return _build_backends(session, nccl_device=nccl_device, nccl_timeout_s=nccl_timeout_s)
    except BaseException:
        session.close()
        raise


def _build_backends(
    session: Session, *, nccl_device: Any | None, nccl_timeout_s: float | None
) -> DataPlaneGroup:
    """The bytes' set-up: gloo (frames, and CPU tensors) and, for NCCL, one process group
    per direction, on the session store."""
    from torch.distributed import PrefixStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    config, global_rank, afd_store = session.config, session.global_rank, session.keys
    world = session.topology.world_size
    transfer_timeout_s = config.transfer_timeout_s
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
    session.barrier(
        "ready",
        "building the process group",
        deadline=session.deadline + config.connect_timeout_s,
    )
    session.leave(deadline=session.deadline + 2 * config.connect_timeout_s)
    return DataPlaneGroup(store=session.store, gloo=gloo, nccl=nccl, desk=session.desk)
