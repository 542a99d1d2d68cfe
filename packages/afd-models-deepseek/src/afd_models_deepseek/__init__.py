"""The DeepSeek family in afd: tiny checkpoint recipes (:mod:`afd_models_deepseek.recipes`)
and real deployment shapes (:mod:`afd_models_deepseek.shapes`), as data. The role-aware
classes are the generic path's (:mod:`afd_moe_runners.generic`)."""

from afd_models_deepseek._version import __version__

__all__ = ["__version__"]
