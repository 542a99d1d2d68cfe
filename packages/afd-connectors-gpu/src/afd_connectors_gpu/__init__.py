"""Point-to-point AFD connector over torch.distributed: NCCL on CUDA GPUs, gloo on CPU."""

from afd_connectors_gpu._version import __version__

__all__ = ["__version__"]
