"""Scoped replacement of module globals — the one patch primitive afd uses.

vLLM's model files build their submodules by calling module-level names
(``FusedMoEFactory(...)``, ``DeepseekV2MLP(...)``, the attention classes). To build
a role-aware model *without copying* a decoder layer's ``__init__``, a wrapper
replaces a few of those names for the duration of its own ``super().__init__()``
call and restores them on every exit path.

Rules for callers (checked by :func:`scoped_globals`):

* every replaced name must already exist in the module (a rename upstream makes
  the wrapper fail at construction with a message naming the symbol, instead of
  silently building the native module);
* callers pin the upstream version they were written against and keep a drift
  test that asserts the names are still referenced where they expect them.

The replacement is process-global while it is active (Python has no per-thread
module namespaces); vLLM builds a model in one thread per process, so the window
is the model constructor only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from afd_core.errors import AFDError

__all__ = ["PatchDriftError", "scoped_globals", "referenced_globals"]

_lock = threading.RLock()


class PatchDriftError(AFDError, RuntimeError):
    """An upstream symbol afd replaces during construction is gone or renamed."""


@contextmanager
def scoped_globals(module: ModuleType | type, replacements: Mapping[str, Any]) -> Iterator[None]:
    """Replace ``module.<name>`` for each item while the block runs; always restore.

    ``module`` may also be a class: a constructor that builds a submodule through a class
    attribute (``self.attention_cls(...)``) is redirected the same way."""
    missing = [name for name in replacements if not hasattr(module, name)]
    if missing:
        raise PatchDriftError(
            f"{module.__name__} no longer defines {missing}; afd's role-aware construction "
            "was written against a vLLM that did. Upgrade afd for this vLLM version."
        )
    with _lock:
        saved = {name: getattr(module, name) for name in replacements}
        try:
            for name, value in replacements.items():
                setattr(module, name, value)
            yield
        finally:
            for name, value in saved.items():
                setattr(module, name, value)


def referenced_globals(func: Callable[..., Any], *, _depth: int = 0) -> frozenset[str]:
    """Global names a function's body refers to (used by drift tests).

    Follows wrappers (``__wrapped__``, and functions held in the closure, as class
    decorators such as vLLM's ``support_torch_compile`` replace ``__init__`` with a
    closure over the original).
    """
    code = getattr(func, "__code__", None)
    if code is None:
        raise TypeError(f"{func!r} has no code object")
    names: set[str] = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names.update(const.co_names)
    if _depth < 3:
        inner: list[Any] = [getattr(func, "__wrapped__", None)]
        inner += [cell.cell_contents for cell in getattr(func, "__closure__", None) or ()]
        for candidate in inner:
            if callable(candidate) and hasattr(candidate, "__code__"):
                names.update(referenced_globals(candidate, _depth=_depth + 1))
    return frozenset(names)
