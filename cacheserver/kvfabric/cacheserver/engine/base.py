"""The interfaces the tiered store composes tiers through, and the names and numbers they report.

Two protocols:

* :class:`Tier` — what every tier answers, DRAM included: index checks, get/put/delete, usage and
  eviction. The store's lookups and statistics walk its ordered tier list through this alone.
* :class:`BackingTier` — a tier below DRAM (local disk, the shared volume, an object store). Promotion
  reads it into DRAM (:meth:`BackingTier.read_into`), write-back writes it, the janitor ticks it.
  Adding a tier means one module implementing this protocol plus a line of configuration
  (``tiers.extra``; see docs/cacheserver.md, "How to add a tier").

Every stored copy carries a *generation* (:mod:`~kvfabric.cacheserver.engine.ordering`): a put gets a
fresh one, a delete records one as a tombstone, and a tier never admits or serves a copy older than the
tombstone of its key. That is how the ordering invariant holds on every tier.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvfabric.cacheserver.engine.ids import BlockId

__all__ = [
    "BackingTier",
    "KeepsNames",
    "MissReason",
    "ReadResult",
    "Tier",
    "TierName",
    "TierUsage",
    "read_miss_counter",
]

READ_MISSES = "read_misses"


class TierName(enum.StrEnum):
    """The one list of tier names: metric labels, stats keys and (``TIER_<NAME>``) the proto enum.

    ``tests/cacheserver/test_cacheserver_tiers.py`` checks this against ``kvfabric.rpc.v1.Tier``.
    """

    DRAM = "dram"
    LOCAL_DISK = "local_disk"
    SHARED = "shared"
    OBJECT = "object"


class MissReason(enum.StrEnum):
    """Why a read that the index promised did not produce verified bytes (counted per reason)."""

    ABSENT = "absent"
    """Not indexed, or the file vanished (deleted or expired elsewhere)."""
    CORRUPT = "corrupt"
    """Checksum, identity or format mismatch."""
    STALE = "stale"
    """An older generation than the index or a tombstone allows."""
    STALE_HANDLE = "stale-handle"
    """ESTALE: another server replaced the file under a network filesystem's handle."""
    IO_ERROR = "io-error"
    """Any other I/O failure (EIO, ENOSPC, an index/file length mismatch)."""


def read_miss_counter(reason: MissReason) -> str:
    """Counter name of read misses for ``reason`` (``read_misses.<reason>``, one metric with a label)."""
    return f"{READ_MISSES}.{reason.value}"


@dataclass(frozen=True, slots=True)
class ReadResult:
    """The outcome of reading one block: its payload length and generation, or why it missed."""

    length: int = 0
    gen: int = 0
    miss: MissReason | None = None

    @property
    def ok(self) -> bool:
        """Whether verified bytes were read."""
        return self.miss is None

    @classmethod
    def missed(cls, reason: MissReason) -> ReadResult:
        """A miss for ``reason``."""
        return cls(miss=reason)


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

    @property
    def name(self) -> TierName:
        """The tier's name (metric label, stats key, proto enum)."""
        ...

    def has(self, bid: BlockId) -> bool:
        """Lock-free index check for the lookup hot path (may be a moment stale)."""
        ...

    def contains(self, bid: BlockId) -> bool:
        """Whether the tier's in-memory index holds ``bid`` (never touches storage)."""
        ...

    def get(self, bid: BlockId) -> bytes | None:
        """Return the payload, verified, or None."""
        ...

    def put(self, bid: BlockId, payload: bytes | bytearray | memoryview, *, bucket: int) -> bool:
        """Store a payload; False if it does not fit."""
        ...

    def delete(self, bid: BlockId, gen: int | None = None) -> bool:
        """Remove the copies of a block older than ``gen`` (every copy if None); True if one was present."""
        ...

    def usage(self) -> TierUsage:
        """Return the current occupancy."""
        ...

    def evict(self, target_bytes: int) -> list[BlockId]:
        """Evict by the tier's policy until usage is at most ``target_bytes``; returns what went."""
        ...


class BackingTier(Tier, Protocol):
    """A tier below DRAM, as the tiered store drives it: promotion source, write-back target."""

    @property
    def durable(self) -> bool:
        """Whether a block written here survives a restart of this server."""
        ...

    def start(self) -> None:
        """Rebuild the index (and open whatever the tier owns: journals, leases, connections)."""
        ...

    def close(self) -> None:
        """Stop background work and release what :meth:`start` opened."""
        ...

    def tick(self) -> None:
        """Janitor work: evict above the high watermark, expire old buckets, renew leases."""
        ...

    def generation(self, bid: BlockId) -> int | None:
        """Generation of the indexed copy, or None when not indexed (index only)."""
        ...

    def length(self, bid: BlockId) -> int | None:
        """Payload length of the indexed copy, or None when not indexed (index only)."""
        ...

    def read_into(self, bid: BlockId, dest: memoryview) -> ReadResult:
        """Read and verify a payload into ``dest`` (page-aligned, payload length rounded up to 4 KiB).

        A failure is a miss with a reason, never an exception; the failing entry is dropped.
        """
        ...

    def write(
        self,
        bid: BlockId,
        payload: memoryview,
        *,
        gen: int,
        bucket: int,
        created_at: float,
        checksum: bytes,
    ) -> bool:
        """Write a copy of generation ``gen``; False if refused (no room, or a newer copy or tombstone).

        Never replaces a newer generation, and never admits one a tombstone superseded.
        """
        ...

    def wants_refresh(self, bid: BlockId, bucket: int) -> bool:
        """Whether a hit should move the copy into ``bucket`` (index only)."""
        ...

    def refresh(self, bid: BlockId, bucket: int) -> bool:
        """Move the copy into ``bucket`` so a hot block does not age out; True if it moved."""
        ...

    def purge(self, bid: BlockId, gen: int) -> bool:
        """Apply a delete learned from elsewhere: drop copies older than ``gen``, without announcing it."""
        ...


@runtime_checkable
class ConfirmsPresence(Protocol):
    """A backing tier whose index can outlive its copies, and that can check one cheaply.

    The disk tiers: a shared volume's index is built from other servers' journals, and a file can
    go without its ``D`` record ever arriving (a journal that started over, an admin). A lookup may
    trust the index (a stale entry costs one miss on the load, which drops it); a store may not:
    "already stored" makes the client skip a block the tier no longer has.
    """

    def confirm(self, bid: BlockId) -> bool:
        """Whether the indexed copy of ``bid`` is still there (dropping the entry when it is not)."""
        ...


@runtime_checkable
class KeepsNames(Protocol):
    """A backing tier that keeps a chunk's names with its copy, across restarts (the local disk).

    The names are the residency metadata a connector attached to the chunk (encoded, at most
    64 KiB): a write-back hands them over with the payload, and the tier's start-up scan hands the
    names of every copy it indexed, verified, to ``on_meta``, so the residency feed serves them
    again after a restart.
    """

    on_meta: Callable[[BlockId, bytes], None] | None

    def write(
        self,
        bid: BlockId,
        payload: memoryview,
        *,
        gen: int,
        bucket: int,
        created_at: float,
        checksum: bytes,
        meta: bytes | None = None,
    ) -> bool:
        """:meth:`BackingTier.write`, with the chunk's names (None: it has none)."""
        ...

    def rewrite_names(self, bid: BlockId, meta: bytes | None) -> bool:
        """Make ``meta`` the names kept with the indexed copy (names that arrived after its write)."""
        ...


@runtime_checkable
class ReadsIntoFiles(Protocol):
    """A backing tier that can fill a file descriptor directly (the disk tiers and the object tier).

    A promotion into DRAM prefers it to :meth:`BackingTier.read_into`: the tier writes the payload
    into the block's memfd in pieces as it reads them, instead of reading into a fresh mapping.
    """

    def read_into_fd(self, bid: BlockId, fd: int, *, room: int | None = None) -> ReadResult:
        """Read and verify ``bid`` into the start of ``fd`` (a memfd of its length); misses as read_into.

        ``room``: the length the caller sized for; a payload longer than that (the block was
        replaced by a longer copy since the caller asked its length) is a STALE miss, nothing written.
        """
        ...


@runtime_checkable
class ClosesForSuccessor(Protocol):
    """A backing tier with state shared with a successor of the same server id (the hand-over).

    The shared tier keeps its lease (the successor has the same server id and renews it); a tier
    without this hook is closed with ``close()``.
    """

    def resume_after_successor(self) -> None:
        """A hand-over failed after the successor may have started: take shared state back."""
        ...

    def close_for_successor(self) -> None:
        """Stop background work and release this process's resources; leave the rest to the successor."""
        ...


@runtime_checkable
class Quiesces(Protocol):
    """A backing tier that changes its storage on its own threads (the object store's janitor, uploads).

    A hand-over's freeze quiesces it after the store's own write-backs settled, and resumes it if the
    hand-over does not happen.
    """

    def quiesce(self, timeout: float) -> bool:
        """Stop changing storage; True once nothing is in flight (within ``timeout``)."""
        ...

    def resume(self) -> None:
        """Change storage again."""
        ...
