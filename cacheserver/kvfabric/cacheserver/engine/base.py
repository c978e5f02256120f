"""The one small interface every tier implements, and the numbers it reports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvfabric.cacheserver.engine.ids import BlockId

__all__ = ["Tier", "TierUsage"]


@dataclass(frozen=True, slots=True)
class TierUsage:
    """Occupancy of one tier."""

    name: str
    used_bytes: int
    capacity_bytes: int
    blocks: int
    high_watermark: float
    low_watermark: float

    @property
    def high_bytes(self) -> int:
        """Usage at which eviction starts; a put never takes usage above it."""
        return int(self.capacity_bytes * self.high_watermark)


class Tier(Protocol):
    """A store of blocks with a byte budget. Implementations are thread-safe.

    ``get`` returns the verified payload or None (a miss; a corrupt block counts as a miss and is
    removed); ``put`` returns False when the block cannot be taken without exceeding the budget.
    """

    name: str

    def contains(self, bid: BlockId) -> bool:
        """Whether the tier's in-memory index holds ``bid`` (never touches storage)."""
        ...

    def get(self, bid: BlockId) -> bytes | None:
        """Return the payload, verified, or None."""
        ...

    def put(self, bid: BlockId, payload: bytes | bytearray | memoryview, *, bucket: int) -> bool:
        """Store a payload; False if it does not fit."""
        ...

    def delete(self, bid: BlockId) -> bool:
        """Remove a block; True if it was present."""
        ...

    def usage(self) -> TierUsage:
        """Return the current occupancy."""
        ...

    def evict(self, target_bytes: int) -> list[BlockId]:
        """Evict by the tier's policy until usage is at most ``target_bytes``; returns what went."""
        ...
