"""CAM-based AFD connectors (CAMP2p, CAMAsync) for Ascend NPUs.

``import afd_connectors_npu`` imports neither torch nor any Ascend library; the names
below are loaded from their submodules on first use, and the vendor CAM operators only
when a connector's ``init()`` builds its :class:`~afd_connectors_npu.ops.CAMOps`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from afd_connectors_npu._version import __version__
from afd_core.lazy import lazy_exports

if TYPE_CHECKING:
    from afd_connectors_npu.camasync import CAMAsyncAFDConnector
    from afd_connectors_npu.camp2p import CAMP2pAFDConnector
    from afd_connectors_npu.ops import CAMOps, CAMUnavailableError
    from afd_connectors_npu.validation import (
        NPUDeploymentShape,
        check_roles_agree,
        shape_from_vllm_config,
        validate_npu_deployment,
    )
    from afd_connectors_npu.vendor import load_vendor_cam_ops

_EXPORTS = {
    "CAMP2pAFDConnector": "afd_connectors_npu.camp2p",
    "CAMAsyncAFDConnector": "afd_connectors_npu.camasync",
    "CAMOps": "afd_connectors_npu.ops",
    "CAMUnavailableError": "afd_connectors_npu.ops",
    "load_vendor_cam_ops": "afd_connectors_npu.vendor",
    "NPUDeploymentShape": "afd_connectors_npu.validation",
    "shape_from_vllm_config": "afd_connectors_npu.validation",
    "validate_npu_deployment": "afd_connectors_npu.validation",
    "check_roles_agree": "afd_connectors_npu.validation",
}

__all__ = [
    "__version__",
    "CAMP2pAFDConnector",
    "CAMAsyncAFDConnector",
    "CAMOps",
    "CAMUnavailableError",
    "load_vendor_cam_ops",
    "NPUDeploymentShape",
    "shape_from_vllm_config",
    "validate_npu_deployment",
    "check_roles_agree",
]
assert set(__all__) == {"__version__", *_EXPORTS}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
