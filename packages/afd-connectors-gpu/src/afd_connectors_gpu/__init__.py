"""Point-to-point AFD connectors: NCCL on CUDA GPUs, gloo on CPU, shared memory on one host.

Importing this package imports neither torch nor vLLM; the connector classes are
loaded on first attribute access (and torch on ``init()``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from afd_connectors_gpu._version import __version__
from afd_core.lazy import lazy_exports

if TYPE_CHECKING:
    from afd_connectors_gpu.p2p import (
        P2pAFDConnector,
        P2pGlooAFDConnector,
        P2pNcclAFDConnector,
    )
    from afd_connectors_gpu.shm import P2pShmAFDConnector

__all__ = [
    "__version__",
    "P2pAFDConnector",
    "P2pGlooAFDConnector",
    "P2pNcclAFDConnector",
    "P2pShmAFDConnector",
]

_LAZY = {
    "P2pAFDConnector": "afd_connectors_gpu.p2p",
    "P2pGlooAFDConnector": "afd_connectors_gpu.p2p",
    "P2pNcclAFDConnector": "afd_connectors_gpu.p2p",
    "P2pShmAFDConnector": "afd_connectors_gpu.shm",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
