"""What the launcher needs to know about a connector, read from what it declares.

The launcher places roles by the connector's declared capabilities
(:class:`afd_core.connector.ConnectorCapabilities`, read through the registry), not by
a table of connector names: a connector from any installed distribution that declares
``same_host_only`` is packed on one host like the shared-memory one. Each connector's
class is looked up once per process.
"""

from __future__ import annotations

import functools

from afd_core.connector import ConnectorCapabilities
from afd_core.errors import AFDConfigError
from afd_core.registry import get_connector_class

__all__ = ["connector_capabilities", "same_host_only"]


@functools.lru_cache(maxsize=16)
def connector_capabilities(name: str) -> ConnectorCapabilities | None:
    """What the connector registered as ``name`` declares, or None when no installed
    connector has that name (the roles then refuse it, naming the installed ones)."""
    try:
        return get_connector_class(name).capabilities
    except AFDConfigError:
        return None


def same_host_only(name: str) -> bool:
    """Whether the connector's ranks must share one host (shared memory): a Ray
    deployment then packs its roles on one node."""
    caps = connector_capabilities(name)
    return caps is not None and caps.same_host_only
