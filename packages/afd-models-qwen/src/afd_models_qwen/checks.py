"""Options the Qwen AFD wrappers reject at construction: the model-independent checks
of :func:`afd_moe_runners.role_model.reject_unsupported_options` (re-exported here for
existing imports)."""

from __future__ import annotations

from afd_moe_runners.role_model import reject_unsupported_options

__all__ = ["reject_unsupported_options"]
