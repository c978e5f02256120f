"""The object-store tier: one S3 object per chunk, shared by every server using the same bucket/prefix.

Layout under the configured prefix::

    blocks/<namespace>/<bucket>/<key>        header (blockfile.py, 4 KiB) + payload: a block file's bytes
    journal/<server>/<incarnation>/<seq>     journal segments (objectjournal.py)
    clock/<server>                           clock objects (objectjournal.py)

* **Index**: rebuilt from one listing of ``blocks/`` at start-up (path = identity and TTL bucket,
  size = length), then kept current from the journal segments of the other servers, and rebuilt
  again every ``rescan_seconds`` or when a journal gap shows events were missed. Lookups never send a
  request.
* **Reads** fetch the object with parallel ranged GETs of ``part_bytes`` straight into the
  destination (the DRAM file a hit is promoted into), then verify the header checksum, the identity
  in the header, the length and the payload checksum; parts of different versions (e-tags) are a
  miss. A corrupt or truncated object is deleted, counted (``checksum_failures{tier=object}``) and a
  miss. An unreachable store is a miss (``object_errors``), never an error.
* **Writes** are asynchronous write-back: :meth:`ObjectStoreTier.enqueue` takes an open handle on the
  block and returns at once; the upload runs on the tier's own pool, bounded by ``max_pending_bytes``
  and ``max_concurrent_puts`` — beyond either the write-back is dropped and counted. A single PUT per
  object, so an object is never visible half-written.
* **Capacity**: a byte budget with watermarks; a write that would cross the high watermark first
  evicts the oldest bucket's blocks (LRU within a bucket) down to the low watermark.
* **TTL**: the same bucket scheme as the shared volume, with the object store's clock; a hit moves
  the object into the current bucket by a server-side COPY (no bytes through the node) and a DELETE.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from kvfabric.cacheserver.config import ObjectStoreTierConfig
from kvfabric.cacheserver.engine.base import TierUsage
from kvfabric.cacheserver.engine.blockfile import (
    HEADER_SIZE,
    BlockHeader,
    CorruptBlock,
    pack_header,
    payload_checksum,
    unpack_header,
)
from kvfabric.cacheserver.engine.ids import BlockId, InvalidId
from kvfabric.cacheserver.engine.journal import Event
from kvfabric.cacheserver.engine.objectclient import (
    ObjectClient,
    ObjectMissing,
    ObjectStoreBusy,
    ObjectStoreError,
)
from kvfabric.cacheserver.engine.objectjournal import ObjectClock, ObjectJournal
from kvfabric.cacheserver.engine.stats import Counters
from kvfabric.cacheserver.engine.ttl import bucket_of, expired_buckets

__all__ = ["BlockSource", "ObjectEntry", "ObjectStoreTier"]

log = logging.getLogger(__name__)
NAME = "object"
BLOCKS = "blocks"


class BlockSource(Protocol):
    """An open, immutable block to upload (the DRAM tier's ``OpenBlock``)."""

    length: int

    def view(self) -> memoryview:
        """The payload."""
        ...

    def close(self) -> None:
        """Release the handle."""
        ...


@dataclass(slots=True)
class ObjectEntry:
    """Index entry of one object."""

    bucket: int
    size: int
    """Whole object size (header + payload)."""

    @property
    def length(self) -> int:
        """Payload bytes."""
        return self.size - HEADER_SIZE


def object_path(bid: BlockId, bucket: int) -> str:
    """The object name of ``bid`` in ``bucket`` (relative to the configured prefix)."""
    return f"{BLOCKS}/{bid.namespace}/{bucket}/{bid.key}"


def parse_object_path(path: str) -> tuple[BlockId, int] | None:
    """Inverse of :func:`object_path` for a listed path (which may still carry the prefix)."""
    parts = path.split("/")
    if len(parts) < 4 or parts[-4] != BLOCKS or not parts[-2].isdigit():
        return None
    try:
        return BlockId.parse(parts[-3], parts[-1]), int(parts[-2])
    except InvalidId:
        return None


class ObjectStoreTier:
    """Blocks as S3 objects, with an in-memory index, budget, watermarks, journal and clock."""

    name = NAME

    def __init__(
        self,
        cfg: ObjectStoreTierConfig,
        *,
        server_id: str,
        bucket_seconds: int,
        ttl_seconds: int,
        janitor_seconds: float = 5.0,
        counters: Counters | None = None,
        client: ObjectClient | None = None,
    ) -> None:
        self.cfg = cfg
        self.server_id = server_id
        self.bucket_seconds = bucket_seconds
        self.ttl_seconds = ttl_seconds
        self.janitor_seconds = janitor_seconds
        self.capacity = cfg.capacity_bytes
        self.high = cfg.high_watermark
        self.low = cfg.low_watermark
        self.counters = counters or Counters()
        self.client = client or ObjectClient(cfg)
        self.clock = ObjectClock(self.client, server_id)
        self.journal = ObjectJournal(
            self.client, server_id, retention_seconds=max(120.0, 60 * cfg.journal_poll_seconds)
        )
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockId, ObjectEntry] = OrderedDict()
        self._by_bucket: dict[int, set[BlockId]] = {}
        self._used = 0
        self._reserved = 0
        self._pending_bytes = 0
        self._pending: set[BlockId] = set()
        self._refreshing: set[BlockId] = set()
        self._parts = ThreadPoolExecutor(max_workers=cfg.max_concurrent_gets, thread_name_prefix="object-get")
        self._uploads = ThreadPoolExecutor(
            max_workers=cfg.max_concurrent_puts, thread_name_prefix="object-put"
        )
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._last_scan = 0.0
        self._scan_recent: set[BlockId] | None = None

    # --- lifecycle -----------------------------------------------------------------------------------

    def start(self, *, background: bool = True) -> None:
        """Sync the clock, mark the journal's current end, build the index from a listing, start loops.

        An unreachable store is not fatal: the tier starts empty and catches up on its next rescan.
        """
        self.clock.sync()
        try:
            # Tail from the current ends *before* listing, so nothing written meanwhile is missed.
            self.journal.skip_to_end()
            self.scan()
        except ObjectStoreError as exc:
            log.warning("object store unreachable at start-up", extra={"reason": str(exc)})
        if background:
            # Own threads: a hung object store never delays the disk tiers' janitor.
            self._spawn("object-journal", self.journal_tick, self.cfg.journal_poll_seconds)
            self._spawn("object-janitor", self.janitor_tick, self.janitor_seconds)

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
        """Finish queued uploads, publish the last journal segment, stop the loops."""
        self._stop.set()
        self._uploads.shutdown(wait=True)
        self._parts.shutdown(wait=True)
        for th in self._threads:
            th.join(timeout=10)
        self.journal.close()

    # --- index ---------------------------------------------------------------------------------------

    def scan(self) -> int:
        """Rebuild the index from one listing of ``blocks/``; returns the number of objects indexed."""
        found: list[tuple[BlockId, int, int, float]] = []
        bad: list[str] = []
        with self._lock:
            # Blocks indexed while the listing runs (our writes, journal events) survive the rebuild.
            self._scan_recent = set()
        try:
            listing = list(self.client.list(f"{BLOCKS}/"))
        except BaseException:
            with self._lock:
                self._scan_recent = None
            raise
        for meta in listing:
            parsed = parse_object_path(meta["path"])
            if parsed is None:
                continue
            bid, bucket = parsed
            if meta["size"] < HEADER_SIZE:
                bad.append(object_path(bid, bucket))
                continue
            found.append((bid, bucket, int(meta["size"]), meta["last_modified"].timestamp()))
        found.sort(key=lambda t: (t[1], t[3]))
        dupes: list[str] = []
        with self._lock:
            recent = {b: self._index[b] for b in self._scan_recent or () if b in self._index}
            self._scan_recent = None
            self._index.clear()
            self._by_bucket.clear()
            self._used = 0
            for bid, bucket, size, _ in found:
                old = self._index.get(bid)
                if old is not None:  # a refresh raced with us: keep the newer bucket's copy
                    dupes.append(object_path(bid, old.bucket))
                self._add_locked(bid, ObjectEntry(bucket, size))
            for bid, entry in recent.items():
                self._add_locked(bid, entry)
            self._last_scan = time.monotonic()
        if bad:
            self.counters.inc("checksum_failures", NAME, len(bad))
        self._delete_quietly(bad + dupes)
        log.info("tier index rebuilt", extra={"tier": NAME, "blocks": len(found), "used": self._used})
        return len(found)

    def _add_locked(self, bid: BlockId, entry: ObjectEntry) -> None:
        self._drop_locked(bid)
        if self._scan_recent is not None:
            self._scan_recent.add(bid)
        self._index[bid] = entry
        self._used += entry.size
        self._by_bucket.setdefault(entry.bucket, set()).add(bid)

    def _drop_locked(self, bid: BlockId) -> ObjectEntry | None:
        entry = self._index.pop(bid, None)
        if entry is not None:
            self._used -= entry.size
            members = self._by_bucket.get(entry.bucket)
            if members is not None:
                members.discard(bid)
                if not members:
                    del self._by_bucket[entry.bucket]
        return entry

    def apply(self, events: list[Event]) -> None:
        """Apply other servers' journal events to the index."""
        with self._lock:
            for ev in events:
                if ev.op == "P" and ev.bid is not None:
                    self._add_locked(ev.bid, ObjectEntry(ev.bucket, HEADER_SIZE + ev.length))
                elif ev.op == "D" and ev.bid is not None:
                    self._drop_locked(ev.bid)
                elif ev.op == "X":
                    for bid in list(self._by_bucket.get(ev.bucket, ())):
                        self._drop_locked(bid)

    def entry(self, bid: BlockId) -> ObjectEntry | None:
        """The index entry of ``bid`` or None."""
        with self._lock:
            return self._index.get(bid)

    def has(self, bid: BlockId) -> bool:
        """Index-only presence, False while the breaker skips an unavailable store (lookups miss)."""
        with self._lock:
            present = bid in self._index
        return present and self.client.available()

    def contains(self, bid: BlockId) -> bool:
        """Whether the index holds ``bid`` (never sends a request)."""
        with self._lock:
            return bid in self._index

    def usage(self) -> TierUsage:
        """Current occupancy (objects incl. headers; uploads in flight count as used)."""
        with self._lock:
            return TierUsage(
                NAME, self._used + self._reserved, self.capacity, len(self._index), self.high, self.low
            )

    # --- reads ---------------------------------------------------------------------------------------

    def read_into(
        self, bid: BlockId, dest: memoryview, *, timeout: float | None = None
    ) -> BlockHeader | None:
        """Fetch ``bid``'s payload into ``dest`` with parallel ranged GETs and verify it; None on a miss."""
        entry = self.entry(bid)
        if entry is None or not self.client.available():
            return None
        if len(dest) < entry.length:
            raise ValueError(f"destination holds {len(dest)} bytes, need {entry.length}")
        deadline = time.monotonic() + (timeout if timeout is not None else self.cfg.retry_timeout_seconds)
        path = object_path(bid, entry.bucket)
        size, part = entry.size, self.cfg.part_bytes
        ranges = [(s, min(s + part, size)) for s in range(0, size, part)]
        head = bytearray(HEADER_SIZE)

        def fetch(start: int, end: int) -> tuple[int, str | None]:
            data, total, etag = self.client.get_range(path, start, end, timeout=deadline - time.monotonic())
            got = memoryview(data)
            if len(got) != end - start:
                raise CorruptBlock(f"range {start}-{end} returned {len(got)} bytes")
            if start < HEADER_SIZE:
                cut = HEADER_SIZE - start
                head[start : start + min(cut, len(got))] = got[:cut]
                if len(got) > cut:
                    dest[0 : len(got) - cut] = got[cut:]
            else:
                dest[start - HEADER_SIZE : end - HEADER_SIZE] = got
            return total, etag

        futures: list[Future[tuple[int, str | None]]] = [
            self._parts.submit(fetch, s, e) for s, e in ranges[1:]
        ]
        results: list[tuple[int, str | None]] = []
        first_exc: BaseException | None = None
        try:
            results.append(fetch(*ranges[0]))
        except BaseException as exc:
            first_exc = exc
        # Wait for every part, even after a failure: a part still writing into ``dest`` after we return
        # would write into a file the caller already reuses. Each part is bounded by the request
        # timeout and the retry budget.
        for fut in futures:
            try:
                results.append(fut.result())
            except BaseException as exc:
                first_exc = first_exc or exc
        if results and results[0][0] != size and not isinstance(first_exc, ObjectMissing):
            # The store says the object has another size than the index: truncated or replaced.
            self._corrupt(bid, entry, f"object is {results[0][0]} bytes, index says {size}")
            return None
        if first_exc is not None:
            self._read_failed(bid, entry, first_exc)
            return None
        if len({etag for _, etag in results}) > 1:
            self.counters.inc("misses_raced", NAME)  # overwritten between our GETs: not corruption
            return None
        try:
            header = unpack_header(memoryview(head))
        except CorruptBlock as exc:
            self._corrupt(bid, entry, str(exc))
            return None
        if header.bid != bid or header.length != entry.length:
            self._corrupt(bid, entry, "header names another block or length")
            return None
        if payload_checksum(dest[: header.length]) != header.checksum:
            self._corrupt(bid, entry, "payload checksum mismatch")
            return None
        self.counters.inc("bytes_read", NAME, header.length)
        return header

    def _read_failed(self, bid: BlockId, entry: ObjectEntry, exc: BaseException) -> None:
        if isinstance(exc, CorruptBlock):
            self._corrupt(bid, entry, str(exc))
        elif isinstance(exc, ObjectMissing):
            # Deleted or moved by another server (a stale hint): forget it, a miss.
            self._forget(bid, entry.bucket)
            self.counters.inc("stale_index", NAME)
        elif isinstance(exc, ObjectStoreError):
            self.counters.inc("object_errors", "get")
            log.warning("object read failed", extra={"key": bid.key, "reason": str(exc)})
        else:
            self.counters.inc("object_errors", "get")
            log.warning("object read failed", extra={"key": bid.key, "reason": repr(exc)})

    def _corrupt(self, bid: BlockId, entry: ObjectEntry, reason: str) -> None:
        log.warning("removing corrupt object", extra={"tier": NAME, "key": bid.key, "reason": reason})
        self.counters.inc("checksum_failures", NAME)
        self._forget(bid, entry.bucket)
        self._delete_quietly([object_path(bid, entry.bucket)])
        self.journal.append([Event("D", bid)])

    def _forget(self, bid: BlockId, bucket: int) -> None:
        with self._lock:
            cur = self._index.get(bid)
            if cur is not None and cur.bucket == bucket:
                self._drop_locked(bid)

    def get(self, bid: BlockId) -> bytes | None:
        """The verified payload or None."""
        entry = self.entry(bid)
        if entry is None:
            return None
        buf = bytearray(entry.length)
        return bytes(buf) if self.read_into(bid, memoryview(buf)) is not None else None

    # --- writes --------------------------------------------------------------------------------------

    def enqueue(self, bid: BlockId, block: BlockSource) -> bool:
        """Queue an asynchronous upload of ``block`` (the tier closes the handle); False if dropped."""
        if self.contains(bid) or self._stop.is_set():
            block.close()
            return True
        with self._lock:
            if bid in self._pending:
                block.close()
                return True
            if self._pending_bytes + block.length > self.cfg.max_pending_bytes:
                block.close()
                self.counters.inc("dropped_writebacks", NAME)
                return False
            self._pending_bytes += block.length
            self._pending.add(bid)
        try:
            self._uploads.submit(self._upload, bid, block)
        except RuntimeError:  # shutting down
            self._unpend(bid, block)
            return False
        return True

    def _unpend(self, bid: BlockId, block: BlockSource) -> None:
        with self._lock:
            self._pending_bytes -= block.length
            self._pending.discard(bid)
        block.close()

    def _upload(self, bid: BlockId, block: BlockSource) -> None:
        try:
            view = block.view()
            try:
                # The queue is bounded by max_pending_bytes (that is where slowness drops stores); a
                # queued upload waits for a PUT slot, which the journal and the clock share.
                if self.write(bid, view, wait=self.cfg.request_timeout_seconds) is None:
                    self.counters.inc("dropped_writebacks", NAME)
            finally:
                view.release()
        except Exception:
            self.counters.inc("dropped_writebacks", NAME)
            log.exception("object write-back failed", extra={"key": bid.key})
        finally:
            self._unpend(bid, block)

    def put(
        self, bid: BlockId, payload: bytes | bytearray | memoryview, *, bucket: int | None = None
    ) -> bool:
        """Synchronous store (tests, tools); False if it was not stored."""
        return self.write(bid, memoryview(payload).cast("B"), bucket=bucket) is not None

    def write(
        self,
        bid: BlockId,
        payload: memoryview,
        *,
        bucket: int | None = None,
        checksum: bytes | None = None,
        wait: float = 0.0,
    ) -> BlockHeader | None:
        """Upload one block now (the caller's thread); None if refused (budget, clock, store)."""
        now = self.clock.now()
        if now is None:
            # Without the store's clock a skewed node would stamp the block into a bucket another
            # server expires at once (or keeps too long): skip it instead.
            return None
        b = bucket if bucket is not None else bucket_of(now, self.bucket_seconds)
        header = BlockHeader(bid, len(payload), checksum or payload_checksum(payload), now, b)
        size = header.file_size
        if not self._reserve(size):
            return None
        try:
            body = bytearray(size)
            body[:HEADER_SIZE] = pack_header(header)
            body[HEADER_SIZE:] = payload
            self.client.put(object_path(bid, b), memoryview(body), wait=wait)
        except ObjectStoreBusy:
            self._unreserve(size)
            return None
        except ObjectStoreError as exc:
            self._unreserve(size)
            self.counters.inc("object_errors", "put")
            log.warning("object write failed", extra={"key": bid.key, "reason": str(exc)})
            return None
        with self._lock:
            self._reserved -= size
            old = self._index.get(bid)
            self._add_locked(bid, ObjectEntry(b, size))
        if old is not None and old.bucket != b:
            self._delete_quietly([object_path(bid, old.bucket)])
        self.counters.inc("bytes_written", NAME, header.length)
        self.journal.append([Event("P", bid, b, header.length)])
        return header

    def _reserve(self, size: int) -> bool:
        with self._lock:
            high = int(self.capacity * self.high)
            if size > high:
                return False
            need_evict = self._used + self._reserved + size > high
        if need_evict:
            self.evict(max(0, int(self.capacity * self.low) - size))
        with self._lock:
            if self._used + self._reserved + size > high:
                self.counters.inc("writes_refused", NAME)
                return False
            self._reserved += size
            return True

    def _unreserve(self, size: int) -> None:
        with self._lock:
            self._reserved -= size

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until queued uploads are done (tests, shutdown); True if drained."""
        end = time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._pending:
                    return True
            if time.monotonic() > end:
                return False
            time.sleep(0.01)

    # --- deletes, eviction, TTL ----------------------------------------------------------------------

    def delete(self, bid: BlockId) -> bool:
        """Delete ``bid`` (journaled); True if it was indexed."""
        with self._lock:
            entry = self._drop_locked(bid)
        if entry is None:
            return False
        self._delete_quietly([object_path(bid, entry.bucket)])
        self.journal.append([Event("D", bid)])
        return True

    def _delete_quietly(self, paths: list[str]) -> None:
        try:
            self.client.delete(paths)
        except ObjectStoreError as exc:
            # A leftover object is repaired by expiry or the next rescan; it is never served wrongly.
            log.warning("object delete failed", extra={"objects": len(paths), "reason": str(exc)})

    def evict(self, target_bytes: int) -> list[BlockId]:
        """Delete oldest-bucket-first (LRU within a bucket) until usage is at most ``target_bytes``."""
        victims: list[tuple[BlockId, int]] = []
        with self._lock:
            for b in sorted(self._by_bucket):
                if self._used + self._reserved <= target_bytes:
                    break
                members = self._by_bucket[b]
                for bid in [k for k in self._index if k in members]:
                    if self._used + self._reserved <= target_bytes:
                        break
                    self._drop_locked(bid)
                    victims.append((bid, b))
        if victims:
            self._delete_quietly([object_path(bid, b) for bid, b in victims])
            self.counters.inc("evictions", NAME, len(victims))
            self.journal.append([Event("D", bid) for bid, _ in victims])
        return [bid for bid, _ in victims]

    def touch(self, bid: BlockId) -> None:
        """Mark ``bid`` recently used, and refresh it into the store's current TTL bucket.

        The move runs in the background (server-side COPY + DELETE), at most once per bucket.
        """
        now = self.clock.now()
        with self._lock:
            entry = self._index.get(bid)
            if entry is None:
                return
            self._index.move_to_end(bid)
            if now is None or entry.bucket >= bucket_of(now, self.bucket_seconds) or bid in self._refreshing:
                return
            self._refreshing.add(bid)
        try:
            self._uploads.submit(self._refresh, bid, entry.bucket, bucket_of(now, self.bucket_seconds))
        except RuntimeError:
            with self._lock:
                self._refreshing.discard(bid)

    def _refresh(self, bid: BlockId, old: int, new: int) -> None:
        try:
            self.client.copy(object_path(bid, old), object_path(bid, new), wait=1.0)
        except ObjectMissing:
            self._forget(bid, old)
            return
        except ObjectStoreError:
            return  # the block stays in its old bucket; it may expire and be recomputed
        finally:
            with self._lock:
                self._refreshing.discard(bid)
        with self._lock:
            cur = self._index.get(bid)
            if cur is not None and cur.bucket == old:
                self._add_locked(bid, ObjectEntry(new, cur.size))
                size = cur.size
            else:
                size = 0
        self._delete_quietly([object_path(bid, old)])
        if size:
            self.journal.append([Event("P", bid, new, size - HEADER_SIZE)])

    def expire(self) -> list[int]:
        """Delete every bucket that ended more than ``ttl_seconds`` ago by the store's clock.

        Not owner-based as on the shared volume: deletes are idempotent, so two servers expiring the
        same bucket only send a duplicate request. Returns the expired buckets.
        """
        now = self.clock.now()
        if now is None:
            return []  # clock unknown: never expire (never early)
        with self._lock:
            buckets = list(self._by_bucket)
        gone = expired_buckets(buckets, now, ttl_seconds=self.ttl_seconds, bucket_seconds=self.bucket_seconds)
        for b in gone:
            with self._lock:
                members = list(self._by_bucket.get(b, ()))
                for bid in members:
                    self._drop_locked(bid)
            self._delete_quietly([object_path(bid, b) for bid in members])
            self.counters.inc("expirations", NAME, len(members))
            self.journal.append([Event("X", bucket=b)])
            log.info("bucket expired", extra={"tier": NAME, "bucket": b, "blocks": len(members)})
        return gone

    # --- background ----------------------------------------------------------------------------------

    def journal_tick(self) -> None:
        """Publish our events, apply the others', rebuild the index when events were missed."""
        self.journal.flush()
        if not self.client.available():
            return
        try:
            events, gap = self.journal.poll()
        except ObjectStoreError:
            return
        if events:
            self.apply(events)
        if gap or time.monotonic() - self._last_scan > self.cfg.rescan_seconds:
            with contextlib.suppress(ObjectStoreError):
                self.scan()

    def janitor_tick(self) -> None:
        """Sync the store's clock, evict above the high watermark, expire old buckets."""
        self.clock.sync()
        u = self.usage()
        if u.used_bytes > u.high_bytes:
            self.evict(int(u.capacity_bytes * u.low_watermark))
        self.expire()

    def stats(self) -> dict[str, Any]:
        """Tier-specific numbers for ``stats()``."""
        with self._lock:
            pending = self._pending_bytes
        return {
            "writeback_pending_bytes": pending,
            "available": self.client.available(),
            "breaker_trips": self.client.breaker_trips,
            "clock": self.clock.now(),
            "journal_dropped_events": self.journal.dropped_events,
        }
