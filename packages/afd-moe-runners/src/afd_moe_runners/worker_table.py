"""The vLLM workers that micro-batch the Attention role, as registered by the runtime.

With ``afd.num_micro_batches`` > 1 the Attention engine must run a worker that splits
each step into micro-batches (:mod:`afd_moe_runners.micro_batching`). Those workers
belong to the runtime that provides them (``afd.runtime.worker``, registered by the
vLLM plugin in every vLLM process): this package checks an engine's ``worker_cls``
against what was registered here and names no worker of an upper layer itself.
Nothing here imports torch or vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["is_micro_batch_worker", "micro_batch_worker", "register_micro_batch_workers"]

_by_device: dict[str, str] = {}
_accepted: set[str] = set()


def register_micro_batch_workers(
    by_device: Mapping[str, str], *, aliases: Iterable[str] = ()
) -> None:
    """Register the ``--worker-cls`` qualified names per vLLM device type (``"cpu"``,
    ``"cuda"``...); ``aliases``: other names of the same workers, accepted too.
    Idempotent; a later registration for a device replaces the earlier one."""
    _by_device.update(by_device)
    _accepted.update(by_device.values())
    _accepted.update(aliases)


def micro_batch_worker(device: str) -> str | None:
    """The ``--worker-cls`` that micro-batches on ``device``, or None (none registered)."""
    return _by_device.get(device)


def is_micro_batch_worker(worker_cls: str) -> bool:
    """Whether ``worker_cls`` (vLLM's ``parallel_config.worker_cls``) is a registered
    micro-batching worker."""
    return worker_cls in _accepted
