"""AFD MoE runners injected through vLLM's FusedMoE factory, and the model-independent FFN-side MoE entry."""

from afd_moe_runners._version import __version__

__all__ = ["__version__"]
