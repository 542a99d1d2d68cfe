"""DeepSeek V2 / V3 / V3.2 role-aware classes, importable under their old names.

They are the generic path's classes (:mod:`afd_moe_runners.generic`): it reads the split
of vLLM's own ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` (MLA attention,
dense first layers, ``DeepseekV2MoE`` with gate, correction bias and shared experts) off
the model itself, so no DeepSeek-specific code is left here. The vLLM plugin registers
the same classes as ``AFDDeepseekV2ForCausalLM`` etc.
"""

from __future__ import annotations

from afd_moe_runners.generic import role_model_class

__all__ = ["AFDDeepseekV2ForCausalLM", "AFDDeepseekV3ForCausalLM", "AFDDeepseekV32ForCausalLM"]

AFDDeepseekV2ForCausalLM = role_model_class("DeepseekV2ForCausalLM")
AFDDeepseekV3ForCausalLM = role_model_class("DeepseekV3ForCausalLM")
#: On vLLM's CPU build ``DeepseekV32ForCausalLM`` is V3's class, whose sparse attention
#: the CPU attention backend refuses ("Sparse Attention is not supported on CPU.").
AFDDeepseekV32ForCausalLM = role_model_class("DeepseekV32ForCausalLM")
