"""Qwen3.5/3.6-MoE role-aware classes, importable under their old names: the generic
path's (:mod:`afd_moe_runners.generic`). What stays Qwen3.5-specific is the import of
vLLM's ``qwen3_5`` model file without torchvision on the CPU build
(:mod:`afd_models_qwen.qwen3_5_import`), done here before the classes are made, so this
module imports even where vLLM's plugins are not loaded."""

from __future__ import annotations

from afd_models_qwen.qwen3_5_import import import_qwen3_5
from afd_moe_runners.generic import role_model_class

__all__ = ["AFDQwen3_5MoeForCausalLM", "AFDQwen3_5MoeForConditionalGeneration"]

import_qwen3_5()
AFDQwen3_5MoeForCausalLM = role_model_class("Qwen3_5MoeForCausalLM")
#: Text only: requires ``--language-model-only`` (refused at construction otherwise).
AFDQwen3_5MoeForConditionalGeneration = role_model_class("Qwen3_5MoeForConditionalGeneration")
