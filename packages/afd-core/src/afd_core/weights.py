"""Which role loads which checkpoint tensor.

A model package supplies a ``classify(name) -> WeightOwner`` function (it knows
its parameter names); :func:`filter_role_weights` then streams vLLM's
``weights`` iterable and yields only the tensors the role owns. It is a lazy,
single-pass generator: checkpoint shards are never materialised, and each
``(name, tensor)`` pair is pulled only when the consumer asks for the next one.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from afd_core.roles import AFDRole

__all__ = ["WeightOwner", "RoleWeightStats", "owner_keeps", "filter_role_weights"]

T = TypeVar("T")


class WeightOwner(enum.Enum):
    ATTENTION = "attention"
    """Attention, norms, embeddings, lm_head, the gate when it runs on Attention..."""
    FFN = "ffn"
    """Routed experts, shared experts, dense MLPs."""
    BOTH = "both"
    """Needed by both roles (e.g. the gate when each role may run it)."""
    NONE = "none"
    """Loaded by neither role (e.g. MTP layers not served, rotary caches)."""


def owner_keeps(owner: WeightOwner, role: AFDRole) -> bool:
    """Whether a tensor owned by ``owner`` is loaded by ``role``."""
    if owner is WeightOwner.BOTH:
        return True
    if owner is WeightOwner.NONE:
        return False
    wanted = WeightOwner.ATTENTION if AFDRole(role) is AFDRole.ATTENTION else WeightOwner.FFN
    return owner is wanted


@dataclass
class RoleWeightStats:
    """Counts of the tensors kept and dropped per owner, filled by :func:`filter_role_weights`."""

    kept: Counter[WeightOwner] = field(default_factory=Counter)
    dropped: Counter[WeightOwner] = field(default_factory=Counter)

    @property
    def num_kept(self) -> int:
        return sum(self.kept.values())

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())

    def summary(self) -> str:
        """One line for logs, e.g. ``kept 12 (attention=10, both=2), dropped 40 (ffn=40)``."""

        def fmt(c: Counter[WeightOwner]) -> str:
            return ", ".join(
                f"{o.value}={n}" for o, n in sorted(c.items(), key=lambda x: x[0].value)
            )

        return (
            f"kept {self.num_kept} ({fmt(self.kept)}), "
            f"dropped {self.num_dropped} ({fmt(self.dropped)})"
        )


def filter_role_weights(
    weights: Iterable[tuple[str, T]],
    role: AFDRole,
    classify: Callable[[str], WeightOwner],
    *,
    stats: RoleWeightStats | None = None,
) -> Iterator[tuple[str, T]]:
    """Yield the ``(name, tensor)`` pairs of ``weights`` that ``role`` owns, lazily, in one pass.

    ``role`` is checked at once; ``weights`` is not touched until the first ``next()``.
    """
    return _filter(weights, AFDRole(role), classify, stats)


def _filter(
    weights: Iterable[tuple[str, T]],
    role: AFDRole,
    classify: Callable[[str], WeightOwner],
    stats: RoleWeightStats | None,
) -> Iterator[tuple[str, T]]:
    for name, tensor in weights:
        owner = classify(name)
        if not isinstance(owner, WeightOwner):
            raise TypeError(
                f"classify({name!r}) returned {owner!r}; expected a WeightOwner "
                f"({', '.join(o.name for o in WeightOwner)})"
            )
        if owner_keeps(owner, role):
            if stats is not None:
                stats.kept[owner] += 1
            yield name, tensor
        elif stats is not None:
            stats.dropped[owner] += 1
