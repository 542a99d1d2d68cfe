"""CAM-based AFD connectors (CAMP2p, CAMAsync) for Ascend NPUs."""

from afd_connectors_npu._version import __version__

__all__ = ["__version__"]
