"""The DRAM tier: one tmpfs file per block in the shared-memory arena directory, evicted LRU.

Keeping DRAM blocks as files on the tmpfs that same-node engines mount is what makes a same-node load
one copy: the server names the file, the client ``preadv``s it straight into its own buffer. Names are
128-bit random tokens in a directory that clients may traverse but not list (mode 0711), so a client
reaches only the blocks the server named to it. Files are read-only to clients and never rewritten:
a block's file is unlinked on eviction or deletion, and a client that already opened it keeps reading
the same, complete bytes.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvfabric.cacheserver.engine.base import TierName, TierUsage
from kvfabric.cacheserver.engine.blockfile import ALIGN
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.ordering import Generations
from kvfabric.cacheserver.engine.stats import Counters

__all__ = ["BytesBlock", "DramBlock", "DramTier", "OpenBlock"]

log = logging.getLogger(__name__)

DRAM_PREFIX = "d_"


@dataclass(frozen=True, slots=True)
class DramBlock:
    """Where a DRAM block lives."""

    name: str
    """File name inside the arena directory."""
    length: int
    """Payload bytes."""
    size: int
    """Bytes charged to the budget (the file, rounded up to a page)."""
    gen: int = 0
    """Generation of the stored copy (see ordering.py)."""


class OpenBlock:
    """An open, read-only handle on a DRAM block; stays valid after eviction. Close it."""

    def __init__(self, fd: int, length: int, gen: int = 0) -> None:
        self.fd = fd
        self.length = length
        self.gen = gen
        self._map: mmap.mmap | None = None

    def view(self) -> memoryview:
        """Return the payload as a read-only memoryview (mapped lazily)."""
        if self.length == 0:
            return memoryview(b"")  # mmap cannot map an empty file
        if self._map is None:
            self._map = mmap.mmap(self.fd, self.length, prot=mmap.PROT_READ)
        return memoryview(self._map)[: self.length]

    def read(self) -> bytes:
        """Return the payload as bytes (one copy)."""
        return os.pread(self.fd, self.length, 0)

    def close(self) -> None:
        """Release the fd and mapping (the mapping stays if a view is still exported)."""
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> OpenBlock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BytesBlock:
    """Verified payload bytes served from a lower tier when DRAM could not take the block.

    The same surface as :class:`OpenBlock` (``length``, ``gen``, ``view``, ``read``, ``close``), so a
    load's result is one type to the service whichever tier answered.
    """

    def __init__(self, data: bytes, gen: int = 0) -> None:
        self.data = data
        self.length = len(data)
        self.gen = gen

    def view(self) -> memoryview:
        """Return the payload as a read-only memoryview."""
        return memoryview(self.data)

    def read(self) -> bytes:
        """Return the payload."""
        return self.data

    def close(self) -> None:
        """Nothing to release."""

    def __enter__(self) -> BytesBlock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DramTier:
    """LRU tier of tmpfs files with a byte budget and high/low watermarks.

    With ``generations`` (the tiered store passes its own) a block older than its key's latest
    delete is never admitted, and a newer resident copy is never replaced by an older one.
    """

    name = TierName.DRAM

    def __init__(
        self,
        directory: Path,
        capacity_bytes: int,
        *,
        high_watermark: float = 1.0,
        low_watermark: float = 0.9,
        counters: Counters | None = None,
        generations: Generations | None = None,
    ) -> None:
        self.generations = generations
        self.dir = directory
        self.capacity = capacity_bytes
        self.high = high_watermark
        self.low = low_watermark
        self.counters = counters or Counters()
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockId, DramBlock] = OrderedDict()
        self.on_change: Callable[[list[BlockId]], None] | None = None
        """Called with blocks whenever the index gains or loses them (the published index listens)."""
        # Lock-free contains() for the lookup hot path: the index's own C-level membership test (128
        # keys per lookup; a Python method around it cost 4x). Atomic under the GIL; a moment stale at
        # worst, which a lookup tolerates (the load that follows re-checks under the lock).
        self.has: Callable[[BlockId], bool] = self._index.__contains__
        self._used = 0
        # Bytes promised to puts in flight; counted so concurrent puts cannot overshoot the budget.
        self._reserved = 0
        self.dir.mkdir(parents=True, exist_ok=True)
        # Traversable but not listable: clients open only the names the server gives them.
        try:
            os.chmod(self.dir, 0o711)  # noqa: S103
        except PermissionError:
            # A directory provisioned by someone else (e.g. a hostPath owned by root): keep going,
            # but say that the arena's names are then listable if its mode allows it.
            log.warning("cannot set arena directory mode 0711", extra={"dir": str(self.dir)})
        self._clean_leftovers()

    def discard_all(self) -> None:
        """Forget every block and unlink its file (a stopping server; readers' open maps stay valid)."""
        with self._lock:
            self._index.clear()
            self._used = 0
        self._clean_leftovers()

    def _clean_leftovers(self) -> None:
        # A previous server process's DRAM does not survive it: its files are stale memory.
        for entry in os.scandir(self.dir):
            if entry.name.startswith(DRAM_PREFIX) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)

    # --- Tier interface ------------------------------------------------------------------------------

    def contains(self, bid: BlockId) -> bool:
        """Whether the block is resident."""
        with self._lock:
            return bid in self._index

    def get(self, bid: BlockId) -> bytes | None:
        """Return the payload (one copy), or None."""
        handle = self.open(bid)
        if handle is None:
            return None
        with handle:
            return handle.read()

    def put(self, bid: BlockId, payload: bytes | bytearray | memoryview, *, bucket: int = 0) -> bool:
        """Copy ``payload`` into a new block; False if it does not fit."""
        view = memoryview(payload).cast("B")

        def fill(fd: int) -> None:
            done = 0
            while done < len(view):
                done += os.pwritev(fd, [view[done:]], done)

        return self.put_with(bid, len(view), fill)

    def delete(self, bid: BlockId, gen: int | None = None) -> bool:
        """Drop a block older than ``gen`` (any if None); clients that opened it keep their bytes."""
        with self._lock:
            blk = self._index.get(bid)
            if blk is None or (gen is not None and blk.gen >= gen):
                return False
            del self._index[bid]
            self._used -= blk.size
        self._unlink(blk.name)
        if self.on_change is not None:
            self.on_change([bid])
        return True

    def usage(self) -> TierUsage:
        """Return the current occupancy."""
        with self._lock:
            return TierUsage(self.name, self._used, self.capacity, len(self._index), self.high, self.low)

    def evict(self, target_bytes: int) -> list[BlockId]:
        """Evict least-recently-used blocks until usage is at most ``target_bytes``."""
        gone: list[tuple[BlockId, DramBlock]] = []
        with self._lock:
            while self._index and self._used + self._reserved > target_bytes:
                bid, blk = self._index.popitem(last=False)
                self._used -= blk.size
                gone.append((bid, blk))
        for _, blk in gone:
            self._unlink(blk.name)
        if gone:
            self.counters.inc("evictions", self.name, len(gone))
            if self.on_change is not None:
                self.on_change([bid for bid, _ in gone])
        return [bid for bid, _ in gone]

    # --- DRAM-specific -------------------------------------------------------------------------------

    def slot(self, bid: BlockId) -> DramBlock | None:
        """Where a resident block lives (and mark it recently used), or None."""
        with self._lock:
            blk = self._index.get(bid)
            if blk is not None:
                self._index.move_to_end(bid)
            return blk

    def open(self, bid: BlockId) -> OpenBlock | None:
        """Open a resident block for reading, or None (also None if it was evicted meanwhile)."""
        blk = self.slot(bid)
        if blk is None:
            return None
        try:
            fd = os.open(self.dir / blk.name, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        return OpenBlock(fd, blk.length, blk.gen)

    def generation(self, bid: BlockId) -> int | None:
        """Generation of the resident copy, or None."""
        blk = self._index.get(bid)
        return None if blk is None else blk.gen

    def put_with(
        self,
        bid: BlockId,
        length: int,
        fill: Callable[[int], None],
        *,
        gen: int | Callable[[], int] = 0,
    ) -> bool:
        """Create a block of ``length`` bytes and let ``fill(fd)`` write its payload.

        Room is reserved first (evicting LRU blocks down to the low watermark when needed), so the
        tier never exceeds its high watermark even with puts in flight. ``fill`` may raise; the
        block is then discarded and the error propagates. ``gen`` is the copy's generation, or a
        function returning it after ``fill`` (a promotion learns it from the block header). The
        block is admitted only if no delete of its key is newer and no newer copy is resident;
        returns False when refused (no room, or superseded).
        """
        size = max(ALIGN, -(-length // ALIGN) * ALIGN)
        if not self._reserve(size):
            return False
        name = f"{DRAM_PREFIX}{secrets.token_hex(16)}"
        path = self.dir / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                os.fchmod(fd, 0o644)
                os.ftruncate(fd, length)
                fill(fd)
            finally:
                os.close(fd)
        except BaseException:
            self._unlink(name)
            with self._lock:
                self._reserved -= size
            raise
        g = gen() if callable(gen) else gen
        old: DramBlock | None
        with self._lock:
            # Checked and committed under one lock hold: a delete records its tombstone before it
            # takes this lock to drop the resident copy, so a copy it superseded never lands after it.
            self._reserved -= size
            cur = self._index.get(bid)
            admitted = (self.generations is None or self.generations.admits(bid, g)) and (
                cur is None or cur.gen <= g
            )
            old = None
            if admitted:
                old = self._index.pop(bid, None)
                if old is not None:
                    self._used -= old.size
                self._index[bid] = DramBlock(name, length, size, g)
                self._used += size
        if not admitted:
            self._unlink(name)
            return cur is not None and cur.gen > g  # a newer copy is resident: the key is stored
        if old is not None:
            self._unlink(old.name)
        if self.on_change is not None:
            self.on_change([bid])
        return True

    def _reserve(self, size: int) -> bool:
        high = int(self.capacity * self.high)
        if size > high:
            return False
        with self._lock:
            if self._used + self._reserved + size <= high:
                self._reserved += size
                return True
        # Make room down to the low watermark (hysteresis: not one eviction per put).
        self.evict(max(0, min(int(self.capacity * self.low), high - size)))
        with self._lock:
            if self._used + self._reserved + size <= high:
                self._reserved += size
                return True
        return False

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.dir / name)
