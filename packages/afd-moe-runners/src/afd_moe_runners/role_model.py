"""Model-independent support for role-aware AFD model wrappers.

A model wrapper (the generic path, :mod:`afd_moe_runners.generic`) builds vLLM's native
model for one role and needs the same things regardless of the family. They live in
one module each, along the role's start-up:

* :mod:`~afd_moe_runners.start_up`: the checks before any module is built and the
  role's deployment plan, resolved once (:func:`~afd_moe_runners.start_up.start_role`;
  the plan itself: :mod:`afd_moe_runners.deployment_plan`);
* :mod:`~afd_moe_runners.placeholders`: parameter-free stand-ins and the
  ``FusedMoEFactory`` stand-ins handed the plan;
* :mod:`~afd_moe_runners.role_runtime`: the connector lifecycle and per-step hooks;
* :mod:`~afd_moe_runners.inventory`: the parameter inventory check and the fingerprint.

This module holds the wrapper mixin (:class:`AFDRoleModel`) and re-exports those
modules' public names (``from afd_moe_runners.role_model import ...`` keeps working).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.model_executor.models.utils import PPMissingLayer

from afd_core.config import AFDConfig, AFDRole
from afd_core.weights import RoleWeightStats, WeightOwner, filter_role_weights
from afd_moe_runners.dense import RemoteDenseMLP
from afd_moe_runners.deployment_plan import DeploymentPlan
from afd_moe_runners.exchange import no_yield, scheduler_yield
from afd_moe_runners.inventory import forbidden_categories, parameter_inventory, role_identity
from afd_moe_runners.placeholders import (
    NoAttention,
    NoGate,
    NoLMHead,
    attention_factory,
    expert_shard_factory,
    layer_index,
)
from afd_moe_runners.role_runtime import RoleRuntime, real_token_count
from afd_moe_runners.start_up import (
    afd_config_of,
    check_supported_parallelism,
    compiled_graph_problem,
    micro_batching_problem,
    model_runner_check,
    reject_unsupported_options,
    start_role,
    tensor_parallel_problem,
)

__all__ = [
    "AFDRoleModel",
    "NoAttention",
    "NoGate",
    "NoLMHead",
    "RemoteDenseMLP",
    "RoleRuntime",
    "afd_config_of",
    "attention_factory",
    "expert_shard_factory",
    "check_supported_parallelism",
    "tensor_parallel_problem",
    "compiled_graph_problem",
    "forbidden_categories",
    "real_token_count",
    "micro_batching_problem",
    "model_runner_check",
    "layer_index",
    "no_yield",
    "scheduler_yield",
    "parameter_inventory",
    "reject_unsupported_options",
    "role_identity",
    "start_role",
]


class AFDRoleModel:
    """Mixin for role-aware model wrappers; list it before the native vLLM model class.

    The wrapper's ``__init__`` resolves the role's plan (``afd_deployment``,
    :func:`~afd_moe_runners.start_up.start_role`), builds the native model for its role
    from it, then sets ``afd_config`` and ``afd_runtime``; this mixin supplies what
    every family does the same way: the per-step metadata hook (``forward``), the FFN
    role's blocks (``afd_ffn_blocks``) and one-pass role-aware weight loading
    (``load_weights``).
    Subclasses implement :meth:`afd_classify_weight`.
    """

    afd_config: AFDConfig
    afd_runtime: RoleRuntime
    afd_deployment: DeploymentPlan

    def afd_classify_weight(self, name: str) -> WeightOwner:
        """Which role owns checkpoint tensor ``name`` (per model family)."""
        raise NotImplementedError

    def afd_decoder_layers(self) -> Iterable[nn.Module]:
        """The decoder layers (text model of a multimodal wrapper included)."""
        inner = getattr(self, "language_model", self)
        return inner.model.layers  # type: ignore[no-any-return]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.afd_runtime.run_forward(super().forward, *args, **kwargs)  # type: ignore[misc]

    def afd_ffn_blocks(self) -> dict[int, nn.Module]:
        """Decoder-layer index -> that layer's FFN block (MoE block or dense MLP)."""
        return {
            idx: layer.mlp
            for idx, layer in enumerate(self.afd_decoder_layers())
            if not isinstance(layer, PPMissingLayer)
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        stats = RoleWeightStats()
        mine = filter_role_weights(
            weights, self.afd_config.role, self.afd_classify_weight, stats=stats
        )
        if self.afd_deployment.role is AFDRole.FFN and self.afd_deployment.ffn_expert_parallel:
            mine = self.afd_runtime.expert_shard_weights(mine)
        loaded: set[str] = super().load_weights(mine)  # type: ignore[misc]
        self.afd_runtime.after_weights_loaded(stats)
        return loaded
