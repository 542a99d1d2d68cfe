"""Role-aware AFD wrappers for DeepSeek V2/V3/V3.2 models in vLLM."""

from afd_models_deepseek._version import __version__

__all__ = ["__version__"]
