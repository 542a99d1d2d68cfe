"""Lazy package exports: names loaded from their submodules on first attribute access.

A package ``__init__`` that must stay cheap to import (no torch, no vendor library)
declares ``{name: module}`` and takes its ``__getattr__`` and ``__dir__`` from
:func:`lazy_exports`::

    _EXPORTS = {"MyConnector": "my_pkg.connector"}
    __all__ = ["__version__", *_EXPORTS]
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, str], namespace: MutableMapping[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` of ``package``: a name of ``exports`` is imported from
    its module on first use and kept in ``namespace`` (the package's ``globals()``)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({"__version__", *exports})

    return __getattr__, __dir__
