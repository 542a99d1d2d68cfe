"""AFD MoE runners for vLLM's FusedMoE factory, and the model-independent FFN-side entry.

``import afd_moe_runners`` is cheap: torch and vLLM are imported only when one of the
names below is first used (each lives in its own submodule).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from afd_moe_runners._version import __version__

if TYPE_CHECKING:
    from afd_moe_runners.builder import (
        afd_moe_factory,
        afd_runner_kwargs,
        build_afd_moe,
    )
    from afd_moe_runners.dense import RemoteDenseMLP
    from afd_moe_runners.exchange import MicroBatchYield
    from afd_moe_runners.external_routing_runner import ExternalRoutingRunner
    from afd_moe_runners.ffn_compute import FFNLayerCompute, find_moe_runner
    from afd_moe_runners.remote_experts import RemoteExpertsMethod, RemoteRoutedExperts
    from afd_moe_runners.remote_runner import RemoteExpertsRunner

_EXPORTS = {
    "afd_runner_kwargs": "afd_moe_runners.builder",
    "build_afd_moe": "afd_moe_runners.builder",
    "afd_moe_factory": "afd_moe_runners.builder",
    "RemoteExpertsRunner": "afd_moe_runners.remote_runner",
    "ExternalRoutingRunner": "afd_moe_runners.external_routing_runner",
    "RemoteRoutedExperts": "afd_moe_runners.remote_experts",
    "RemoteExpertsMethod": "afd_moe_runners.remote_experts",
    "RemoteDenseMLP": "afd_moe_runners.dense",
    "FFNLayerCompute": "afd_moe_runners.ffn_compute",
    "find_moe_runner": "afd_moe_runners.ffn_compute",
    "MicroBatchYield": "afd_moe_runners.exchange",
}

__all__ = [
    "__version__",
    "afd_runner_kwargs",
    "build_afd_moe",
    "afd_moe_factory",
    "RemoteExpertsRunner",
    "ExternalRoutingRunner",
    "RemoteRoutedExperts",
    "RemoteExpertsMethod",
    "RemoteDenseMLP",
    "FFNLayerCompute",
    "find_moe_runner",
    "MicroBatchYield",
]
assert set(__all__) == {"__version__", *_EXPORTS}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'afd_moe_runners' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
