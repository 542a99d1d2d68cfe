"""Compatibility alias of :mod:`afd.runtime.ffn_server` (moved into the runtime room):
``READY_MARKER`` and ``worker_extension_cls="afd.ffn_server.AFDWorkerExtension"`` keep
working for code written before the move. New code names ``afd.runtime.ffn_server``."""

from __future__ import annotations

from afd.runtime.ffn_server import READY_MARKER, AFDWorkerExtension, run_ffn_server

__all__ = ["READY_MARKER", "AFDWorkerExtension", "run_ffn_server"]
