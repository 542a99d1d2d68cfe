"""The Qwen MoE families in afd: the torchvision-free import seam of vLLM's ``qwen3_5``
(:mod:`afd_models_qwen.qwen3_5_import`), tiny checkpoint recipes
(:mod:`afd_models_qwen.recipes`) and real deployment shapes
(:mod:`afd_models_qwen.shapes`), as data. The role-aware classes are the generic path's
(:mod:`afd_moe_runners.generic`)."""

from afd_models_qwen._version import __version__

__all__ = ["__version__"]
