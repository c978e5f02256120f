"""Result types returned by the cache client."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LookupResult", "StoreResult"]


@dataclass(frozen=True, slots=True)
class LookupResult:
    """How many leading keys are stored, and where each of them is."""

    matched: int
    """Number of leading keys that are stored."""
    tiers: list[str] = field(default_factory=list)
    """Tier of each matched key: ``"dram"``, ``"local_disk"``, ``"shared"`` or ``"object"``."""


@dataclass(frozen=True, slots=True)
class StoreResult:
    """Outcome of a store: every key is either accepted or dropped."""

    accepted: int
    """Keys now stored (including keys that were already stored)."""
    dropped: int
    """Keys dropped under backpressure; a drop costs a future recompute, never correctness."""
