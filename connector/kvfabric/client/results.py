"""Result types returned by the cache client."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FlushResult", "LookupResult", "StoreResult"]


@dataclass(frozen=True, slots=True)
class LookupResult:
    """How many leading keys are stored, and where each of them is."""

    matched: int
    """Number of leading keys that are stored."""
    tiers: list[str] = field(default_factory=list)
    """Tier of each matched key: ``"dram"``, ``"local_disk"``, ``"shared"`` or ``"object"`` (``"unknown"``
    for a tier this client does not know)."""


@dataclass(frozen=True, slots=True)
class StoreResult:
    """Outcome of a store: every key is either accepted or dropped."""

    accepted: int
    """Keys now stored (including keys that were already stored)."""
    dropped: int
    """Keys dropped under backpressure; a drop costs a future recompute, never correctness."""


@dataclass(frozen=True, slots=True)
class FlushResult:
    """Which tiers hold each key *durably* (survive a restart of the server), after a flush."""

    tiers: list[list[str]]
    """Parallel to the keys asked for: the durable tiers holding the key's latest stored generation
    (``"local_disk"``, ``"shared"``, ``"object"``); empty when the key is in DRAM only, or not stored."""
    complete: bool
    """False if the deadline came before every pending write-back of these keys finished (a key's
    empty list may then still become durable)."""
