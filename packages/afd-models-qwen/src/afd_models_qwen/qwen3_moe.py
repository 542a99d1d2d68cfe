"""Qwen3-MoE role-aware class, importable under its old name: the generic path's
(:mod:`afd_moe_runners.generic`), which reads the split of vLLM's own
``Qwen3MoeForCausalLM`` off the model; no Qwen3-MoE-specific code is left here."""

from __future__ import annotations

from afd_moe_runners.generic import role_model_class

__all__ = ["AFDQwen3MoeForCausalLM"]

AFDQwen3MoeForCausalLM = role_model_class("Qwen3MoeForCausalLM")
