"""Ping-pong micro-batching of the Attention role (``afd.num_micro_batches`` = m > 1).

With one batch per step the two roles take turns: the FFN role idles while the
Attention role computes attention, and the Attention role idles while the FFN role
computes the experts. With m micro-batches the Attention role computes micro-batch
i+1 of layer L while the FFN role computes micro-batch i of layer L, so both roles
work at once (MegaScale-Infer's ping-pong pipeline, vLLM's dual-batch overlap).

Three pieces, each small:

* **The plan** (:func:`plan_micro_batches`): the step's requests split at request
  boundaries into m contiguous groups with balanced token counts, as vLLM's own
  ``UBatchSlice`` values (``vllm/v1/worker/ubatch_utils.py``). A step with fewer
  requests than m, or fewer tokens than ``afd.micro_batch_min_tokens``, is not split
  (m = 1 for that step).
* **The model runner** (:class:`MicroBatchModelRunner`, mixed into vLLM's runner by
  the AFD worker, ``afd.runtime.worker``): vLLM 0.32 only micro-batches under data
  parallelism with DeepEP kernels, and turns DBO off on CPU, but its runner already
  knows how to build one attention metadata / slot mapping per micro-batch when given
  ``ubatch_slices``. The mixin hands it the plan (and never lets vLLM split a step on
  its own), then puts the plan into the step's forward context.
* **The scheduler** (:class:`PingPongScheduler`): one thread per micro-batch, exactly
  one running at a time. Each runs the native model forward on its slice under its own
  forward context; an AFD layer sends its payload and calls the scheduler's
  ``yield_turn`` (the runners' existing yield point), which hands the turn to the next
  micro-batch and returns when the FFN role has had time to answer. The FFN role
  serves messages in arrival order and needs no change.

With several attention ranks (vLLM data parallelism) the FFN role takes one message
per rank for each (layer, micro-batch), so every rank must send the same sequence
every step: a rank with fewer real micro-batches than m (one request, or vLLM's dummy
step on an idle rank) adds *shadow* micro-batches that send zero tokens for each layer
the real ones send.

Nothing here depends on the device: the same scheduler runs wherever the connector's
send/receive are blocking calls (gloo and shared memory on CPU, NCCL on CUDA). On CUDA
the micro-batch threads run on their starter's device and stream
(:mod:`afd_moe_runners.micro_batch_threads`).

Over 400 lines on purpose: the plan, the runner mixin and the scheduler share the step's
forward-context state, which this module alone owns.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from vllm.config import CUDAGraphMode
from vllm.v1.worker.ubatch_utils import UBatchSlice

from afd_core.connector import AFDConnector
from afd_core.errors import AFDConfigError
from afd_core.forward_context import AFD_CONTEXT_KEY, AFDStepMetadata
from afd_core.transfer import AttentionToFFN
from afd_moe_runners._vllm_compat import activate_forward_context
from afd_moe_runners.exchange import send_to_ffn
from afd_moe_runners.micro_batch_threads import start_thread, starter_placement, wait_for_threads

logger = logging.getLogger(__name__)

__all__ = [
    "MICRO_BATCH_PLAN_KEY",
    "MicroBatchModelRunner",
    "PingPongScheduler",
    "install_micro_batching",
    "plan_micro_batches",
    "run_micro_batches",
]

MICRO_BATCH_PLAN_KEY = "afd.micro_batch_plan"
"""``ForwardContext.additional_kwargs`` key of the step's plan (a list of ``UBatchSlice``)."""

_PAYLOAD_FIELDS = ("hidden_states", "topk_ids", "topk_weights", "router_logits", "token_ids")

#: ``cudagraph_runtime_mode`` of a split micro-batch (see :func:`run_micro_batches`).
_NO_GRAPHS = CUDAGraphMode.NONE


def plan_micro_batches(
    num_scheduled_tokens: Sequence[int] | np.ndarray,
    num_micro_batches: int,
    min_tokens: int = 0,
) -> list[UBatchSlice] | None:
    """Split a step's requests into ``num_micro_batches`` contiguous groups.

    Split points are request boundaries chosen so that the groups' token counts are as
    even as the requests allow (a long prefill is never cut in two). None when m is 1,
    when the step has fewer requests than micro-batches, or when it schedules fewer than
    ``min_tokens`` tokens (``afd.micro_batch_min_tokens``): the step runs whole.
    """
    m = int(num_micro_batches)
    tokens = np.asarray(num_scheduled_tokens, dtype=np.int64)
    n = int(tokens.shape[0])
    if m <= 1 or n < m or int(tokens.min(initial=1)) <= 0:
        return None
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(tokens, out=cu[1:])
    total = int(cu[-1])
    if total < min_tokens:
        return None
    bounds = [0]
    for k in range(1, m):
        lo, hi = bounds[-1] + 1, n - (m - k)  # leave at least one request per group
        target = total * k / m
        candidates = np.arange(lo, hi + 1)
        best = int(candidates[np.argmin(np.abs(cu[candidates] - target))])
        bounds.append(best)
    bounds.append(n)
    return [
        UBatchSlice(
            request_slice=slice(bounds[i], bounds[i + 1]),
            token_slice=slice(int(cu[bounds[i]]), int(cu[bounds[i + 1]])),
        )
        for i in range(m)
    ]


class _Aborted(Exception):
    """Another micro-batch failed: this one stops at its next yield point."""


class PingPongScheduler:
    """Runs m micro-batch bodies in turn; one runs at a time, the turn passes at yields.

    Body 0 runs on the calling thread, the others on threads of their own (started per
    step; a thread costs ~0.1 ms, a step several ms) on the calling thread's CUDA device
    and stream, which waits for their work before :meth:`run` returns the outputs.
    Before a body runs, and every time it gets the turn back, its own forward context is
    made current (vLLM keeps the current forward context in one module global, as vLLM's
    DBO threads also do).
    The first exception of any body is re-raised by :meth:`run` after the others
    stopped at their next yield point.
    """

    def __init__(self, contexts: Sequence[Any]) -> None:
        self._contexts = list(contexts)
        self._m = len(self._contexts)
        self._cond = threading.Condition()
        self._turn = 0
        self._done = [False] * self._m
        self._error: BaseException | None = None
        # (layer, zero-row payload) of each send of micro-batch 0, in order: what the
        # shadow micro-batches mirror.
        self.templates: list[tuple[int, AttentionToFFN]] = []
        self.turns: list[tuple[int, int]] = []
        """(layer, micro-batch) of every yield, in order (for tests and logs)."""

    # -- MicroBatchScheduler protocol --------------------------------------------------
    def on_send(self, layer_idx: int, micro_batch_idx: int, payload: Any) -> None:
        if micro_batch_idx == 0:
            empty = {
                name: None if (t := getattr(payload, name)) is None else t[:0]
                for name in _PAYLOAD_FIELDS
            }
            self.templates.append((layer_idx, AttentionToFFN(**empty)))

    def yield_turn(self, layer_idx: int, micro_batch_idx: int) -> None:
        i = micro_batch_idx
        with self._cond:
            self.turns.append((layer_idx, i))
            self._pass_turn(i)
            self._cond.wait_for(lambda: self._turn == i or self._error is not None)
            if self._error is not None:
                raise _Aborted
        activate_forward_context(self._contexts[i])

    # -- running -----------------------------------------------------------------------
    def _pass_turn(self, i: int) -> None:
        for step in range(1, self._m + 1):
            j = (i + step) % self._m
            if not self._done[j]:
                self._turn = j
                break
        self._cond.notify_all()

    def _body(
        self, i: int, fn: Callable[[], Any], results: list[Any], grad: tuple[bool, bool]
    ) -> None:
        inference, enabled = grad
        try:
            activate_forward_context(self._contexts[i])
            if inference:
                with torch.inference_mode():
                    results[i] = fn()
            else:
                with torch.set_grad_enabled(enabled):
                    results[i] = fn()
        except _Aborted:
            pass
        except BaseException as exc:  # re-raised by run()
            with self._cond:
                if self._error is None:
                    self._error = exc
                self._cond.notify_all()
        finally:
            with self._cond:
                self._done[i] = True
                if self._turn == i:
                    self._pass_turn(i)
                self._cond.notify_all()

    def _thread(
        self, i: int, fn: Callable[[], Any], results: list[Any], grad: tuple[bool, bool]
    ) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == i or self._error is not None)
            if self._error is not None:
                self._done[i] = True
                self._cond.notify_all()
                return
        self._body(i, fn, results, grad)

    def run(self, bodies: Sequence[Callable[[], Any]], *, restore: Any) -> list[Any]:
        """Run ``bodies`` (one per context) to completion; make ``restore`` current after."""
        if len(bodies) != self._m:
            raise ValueError(f"expected {self._m} micro-batch bodies, got {len(bodies)}")
        results: list[Any] = [None] * self._m
        grad = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        placement = starter_placement()
        threads = [
            start_thread(
                self._thread, (i, bodies[i], results, grad),
                name=f"afd-micro-batch-{i}", placement=placement,
            )
            for i in range(1, self._m)
        ]  # fmt: skip
        try:
            self._body(0, bodies[0], results, grad)
            with self._cond:
                self._cond.wait_for(lambda: all(self._done))
            for t in threads:
                t.join()
        finally:
            activate_forward_context(restore)
        if self._error is not None:
            raise self._error
        wait_for_threads(placement)
        return results


def _slice_positions(positions: torch.Tensor, s: slice) -> torch.Tensor:
    # M-RoPE positions are [sections, tokens]; plain positions are [tokens].
    return positions[..., s] if positions.dim() == 2 else positions[s]


def run_micro_batches(
    forward: Callable[..., Any],
    ctx: Any,
    connector: AFDConnector,
    num_micro_batches: int,
    plan: Sequence[UBatchSlice] | None,
    input_ids: torch.Tensor | None,
    positions: torch.Tensor,
    inputs_embeds: torch.Tensor | None,
    num_tokens: int | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Run ``forward(input_ids, positions, None, inputs_embeds, **kwargs)`` per micro-batch.

    ``plan`` None: the whole batch is micro-batch 0 (its metadata is the step's own, and
    of its rows the first ``num_tokens`` carry tokens: None all,
    :func:`afd_moe_runners.role_runtime.real_token_count`) and micro-batches 1..m-1 are
    shadows. Otherwise ``ctx.attn_metadata`` and ``ctx.slot_mapping`` are vLLM's
    per-micro-batch lists for ``plan`` (a planned step has no padding rows);
    micro-batches past ``len(plan)`` are shadows.

    CUDA graphs: a split micro-batch runs with ``cudagraph_runtime_mode`` NONE and no
    batch descriptor (its compiled pieces run without graph replay). The step's mode and
    descriptor name graphs captured for the whole batch's token count; a piecewise graph
    replayed for a micro-batch would read and write the whole batch's addresses. The
    whole batch (``plan`` None) keeps the step's own mode.
    """
    m = num_micro_batches
    real = 1 if plan is None else len(plan)
    if real > m:
        raise AFDConfigError(f"micro-batch plan of {real} slices for num_micro_batches={m}")
    rows = int(positions.shape[-1])
    slices = [slice(0, rows)] if plan is None else [p.token_slice for p in plan]
    contexts: list[Any] = []
    scheduler_box: list[PingPongScheduler] = []

    def meta(i: int) -> AFDStepMetadata:
        return AFDStepMetadata(
            connector=connector, micro_batch_idx=i, num_micro_batches=m,
            num_tokens=num_tokens if plan is None and i == 0 else None,
            scheduler=scheduler_box[0],
        )  # fmt: skip

    for i in range(m):
        if plan is None or i >= real:
            contexts.append(dataclasses.replace(ctx, additional_kwargs=dict(ctx.additional_kwargs)))
            continue
        s = slices[i]
        contexts.append(
            dataclasses.replace(
                ctx,
                attn_metadata=ctx.attn_metadata[i],
                slot_mapping=ctx.slot_mapping[i] if isinstance(ctx.slot_mapping, list) else {},
                is_padding=None if ctx.is_padding is None else ctx.is_padding[s],
                cudagraph_runtime_mode=_NO_GRAPHS,
                batch_descriptor=None,
                additional_kwargs=dict(ctx.additional_kwargs),
            )
        )
    scheduler = PingPongScheduler(contexts)
    scheduler_box.append(scheduler)
    for i, c in enumerate(contexts):
        c.additional_kwargs[AFD_CONTEXT_KEY] = meta(i)

    def real_body(s: slice) -> Callable[[], Any]:
        def body() -> Any:
            return forward(
                None if input_ids is None else input_ids[s],
                _slice_positions(positions, s),
                None,
                None if inputs_embeds is None else inputs_embeds[s],
                **kwargs,
            )

        return body

    def shadow_body(i: int) -> Callable[[], Any]:
        def body() -> Any:
            k = 0
            while k < len(scheduler.templates):
                layer, empty = scheduler.templates[k]
                pending = send_to_ffn(empty, layer_idx=layer)
                scheduler.yield_turn(layer, i)
                pending.receive()
                k += 1
            return None

        return body

    bodies = [real_body(slices[i]) if i < real else shadow_body(i) for i in range(m)]
    outputs = scheduler.run(bodies, restore=ctx)[:real]
    for out in outputs:
        if not isinstance(out, torch.Tensor):
            raise AFDConfigError(
                f"micro-batching needs a model forward that returns the hidden states "
                f"tensor, got {type(out).__name__}; set afd.num_micro_batches=1"
            )
    return outputs[0] if real == 1 else torch.cat(outputs, dim=0)


# -- vLLM model runner -----------------------------------------------------------------


def _bind(
    method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> inspect.BoundArguments:
    bound = inspect.signature(method).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


class MicroBatchModelRunner:
    """Mixed into vLLM's GPU/CPU model runner (v1) by :func:`install_micro_batching`.

    Overrides four runner methods, each only to pass the AFD plan through (see
    ``_vllm_compat.PRIVATE_VLLM_SYMBOLS`` for the signatures the drift test pins):

    * ``execute_model``: marks a real step (warm-up and dummy runs are never split);
    * ``_determine_batch_execution_and_padding``: never lets vLLM micro-batch on its
      own (vLLM's split is token-balanced and may cut a request); makes the AFD plan
      when vLLM's prefix-cache check (``allow_microbatching``) allows a split;
    * ``_get_slot_mappings`` / ``_build_attention_metadata``: given the plan as
      ``ubatch_slices``, vLLM builds one slot mapping and one attention metadata per
      micro-batch with its own ``split_attn_metadata`` and per-micro-batch builders;
    * ``_model_forward`` (vLLM's documented override point): stores the plan in the
      forward context, where the AFD model's forward finds it.
    """

    afd_num_micro_batches: int = 1
    afd_micro_batch_min_tokens: int = 0
    _afd_in_step: bool = False
    _afd_plan: list[UBatchSlice] | None = None

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        self._afd_in_step = True
        try:
            return super().execute_model(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._afd_in_step = False
            self._afd_plan = None

    def _determine_batch_execution_and_padding(self, *args: Any, **kwargs: Any) -> Any:
        base = super()._determine_batch_execution_and_padding  # type: ignore[misc]
        bound = _bind(base, args, kwargs)
        allow = bool(bound.arguments["allow_microbatching"])
        bound.arguments["allow_microbatching"] = False
        result = base(*bound.args, **bound.kwargs)
        self._afd_plan = None
        if self._afd_in_step and allow:
            num_tokens = int(bound.arguments["num_tokens"])
            num_reqs = int(bound.arguments["num_reqs"])
            batch_descriptor = result[1]
            if int(batch_descriptor.num_tokens) == num_tokens:  # no padded rows
                tokens = bound.arguments["num_scheduled_tokens_np"][:num_reqs]
                self._afd_plan = plan_micro_batches(
                    tokens, self.afd_num_micro_batches, self.afd_micro_batch_min_tokens
                )
        return result

    def _with_plan(
        self, method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        bound = _bind(method, args, kwargs)
        if self._afd_plan is not None and bound.arguments.get("ubatch_slices") is None:
            bound.arguments["ubatch_slices"] = self._afd_plan
        return method(*bound.args, **bound.kwargs)

    def _get_slot_mappings(self, *args: Any, **kwargs: Any) -> Any:
        return self._with_plan(super()._get_slot_mappings, args, kwargs)  # type: ignore[misc]

    def _build_attention_metadata(self, *args: Any, **kwargs: Any) -> Any:
        return self._with_plan(super()._build_attention_metadata, args, kwargs)  # type: ignore[misc]

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        plan, self._afd_plan = self._afd_plan, None
        if plan is not None:
            from vllm.forward_context import get_forward_context

            get_forward_context().additional_kwargs[MICRO_BATCH_PLAN_KEY] = plan
        return super()._model_forward(*args, **kwargs)  # type: ignore[misc]


_RUNNER_METHODS = (
    "execute_model",
    "_determine_batch_execution_and_padding",
    "_get_slot_mappings",
    "_build_attention_metadata",
    "_model_forward",
)


def install_micro_batching(model_runner: Any, num_micro_batches: int, min_tokens: int = 0) -> None:
    """Make ``model_runner`` (a vLLM v1 GPU/CPU model runner) plan AFD micro-batches:
    ``num_micro_batches`` per step with at least ``min_tokens`` scheduled tokens.

    Called by the AFD worker right after vLLM built the runner: the runner's class is
    replaced by a subclass that adds :class:`MicroBatchModelRunner` in front (the runner
    is built inside the worker's ``init_device``; subclassing the worker alone cannot
    choose its class without copying that method).
    """
    base = type(model_runner)
    missing = [name for name in _RUNNER_METHODS if not hasattr(base, name)]
    if missing:
        raise AFDConfigError(
            f"afd.num_micro_batches={num_micro_batches} needs vLLM's v1 model runner; "
            f"{base.__module__}.{base.__qualname__} has no {missing} (is the V2 model "
            "runner enabled? set VLLM_USE_V2_MODEL_RUNNER=0)"
        )
    if not isinstance(model_runner, MicroBatchModelRunner):
        cls = type(f"AFDMicroBatch{base.__name__}", (MicroBatchModelRunner, base), {})
        model_runner.__class__ = cls
    model_runner.afd_num_micro_batches = int(num_micro_batches)
    model_runner.afd_micro_batch_min_tokens = int(min_tokens)
    logger.info(
        "AFD attention role: ping-pong micro-batching with %d micro-batches per step "
        "(steps with fewer requests%s run whole)",
        num_micro_batches,
        f" or fewer than {min_tokens} tokens" if min_tokens > 0 else "",
    )
