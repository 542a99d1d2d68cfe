"""Which of vLLM's model runners an AFD role runs on: V1 only.

vLLM 0.32 has two model runners. Its V2 runner (``vllm/v1/worker/gpu/``, also the base
of the CPU V2 runner) is its choice on CUDA with triton unless
``VLLM_USE_V2_MODEL_RUNNER=0``; the CPU build has no triton, takes V1, and refuses
``VLLM_USE_V2_MODEL_RUNNER=1`` itself ("Model Runner V2 requires Triton"). afd runs on
the V1 runner only:

* the Attention role's micro-batching (:mod:`afd_moe_runners.micro_batching`) hooks V1
  runner methods that V2 does not have (V2 splits micro-batches in its own
  ``UBatchRunner``);
* the scheduler must agree with the worker. vLLM decides per process, from the config
  each process holds: the AFD worker's ``parallel_config.ubatch_size = m`` makes its
  own copy resolve to V1 (vLLM's V2 runner takes micro-batching only when the variable
  is set explicitly) while the engine core's scheduler, which never sees that setting,
  resolves to V2 and sends V2-style scheduler output (resumed requests as new ones,
  ``all_token_ids`` left out): wrong tokens or a KeyError after a preemption;
* no V2 run of afd has been verified (it cannot run on vLLM's CPU build).

So the decision is the same on every platform: a role whose engine resolves to V2 is
refused, naming the variable. ``afd serve`` (so every role ``afd launch`` starts) sets
``VLLM_USE_V2_MODEL_RUNNER=0`` for its whole process tree when it is unset
(:func:`serve_environment_problem`); the model build and the AFD worker refuse an engine
that still resolves to V2 (:func:`model_runner_problem`; a hand-started ``vllm serve``).

Nothing here imports torch or vLLM: the CLI checks before starting anything.
"""

from __future__ import annotations

from collections.abc import MutableMapping

__all__ = ["V2_RUNNER_ENV", "model_runner_problem", "serve_environment_problem"]

V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"

_WHY = (
    "afd runs on vLLM's V1 model runner only (its micro-batching hooks V1 runner methods, "
    "the scheduler and the worker must use the same runner, and no V2 run of afd has been "
    "verified)"
)


def model_runner_problem(uses_v2_model_runner: bool, *, role: str) -> str | None:
    """Why this AFD ``role`` cannot run on the engine's model runner, or None.

    ``uses_v2_model_runner``: vLLM's own resolution of the engine's config
    (``VllmConfig.use_v2_model_runner``: the variable, else triton and V2's feature
    list), read before afd changes the config (the AFD worker's ``ubatch_size``)."""
    if not uses_v2_model_runner:
        return None
    return (
        f"the AFD {role} role would run on vLLM's V2 model runner (vLLM's default on CUDA "
        f"with triton); {_WHY}. Start every process of the deployment with "
        f"{V2_RUNNER_ENV}=0 (afd serve and afd launch set it when it is unset)"
    )


def serve_environment_problem(environ: MutableMapping[str, str], *, role: str) -> str | None:
    """``afd serve``: set ``VLLM_USE_V2_MODEL_RUNNER=0`` in ``environ`` when unset (the
    process and every process it starts then use the V1 runner); return why an explicit
    value is refused (V2 asked for, or not an integer as vLLM reads it), else None."""
    raw = environ.get(V2_RUNNER_ENV)
    if raw is None:
        environ[V2_RUNNER_ENV] = "0"
        return None
    try:
        asks_v2 = bool(int(raw))  # vLLM's envs.maybe_convert_bool
    except ValueError:
        return f"{V2_RUNNER_ENV}={raw!r} is not 0 or 1; afd needs {V2_RUNNER_ENV}=0 or unset"
    if not asks_v2:
        return None
    return (
        f"{V2_RUNNER_ENV}={raw} asks for vLLM's V2 model runner, which the AFD {role} role "
        f"does not run on; {_WHY}. Unset it or set {V2_RUNNER_ENV}=0"
    )
