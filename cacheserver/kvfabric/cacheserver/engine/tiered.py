"""TieredStore: DRAM over an ordered list of backing tiers, composed through their protocol alone.

* The tiers are ``[dram, *backing]``, fastest first: local disk, the shared volume, then any
  ``tiers.extra`` (engine/tiers.py builds them). The store knows no tier by name; every call goes
  through :class:`~kvfabric.cacheserver.engine.base.Tier` / ``BackingTier``.
* Lookups answer from the in-memory indexes only.
* A put lands in DRAM at once with a fresh generation; write-back to every backing tier happens on a
  separate thread pool, bounded by ``store_queue_bytes`` (beyond it the copy is dropped and counted —
  the block stays in DRAM).
* A hit in a backing tier is promoted into DRAM (one verified read straight into the block's memfd),
  refreshed into the current TTL bucket, and copied into the faster backing tiers that lack it.
* A delete records a tombstone first, then removes older copies from every tier; a tier that learns
  of a delete made on another server reports it (``on_delete``) and the store applies it everywhere.
  No tier admits a copy a tombstone superseded, so nothing in flight resurrects a deleted key.
* The janitor syncs the clock and ticks each backing tier (eviction, expiry, leases).
* A hand-over to a successor on the same node (:meth:`TieredStore.freeze`, :meth:`export`,
  :meth:`adopt`) freezes every change to storage first: stores are dropped and deletes refused
  (:class:`HandingOver`) until the successor took over or gave up, so the successor's disk scan and
  the DRAM blocks it adopts are one consistent state.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvfabric.cacheserver.config import ServerConfig
from kvfabric.cacheserver.engine.base import (
    BackingTier,
    ClosesForSuccessor,
    ConfirmsPresence,
    KeepsNames,
    MissReason,
    Quiesces,
    ReadsIntoFiles,
    Tier,
    TierName,
    TierUsage,
    read_miss_counter,
)
from kvfabric.cacheserver.engine.blockfile import ALIGN, DestinationFailed, payload_checksum
from kvfabric.cacheserver.engine.dram import BytesBlock, DramBlock, DramTier, OpenBlock, descriptor_budget
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.ordering import DELETE_MARGIN_S, Generations
from kvfabric.cacheserver.engine.periodic import start_periodic
from kvfabric.cacheserver.engine.stats import Counters
from kvfabric.cacheserver.engine.tiers import TierContext, build_backing_tiers
from kvfabric.cacheserver.engine.ttl import LocalClock, SharedClock, bucket_of, clock_path

__all__ = ["HandingOver", "Payload", "Snapshot", "TieredStore"]

log = logging.getLogger(__name__)

WRITEBACK_DESCRIPTOR_SHARE = 0.125
"""Most of the process's descriptor limit queued write-backs may hold (each holds its block's).

The queue is bounded in bytes (``limits.store_queue_bytes``), but many tiny blocks fill no byte
bound: without this one a tenant storing 4 KiB blocks faster than the disk takes them queued a
descriptor per block until the server had none left, and every client's stores failed. The DRAM
tier holds at most half the limit and the staging arena a quarter, which leaves the sockets theirs.
"""

Payload = OpenBlock | BytesBlock
"""A load's result: an open DRAM block, or verified bytes when DRAM could not take the block.
Both have ``length``, ``gen``, ``view()``, ``read()`` and ``close()``."""


class _Miss(Exception):  # noqa: N818 - control flow inside a fill callback, never escapes
    def __init__(self, reason: MissReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


class HandingOver(RuntimeError):  # noqa: N818 - reads better at the call sites than HandingOverError
    """The store is frozen for a hand-over to a successor: this change is refused (retry it there)."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What a frozen store hands to its successor: its clock, its deletes and its DRAM blocks."""

    last_gen: int
    """The highest generation issued or seen: the successor issues greater ones."""
    tombstones: list[tuple[BlockId, int]]
    blocks: list[tuple[BlockId, str, int, int]]
    """``(bid, handle name, length, gen)`` of the DRAM blocks, least recently used first."""


@dataclass(frozen=True, slots=True)
class _Pending:
    bid: BlockId
    handle: OpenBlock
    targets: tuple[BackingTier, ...]


class TieredStore:
    """The cache's storage: tiers, write-back, promotion, deletes and the janitor."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        counters: Counters | None = None,
        backing: Callable[[TierContext], Sequence[BackingTier]] = build_backing_tiers,
    ) -> None:
        self.config = config
        self.server_id = config.resolved_server_id()
        self.counters = counters or Counters()
        t = config.tiers
        # One clock for every expiry decision: the shared volume's when there is one.
        faults = None if t.shared is None else t.shared.faults
        local = LocalClock(0.0 if faults is None else faults.clock_skew_seconds)
        clock_file = None if t.shared is None else clock_path(t.shared.path, self.server_id)
        self.clock = SharedClock(clock_file, local)
        self.generations = Generations(self._generation_clock)
        self.dram = DramTier(
            t.dram.capacity_bytes,
            high_watermark=t.dram.high_watermark,
            low_watermark=t.dram.low_watermark,
            counters=self.counters,
            generations=self.generations,
        )
        ctx = TierContext(
            config=config,
            server_id=self.server_id,
            counters=self.counters,
            generations=self.generations,
            clock=self.clock,
            on_delete=self._deleted_elsewhere,
        )
        self.backing: tuple[BackingTier, ...] = tuple(backing(ctx))
        self._names_of: Callable[[BlockId], bytes | None] | None = None  # set_names()
        self.tiers: tuple[Tier, ...] = (self.dram, *self.backing)
        self._has = tuple((tier.name, tier.has) for tier in self.tiers)
        self._has_rest = self._has[1:]
        self._wb_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="writeback")
        self._wb_lock = threading.Lock()
        self._wb_done = threading.Condition(self._wb_lock)
        self._wb_bytes = 0
        self._wb_keys: Tally[BlockId] = Tally()  # write-back jobs queued or running, per key
        self._wb_handles = 0  # ... in all: each holds a descriptor of its block
        self._wb_max_handles = descriptor_budget(WRITEBACK_DESCRIPTOR_SHARE)
        self._refreshing: set[tuple[TierName, BlockId]] = set()
        self._renaming: set[BlockId] = set()  # names rewrites queued, not started (names_changed)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # Changes to storage in progress; a freeze waits for them, then refuses new ones.
        self._mut = threading.Condition()
        self._mutating = 0
        self._frozen = False
        self._purges_while_frozen: list[tuple[BlockId, int]] = []

    def _generation_clock(self) -> float:
        """The clock generations follow: volume time, capped a janitor interval past the earliest live clock.

        On NFS every server's volume time is the same clock (peers' estimates lag it by less than a
        janitor interval, so the cap never bites). On a client-stamped volume a server days ahead
        would otherwise issue generations no delete made elsewhere could supersede; capped, every
        server's generation clock is within a janitor interval of the earliest one, which the delete
        margin (one second plus a janitor interval) covers.
        """
        t = self.clock.now_or_local()
        earliest = self.clock.expiry_now()
        if earliest is not None:
            t = min(t, earliest + self.config.janitor_interval_seconds)
        return t

    def tier(self, name: TierName | str) -> Tier:
        """The configured tier called ``name`` (KeyError if none is)."""
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    def set_listener(self, on_change: Callable[[list[BlockId]], None] | None) -> bool:
        """Call ``on_change(blocks)`` after any tier's index gains or loses blocks (before start()).

        Called from whichever thread changed the index, possibly under that tier's lock: it must not
        call back into a tier except through the lock-free :meth:`lookup`. Returns False (and
        installs nothing) when some tier cannot report its changes (an extra tier without an
        ``on_change`` hook): a published index would then miss that tier's blocks.
        """
        targets: list[Any] = [self.dram]
        for tier in self.backing:
            target = getattr(tier, "disk", tier)  # the shared tier keeps its index in a DiskTier
            if not hasattr(target, "on_change"):
                return False
            targets.append(target)
        for target in targets:
            target.on_change = on_change
        return True

    def set_names(
        self, names_of: Callable[[BlockId], bytes | None], restore: Callable[[BlockId, bytes], None]
    ) -> None:
        """Keep chunks' names with their copies in the tiers that can (before start()).

        A write-back into such a tier (:class:`~kvfabric.cacheserver.engine.base.KeepsNames`: the
        local disk) writes ``names_of(bid)`` (the residency feed's encoded metadata, or None) with
        the payload; its start-up scan hands each copy's names back to ``restore(bid, names)``.
        """
        self._names_of = names_of
        for tier in self.backing:
            if isinstance(tier, KeepsNames):
                tier.on_meta = restore

    def names_changed(self, bid: BlockId) -> None:
        """Write ``bid``'s names (now) with its copies in the tiers that keep names, in the background.

        For names that reach the residency feed after the write-back wrote the copy. Coalesced per
        key: a rewrite queued and not yet started reads the names when it runs.
        """
        if self._names_of is None:
            return
        tiers = [t for t in self.backing if isinstance(t, KeepsNames) and t.has(bid)]
        if not tiers:
            return  # no copy yet: the write-back looks the names up when it writes
        with self._wb_lock:
            if bid in self._renaming:
                return
            self._renaming.add(bid)
        try:
            self._wb_pool.submit(self._rewrite_names, bid, tiers)
        except RuntimeError:  # shutting down
            with self._wb_lock:
                self._renaming.discard(bid)

    def _rewrite_names(self, bid: BlockId, tiers: Sequence[KeepsNames]) -> None:
        with self._wb_lock:
            self._renaming.discard(bid)  # a describe from now on queues another rewrite
        assert self._names_of is not None
        try:
            with contextlib.suppress(HandingOver), self._mutation():
                meta = self._names_of(bid)
                if meta is None:
                    return  # none in memory (bounded away): the copy keeps what it has
                for tier in tiers:
                    tier.rewrite_names(bid, meta)
        except Exception:
            log.exception("rewriting a block's names failed", extra={"key": bid.key})

    def tier_of(self, bid: BlockId) -> str | None:
        """The fastest tier indexing ``bid`` now (index only), or None."""
        tiers = self.lookup([bid])
        return tiers[0] if tiers else None

    def tiers_holding(self, bid: BlockId) -> list[str]:
        """Every tier indexing ``bid`` now, fastest first (index only, lock-free like :meth:`lookup`)."""
        return [name for name, present in self._has if present(bid)]

    # --- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the backing tiers (rebuilding their indexes) and the janitor.

        Slowest first: a lower tier may hold tombstones (the shared volume does) that a faster one
        must honour while it rebuilds its index.
        """
        for tier in reversed(self.backing):
            tier.start()
        self._spawn("janitor", self.janitor_tick, self.config.janitor_interval_seconds)

    def _spawn(self, name: str, fn: Callable[[], None], every: float) -> None:
        self._threads.append(start_periodic(name, fn, every, self._stop, log))

    def close(self, *, handed_over: bool = False) -> None:
        """Stop background work; pending write-backs finish first.

        ``handed_over``: a successor runs on these tiers now (it has the same server id), so tiers
        leave what it took over in place (:class:`~kvfabric.cacheserver.engine.base.ClosesForSuccessor`).
        """
        self._stop.set()
        self._wb_pool.shutdown(wait=True)
        for th in self._threads:
            th.join(timeout=5)
        for tier in self.backing:
            if handed_over and isinstance(tier, ClosesForSuccessor):
                tier.close_for_successor()
            else:
                tier.close()
        # This process's descriptors of the DRAM blocks: a successor that adopted them holds its own.
        self.dram.discard_all()

    # --- hand-over -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _mutation(self) -> Iterator[None]:
        """Mark a change to storage in progress; raises :class:`HandingOver` while frozen."""
        with self._mut:
            if self._frozen:
                raise HandingOver(
                    "the cache server is handing over to its successor on this node; retry in a moment"
                )
            self._mutating += 1
        try:
            yield
        finally:
            with self._mut:
                self._mutating -= 1
                self._mut.notify_all()

    @property
    def frozen(self) -> bool:
        """Whether a hand-over froze the store."""
        return self._frozen

    def freeze(self, timeout: float) -> bool:
        """Refuse changes from now on, and wait for those in progress and every queued write-back.

        Returns True once storage is still: nothing of this server writes to any tier until
        :meth:`thaw`, except eviction inside DRAM (tiers that change storage on their own threads,
        the object store, are quiesced too). False (and thawed again) if that took longer than
        ``timeout``: the hand-over is off and this server goes on as before.
        """
        end = time.monotonic() + timeout
        with self._mut:
            self._frozen = True
            still = self._mut.wait_for(lambda: self._mutating == 0, timeout)
        if still:
            still = self.flush(max(0.0, end - time.monotonic()))
        for tier in self.backing:
            if still and isinstance(tier, Quiesces):
                still = tier.quiesce(max(0.0, end - time.monotonic()))
        if not still:
            self.thaw()
        return still

    def thaw(self, *, reclaim: bool = True) -> None:
        """Accept changes again, and catch up on what the freeze held back.

        Deletes learned from other servers meanwhile are applied to the disks now. With ``reclaim``
        (a predecessor whose successor gave up), tiers with shared state take it back: the shared
        tier reopens its journal, since a successor that started may have replaced the file.
        """
        with self._mut:
            if not self._frozen:
                return
            self._frozen = False
            purges, self._purges_while_frozen = self._purges_while_frozen, []
        for tier in self.backing:
            if isinstance(tier, Quiesces):
                tier.resume()
            if reclaim and isinstance(tier, ClosesForSuccessor):
                tier.resume_after_successor()
        for bid, gen in purges:
            self._deleted_elsewhere(bid, gen)

    def export(self) -> Snapshot:
        """The frozen store's state for its successor (DRAM blocks by handle name, no descriptors)."""
        if not self._frozen:
            raise RuntimeError("export() needs a frozen store")
        last, tombs = self.generations.export()
        return Snapshot(last, tombs, self.dram.export())

    def learn(self, last_gen: int, tombstones: Sequence[tuple[BlockId, int]]) -> None:
        """Take a predecessor's clock and deletes (before :meth:`start`: the scans honour them)."""
        self.generations.observe(last_gen)
        for bid, gen in tombstones:
            self.generations.tombstone(bid, gen)

    def adopt(self, blocks: Sequence[tuple[BlockId, int, int, int]]) -> int:
        """Adopt a predecessor's DRAM blocks, oldest first; the store owns every fd. Returns how many.

        After :meth:`start`: a delete any tier learned meanwhile refuses the copy it superseded.
        """
        n = 0
        for bid, fd, length, gen in blocks:
            self.generations.observe(gen)
            if self.dram.adopt(bid, fd, length, gen) and self.dram.generation(bid) == gen:
                n += 1
                self.counters.inc("adopted_bytes", TierName.DRAM, length)
        self.counters.inc("adopted_blocks", TierName.DRAM, n)
        return n

    # --- reads ---------------------------------------------------------------------------------------

    def lookup(self, bids: list[BlockId]) -> list[TierName]:
        """Tier name of each leading present key (index only, no storage access)."""
        out: list[TierName] = []
        append = out.append
        first_name, first = self._has[0]
        rest = self._has_rest
        for bid in bids:
            if first(bid):  # DRAM: the common case, kept to one C-level call per key
                append(first_name)
                continue
            for name, present in rest:
                if present(bid):
                    append(name)
                    break
            else:
                break
        return out

    def dram_hit(self, bid: BlockId) -> DramBlock | None:
        """The DRAM block for ``bid`` if it is resident (a hit, counted), else None; never any I/O."""
        blk = self.dram.slot(bid)
        if blk is not None:
            self.counters.inc("hits", TierName.DRAM)
            self._refresh_later(bid)
        return blk

    def ensure_dram(self, bid: BlockId) -> DramBlock | None:
        """Return the DRAM block for ``bid``, promoting it from a backing tier if needed; None on a miss."""
        blk = self.dram_hit(bid)
        if blk is not None:
            return blk
        for i, tier in enumerate(self.backing):
            length = tier.length(bid)
            if length is None:
                continue
            gen = self._promote(tier, bid, length)
            if gen is not None:
                self.counters.inc("hits", tier.name)
                self._refresh(tier, bid)
                faster = tuple(t for t in self.backing[:i] if (t.generation(bid) or 0) < gen)
                if faster:
                    self._enqueue_writeback(bid, faster)
                return self.dram.slot(bid)
        self.counters.inc("misses")
        return None

    def _promote(self, tier: BackingTier, bid: BlockId, length: int) -> int | None:
        """Read a block from ``tier`` into a new DRAM block; its generation, or None on a miss."""
        padded = max(ALIGN, -(-length // ALIGN) * ALIGN)
        got: list[int] = []

        def fill(fd: int) -> None:
            if isinstance(tier, ReadsIntoFiles):
                # Disk tiers write the payload into the memfd in pieces while reading the next, the
                # object tier each part as it arrives: the memfd's pages are allocated by the write,
                # never zeroed first, 1.3-2x cheaper than filling a fresh mapping (docs/performance.md).
                res = tier.read_into_fd(bid, fd, room=length)
            else:
                # Read straight into the block's memfd (page-aligned mapping: O_DIRECT-friendly),
                # verified. Pre-allocating its pages (fallocate + MAP_POPULATE) measured slower.
                os.ftruncate(fd, padded)
                with mmap.mmap(fd, padded) as m:
                    view = memoryview(m)
                    try:
                        res = tier.read_into(bid, view)
                    finally:
                        view.release()
            if res.miss is not None:
                raise _Miss(res.miss)
            if res.length != length:
                raise _Miss(MissReason.IO_ERROR)
            os.ftruncate(fd, length)
            got.append(res.gen)

        try:
            if not self.dram.put_with(bid, length, fill, gen=lambda: got[0]):
                return None
        except _Miss:
            return None  # counted by the tier, which dropped the entry
        except (OSError, DestinationFailed) as exc:
            # The DRAM side failed (memory full: ENOSPC/EFAULT while the read fills its pages): a
            # miss with a reason, never an error to the client; the disk copy stays.
            log.warning("promotion failed", extra={"tier": tier.name, "key": bid.key, "reason": str(exc)})
            self.counters.inc(read_miss_counter(MissReason.IO_ERROR), TierName.DRAM)
            return None
        return self.dram.generation(bid)

    def _current_bucket(self) -> int | None:
        now = self.clock.now()
        return None if now is None else bucket_of(now, self.config.bucket_seconds)

    def _refresh(self, tier: BackingTier, bid: BlockId) -> None:
        bucket = self._current_bucket()
        if bucket is not None and tier.wants_refresh(bid, bucket):
            with contextlib.suppress(HandingOver), self._mutation():
                tier.refresh(bid, bucket)

    def _refresh_later(self, bid: BlockId) -> None:
        # A block hot in DRAM must not let its disk copies age out: move them into the current
        # bucket too. Only index lookups here; the rename (a round trip on NFS) runs in the background.
        if not self.backing:
            return
        bucket = self._current_bucket()
        if bucket is None:
            return
        for tier in self.backing:
            if not tier.wants_refresh(bid, bucket):
                continue
            with self._wb_lock:
                # Hot blocks are hit many times before the rename lands: queue each refresh once.
                if (tier.name, bid) in self._refreshing:
                    continue
                self._refreshing.add((tier.name, bid))
            try:
                self._wb_pool.submit(self._refresh_once, tier, bid)
            except RuntimeError:  # shutting down
                with self._wb_lock:
                    self._refreshing.discard((tier.name, bid))

    def _refresh_once(self, tier: BackingTier, bid: BlockId) -> None:
        try:
            self._refresh(tier, bid)
        finally:
            with self._wb_lock:
                self._refreshing.discard((tier.name, bid))

    def open_block(self, bid: BlockId) -> Payload | None:
        """Return an open DRAM block (promoted if needed) or, if DRAM cannot take it, verified bytes."""
        if self.ensure_dram(bid) is not None:
            handle = self.dram.open(bid)
            if handle is not None:
                return handle
        for tier in self.backing:
            gen = tier.generation(bid)
            data = tier.get(bid)
            if data is not None and gen is not None:
                return BytesBlock(data, gen)
        return None

    # --- writes --------------------------------------------------------------------------------------

    def contains(self, bid: BlockId) -> bool:
        """Whether any tier indexes ``bid``."""
        return any(present(bid) for _, present in self._has)

    def holds(self, bid: BlockId) -> bool:
        """Whether a copy of ``bid`` is here now: what a client's store may skip (not index only).

        DRAM's index is exact; a tier whose index can outlive its copies (``ConfirmsPresence``: the
        disk tiers) is asked to check its copy, one ``stat``. Runs on a pool thread, never the loop.
        """
        if self.dram.has(bid):
            return True
        for tier in self.backing:
            if tier.has(bid) and (not isinstance(tier, ConfirmsPresence) or tier.confirm(bid)):
                return True
        return False

    def put_with(self, bid: BlockId, length: int, fill: Callable[[int], None]) -> bool:
        """Store a block into DRAM via ``fill(fd)``; write-back is queued. False if dropped."""
        try:
            with self._mutation():
                return self._put_with(bid, length, fill)
        except HandingOver:
            self.counters.inc("handover_dropped_stores", TierName.DRAM)
            return False

    def _put_with(self, bid: BlockId, length: int, fill: Callable[[int], None]) -> bool:
        gen = self.generations.next()
        try:
            stored = self.dram.put_with(bid, length, fill, gen=gen)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
                raise
            stored = False  # no memory for the memfd whatever the budget says: a dropped store
        if not stored:
            self.counters.inc("dropped_stores", TierName.DRAM)
            return False
        self.counters.inc("stores")
        if self.config.tiers.write_back == "all" and self.backing:
            self._queue_writeback(bid, self.backing)
        return True

    def put_sealed(self, bid: BlockId, fd: int, length: int) -> bool:
        """Store a filled memfd, sealed as blocks are (``BLOCK_SEALS``), as the block itself: no copy.

        The store owns ``fd`` from here on, whatever the outcome (closed when refused). Only a memfd
        of exactly ``length`` bytes sealed against every change is taken (see
        :meth:`DramTier.adopt`); write-back is queued as for :meth:`put_with`. False if dropped.
        """
        owned = [fd]
        try:
            with self._mutation():
                return self._put_sealed(bid, owned, length)
        except HandingOver:
            self.counters.inc("handover_dropped_stores", TierName.DRAM)
            return False
        finally:
            if owned:  # refused before the tier took it
                os.close(owned.pop())

    def _put_sealed(self, bid: BlockId, owned: list[int], length: int) -> bool:
        gen = self.generations.next()
        if not self.dram.adopt(bid, owned.pop(), length, gen):  # the tier owns the fd now
            self.counters.inc("dropped_stores", TierName.DRAM)
            return False
        self.counters.inc("stores")
        if self.config.tiers.write_back == "all" and self.backing:
            self._queue_writeback(bid, self.backing)
        return True

    def put(self, bid: BlockId, payload: bytes | bytearray | memoryview) -> bool:
        """Store a payload from memory."""
        view = memoryview(payload).cast("B")

        def fill(fd: int) -> None:
            done = 0
            while done < len(view):
                done += os.pwritev(fd, [view[done:]], done)

        return self.put_with(bid, len(view), fill)

    def _enqueue_writeback(self, bid: BlockId, targets: tuple[BackingTier, ...]) -> None:
        """Queue a copy into ``targets`` (a promotion's); nothing while frozen."""
        with contextlib.suppress(HandingOver), self._mutation():
            self._queue_writeback(bid, targets)

    def _queue_writeback(self, bid: BlockId, targets: tuple[BackingTier, ...]) -> None:
        with self._wb_lock:
            if self._wb_handles >= self._wb_max_handles:
                self.counters.inc("dropped_writebacks")
                return
            self._wb_handles += 1  # taken before the descriptor is: at the bound, none is
        handle: OpenBlock | None = None
        queued = False
        try:
            handle = self.dram.open(bid)  # None: evicted meanwhile, nothing to write back
            if handle is not None:
                with self._wb_lock:
                    queued = handle.length <= self.config.limits.store_queue_bytes - self._wb_bytes
                    if queued:
                        self._wb_bytes += handle.length
                        self._wb_keys[bid] += 1
        except OSError:
            # Out of descriptors (EMFILE, ENFILE) after all: the block is in DRAM and its store
            # succeeded; only its copy to the backing tiers is dropped.
            handle = None
            self.counters.inc("dropped_writebacks")
        finally:
            if not queued:
                with self._wb_lock:
                    self._wb_handles -= 1
        if handle is None:
            return
        if not queued:
            handle.close()
            self.counters.inc("dropped_writebacks")
            return
        try:
            self._wb_pool.submit(self._writeback, _Pending(bid, handle, targets))
        except RuntimeError:  # shutting down
            self._writeback_done(bid, handle.length)
            handle.close()

    def _writeback_done(self, bid: BlockId, nbytes: int) -> None:
        with self._wb_lock:
            self._wb_bytes -= nbytes
            self._wb_handles -= 1
            self._wb_keys[bid] -= 1
            if self._wb_keys[bid] <= 0:
                del self._wb_keys[bid]
            self._wb_done.notify_all()

    def _writeback(self, job: _Pending) -> None:
        try:
            now = self.clock.now_or_local()
            bucket = bucket_of(now, self.config.bucket_seconds)
            gen = job.handle.gen
            view = job.handle.view()
            try:
                checksum = payload_checksum(view)
                for tier in job.targets:
                    held = tier.generation(job.bid)
                    if held is not None and held >= gen:
                        continue  # this copy, or a newer one, is there already
                    if isinstance(tier, KeepsNames) and self._names_of is not None:
                        # Looked up now, not when queued: names that arrived meanwhile are kept too.
                        meta = self._names_of(job.bid)
                        written = tier.write(
                            job.bid,
                            view,
                            gen=gen,
                            bucket=bucket,
                            created_at=now,
                            checksum=checksum,
                            meta=meta,
                        )
                        if written and self._names_of(job.bid) != meta:
                            # Described while the copy was written: a describe from now on finds the
                            # copy indexed and rewrites it itself (names_changed), one before did not.
                            self.names_changed(job.bid)
                    else:
                        written = tier.write(
                            job.bid, view, gen=gen, bucket=bucket, created_at=now, checksum=checksum
                        )
                    if not written:
                        self.counters.inc("dropped_writebacks", tier.name)
                        continue
                    self.counters.inc("bytes_written", tier.name, job.handle.length)
            finally:
                view.release()
        except Exception:
            log.exception("write-back failed", extra={"key": job.bid.key})
        finally:
            self._writeback_done(job.bid, job.handle.length)
            job.handle.close()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until queued write-backs are done (tests, shutdown); True if drained."""
        end = time.monotonic() + timeout
        while True:
            with self._wb_lock:
                if self._wb_bytes == 0:
                    return True
            if time.monotonic() > end:
                return False
            time.sleep(0.01)

    def durable_tiers(self, bids: list[BlockId], timeout: float) -> tuple[list[list[TierName]], bool]:
        """Per key, the durable tiers holding its latest stored generation, after its write-backs.

        Waits up to ``timeout`` for the keys' pending write-backs first. The latest generation is
        the DRAM copy's, else the newest any tier holds. Returns ``(tiers per key, complete)``;
        ``complete`` is False if the wait timed out.
        """
        end = time.monotonic() + timeout
        with self._wb_lock:
            complete = self._wb_done.wait_for(
                lambda: not any(b in self._wb_keys for b in bids), max(0.0, end - time.monotonic())
            )
        out: list[list[TierName]] = []
        for bid in bids:
            want = self.dram.generation(bid)
            if want is None:
                want = max((g for t in self.backing if (g := t.generation(bid)) is not None), default=None)
            out.append(
                []
                if want is None
                else [
                    t.name
                    for t in self.backing
                    if t.durable and (g := t.generation(bid)) is not None and g >= want
                ]
            )
        return out, complete

    def delete(self, bid: BlockId) -> bool:
        """Delete from every tier (and tell the other servers); True if it was stored anywhere.

        The tombstone is recorded first, so a write-back or promotion of an older copy still in
        flight cannot land afterwards (each tier re-checks it when it commits).
        Raises :class:`HandingOver` while frozen: a delete must reach the successor, which has this
        server's blocks (retried there, it is applied).
        """
        with self._mutation():
            gen = self.generations.for_delete(DELETE_MARGIN_S + self.config.janitor_interval_seconds)
            self.generations.tombstone(bid, gen)
            found = self.dram.delete(bid, gen)
            for tier in self.backing:
                found = tier.delete(bid, gen) or found
            return found

    def _deleted_elsewhere(self, bid: BlockId, gen: int) -> None:
        self.generations.tombstone(bid, gen)
        self.dram.delete(bid, gen)
        # While frozen the successor applies it to the disks (it reads the same tombstones); kept for
        # thaw() in case the hand-over fails.
        try:
            with self._mutation():
                for tier in self.backing:
                    tier.purge(bid, gen)
        except HandingOver:
            with self._mut:
                self._purges_while_frozen.append((bid, gen))

    # --- background ----------------------------------------------------------------------------------

    def janitor_tick(self) -> None:
        """Sync the clock, then each backing tier's eviction, expiry and leases; not while frozen."""
        with contextlib.suppress(HandingOver), self._mutation():
            self._janitor_tick()

    def _janitor_tick(self) -> None:
        self.clock.sync()
        for tier in self.backing:
            tier.tick()
        now = self.clock.expiry_now()
        if now is not None:
            # No copy older than two TTLs survives expiry, so neither need its tombstone here.
            self.generations.prune(int((now - 2 * self.config.ttl_seconds) * 1e9))

    # --- stats ---------------------------------------------------------------------------------------

    def usage(self) -> list[TierUsage]:
        """Occupancy of every tier, fastest first."""
        return [t.usage() for t in self.tiers]

    def stats(self) -> dict[str, Any]:
        """Usage per tier and every counter, JSON-ready."""
        tiers = {}
        for u in self.usage():
            tiers[str(u.name)] = {
                "used_bytes": u.used_bytes,
                "capacity_bytes": u.capacity_bytes,
                "high_bytes": u.high_bytes,
                "blocks": u.blocks,
            }
        counters: dict[str, Any] = {}
        for (name, tier), value in sorted(self.counters.snapshot().items()):
            if tier:
                counters.setdefault(name, {})[str(tier)] = value
            else:
                counters[name] = value
        with self._wb_lock:
            pending = self._wb_bytes
        # Blocks same-node clients keep mapped: all of them counted in the DRAM tier's used bytes,
        # the retired ones (evicted or deleted, not yet released) too.
        tiers[str(TierName.DRAM)]["held_bytes"] = self.dram.held_bytes
        tiers[str(TierName.DRAM)]["retired_held_bytes"] = self.dram.retired_bytes
        tiers[str(TierName.DRAM)]["held_blocks"] = self.dram.held_blocks
        tiers[str(TierName.DRAM)]["max_blocks"] = self.dram.max_blocks
        tiers[str(TierName.DRAM)]["max_held_blocks"] = self.dram.max_held_blocks
        return {
            "server_id": self.server_id,
            "tiers": tiers,
            "counters": counters,
            "writeback_pending_bytes": pending,
            "clock": self.clock.now(),
            "clock_stamps_local": self.clock.stamps_local_clock,
            "clock_spread_seconds": self.clock.spread(),
        }
