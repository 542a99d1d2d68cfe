"""The model families afd knows, found through entry points rather than by name.

Each model package (afd-models-deepseek, afd-models-qwen, or one from another
distribution) declares its family in the entry point group :data:`GROUP`
(``[project.entry-points."afd.families"]`` in its pyproject.toml), naming an object
(usually a module, ``afd_models_deepseek.family``) with these attributes, all but
``NAME`` optional:

* ``NAME``: the family's name; ``PACKAGE``: its import package (its logger gets
  afd's log handler in vLLM processes, :mod:`afd.runtime.plugin`);
* ``RECIPES``: its tiny checkpoint recipes (:class:`afd_moe_runners.recipes.TinyRecipe`,
  ``afd models tiny``); ``SHAPES``: its real deployment shapes
  (:class:`afd_moe_runners.recipes.DeploymentShape`);
* ``install_import_hooks()``: what every vLLM process needs before it imports one of
  its models (the vLLM plugin calls it);
* ``cpu_attention_backend(text_config, dtype, *, amx_tiles)``: the attention backend
  vLLM's CPU build needs for one of its models (a checkpoint's text config, a resolved
  dtype; ``amx_tiles()`` says whether this CPU has AMX tiles, asked only when it
  matters: it imports torch), None where vLLM's own pick works;
* ``test_blocks()``: its MoE blocks for the test kit (:mod:`afd_moe_runners.testing`).

Nothing heavy is imported: a family's object is data and functions. The families are
read once per process, in entry point name order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "GROUP",
    "cpu_attention_backend",
    "families",
    "family_packages",
    "family_recipes",
    "family_shapes",
    "install_import_hooks",
]

GROUP = "afd.families"
"""The entry point group of the model families."""


@functools.cache
def families() -> tuple[Any, ...]:
    """Every installed family's object, in entry point name order (one per name; an
    entry point that fails to load raises, naming it)."""
    from importlib.metadata import entry_points

    found: dict[str, Any] = {}
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        if ep.name in found:
            continue
        try:
            family = ep.load()
        except Exception as exc:
            raise ImportError(
                f"model family {ep.name!r} ({ep.value}, entry point group {GROUP}) failed "
                f"to load: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(getattr(family, "NAME", None), str):
            raise TypeError(f"model family {ep.name!r} ({ep.value}) has no NAME")
        found[ep.name] = family
    return tuple(found.values())


def family_packages() -> tuple[str, ...]:
    """The families' import packages (``PACKAGE``)."""
    return tuple(f.PACKAGE for f in families() if getattr(f, "PACKAGE", None))


def family_recipes() -> tuple[Any, ...]:
    """The families' tiny checkpoint recipes (``RECIPES``), family by family."""
    return tuple(r for f in families() for r in getattr(f, "RECIPES", ()))


def family_shapes() -> tuple[Any, ...]:
    """The families' real deployment shapes (``SHAPES``), family by family."""
    return tuple(s for f in families() for s in getattr(f, "SHAPES", ()))


def install_import_hooks() -> None:
    """Every family's ``install_import_hooks()`` (the vLLM plugin, each process)."""
    for family in families():
        hook = getattr(family, "install_import_hooks", None)
        if hook is not None:
            hook()


def cpu_attention_backend(
    text_config: Mapping[str, Any], dtype: str, *, amx_tiles: Callable[[], bool]
) -> str | None:
    """The attention backend vLLM's CPU build needs for a model (its text config) at a
    resolved ``dtype``, as the first family that knows one says; None: vLLM's own pick."""
    for family in families():
        backend_of = getattr(family, "cpu_attention_backend", None)
        backend = (
            None if backend_of is None else backend_of(text_config, dtype, amx_tiles=amx_tiles)
        )
        if backend is not None:
            return str(backend)
    return None
