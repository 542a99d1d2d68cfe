"""The two errors of ``afd launch``: a bad spec, and a deployment that did not start."""

from __future__ import annotations

from afd_core.errors import AFDConfigError, AFDError

__all__ = ["DeploymentError", "SpecError"]


class SpecError(AFDConfigError):
    """An invalid deployment spec (the message names the field and what is allowed)."""


class DeploymentError(AFDError, RuntimeError):
    """A deployment failed to start (a role exited, or start-up timed out)."""
