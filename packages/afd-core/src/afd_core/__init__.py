"""Typed contracts for Attention-FFN Disaggregation: configuration, topology, transfer payloads, connector interface and registry, testing kit. Imports neither torch nor vLLM."""

from afd_core._version import __version__

__all__ = ["__version__"]
