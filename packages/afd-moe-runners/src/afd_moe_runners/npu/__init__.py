"""Ascend (NPU) building blocks of the AFD MoE runners, loaded lazily.

``import afd_moe_runners.npu`` imports neither torch, vLLM nor vLLM-Ascend; each
name below is loaded from its submodule on first use, and only the classes that
derive from vLLM-Ascend classes import ``vllm_ascend`` (inside their builders).

* :mod:`~afd_moe_runners.npu.runners` -- Attention-role runners on ``AscendMoERunner``;
* :mod:`~afd_moe_runners.npu.external_routing` -- the FFN-role external-routing flow
  (pure torch; runs on CPU);
* :mod:`~afd_moe_runners.npu.ascend` -- its vLLM-Ascend prepare/finalize and comm
  subclasses (Ascend hosts only).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from afd_moe_runners.npu.ascend import build_ascend_external_routing_moe
    from afd_moe_runners.npu.external_routing import (
        CommSlot,
        ExpertsApply,
        ExternalRouting,
        ExternalRoutingComm,
        ExternalRoutingMoE,
        LocalCommSlot,
        LocalExternalRoutingComm,
        LocalPrepareAndFinalize,
        RoutedExpertsApply,
    )
    from afd_moe_runners.npu.runners import compose_runner, npu_runner_classes

# name -> submodule of this package.
_EXPORTS: dict[str, str] = {
    "AFDNPURemoteExpertsRunner": "runners",
    "AFDNPUAttentionGateRunner": "runners",
    "compose_runner": "runners",
    "npu_runner_classes": "runners",
    "ExternalRouting": "external_routing",
    "ExternalRoutingMoE": "external_routing",
    "ExternalRoutingComm": "external_routing",
    "CommSlot": "external_routing",
    "ExpertsApply": "external_routing",
    "LocalPrepareAndFinalize": "external_routing",
    "LocalExternalRoutingComm": "external_routing",
    "LocalCommSlot": "external_routing",
    "RoutedExpertsApply": "external_routing",
    "AFDPrepareAndFinalizeWithAllGather": "ascend",
    "AFDPrepareAndFinalizeWithMC2": "ascend",
    "AFDAllGatherCommImpl": "ascend",
    "AFDMC2CommImpl": "ascend",
    "build_ascend_external_routing_moe": "ascend",
}

__all__ = [
    "AFDNPURemoteExpertsRunner",
    "AFDNPUAttentionGateRunner",
    "compose_runner",
    "npu_runner_classes",
    "ExternalRouting",
    "ExternalRoutingMoE",
    "ExternalRoutingComm",
    "CommSlot",
    "ExpertsApply",
    "LocalPrepareAndFinalize",
    "LocalExternalRoutingComm",
    "LocalCommSlot",
    "RoutedExpertsApply",
    "AFDPrepareAndFinalizeWithAllGather",
    "AFDPrepareAndFinalizeWithMC2",
    "AFDAllGatherCommImpl",
    "AFDMC2CommImpl",
    "build_ascend_external_routing_moe",
]
assert set(__all__) == set(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    if not name.startswith("AFD"):
        # The AFD* classes are built from vLLM-Ascend on first use: not cached here, so
        # a first attempt without vllm_ascend is retried rather than remembered.
        globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
