"""vLLM workers of the AFD Attention role when it micro-batches (``--worker-cls``).

``afd.num_micro_batches`` = m > 1 makes the Attention role split each step into m
micro-batches and pipeline them against the FFN role
(:mod:`afd_moe_runners.micro_batching`). Two things must happen in the worker, before
vLLM builds its attention metadata builders:

* ``parallel_config.ubatch_size = m``: vLLM then creates one metadata builder per
  micro-batch and runs its own prefix-cache check (a step whose prefix-cache reader
  and writer would land in different micro-batches is never split). vLLM's config
  check refuses ``--ubatch-size`` without DeepEP kernels, so it is set here, after it;
  vLLM's own micro-batching stays off (the AFD runner never lets it split).
* the model runner gets :class:`~afd_moe_runners.micro_batching.MicroBatchModelRunner`.

First the worker refuses an engine whose config resolves to vLLM's V2 model runner (its
CUDA default): ``ubatch_size`` turns only this copy of the config to V1, while the engine
core's scheduler keeps V2 (:mod:`afd_moe_runners.model_runner_choice`;
``VLLM_USE_V2_MODEL_RUNNER=0``, which ``afd serve`` sets, avoids it).

``afd serve`` / ``afd launch`` pass ``--worker-cls afd.runtime.worker.AFDCPUWorker`` (or
``AFDGPUWorker`` on CUDA) for the Attention role when m > 1; the AFD model refuses to
build with m > 1 under any other worker. With m = 1 (or on the FFN role) these workers
behave exactly like vLLM's.
"""

from __future__ import annotations

import logging
from typing import Any

from afd_core.config import AFDRole, afd_config_of
from afd_core.errors import AFDConfigError

logger = logging.getLogger(__name__)

__all__ = ["WORKERS", "micro_batches_of", "register_workers"]
# plus AFDCPUWorker and AFDGPUWorker, built on first access

#: ``--worker-cls`` of the Attention role with ``afd.num_micro_batches`` > 1, per vLLM
#: device type. The table lives here, with the workers; the plugin registers it
#: (:func:`register_workers`) for the model's start-up check in ``afd_moe_runners``.
WORKERS = {"cpu": f"{__name__}.AFDCPUWorker", "cuda": f"{__name__}.AFDGPUWorker"}
#: The names the workers had before they moved into the runtime room (``afd.worker``,
#: kept as an alias module): still accepted.
FORMER_NAMES = ("afd.worker.AFDCPUWorker", "afd.worker.AFDGPUWorker")


def register_workers() -> None:
    """Tell ``afd_moe_runners`` which workers micro-batch (idempotent, imports nothing
    heavy); the vLLM plugin calls it in every vLLM process."""
    from afd_moe_runners.worker_table import register_micro_batch_workers

    register_micro_batch_workers(WORKERS, aliases=FORMER_NAMES)


def micro_batches_of(vllm_config: Any) -> int:
    """``afd.num_micro_batches`` of an Attention-role config (1 for anything else)."""
    afd = afd_config_of(vllm_config)
    return afd.num_micro_batches if afd is not None and afd.role is AFDRole.ATTENTION else 1


def _min_tokens_of(vllm_config: Any) -> int:
    """``afd.micro_batch_min_tokens`` of a config (0 without an AFD section)."""
    afd = afd_config_of(vllm_config)
    return 0 if afd is None else afd.micro_batch_min_tokens


def _prepare(vllm_config: Any) -> int:
    register_workers()  # the model's start-up check accepts this worker (plugin or not)
    m = micro_batches_of(vllm_config)
    # Before ubatch_size is set: it turns this copy of the config to vLLM's V1 model
    # runner while the engine core's scheduler, which never sees it, may resolve to V2.
    from afd_moe_runners.model_runner_choice import model_runner_problem

    problem = model_runner_problem(bool(vllm_config.use_v2_model_runner), role="attention")
    if problem is not None:
        raise AFDConfigError(f"AFD worker: {problem}")
    if m > 1:
        vllm_config.parallel_config.ubatch_size = m
    return m


def _install(worker: Any, m: int) -> None:
    if m > 1:
        from afd_moe_runners.micro_batching import install_micro_batching

        install_micro_batching(worker.model_runner, m, _min_tokens_of(worker.vllm_config))


def _worker_class(base: type, name: str) -> type:
    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        self.afd_num_micro_batches = _prepare(vllm_config)
        base.__init__(self, vllm_config, *args, **kwargs)  # type: ignore[misc]

    def init_device(self: Any) -> None:
        base.init_device(self)  # type: ignore[attr-defined]
        _install(self, self.afd_num_micro_batches)

    doc = f"vLLM's ``{base.__module__}.{base.__qualname__}`` plus AFD micro-batching."
    return type(
        name,
        (base,),
        {"__init__": __init__, "init_device": init_device, "__doc__": doc, "__module__": __name__},
    )


def __getattr__(name: str) -> Any:
    # Resolved lazily: the CPU worker imports vllm's CPU platform code, the GPU worker
    # CUDA code; each only where it is used.
    if name == "AFDCPUWorker":
        from vllm.v1.worker.cpu_worker import CPUWorker

        cls = _worker_class(CPUWorker, name)
    elif name == "AFDGPUWorker":
        from vllm.v1.worker.gpu_worker import Worker

        cls = _worker_class(Worker, name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = cls
    return cls
