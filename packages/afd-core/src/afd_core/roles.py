"""The two AFD roles: the one name every afd module agrees on (imports nothing)."""

from __future__ import annotations

import enum

__all__ = ["AFDRole"]


class AFDRole(enum.StrEnum):
    ATTENTION = "attention"
    FFN = "ffn"
