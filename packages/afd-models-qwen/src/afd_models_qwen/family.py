"""The Qwen MoE families as afd finds them: entry point ``qwen`` of the group
``afd.families`` (this package's pyproject.toml), read by the ``afd`` package
(:mod:`afd.model_families`) and the test kit (:func:`afd_moe_runners.testing.block_recipe`).

What a family offers (see :mod:`afd.model_families`): its name and package, its tiny
checkpoint recipes and real deployment shapes, the import hooks vLLM processes need for it
and its test blocks. Importing this module is cheap: data and functions, no torch or vLLM.
"""

from __future__ import annotations

import logging
from typing import Any

from afd_models_qwen.recipes import TINY_RECIPES
from afd_models_qwen.shapes import SHAPES

__all__ = ["NAME", "PACKAGE", "RECIPES", "SHAPES", "install_import_hooks", "test_blocks"]

logger = logging.getLogger(__name__)

NAME = "qwen"
PACKAGE = "afd_models_qwen"
"""The import package (its logger gets afd's log handler in vLLM processes)."""
RECIPES = TINY_RECIPES
"""The tiny checkpoint recipes (``afd models tiny --arch``); ``SHAPES``: the real
deployment shapes (:mod:`.shapes`)."""


def install_import_hooks() -> None:
    """What every vLLM process needs before it imports a model of the family: the
    torchvision-free import of vLLM's ``qwen3_5`` (:mod:`afd_models_qwen.qwen3_5_import`;
    idempotent, cheap)."""
    from afd_models_qwen.qwen3_5_import import install_import_hook

    if install_import_hook():
        logger.debug("vLLM's qwen3_5 will be imported without torchvision (text only)")


def test_blocks() -> dict[str, Any]:
    """The family's MoE blocks for :mod:`afd_moe_runners.testing`, by name."""
    from afd_models_qwen.testing import BLOCKS

    return dict(BLOCKS)
