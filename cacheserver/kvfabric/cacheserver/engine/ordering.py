"""Generations and tombstones: what makes "the latest store, unless a later delete" checkable.

Every put gets a *generation*: a 64-bit number, strictly increasing on one server and ordered by
volume time across servers (a hybrid logical clock: nanoseconds of the shared clock, bumped past
every generation this server has seen, its own or another server's). A delete records a tombstone
``(key, generation)``; from then on no tier admits, keeps or serves a copy of that key whose
generation is not greater. Every copy carries its generation: DRAM in its index, disk tiers in the
block header and the index, the shared volume's journal in its ``P`` and ``T`` records.

Servers agree on volume time only to within the filesystem's timestamp granularity (a few ms) plus
monotonic drift between syncs. So that a delete supersedes every store acknowledged anywhere before
it, its generation is taken a margin ahead of now (:meth:`Generations.for_delete`; the store passes
one second plus a janitor interval, the same on every server): a store on another server within
that margin which had not yet learned of the delete is superseded too — a miss, never old bytes.
The margin must be the same everywhere: deletes whose margins differ could order against each other.

Stores never inherit a delete's margin: the store clock (:meth:`Generations.next`) follows volume
time and the stores it has seen, not tombstones. If a store right after a delete took the delete's
generation plus one (what a plain hybrid logical clock does), it would sit a margin ahead of volume
time, and a delete of the same key on another server a moment later (its clock within the timestamp
granularity of this one's) would come out *older* than that store: deleted bytes would survive the
delete. So a key stays deleted for the margin: stores of it are refused (a miss) until volume time
passes its tombstone, everywhere alike.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvfabric.cacheserver.engine.ids import BlockId

__all__ = ["DELETE_MARGIN_S", "Generations"]

DELETE_MARGIN_S = 1.0


class Generations:
    """The server's generation clock and its tombstones (thread-safe)."""

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self._lock = threading.Lock()
        self._last = 0
        self._tombs: dict[BlockId, int] = {}

    def next(self) -> int:
        """A generation greater than every one issued or observed so far."""
        t = int(self._now() * 1e9)
        with self._lock:
            self._last = max(self._last + 1, t)
            return self._last

    def for_delete(self, margin_s: float = DELETE_MARGIN_S) -> int:
        """A delete's generation, ``margin_s`` ahead of now (and of every store issued here).

        It is ahead of every store acknowledged so far on any server whose generation clock is less
        than ``margin_s`` ahead of this one's. It does not advance the store clock (see above).
        """
        t = int((self._now() + margin_s) * 1e9)
        with self._lock:
            if self._last + 1 <= t:
                return t
            # The store clock is already past the margin (it observed a peer skewed beyond it):
            # reserve the value, so no store issued meanwhile gets the same generation.
            self._last += 1
            return self._last

    def observe(self, gen: int) -> None:
        """Note a generation seen elsewhere, so later ones issued here are greater."""
        with self._lock:
            self._last = max(self._last, gen)

    def tombstone(self, bid: BlockId, gen: int) -> bool:
        """Record a delete of ``bid`` at ``gen``; True if it is newer than the one already known.

        The store clock is left alone: a store after a delete stays behind it until volume time
        passes it (see above).
        """
        with self._lock:
            if self._tombs.get(bid, 0) >= gen:
                return False
            self._tombs[bid] = gen
            return True

    def deleted_at(self, bid: BlockId) -> int:
        """Generation of the latest delete of ``bid`` known here (0: never deleted)."""
        return self._tombs.get(bid, 0)

    def admits(self, bid: BlockId, gen: int) -> bool:
        """Whether a copy of generation ``gen`` is newer than every delete of ``bid``."""
        tomb = self._tombs.get(bid)
        return tomb is None or gen > tomb

    def prune(self, before_gen: int) -> int:
        """Forget tombstones older than ``before_gen`` (no copy that old survives TTL expiry)."""
        with self._lock:
            old = [b for b, g in self._tombs.items() if g < before_gen]
            for b in old:
                del self._tombs[b]
        return len(old)

    def export(self) -> tuple[int, list[tuple[BlockId, int]]]:
        """``(last generation, tombstones)``: what a successor must know to order after this server."""
        with self._lock:
            return self._last, list(self._tombs.items())
