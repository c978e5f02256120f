"""The DRAM tier: one sealed memfd per block, owned by the server, evicted LRU.

Blocks live in anonymous memory files (``memfd_create``) that only this process holds: no directory
shared with engine pods contains them, so no other process on the node can list, read, change,
truncate or replace a block. A same-node load is still one copy: the server hands the client a
descriptor of the requested block over its Unix socket (``SCM_RIGHTS``, see
:mod:`kvfabric.cacheserver.transport.blocksock`) and the client copies it straight into its own
buffer. Each block is sealed once written (``F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW |
F_SEAL_SEAL``), so no holder of a descriptor, the server included, can write, truncate (the SIGBUS of
a shrunk mapping), punch holes in or map it writable. A block's handle name is a 128-bit random token
that the server gives only to callers of its load RPC; eviction or deletion closes the tier's
descriptor, and a client that already received one keeps reading the same, complete bytes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import resource
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvfabric.cacheserver.engine.base import TierName, TierUsage
from kvfabric.cacheserver.engine.blockfile import ALIGN
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.ordering import Generations
from kvfabric.cacheserver.engine.stats import Counters

__all__ = ["BLOCK_SEALS", "BytesBlock", "DramBlock", "DramTier", "OpenBlock", "new_memfd", "seal"]

log = logging.getLogger(__name__)

DRAM_PREFIX = "d_"
HELD_SHARE = 0.5
"""Most of the DRAM budget, in bytes and in blocks, clients may hold (keep mapped across loads);
beyond it blocks are lent.

Eviction passes over held blocks (evicting one would free nothing), so at least this share of the
budget, and of the tier's descriptor cap, is always evictable: many tiny held blocks cannot pin the
descriptors other engines' blocks need."""
BLOCK_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
"""Seals of a committed block: its bytes and size are fixed for good, whoever holds a descriptor."""


def descriptor_budget(share: float) -> int:
    """``share`` of this process's descriptor limit (raised to its hard limit first, once).

    Every DRAM block and staging area holds a descriptor; container runtimes often start processes
    with a soft limit of 1024, which would cap the tier at about a thousand blocks and starve the
    server's sockets and disk I/O of descriptors.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft and (hard == resource.RLIM_INFINITY or hard > soft):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    limit = soft if soft != resource.RLIM_INFINITY else 1 << 20
    return max(64, int(limit * share))


def new_memfd(label: str, length: int) -> int | None:
    """A fresh sealable memfd of ``length`` bytes (close-on-exec), or None when out of room.

    Out of descriptors or memory (``EMFILE``, ``ENFILE``, ``ENOMEM``) is a full tier, not an error;
    other errors raise.
    """
    try:
        fd = os.memfd_create(f"kvfabric-{label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
            log.warning("cannot create a memfd", extra={"label": label, "error": str(exc)})
            return None
        raise
    try:
        os.ftruncate(fd, length)
    except BaseException:
        os.close(fd)
        raise
    return fd


def seal(fd: int) -> None:
    """Seal ``fd`` against any change (EBUSY while someone still maps it writable)."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, BLOCK_SEALS)


@dataclass(frozen=True, slots=True)
class DramBlock:
    """Where a DRAM block lives."""

    name: str
    """Handle name: the token a client trades for a descriptor on the block socket."""
    fd: int
    """The tier's own descriptor of the sealed memfd (closed on eviction or deletion)."""
    length: int
    """Payload bytes."""
    size: int
    """Bytes charged to the budget (the memfd, rounded up to a page)."""
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
    """LRU tier of sealed memfds with a byte budget and high/low watermarks.

    With ``generations`` (the tiered store passes its own) a block older than its key's latest
    delete is never admitted, and a newer resident copy is never replaced by an older one.
    """

    name = TierName.DRAM

    def __init__(
        self,
        capacity_bytes: int,
        *,
        high_watermark: float = 1.0,
        low_watermark: float = 0.9,
        counters: Counters | None = None,
        generations: Generations | None = None,
    ) -> None:
        self.generations = generations
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
        # Half the descriptor limit at most: the rest is for staging, sockets and disk I/O.
        self.max_blocks = descriptor_budget(0.5)
        # Bytes promised to puts in flight; counted so concurrent puts cannot overshoot the budget.
        self._reserved = 0
        self._by_name: dict[str, BlockId] = {}
        # Holds: same-node clients that keep a block mapped across loads hold it (block socket,
        # ``KVBH1``). A held block that is evicted or deleted leaves the index at once (never named
        # again) but stays *retired*: its descriptor open and its bytes charged to ``_used`` until the
        # last hold is released, because the client's mapping keeps its pages alive. The budget
        # therefore counts every byte the blocks really occupy, mapped by clients or not.
        self.max_held_bytes = int(capacity_bytes * HELD_SHARE)
        # And in blocks: each held block keeps a descriptor open (the tier's own, and a retired one
        # after an eviction or delete), so bytes alone would let tiny blocks pin every descriptor.
        self.max_held_blocks = max(1, int(self.max_blocks * HELD_SHARE))
        self._holds: dict[str, int] = {}
        self._held_bytes = 0
        self._retired: dict[str, DramBlock] = {}

    def discard_all(self) -> None:
        """Forget every block and close its memfd (a stopping server; readers' descriptors stay valid)."""
        with self._lock:
            blocks = [*self._index.values(), *self._retired.values()]
            self._index.clear()
            self._by_name.clear()
            self._retired.clear()
            self._holds.clear()
            self._held_bytes = 0
            self._used = 0
        for blk in blocks:
            os.close(blk.fd)

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
            fd = self._unindex_locked(blk)
        if fd is not None:
            os.close(fd)
        if self.on_change is not None:
            self.on_change([bid])
        return True

    def _unindex_locked(self, blk: DramBlock) -> int | None:
        """Forget a block the caller removed from ``_index``; its descriptor to close, or None if held.

        A held block is retired instead: never named again, still charged until its last release.
        """
        del self._by_name[blk.name]
        if blk.name in self._holds:
            self._retired[blk.name] = blk
            return None
        self._used -= blk.size
        return blk.fd

    # --- holds (clients that keep a block mapped) ----------------------------------------------------

    def hold_by_name(self, name: str, budget: int) -> tuple[int, int, int] | None:
        """Like :meth:`dup_by_name`, and hold the block if it fits ``budget`` and the tier's share.

        Returns ``(descriptor, length, held_size)``: ``held_size`` is the bytes charged to the caller's
        budget (the block's page-rounded size), 0 when it was not held; None if the block is gone. The
        caller's own ``budget`` always applies (a block others hold costs it the same); a block held
        already costs the tier's share nothing more. The share is :data:`HELD_SHARE` of the byte
        budget and of the block (descriptor) cap.
        """
        with self._lock:
            bid = self._by_name.get(name)
            if bid is None:
                return None
            blk = self._index[bid]
            fd = os.dup(blk.fd)  # first: a failed dup (EMFILE) must not leave a hold behind
            already = name in self._holds
            held = blk.size <= budget and (
                already
                or (
                    self._held_bytes + blk.size <= self.max_held_bytes
                    and len(self._holds) < self.max_held_blocks
                )
            )
            if held:
                if not already:
                    self._held_bytes += blk.size
                self._holds[name] = self._holds.get(name, 0) + 1
            return fd, blk.length, blk.size if held else 0

    def release(self, name: str, times: int = 1) -> None:
        """Release ``times`` holds of ``name`` (unknown names and extra releases are ignored)."""
        fd = None
        with self._lock:
            count = self._holds.get(name)
            if count is None:
                return
            if count > times:
                self._holds[name] = count - times
                return
            del self._holds[name]
            retired = self._retired.pop(name, None)
            if retired is not None:
                size = retired.size
                self._used -= size
                fd = retired.fd
            else:
                size = self._index[self._by_name[name]].size
            self._held_bytes -= size
        if fd is not None:
            os.close(fd)

    @property
    def held_bytes(self) -> int:
        """Bytes of blocks that clients hold (resident or retired)."""
        with self._lock:
            return self._held_bytes

    @property
    def held_blocks(self) -> int:
        """Blocks that clients hold (resident or retired): each keeps a descriptor of this tier open."""
        with self._lock:
            return len(self._holds)

    @property
    def retired_bytes(self) -> int:
        """Bytes of evicted or deleted blocks still charged because a client holds them."""
        with self._lock:
            return sum(b.size for b in self._retired.values())

    def usage(self) -> TierUsage:
        """Return the current occupancy."""
        with self._lock:
            return TierUsage(self.name, self._used, self.capacity, len(self._index), self.high, self.low)

    def _evict_oldest(self, count: int) -> None:
        self._evict_while(lambda evicted: evicted < count)

    def _evict_while(self, more: Callable[[int], bool]) -> list[BlockId]:
        """Evict least-recently-used blocks while ``more(evicted so far)`` holds (under the lock)."""
        gone: list[tuple[BlockId, DramBlock]] = []
        to_close: list[int] = []
        skipped = 0
        with self._lock:
            while self._index and more(len(gone)):
                bid, blk = self._index.popitem(last=False)
                if blk.name in self._holds:
                    # Held: evicting it would free nothing (a client's mapping keeps its pages), so it
                    # stays resident and useful; it counts as recently used. Once every held block
                    # was passed over, only held ones are left.
                    self._index[bid] = blk
                    skipped += 1
                    if skipped > len(self._holds):
                        break
                    continue
                fd = self._unindex_locked(blk)
                if fd is not None:
                    to_close.append(fd)
                gone.append((bid, blk))
        for fd in to_close:
            os.close(fd)
        if gone:
            self.counters.inc("evictions", self.name, len(gone))
            if self.on_change is not None:
                self.on_change([bid for bid, _ in gone])
        return [bid for bid, _ in gone]

    def evict(self, target_bytes: int) -> list[BlockId]:
        """Evict least-recently-used blocks until usage is at most ``target_bytes``."""
        return self._evict_while(lambda _: self._used + self._reserved > target_bytes)

    # --- DRAM-specific -------------------------------------------------------------------------------

    def slot(self, bid: BlockId) -> DramBlock | None:
        """Where a resident block lives (and mark it recently used), or None."""
        with self._lock:
            blk = self._index.get(bid)
            if blk is not None:
                self._index.move_to_end(bid)
            return blk

    def open(self, bid: BlockId) -> OpenBlock | None:
        """Open a resident block for reading (and mark it recently used), or None."""
        with self._lock:
            blk = self._index.get(bid)
            if blk is None:
                return None
            self._index.move_to_end(bid)
            # Duplicated under the lock: an eviction closes the tier's descriptor only after it.
            fd = os.dup(blk.fd)
        return OpenBlock(fd, blk.length, blk.gen)

    def dup_by_name(self, name: str) -> tuple[int, int] | None:
        """``(descriptor, length)`` of the block a load named ``name``, or None if it is gone.

        The descriptor is a duplicate the caller closes (the block socket sends it to the client).
        """
        with self._lock:
            bid = self._by_name.get(name)
            if bid is None:
                return None
            blk = self._index[bid]
            return os.dup(blk.fd), blk.length

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
        fd = new_memfd("block", length)
        if fd is None:
            with self._lock:
                self._reserved -= size
            return False  # out of descriptors or memory: the store is dropped
        try:
            fill(fd)
            seal(fd)
        except BaseException:
            os.close(fd)
            with self._lock:
                self._reserved -= size
            raise
        g = gen() if callable(gen) else gen
        return self._admit(bid, fd, length, size, g)

    def _admit(self, bid: BlockId, fd: int, length: int, size: int, g: int) -> bool:
        """Index a filled, sealed block whose ``size`` bytes the caller reserved; the fd is ours now."""
        name = f"{DRAM_PREFIX}{secrets.token_hex(16)}"
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
            old_fd = None
            if admitted:
                old = self._index.pop(bid, None)
                if old is not None:
                    old_fd = self._unindex_locked(old)
                self._index[bid] = DramBlock(name, fd, length, size, g)
                self._by_name[name] = bid
                self._used += size
        if not admitted:
            os.close(fd)
            return cur is not None and cur.gen > g  # a newer copy is resident: the key is stored
        if old_fd is not None:
            os.close(old_fd)
        if self.on_change is not None:
            self.on_change([bid])
        return True

    # --- hand-over to a successor (transport/handover.py) ---------------------------------------------

    def export(self) -> list[tuple[BlockId, str, int, int]]:
        """Every resident block, least recently used first: ``(bid, handle name, length, gen)``.

        The hand-over takes each block's descriptor by name (:meth:`dup_by_name`) batch by batch, so
        a tier of many blocks never needs all of their duplicates open at once.
        """
        with self._lock:
            return [(bid, blk.name, blk.length, blk.gen) for bid, blk in self._index.items()]

    def adopt(self, bid: BlockId, fd: int, length: int, gen: int) -> bool:
        """Index a block a predecessor handed over; the tier owns ``fd`` from now on (closed if refused).

        Only a memfd sealed as committed blocks are (:data:`BLOCK_SEALS`) and exactly ``length`` bytes
        long is taken: it can never change under a reader. Room is made as for a put (LRU first, so
        adopting oldest first keeps the most recently used when the budget is smaller than before),
        and a delete or a newer copy this server already knows wins, as for any put.
        """
        try:
            ok = (
                fcntl.fcntl(fd, fcntl.F_GET_SEALS) & BLOCK_SEALS == BLOCK_SEALS
                and os.fstat(fd).st_size == length
            )
        except OSError:
            ok = False  # not a memfd at all
        size = max(ALIGN, -(-length // ALIGN) * ALIGN)
        if not ok or not self._reserve(size):
            os.close(fd)
            return False
        return self._admit(bid, fd, length, size, gen)

    def _reserve(self, size: int) -> bool:
        high = int(self.capacity * self.high)
        if size > high:
            return False
        open_blocks = len(self._index) + len(self._retired)
        if open_blocks >= self.max_blocks:
            # Out of descriptors before bytes (many tiny blocks): the least recently used go first.
            self._evict_oldest(open_blocks - self.max_blocks + 1)
        with self._lock:
            if self._used + self._reserved + size <= high:
                self._reserved += size
                return True
        # Make room down to the low watermark (hysteresis: not one eviction per put) — or, when held
        # blocks (which eviction passes over) keep usage above it, only the room this put needs:
        # never every unheld block for one put.
        goal = min(int(self.capacity * self.low), high - size)
        with self._lock:
            if self._held_bytes > goal:
                goal = high - size
        self.evict(max(0, goal))
        with self._lock:
            if self._used + self._reserved + size <= high:
                self._reserved += size
                return True
        return False
