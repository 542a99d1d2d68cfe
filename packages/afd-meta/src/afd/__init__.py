"""Attention-FFN Disaggregation for vLLM: the vLLM plugin, role runtime and `afd` CLI."""

from afd._version import __version__

__all__ = ["__version__"]
