"""TieredStore: DRAM over local disk over the shared volume, composed from independent tiers.

* Lookups answer from the in-memory indexes only.
* A put lands in DRAM at once; write-back to the disk tiers happens on a separate thread pool, bounded
  by ``store_queue_bytes`` (beyond it the copy is dropped and counted — the block stays in DRAM).
* A hit in a lower tier is promoted into DRAM (one verified read straight into the tmpfs file) and
  refreshed into the current TTL bucket; a shared-tier hit is also copied to local disk.
* Background threads tail the other servers' journals and run the janitor (clock, lease, eviction,
  bucket expiry).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfabric.cacheserver.config import ServerConfig
from kvfabric.cacheserver.engine.blockfile import ALIGN, payload_checksum
from kvfabric.cacheserver.engine.disk import DiskTier
from kvfabric.cacheserver.engine.dram import DramBlock, DramTier, OpenBlock
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.journal import Event, JournalReader, JournalWriter
from kvfabric.cacheserver.engine.stats import Counters
from kvfabric.cacheserver.engine.ttl import (
    SharedClock,
    bucket_of,
    drop_lease,
    expired_buckets,
    live_servers,
    owner_of,
    touch_lease,
)

__all__ = ["TieredStore"]

log = logging.getLogger(__name__)
STALE_TMP_SECONDS = 3600.0


class _Miss(Exception):  # noqa: N818 - control flow inside a fill callback, never escapes
    pass


@dataclass(frozen=True, slots=True)
class _Pending:
    bid: BlockId
    handle: OpenBlock
    targets: tuple[DiskTier, ...]


class TieredStore:
    """The cache's storage: tiers, write-back, promotion, journals and the janitor."""

    def __init__(self, config: ServerConfig, *, counters: Counters | None = None) -> None:
        self.config = config
        self.server_id = config.resolved_server_id()
        self.counters = counters or Counters()
        t = config.tiers
        self.dram = DramTier(
            config.shm.dir,
            t.dram.capacity_bytes,
            high_watermark=t.dram.high_watermark,
            low_watermark=t.dram.low_watermark,
            counters=self.counters,
        )
        self.local: DiskTier | None = None
        if t.local_disk is not None:
            self.local = DiskTier(
                "local_disk",
                t.local_disk.path,
                t.local_disk.capacity_bytes,
                server_id=self.server_id,
                high_watermark=t.local_disk.high_watermark,
                low_watermark=t.local_disk.low_watermark,
                min_free_fraction=t.local_disk.min_free_fraction,
                policy="lru",
                counters=self.counters,
            )
        self.shared: DiskTier | None = None
        self.journal: JournalWriter | None = None
        self._reader: JournalReader | None = None
        clock_path: Path | None = None
        if t.shared is not None:
            root = t.shared.path
            self.shared = DiskTier(
                "shared",
                root,
                t.shared.capacity_bytes,
                server_id=self.server_id,
                high_watermark=t.shared.high_watermark,
                low_watermark=t.shared.low_watermark,
                min_free_fraction=t.shared.min_free_fraction,
                policy="oldest_bucket",
                counters=self.counters,
            )
            self.shared.on_evicted = self._journal_deletes  # type: ignore[method-assign]
            self.lease_dir = root / "leases"
            clock_path = root / "clock"
            self._reader = JournalReader(root / "journals", self.server_id)
        self.clock = SharedClock(clock_path)
        self._wb_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="writeback")
        self._wb_lock = threading.Lock()
        self._wb_bytes = 0
        self._refreshing: set[tuple[str, BlockId]] = set()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def disk_tiers(self) -> list[DiskTier]:
        """The configured disk tiers, fastest first."""
        return [x for x in (self.local, self.shared) if x is not None]

    def set_listener(self, on_change: Callable[[list[BlockId]], None] | None) -> None:
        """Call ``on_change(blocks)`` after any tier's index gains or loses blocks (before start()).

        Called from whichever thread changed the index, possibly under that tier's lock: it must not
        call back into a tier except through the lock-free :meth:`lookup`.
        """
        self.dram.on_change = on_change
        for tier in self.disk_tiers:
            tier.on_change = on_change

    def tier_of(self, bid: BlockId) -> str | None:
        """The fastest tier indexing ``bid`` now (index only), or None."""
        tiers = self.lookup([bid])
        return tiers[0] if tiers else None

    # --- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Rebuild indexes from block headers, open the journal, start background threads."""
        if self.shared is not None and self._reader is not None:
            # Tail from the current ends *before* scanning, so nothing written meanwhile is missed.
            self._reader.skip_to_end()
            self.journal = JournalWriter(self.shared.root / "journals", self.server_id)
            touch_lease(self.lease_dir, self.server_id)
        for tier in self.disk_tiers:
            tier.scan()
        if self.shared is not None:
            self._spawn("journal-tail", self._tail_loop, self.config.journal_poll_seconds)
        self._spawn("janitor", self._janitor_loop, self.config.janitor_interval_seconds)

    def _spawn(self, name: str, fn: Callable[[], None], every: float) -> None:
        def loop() -> None:
            while not self._stop.wait(every):
                try:
                    fn()
                except Exception:
                    log.exception("background task failed", extra={"task": name})

        th = threading.Thread(target=loop, name=name, daemon=True)
        th.start()
        self._threads.append(th)

    def close(self) -> None:
        """Stop background work; pending write-backs finish first."""
        self._stop.set()
        self._wb_pool.shutdown(wait=True)
        for th in self._threads:
            th.join(timeout=5)
        if self.shared is not None:
            drop_lease(self.lease_dir, self.server_id)
        if self.journal is not None:
            self.journal.close()

    # --- reads ---------------------------------------------------------------------------------------

    def lookup(self, bids: list[BlockId]) -> list[str]:
        """Tier name of each leading present key (index only, no storage access)."""
        out: list[str] = []
        dram, local, shared = self.dram, self.local, self.shared
        for bid in bids:
            if dram.has(bid):
                out.append("dram")
            elif local is not None and local.has(bid):
                out.append("local_disk")
            elif shared is not None and shared.has(bid):
                out.append("shared")
            else:
                break
        return out

    def ensure_dram(self, bid: BlockId) -> DramBlock | None:
        """Return the DRAM block for ``bid``, promoting it from a disk tier if needed; None on a miss."""
        blk = self.dram.slot(bid)
        if blk is not None:
            self.counters.inc("hits", "dram")
            self._refresh_later(bid)
            return blk
        for tier in self.disk_tiers:
            entry = tier.entry(bid)
            if entry is None:
                continue
            if self._promote(tier, bid, entry.length):
                self.counters.inc("hits", tier.name)
                self._refresh(tier, bid)
                if tier is self.shared and self.local is not None and not self.local.contains(bid):
                    self._enqueue_writeback(bid, (self.local,))
                return self.dram.slot(bid)
        self.counters.inc("misses")
        return None

    def _promote(self, tier: DiskTier, bid: BlockId, length: int) -> bool:
        padded = max(ALIGN, -(-length // ALIGN) * ALIGN)

        def fill(fd: int) -> None:
            # Read straight into the tmpfs file (page-aligned mapping: O_DIRECT-friendly), verified.
            # Pages are allocated by the read itself: pre-allocating them (fallocate + MAP_POPULATE)
            # measured slower, because zeroing then happens twice as visibly on the critical path.
            os.ftruncate(fd, padded)
            with mmap.mmap(fd, padded) as m:
                view = memoryview(m)
                try:
                    header = tier.read_into(bid, view)
                finally:
                    view.release()
            if header is None or header.length != length:
                raise _Miss
            os.ftruncate(fd, length)

        try:
            return self.dram.put_with(bid, length, fill)
        except _Miss:
            return False

    def _refresh(self, tier: DiskTier, bid: BlockId) -> None:
        now = self.clock.now()
        if now is None:
            return
        bucket = bucket_of(now, self.config.bucket_seconds)
        entry = tier.entry(bid)
        moved = entry is not None and entry.bucket < bucket and tier.refresh(bid, bucket)
        if moved and entry is not None and tier is self.shared and self.journal is not None:
            self.journal.append([Event("P", bid, bucket, entry.length)])

    def _refresh_later(self, bid: BlockId) -> None:
        # A block hot in DRAM must not let its disk copies age out: move them into the current
        # bucket too. Only index lookups here; the rename (a round trip on NFS) runs in the background.
        now = self.clock.now()
        if now is None or not self.disk_tiers:
            return
        bucket = bucket_of(now, self.config.bucket_seconds)
        for tier in self.disk_tiers:
            entry = tier.entry(bid)
            if entry is None or entry.bucket >= bucket:
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

    def _refresh_once(self, tier: DiskTier, bid: BlockId) -> None:
        try:
            self._refresh(tier, bid)
        finally:
            with self._wb_lock:
                self._refreshing.discard((tier.name, bid))

    def open_block(self, bid: BlockId) -> OpenBlock | bytes | None:
        """Return an open DRAM block (promoted if needed) or, if DRAM cannot take it, verified bytes."""
        if self.ensure_dram(bid) is not None:
            handle = self.dram.open(bid)
            if handle is not None:
                return handle
        for tier in self.disk_tiers:
            data = tier.get(bid)
            if data is not None:
                return data
        return None

    # --- writes --------------------------------------------------------------------------------------

    def contains(self, bid: BlockId) -> bool:
        """Whether any tier indexes ``bid``."""
        return bool(self.lookup([bid]))

    def put_with(self, bid: BlockId, length: int, fill: Callable[[int], None]) -> bool:
        """Store a block into DRAM via ``fill(fd)``; write-back is queued. False if dropped."""
        if not self.dram.put_with(bid, length, fill):
            self.counters.inc("dropped_stores", "dram")
            return False
        self.counters.inc("stores")
        if self.config.tiers.write_back == "all" and self.disk_tiers:
            self._enqueue_writeback(bid, tuple(self.disk_tiers))
        return True

    def put(self, bid: BlockId, payload: bytes | bytearray | memoryview) -> bool:
        """Store a payload from memory."""
        view = memoryview(payload).cast("B")

        def fill(fd: int) -> None:
            done = 0
            while done < len(view):
                done += os.pwritev(fd, [view[done:]], done)

        return self.put_with(bid, len(view), fill)

    def _enqueue_writeback(self, bid: BlockId, targets: tuple[DiskTier, ...]) -> None:
        handle = self.dram.open(bid)
        if handle is None:
            return
        with self._wb_lock:
            if self._wb_bytes + handle.length > self.config.limits.store_queue_bytes:
                handle.close()
                self.counters.inc("dropped_writebacks")
                return
            self._wb_bytes += handle.length
        try:
            self._wb_pool.submit(self._writeback, _Pending(bid, handle, targets))
        except RuntimeError:  # shutting down
            with self._wb_lock:
                self._wb_bytes -= handle.length
            handle.close()

    def _writeback(self, job: _Pending) -> None:
        try:
            volume_now = self.clock.now()
            now = self.clock.now_or_local()
            bucket = bucket_of(now, self.config.bucket_seconds)
            view = job.handle.view()
            try:
                checksum = payload_checksum(view)
                for tier in job.targets:
                    if tier.contains(job.bid):
                        continue
                    if tier is self.shared and volume_now is None:
                        # Without the volume's clock a skewed local clock would stamp the block into a
                        # bucket another server expires at once (or keeps too long): skip it instead.
                        self.counters.inc("dropped_writebacks", tier.name)
                        continue
                    header = tier.write(job.bid, view, bucket=bucket, created_at=now, checksum=checksum)
                    if header is None:
                        self.counters.inc("dropped_writebacks", tier.name)
                        continue
                    self.counters.inc("bytes_written", tier.name, header.length)
                    if tier is self.shared and self.journal is not None:
                        self.journal.append([Event("P", job.bid, bucket, header.length)])
            finally:
                view.release()
        except Exception:
            log.exception("write-back failed", extra={"key": job.bid.key})
        finally:
            with self._wb_lock:
                self._wb_bytes -= job.handle.length
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

    def delete(self, bid: BlockId) -> bool:
        """Delete from every tier (and tell the other servers); True if it was stored anywhere."""
        found = self.dram.delete(bid)
        for tier in self.disk_tiers:
            if tier.delete(bid):
                found = True
                if tier is self.shared:
                    self._journal_deletes([bid])
        return found

    def _journal_deletes(self, bids: list[BlockId]) -> None:
        if self.journal is not None:
            self.journal.append([Event("D", b) for b in bids])

    # --- background ----------------------------------------------------------------------------------

    def _tail_loop(self) -> None:
        if self._reader is None or self.shared is None:
            return
        events = self._reader.poll()
        if events:
            self.shared.apply(events)

    def _janitor_loop(self) -> None:
        self.janitor_tick()

    def janitor_tick(self) -> None:
        """Sync the volume clock, renew the lease, evict above watermarks, expire old buckets."""
        self.clock.sync()
        if self.shared is not None:
            touch_lease(self.lease_dir, self.server_id)
        for tier in self.disk_tiers:
            u = tier.usage()
            if u.used_bytes > u.high_bytes:
                tier.evict(int(u.capacity_bytes * u.low_watermark))
        now = self.clock.now()
        if now is None:
            return  # clock unknown: never expire (never early)
        ttl, width = self.config.ttl_seconds, self.config.bucket_seconds
        if self.local is not None:
            for b in expired_buckets(self.local.bucket_dirs(), now, ttl_seconds=ttl, bucket_seconds=width):
                gone = self.local.expire_bucket(b)
                if gone is not None:
                    log.info("bucket expired", extra={"tier": "local_disk", "bucket": b, "blocks": len(gone)})
        if self.shared is not None:
            live = live_servers(self.lease_dir, now, self.config.lease_seconds)
            if self.server_id not in live:
                live.append(self.server_id)
            for b in expired_buckets(self.shared.bucket_dirs(), now, ttl_seconds=ttl, bucket_seconds=width):
                if owner_of(b, live) != self.server_id:
                    continue
                gone = self.shared.expire_bucket(b)
                if gone is not None:
                    if self.journal is not None:
                        self.journal.append([Event("X", bucket=b)])
                    log.info(
                        "bucket expired",
                        extra={
                            "tier": "shared",
                            "bucket": b,
                            "blocks": len(gone),
                            "server_id": self.server_id,
                        },
                    )
            self.shared.reap_stale_tmp(STALE_TMP_SECONDS)

    # --- stats ---------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Usage per tier and every counter, JSON-ready."""
        tiers = {}
        for u in [self.dram.usage(), *(t.usage() for t in self.disk_tiers)]:
            tiers[u.name] = {
                "used_bytes": u.used_bytes,
                "capacity_bytes": u.capacity_bytes,
                "high_bytes": u.high_bytes,
                "blocks": u.blocks,
            }
        counters: dict[str, Any] = {}
        for (name, tier), value in sorted(self.counters.snapshot().items()):
            if tier:
                counters.setdefault(name, {})[tier] = value
            else:
                counters[name] = value
        with self._wb_lock:
            pending = self._wb_bytes
        return {
            "server_id": self.server_id,
            "tiers": tiers,
            "counters": counters,
            "writeback_pending_bytes": pending,
            "clock": self.clock.now(),
        }
