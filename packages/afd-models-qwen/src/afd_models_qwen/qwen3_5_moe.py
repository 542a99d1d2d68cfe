"""Role-aware Qwen3.5/3.6-MoE models for AFD.

``AFDQwen3_5MoeForCausalLM`` (text-only checkpoints, ``model_type=qwen3_5_moe_text``)
and ``AFDQwen3_5MoeForConditionalGeneration`` (the multimodal checkpoints, served text
only: ``--language-model-only`` is required) subclass vLLM's native classes and build
them natively with a few module-level names replaced for the constructor's duration
(:func:`afd_core.patching.scoped_globals`), as the Qwen3-MoE wrapper does. Qwen3.5's
decoder layer lives in ``vllm.model_executor.models.qwen3_5`` and its MoE block
(``Qwen3NextSparseMoeBlock``: router, routed experts, a shared expert with a sigmoid
shared-expert gate) in ``vllm.model_executor.models.qwen3_next``, so names of both
modules are replaced:

Attention role
    the hybrid attention (Gated DeltaNet ``linear_attn`` and gated full attention),
    norms, embedding and LM head are native; ``FusedMoEFactory`` (qwen3_next) builds the
    AFD runner; the shared expert, its gate and (gate on FFN) the router are dropped
    after construction: the FFN role computes them.
FFN role
    ``QwenGatedDeltaNetAttention`` / ``Qwen3NextAttention`` (and so every KV-cache and
    recurrent-state layer), the token embedding and the LM head are parameter-free
    placeholders; the MoE blocks are vLLM's own, served by the model-independent
    ``FFNLayerCompute``.

Importing this module imports vLLM's ``qwen3_5`` model file through
:func:`afd_models_qwen.qwen3_5_import.import_qwen3_5`: on vLLM 0.32 without torchvision
(the CPU environment), that file's multimodal imports reach a torchvision-only
transformers module, which a placeholder stands in for during that one import.
"""

from __future__ import annotations

from typing import Any

import vllm.model_executor.models.qwen3_next as qn
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.utils import PPMissingLayer

from afd_core.config import AFDConfig, AFDRole
from afd_core.patching import scoped_globals
from afd_core.weights import WeightOwner
from afd_models_qwen.checks import reject_unsupported_options
from afd_models_qwen.qwen3_5_import import import_qwen3_5
from afd_models_qwen.qwen3_5_moe_names import SUBSTITUTED_NAMES
from afd_models_qwen.qwen3_moe import strip_attention_moe
from afd_models_qwen.weights import classify_qwen_weight
from afd_moe_runners import role_model

q5 = import_qwen3_5()

__all__ = [
    "AFDQwen3_5MoeForCausalLM",
    "AFDQwen3_5MoeForConditionalGeneration",
    "SUBSTITUTED_NAMES",
]


class _Substituted:
    """Both modules' replacements for one role, as one context manager."""

    def __init__(self, afd: AFDConfig) -> None:
        if afd.role is AFDRole.ATTENTION:
            self.next_subs: dict[str, Any] = {
                "FusedMoEFactory": role_model.attention_factory(afd, qn.FusedMoEFactory)
            }
            self.q5_subs: dict[str, Any] = {}
        else:
            self.next_subs = {}
            self.q5_subs = {
                "QwenGatedDeltaNetAttention": role_model.NoAttention,
                "Qwen3NextAttention": role_model.NoAttention,
                "VocabParallelEmbedding": PPMissingLayer,
                "ParallelLMHead": role_model.NoLMHead,
            }

    def __enter__(self) -> None:
        self._a = scoped_globals(qn, self.next_subs)
        self._b = scoped_globals(q5, self.q5_subs)
        self._a.__enter__()
        try:
            self._b.__enter__()
        except BaseException:
            self._a.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self._b.__exit__(*exc)
        finally:
            self._a.__exit__(*exc)


def _layers(model: nn.Module) -> Any:
    inner = getattr(model, "language_model", model)
    return inner.model.layers


class _QwenNextRoleMixin(role_model.AFDRoleModel):
    """Shared construction of both Qwen3.5/3.6-MoE wrappers."""

    def _afd_build(
        self, vllm_config: VllmConfig, prefix: str, *, multimodal_capable: bool, native: Any
    ) -> None:
        name = type(self).__name__
        afd = role_model.afd_config_of(vllm_config)
        role_model.check_supported_parallelism(vllm_config, name)
        reject_unsupported_options(vllm_config, name, multimodal_capable=multimodal_capable)
        with _Substituted(afd):
            native.__init__(self, vllm_config=vllm_config, prefix=prefix)
        self.afd_config = afd
        if afd.role is AFDRole.ATTENTION:
            for layer in _layers(self):
                mlp = getattr(layer, "mlp", None)
                if isinstance(mlp, qn.Qwen3NextSparseMoeBlock):
                    strip_attention_moe(mlp, afd)
        self.afd_runtime = role_model.RoleRuntime(self, afd, vllm_config)

    def afd_classify_weight(self, name: str) -> WeightOwner:
        return classify_qwen_weight(
            name, gate_on_attention=self.afd_config.compute_gate_on_attention
        )


class AFDQwen3_5MoeForCausalLM(_QwenNextRoleMixin, q5.Qwen3_5MoeForCausalLM):
    """``Qwen3_5MoeForCausalLM`` (text-only Qwen3.5/3.6-MoE) built for one AFD role."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        self._afd_build(
            vllm_config, prefix, multimodal_capable=False, native=q5.Qwen3_5MoeForCausalLM
        )


class AFDQwen3_5MoeForConditionalGeneration(
    _QwenNextRoleMixin, q5.Qwen3_5MoeForConditionalGeneration
):
    """``Qwen3_5MoeForConditionalGeneration`` served as a text model for one AFD role.

    Requires ``--language-model-only``: image/video input is rejected at construction.
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "model") -> None:
        self._afd_build(
            vllm_config,
            prefix,
            multimodal_capable=True,
            native=q5.Qwen3_5MoeForConditionalGeneration,
        )
