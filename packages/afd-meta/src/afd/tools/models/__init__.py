"""Locally generated model checkpoints for tests, examples and benchmarks.

Nothing here downloads from a model hub: :mod:`afd.tools.models.tiny` builds small MoE
checkpoints (seeded random weights, a locally trained tokenizer) that vLLM's CPU
build loads in seconds.
"""

from afd.tools.models.tiny import (
    GENERATOR_VERSION,
    TINY_ARCHS,
    TinyRecipe,
    checkpoint_name,
    generate_tiny_checkpoint,
    tiny_config,
    tiny_variants,
)

__all__ = [
    "GENERATOR_VERSION",
    "TINY_ARCHS",
    "TinyRecipe",
    "checkpoint_name",
    "generate_tiny_checkpoint",
    "tiny_config",
    "tiny_variants",
]
