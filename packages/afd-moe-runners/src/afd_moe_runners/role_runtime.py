"""A role model's connector lifecycle and per-step hooks (:class:`RoleRuntime`).

One :class:`RoleRuntime` per role-aware model, made after its construction: it checks
the parameter inventory against the role's plan, and on the Attention role creates the
connector the plan's layout asks for (the rank's own; one per expert plane under FFN
expert parallelism; TP worker 0's behind a tensor-parallel wrapper), connects it,
records fatal errors for the server's exit code, closes it at exit, installs each
step's AFD metadata in vLLM's forward context and runs the step whole or as
micro-batches (:mod:`afd_moe_runners.micro_batching`).
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available

from afd_core.config import AFDConfig, AFDRole
from afd_core.connector import AFDConnector
from afd_core.errors import (
    AFDConfigError,
    AFDPeerLostError,
    AFDTimeoutError,
    AFDTransferMismatchError,
)
from afd_core.forward_context import AFDStepMetadata, set_step_metadata
from afd_core.lifecycle import record_exit_reason
from afd_core.registry import create_connector
from afd_core.weights import RoleWeightStats
from afd_moe_runners.deployment_plan import DeploymentPlan, resolve_plan
from afd_moe_runners.inventory import forbidden_categories, parameter_inventory, role_identity
from afd_moe_runners.metrics import attention_peers_changed, attention_step_ended

logger = logging.getLogger(__name__)

__all__ = ["RoleRuntime", "real_token_count"]


# Errors that stop the role; recorded for the server's exit code (afd_core.lifecycle).
_FATAL = (AFDPeerLostError, AFDTimeoutError, AFDTransferMismatchError, AFDConfigError)


class RoleRuntime:
    """Per-process AFD state of one role-aware model: connector, step metadata, checks."""

    def __init__(
        self,
        model: nn.Module,
        afd: AFDConfig,
        vllm_config: VllmConfig,
        *,
        inventory: Callable[[nn.Module], dict[str, int]] = parameter_inventory,
        plan: DeploymentPlan | None = None,
    ) -> None:
        """``inventory``: parameters per category of a model (default: by name markers,
        :func:`~afd_moe_runners.inventory.parameter_inventory`; the generic path passes
        its split plan's). ``plan``: the role's deployment plan, resolved at start-up
        (:func:`afd_moe_runners.start_up.start_role`); resolved here when not given."""
        self._model = weakref.ref(model)
        self._inventory = inventory
        self.afd = afd
        self.plan = plan if plan is not None else resolve_plan(afd, vllm_config)
        self.inventory: dict[str, int] = {}
        self.weight_stats = RoleWeightStats()
        self.connector: AFDConnector | None = None
        self.rank = self.plan.rank
        self._text_config = getattr(vllm_config.model_config, "hf_text_config", None)
        self._check_inventory(model, when="construction")
        self.tp_rank = self.plan.tensor_parallel_rank
        self.tp_size = self.plan.tensor_parallel_size
        if self.plan.role is AFDRole.ATTENTION:
            self.connector = self._attention_connector(model, vllm_config, afd)
            if self.tp_rank > 0:
                logger.info(
                    "AFD attention rank %d, TP worker %d/%d: takes each FFN answer from TP "
                    "worker 0 (broadcast)",
                    self.rank,
                    self.tp_rank,
                    self.tp_size,
                )
                return
            logger.info(
                "AFD attention rank %d: connecting to the FFN role via %s at %s:%d "
                "(waits up to %.0f s for the FFN server)",
                self.rank,
                afd.connector,
                afd.host,
                afd.port,
                afd.connect_timeout_s,
            )
            try:
                self.connector.init()
            except _FATAL as exc:
                record_exit_reason(f"AFD connector start failed: {type(exc).__name__}: {exc}")
                raise
            atexit.register(self.close)
            logger.info("AFD attention rank %d: connected", self.rank)
            self._peers_changed(connected=True)

    def _attention_connector(
        self, model: nn.Module, vllm_config: VllmConfig, afd: AFDConfig
    ) -> AFDConnector:
        """This worker's connector: the rank's own; under tensor parallelism TP worker
        0's wrapped in a :class:`TensorParallelExchange` (the others hold none)."""
        if self.tp_size == 1:
            return self._rank_connector(model, vllm_config, afd)
        from afd_moe_runners.tensor_parallel import TensorParallelExchange

        inner = None
        if self.tp_rank == 0:
            inner = self._rank_connector(model, vllm_config, afd)
        return TensorParallelExchange(
            afd, rank=self.rank, tp_rank=self.tp_rank, tp_size=self.tp_size, inner=inner
        )

    def _rank_connector(
        self, model: nn.Module, vllm_config: VllmConfig, afd: AFDConfig
    ) -> AFDConnector:
        """The attention rank's exchange with the FFN role: one connector, or with
        ``afd.ffn_expert_parallel`` one per FFN rank (its expert plane) behind an
        :class:`~afd_moe_runners.expert_parallel.ExpertParallelExchange`."""
        identity = role_identity(model, vllm_config, afd, plan=self.plan)
        if not self.plan.ffn_expert_parallel:
            return create_connector(afd, rank=self.rank, identity=identity)
        from afd_core.admission import assembling
        from afd_moe_runners.expert_parallel import (
            ExpertParallelExchange,
            has_shared_experts,
            routed_experts_of,
        )

        n = self.plan.num_ffn_ranks
        # One rendezvous per expert plane, joined one after another: a rank claimed twice
        # at a plane that already assembled stops the planes still waiting (`assembling`).
        with assembling():
            planes = [
                create_connector(
                    afd.expert_plane(f),
                    rank=self.rank,
                    identity={**identity, "expert_shard": f"{f}/{n}"},
                )
                for f in range(n)
            ]
        text = vllm_config.model_config.hf_text_config
        return ExpertParallelExchange(
            afd,
            rank=self.rank,
            planes=planes,
            num_experts=routed_experts_of(text),
            rank0_gets_every_row=has_shared_experts(text),
        )

    @property
    def _counted(self) -> bool:
        # Under tensor parallelism only TP worker 0's exchanges count in the metrics.
        return bool(getattr(self.connector, "records_exchanges", True))

    def _peers_changed(self, *, connected: bool) -> None:
        if self.connector is not None and self._counted:
            attention_peers_changed(self.connector, self.rank, connected=connected)

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()
            self._peers_changed(connected=False)

    def attach_step_metadata(self) -> None:
        """Install this step's AFD metadata in vLLM's forward context (Attention role)."""
        if self.connector is None or not is_forward_context_available():
            return
        set_step_metadata(get_forward_context(), AFDStepMetadata(connector=self.connector))

    def run_forward(self, forward: Any, *args: Any, **kwargs: Any) -> Any:
        """Run the native model ``forward`` for this step, micro-batched when planned.

        The Attention role with ``afd.num_micro_batches`` = m > 1 runs the step as m
        micro-batches (:mod:`afd_moe_runners.micro_batching`) when the model runner
        planned a split, and, with several attention ranks, always (shadow micro-batches
        keep every rank's message sequence the same). Otherwise it runs whole.
        """
        if self.connector is None or not is_forward_context_available():
            return forward(*args, **kwargs)
        try:
            return self._run_forward(forward, *args, **kwargs)
        except _FATAL as exc:
            record_exit_reason(f"{type(exc).__name__}: {exc}")
            if isinstance(exc, AFDPeerLostError):
                self._peers_changed(connected=False)
            raise
        finally:
            if self._counted:
                attention_step_ended(self.rank)

    def _run_forward(self, forward: Any, *args: Any, **kwargs: Any) -> Any:
        from afd_moe_runners import micro_batching

        ctx = get_forward_context()
        plan = ctx.additional_kwargs.pop(micro_batching.MICRO_BATCH_PLAN_KEY, None)
        num_tokens = real_token_count(ctx)
        m = self.plan.num_micro_batches
        if self.plan.micro_batched and (plan is not None or self.plan.data_parallel_size > 1):
            call = _bind_forward(args, kwargs)
            if call["intermediate_tensors"] is None:
                return micro_batching.run_micro_batches(
                    forward,
                    ctx,
                    self.connector,
                    m,
                    plan,
                    call["input_ids"],
                    call["positions"],
                    call["inputs_embeds"],
                    num_tokens=num_tokens,
                    **call["rest"],
                )
        set_step_metadata(ctx, AFDStepMetadata(connector=self.connector, num_tokens=num_tokens))
        return forward(*args, **kwargs)

    def _check_inventory(self, model: nn.Module, *, when: str) -> None:
        inventory = self._inventory(model)
        bad = {c: inventory[c] for c in forbidden_categories(self.plan) if inventory.get(c)}
        if bad:
            raise AFDConfigError(
                f"AFD {self.afd.role.value} role built parameters it must not own after "
                f"{when}: {bad}; the role-aware construction of {type(model).__name__} "
                "does not match this vLLM version"
            )
        self.inventory = inventory

    def expert_shard_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """FFN expert parallelism: this FFN rank's checkpoint tensors, the routed experts
        of other ranks dropped (:func:`afd_moe_runners.expert_parallel.shard_checkpoint`)."""
        from afd_moe_runners.expert_parallel import routed_experts_of, shard_checkpoint

        assert self._text_config is not None
        return shard_checkpoint(
            weights, routed_experts_of(self._text_config), self.rank, self.plan.num_ffn_ranks
        )

    def after_weights_loaded(self, stats: RoleWeightStats) -> None:
        model = self._model()
        assert model is not None
        self._check_inventory(model, when="loading")
        self.weight_stats = stats
        logger.info(
            "AFD %s role parameter inventory: %s; checkpoint tensors %s",
            self.afd.role.value,
            " ".join(f"{k}={v}" for k, v in sorted(self.inventory.items())),
            stats.summary(),
        )


def real_token_count(ctx: Any) -> int | None:
    """How many leading rows of this step carry tokens, or None when every row does.

    Only those rows travel to the FFN role (:func:`afd_moe_runners.exchange.send_to_ffn`;
    the others come back as zeros). vLLM pads a step to a captured CUDA-graph size, and
    its dummy steps carry no token at all: CUDA-graph capture (whose exchanges would
    otherwise ship the uninitialised memory a capture leaves in the piece before the op)
    and its warm-up runs, the compile warm-up, an idle data-parallel rank's step. vLLM
    says which rows are padding in ``ForwardContext.is_padding`` (its profile run counts
    every row as real: its dummy tokens are computed eagerly and are finite, and they
    size the FFN role's largest batch). A real step's attention metadata carries the
    same count as a host integer (``num_actual_tokens``), read first so that a real step
    costs no device-to-host read; dummy steps (no attention metadata) read the mask.
    """
    attn = getattr(ctx, "attn_metadata", None)
    if isinstance(attn, dict):
        for metadata in attn.values():
            count = getattr(metadata, "num_actual_tokens", None)
            if isinstance(count, int):
                return count
    pad = getattr(ctx, "is_padding", None)
    if pad is None:
        return None
    return int(pad.shape[0]) - int(pad.sum())


def _bind_forward(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """vLLM's model call ``(input_ids, positions, intermediate_tensors, inputs_embeds,
    **model_kwargs)`` by name."""
    names = ("input_ids", "positions", "intermediate_tensors", "inputs_embeds")
    rest = dict(kwargs)
    call: dict[str, Any] = dict.fromkeys(names)
    for name, value in zip(names, args, strict=False):
        call[name] = value
    for name in names:
        if name in rest:
            call[name] = rest.pop(name)
    call["rest"] = rest
    return call
