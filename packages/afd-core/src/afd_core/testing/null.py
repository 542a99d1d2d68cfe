"""``NullConnector``: a connector that moves nothing (for tests that only need an object
of the :class:`~afd_core.connector.AFDConnector` type: registry, step metadata)."""

from __future__ import annotations

from typing import ClassVar

from afd_core.connector import AFDConnector, FFNBatch
from afd_core.transfer import AttentionToFFN, FFNToAttention

__all__ = ["NullConnector"]


class NullConnector(AFDConnector):
    """Sends are dropped, receives raise :class:`NotImplementedError`; ``initialized``
    is what :attr:`is_initialized` answers."""

    name: ClassVar[str] = "NullConnector"
    initialized: ClassVar[bool] = False

    def init(self) -> None:
        pass

    @property
    def is_initialized(self) -> bool:
        return self.initialized

    def close(self) -> None:
        pass

    def send_to_ffn(
        self, payload: AttentionToFFN, *, layer_idx: int, micro_batch_idx: int = 0
    ) -> None:
        pass

    def recv_from_ffn(
        self, *, layer_idx: int, micro_batch_idx: int = 0, timeout_s: float | None = None
    ) -> FFNToAttention:
        raise NotImplementedError

    def recv_from_attention(self, *, timeout_s: float | None = None) -> FFNBatch:
        raise NotImplementedError

    def send_to_attention(self, batch: FFNBatch, result: FFNToAttention) -> None:
        pass
