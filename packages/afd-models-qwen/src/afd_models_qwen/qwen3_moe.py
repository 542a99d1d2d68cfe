"""Role-aware Qwen3-MoE model for AFD (``AFDQwen3MoeForCausalLM``).

The wrapper subclasses vLLM's ``Qwen3MoeForCausalLM`` and builds it natively, with a
few module-level names of ``vllm.model_executor.models.qwen3_moe`` replaced for the
duration of the constructor (:func:`afd_core.patching.scoped_globals`), so no vLLM
code is copied:

Attention role
    ``FusedMoEFactory`` gets the AFD runner kwargs (:func:`afd_moe_runners.role_model.
    attention_factory`: no expert weights, the runner ships activations to the FFN
    role); dense MLP layers (``mlp_only_layers`` / ``decoder_sparse_step``) become a
    parameter-free :class:`~afd_moe_runners.role_model.RemoteDenseMLP`; a shared expert
    (``shared_expert_intermediate_size > 0``) is not built and its gate is dropped; with
    the gate on FFN the native router is dropped after construction.
FFN role
    ``Qwen3MoeAttention`` (and with it the KV-cache ``Attention`` layer), the token
    embedding and the LM head are parameter-free placeholders; the MoE blocks and dense
    MLPs are vLLM's own ``Qwen3MoeSparseMoeBlock`` / ``Qwen3MoeMLP``, served through the
    model-independent :class:`afd_moe_runners.ffn_compute.FFNLayerCompute`.

Why not the ``decoder_layer_type`` seam: ``Qwen3MoeModel.__init__`` accepts one, but
``Qwen3MoeForCausalLM.__init__`` does not pass it through, and ``Qwen3MoeDecoderLayer``
builds its submodules by module-global names. Using it would mean copying both
constructors; replacing the names for the constructor's duration copies nothing.
"""

from __future__ import annotations

import logging
from typing import Any

import vllm.model_executor.models.qwen3_moe as qm
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.utils import PPMissingLayer

from afd_core.config import AFDConfig, AFDRole
from afd_core.patching import scoped_globals
from afd_core.weights import WeightOwner
from afd_models_qwen.checks import reject_unsupported_options
from afd_models_qwen.weights import classify_qwen_weight
from afd_moe_runners import role_model

logger = logging.getLogger(__name__)

__all__ = ["AFDQwen3MoeForCausalLM", "SUBSTITUTED_NAMES", "strip_attention_moe"]

#: Names of vllm.model_executor.models.qwen3_moe replaced during construction (per
#: role). tests/test_vllm_drift.py checks each is still defined and used where expected.
SUBSTITUTED_NAMES: dict[AFDRole, tuple[str, ...]] = {
    AFDRole.ATTENTION: ("FusedMoEFactory", "Qwen3MoeMLP"),
    AFDRole.FFN: ("Qwen3MoeAttention", "VocabParallelEmbedding", "ParallelLMHead"),
}


def _attention_substitutions(afd: AFDConfig) -> dict[str, Any]:
    def mlp(*args: Any, prefix: str = "", **kwargs: Any) -> nn.Module | None:
        if prefix.endswith(".shared_expert"):
            return None  # the FFN role computes the shared expert
        return role_model.RemoteDenseMLP(role_model.layer_index(prefix))

    return {
        "Qwen3MoeMLP": mlp,
        "FusedMoEFactory": role_model.attention_factory(afd, qm.FusedMoEFactory),
    }


def _ffn_substitutions() -> dict[str, Any]:
    return {
        "Qwen3MoeAttention": role_model.NoAttention,
        "VocabParallelEmbedding": PPMissingLayer,
        "ParallelLMHead": role_model.NoLMHead,
    }


def strip_attention_moe(block: nn.Module, afd: AFDConfig) -> None:
    """Drop what an Attention-role MoE block must not own (built natively, unused here).

    The shared expert and its sigmoid gate always run on the FFN role; the router runs
    there too unless ``compute_gate_on_attention``. (The AFD runner given these modules
    by the factory already discarded them; the block's own references go too.)
    """
    if getattr(block, "shared_expert", None) is not None:
        block.shared_expert = None
    if getattr(block, "shared_expert_gate", None) is not None:
        block.shared_expert_gate = None
    if hasattr(block, "replicate_shared_expert"):
        block.replicate_shared_expert = False
    if not afd.compute_gate_on_attention:
        block.gate = None


class AFDQwen3MoeForCausalLM(role_model.AFDRoleModel, qm.Qwen3MoeForCausalLM):
    """``Qwen3MoeForCausalLM`` built for one AFD role (``additional_config["afd"]``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        name = type(self).__name__
        afd = role_model.afd_config_of(vllm_config)
        role_model.check_supported_parallelism(vllm_config, name)
        reject_unsupported_options(vllm_config, name)
        subs = (
            _attention_substitutions(afd) if afd.role is AFDRole.ATTENTION else _ffn_substitutions()
        )
        with scoped_globals(qm, subs):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.afd_config = afd
        if afd.role is AFDRole.ATTENTION:
            for layer in self.model.layers:
                mlp = getattr(layer, "mlp", None)
                if isinstance(mlp, qm.Qwen3MoeSparseMoeBlock):
                    strip_attention_moe(mlp, afd)
        self.afd_runtime = role_model.RoleRuntime(self, afd, vllm_config)

    def afd_classify_weight(self, name: str) -> WeightOwner:
        return classify_qwen_weight(
            name, gate_on_attention=self.afd_config.compute_gate_on_attention
        )
