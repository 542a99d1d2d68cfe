"""What a role's model holds: its parameter inventory, the categories it must not own,
and its deployment fingerprint.

A role builds the modules its plan puts on it and nothing else: after construction and
after loading, :class:`~afd_moe_runners.role_runtime.RoleRuntime` counts the model's
parameters per category (:func:`parameter_inventory`, or the split plan's) and refuses a
role that owns one of :func:`forbidden_categories`. :func:`role_identity` is the
fingerprint both roles compare in the handshake.
"""

from __future__ import annotations

from collections import Counter

from torch import nn
from vllm.config import VllmConfig

from afd_core.config import AFDConfig, AFDRole
from afd_moe_runners.deployment_plan import DeploymentPlan

__all__ = ["forbidden_categories", "parameter_inventory", "role_identity"]


_CATEGORIES = (
    ("attention", (".self_attn.", ".linear_attn.", ".attn.")),
    ("routed_experts", (".experts.",)),
    ("shared_experts", (".shared_experts.", ".shared_expert.", ".shared_expert_gate.")),
    ("gate", (".mlp.gate.",)),
    ("embedding", ("embed_tokens.", "lm_head.")),
    ("dense_mlp", (".mlp.",)),
)


def parameter_inventory(model: nn.Module) -> dict[str, int]:
    """Number of parameters (tensors, not elements) per category of a model."""
    counts: Counter[str] = Counter()
    for name, _ in model.named_parameters():
        dotted = f".{name}"
        for category, markers in _CATEGORIES:
            if any(m in dotted for m in markers):
                counts[category] += 1
                break
        else:
            counts["other"] += 1
    counts["total"] = sum(counts.values())
    return dict(counts)


def forbidden_categories(plan: DeploymentPlan) -> tuple[str, ...]:
    """Parameter categories the plan's role must not own: what the other role computes.
    Dense layers and shared experts belong to the role the plan places them on."""
    local = {
        "dense_mlp": plan.dense_layers_on_attention,
        "shared_experts": plan.shared_experts_on_attention,
    }
    if plan.role is AFDRole.FFN:
        return ("attention", "embedding", *(c for c, here in local.items() if here))
    forbidden = ["routed_experts", *(c for c, here in local.items() if not here)]
    if not plan.gate_on_attention:
        forbidden.append("gate")
    return tuple(forbidden)


def role_identity(
    model: nn.Module,
    vllm_config: VllmConfig,
    afd: AFDConfig,
    *,
    plan: DeploymentPlan | None = None,
) -> dict[str, str]:
    """The deployment fingerprint of this role's model (compared in the handshake).

    ``plan``: the role's plan; default the model's own (``afd_deployment``), else the
    shared-expert placement resolved from ``afd``."""
    from afd_moe_runners.identity import deployment_identity

    if plan is None:
        plan = getattr(model, "afd_deployment", None)
    if plan is not None:
        shared_on_attention = plan.shared_experts_on_attention
    else:
        from afd_moe_runners.deployment_plan import shared_experts_placement

        shared_on_attention = shared_experts_placement(afd) is AFDRole.ATTENTION
    return deployment_identity(
        model, vllm_config, afd, shared_experts_on_attention=shared_on_attention
    )
