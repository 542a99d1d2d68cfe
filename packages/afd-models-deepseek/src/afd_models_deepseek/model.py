"""Role-aware DeepSeek V2 / V3 / V3.2 models for AFD.

The wrappers subclass vLLM's own ``DeepseekV2ForCausalLM`` and build it natively,
with a few module-level names of ``vllm.model_executor.models.deepseek_v2`` replaced
for the duration of the constructor (:func:`afd_core.patching.scoped_globals`), so no
decoder-layer code is copied:

Attention role
    ``FusedMoEFactory`` gets the AFD runner kwargs (remote experts: no expert weights,
    the runner ships activations to the FFN role); the dense MLPs and the MoE shared
    experts are replaced by parameter-free stand-ins (the FFN role owns them); with the
    gate on FFN the native gate is dropped after construction.
FFN role
    the attention classes, the token embedding and the LM head are replaced by
    parameter-free placeholders; MoE blocks and dense MLPs are vLLM's own.

Weights are filtered per role in one pass (:func:`afd_core.weights.filter_role_weights`
with :func:`afd_models_deepseek.weights.classify_deepseek_weight`) before vLLM's
native loader sees them, and each role checks its parameter inventory afterwards.
"""

from __future__ import annotations

import logging
from typing import Any

import vllm.model_executor.models.deepseek_v2 as ds
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.utils import PPMissingLayer

from afd_core.config import AFDConfig, AFDRole
from afd_core.patching import scoped_globals
from afd_core.weights import WeightOwner
from afd_models_deepseek.weights import classify_deepseek_weight
from afd_moe_runners import role_model

logger = logging.getLogger(__name__)

__all__ = [
    "AFDDeepseekV2ForCausalLM",
    "AFDDeepseekV3ForCausalLM",
    "AFDDeepseekV32ForCausalLM",
    "SUBSTITUTED_NAMES",
]

#: Names of vllm.model_executor.models.deepseek_v2 replaced during construction
#: (per role). The drift test checks each is still defined and used where expected.
SUBSTITUTED_NAMES: dict[AFDRole, tuple[str, ...]] = {
    AFDRole.ATTENTION: ("FusedMoEFactory", "DeepseekV2MLP"),
    AFDRole.FFN: (
        "DeepseekAttention",
        "DeepseekV2Attention",
        "DeepseekV2MLAAttention",
        "VocabParallelEmbedding",
        "ParallelLMHead",
    ),
}


class _RemoteDeepseekV2MLP(role_model.RemoteDenseMLP, ds.DeepseekV2MLP):
    """Parameter-free dense MLP of the Attention role.

    Subclasses ``DeepseekV2MLP`` only so the decoder layer's ``isinstance`` checks (fp16
    output rescaling) behave exactly as for the native module.
    """

    def __init__(self, layer_idx: int) -> None:
        nn.Module.__init__(self)  # not DeepseekV2MLP.__init__: it would build the weights
        self.layer_idx = layer_idx
        self.micro_batch_yield = role_model.scheduler_yield


def _attention_substitutions(afd: AFDConfig) -> dict[str, Any]:
    def mlp(*args: Any, prefix: str = "", **kwargs: Any) -> nn.Module | None:
        if prefix.endswith(".shared_experts"):
            return None  # the FFN role computes the shared experts
        return _RemoteDeepseekV2MLP(role_model.layer_index(prefix))

    return {
        "DeepseekV2MLP": mlp,
        "FusedMoEFactory": role_model.attention_factory(afd, ds.FusedMoEFactory),
    }


def _ffn_substitutions() -> dict[str, Any]:
    return {
        "DeepseekAttention": role_model.NoAttention,
        "DeepseekV2Attention": role_model.NoAttention,
        "DeepseekV2MLAAttention": role_model.NoAttention,
        "VocabParallelEmbedding": PPMissingLayer,
        "ParallelLMHead": PPMissingLayer,
    }


class AFDDeepseekV2ForCausalLM(role_model.AFDRoleModel, ds.DeepseekV2ForCausalLM):
    """``DeepseekV2ForCausalLM`` built for one AFD role (``additional_config["afd"]``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        afd = role_model.afd_config_of(vllm_config)
        role_model.check_supported_parallelism(vllm_config, type(self).__name__)
        subs = (
            _attention_substitutions(afd) if afd.role is AFDRole.ATTENTION else _ffn_substitutions()
        )
        with scoped_globals(ds, subs):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.afd_config = afd
        if afd.role is AFDRole.ATTENTION and not afd.compute_gate_on_attention:
            for layer in self.model.layers:
                mlp = getattr(layer, "mlp", None)
                if isinstance(mlp, ds.DeepseekV2MoE):
                    mlp.gate = None  # the FFN role runs the gate
        self.afd_runtime = role_model.RoleRuntime(self, afd, vllm_config)

    def afd_classify_weight(self, name: str) -> WeightOwner:
        return classify_deepseek_weight(
            name, gate_on_attention=self.afd_config.compute_gate_on_attention
        )


class AFDDeepseekV3ForCausalLM(AFDDeepseekV2ForCausalLM):
    pass


class AFDDeepseekV32ForCausalLM(AFDDeepseekV2ForCausalLM):
    pass
