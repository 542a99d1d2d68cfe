"""Role-aware AFD wrappers for Qwen3-MoE and Qwen3.5/3.6-MoE models in vLLM."""

from afd_models_qwen._version import __version__

__all__ = ["__version__"]
