"""Which attention rank talks to which FFN rank.

With ``A`` attention ranks and ``F`` FFN ranks, attention rank ``a`` has exactly
one FFN peer, ``a % F``. The fan-in of the FFN ranks (how many attention ranks
each one serves) therefore differs by at most one. When ``A < F`` the FFN ranks
``A..F-1`` serve nobody; they are listed explicitly in
:attr:`AFDTopology.idle_ffn_ranks` so that a runtime can decide what to do with
them instead of silently waiting forever.

Global ranks (for a process group spanning both roles) put the attention ranks
first: attention ``0..A-1``, FFN ``A..A+F-1``.
"""

from __future__ import annotations

from dataclasses import dataclass

from afd_core.errors import AFDConfigError
from afd_core.roles import AFDRole

__all__ = ["AFDTopology", "expert_shard", "expert_owner"]


def _as_role(role: AFDRole | str) -> AFDRole:
    try:
        return AFDRole(role)
    except ValueError:
        raise AFDConfigError(
            f"role: expected 'attention' or 'ffn', got {role!r} ({type(role).__name__})"
        ) from None


@dataclass(frozen=True, slots=True)
class AFDTopology:
    """Peer mapping between ``num_attention_ranks`` (A) and ``num_ffn_ranks`` (F) ranks."""

    num_attention_ranks: int
    num_ffn_ranks: int

    def __post_init__(self) -> None:
        for name in ("num_attention_ranks", "num_ffn_ranks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise AFDConfigError(
                    f"afd.{name}: expected an int >= 1, got {value!r} ({type(value).__name__})"
                )

    # -- sizes ---------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.num_attention_ranks + self.num_ffn_ranks

    @property
    def label(self) -> str:
        """Short id, e.g. ``"3A2F"`` (handy for test ids and logs)."""
        return f"{self.num_attention_ranks}A{self.num_ffn_ranks}F"

    def size_of(self, role: AFDRole | str) -> int:
        role = _as_role(role)
        return self.num_attention_ranks if role is AFDRole.ATTENTION else self.num_ffn_ranks

    def _check_rank(self, role: AFDRole, rank: int) -> None:
        size = self.size_of(role)
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < size:
            raise AFDConfigError(
                f"{role.value} rank: expected an int in 0..{size - 1} "
                f"(num_{role.value}_ranks={size}), got {rank!r}"
            )

    # -- peers ---------------------------------------------------------------------
    def ffn_peer_of(self, attention_rank: int) -> int:
        """The single FFN rank that serves ``attention_rank``."""
        self._check_rank(AFDRole.ATTENTION, attention_rank)
        return attention_rank % self.num_ffn_ranks

    def attention_peers_of(self, ffn_rank: int) -> tuple[int, ...]:
        """Attention ranks served by ``ffn_rank``, ascending (the fan-in order)."""
        self._check_rank(AFDRole.FFN, ffn_rank)
        return tuple(range(ffn_rank, self.num_attention_ranks, self.num_ffn_ranks))

    def fan_in(self, ffn_rank: int) -> int:
        return len(self.attention_peers_of(ffn_rank))

    @property
    def idle_ffn_ranks(self) -> tuple[int, ...]:
        """FFN ranks with no attention peer (only when A < F)."""
        return tuple(range(self.num_attention_ranks, self.num_ffn_ranks))

    @property
    def active_ffn_ranks(self) -> tuple[int, ...]:
        return tuple(range(min(self.num_attention_ranks, self.num_ffn_ranks)))

    def peers_of(self, role: AFDRole | str, rank: int) -> tuple[int, ...]:
        """Ranks of the other role that ``(role, rank)`` exchanges messages with."""
        role = _as_role(role)
        if role is AFDRole.ATTENTION:
            return (self.ffn_peer_of(rank),)
        return self.attention_peers_of(rank)

    # -- global ranks --------------------------------------------------------------
    def global_rank(self, role: AFDRole | str, rank: int) -> int:
        role = _as_role(role)
        self._check_rank(role, rank)
        return rank if role is AFDRole.ATTENTION else self.num_attention_ranks + rank

    def role_rank_of(self, global_rank: int) -> tuple[AFDRole, int]:
        """Inverse of :meth:`global_rank`."""
        if (
            not isinstance(global_rank, int)
            or isinstance(global_rank, bool)
            or not 0 <= global_rank < self.world_size
        ):
            raise AFDConfigError(
                f"global rank: expected an int in 0..{self.world_size - 1} "
                f"(world_size={self.world_size}), got {global_rank!r}"
            )
        if global_rank < self.num_attention_ranks:
            return AFDRole.ATTENTION, global_rank
        return AFDRole.FFN, global_rank - self.num_attention_ranks


def expert_shard(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The routed experts FFN rank ``ep_rank`` of ``ep_size`` holds under expert
    parallelism (``afd.ffn_expert_parallel``): contiguous and balanced, the first
    ``num_experts % ep_size`` ranks one more (16 over 3: 0-5, 6-10, 11-15). Fewer experts
    than ranks is refused (a rank would hold none)."""
    for name, value, low in (("num_experts", num_experts, 1), ("ep_size", ep_size, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise AFDConfigError(f"{name}: expected an int >= {low}, got {value!r}")
    if not isinstance(ep_rank, int) or isinstance(ep_rank, bool) or not 0 <= ep_rank < ep_size:
        raise AFDConfigError(f"ep_rank: expected an int in 0..{ep_size - 1}, got {ep_rank!r}")
    if num_experts < ep_size:
        raise AFDConfigError(
            f"afd.ffn_expert_parallel: {num_experts} routed experts cannot be shared by "
            f"{ep_size} FFN ranks (each must hold at least one); use at most {num_experts} "
            "FFN ranks"
        )
    size, extra = divmod(num_experts, ep_size)
    start = ep_rank * size + min(ep_rank, extra)
    return range(start, start + size + (1 if ep_rank < extra else 0))


def expert_owner(num_experts: int, ep_size: int) -> list[int]:
    """FFN rank of every routed expert (index = expert id), by :func:`expert_shard`."""
    owner = [0] * num_experts
    for rank in range(ep_size):
        for expert in expert_shard(num_experts, ep_size, rank):
            owner[expert] = rank
    return owner
