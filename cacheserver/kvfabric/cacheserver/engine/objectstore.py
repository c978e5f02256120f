"""The object-store tier: one S3 object per chunk, shared by every server using the same bucket/prefix.

Layout under the configured prefix::

    blocks/<namespace>/<bucket>/<key>.<gen>  header (blockfile.py, 4 KiB) + payload: a block file's bytes
    tombstones/<namespace>/<key>.<gen>       deletes (empty objects), honoured by servers starting later
    journal/<server>/<incarnation>/<seq>     journal segments (objectjournal.py)
    clock/<server>                           clock objects (objectjournal.py)

It implements :class:`~kvfabric.cacheserver.engine.base.BackingTier`; the generation (ordering
invariant) is in the object's name, so the start-up listing knows it without reading a header.

* **Index**: rebuilt from one listing of ``blocks/`` at start-up (path = identity and TTL bucket,
  size = length), then kept current from the journal segments of the other servers, and rebuilt
  again every ``rescan_seconds`` or when a journal gap shows events were missed. Every rebuild reads
  the tombstones first (:meth:`ObjectStoreTier.rescan`): missed segments carried deletes too. Lookups
  never send a request.
* **Reads** fetch the object with parallel ranged GETs of ``part_bytes``, each written from the
  client's buffer straight into the destination as it arrives (a promotion ``pwrite``s into the
  block's DRAM memfd: its pages are allocated by the write, never zeroed or mapped first), while the
  payload checksum runs over the parts in order, each as soon as it and those before it are in:
  the checksum of one part overlaps the GETs of the next. Then the header checksum, the identity in
  the header, the length and the payload checksum are verified; parts of different versions
  (e-tags) are a miss, and a part that fails cancels the parts not yet sent and is a miss once the
  ones in flight have finished (none writes into the destination after the read returns). A
  corrupt or truncated object is deleted, counted (``checksum_failures{tier=object}``) and a miss.
  An unreachable store is a miss (``object_errors``), never an error.
* **Writes** are asynchronous write-back: :meth:`ObjectStoreTier.write` (called by the store's
  write-back) copies the block into an upload body and returns at once; the upload runs on the tier's
  own pool, bounded by ``max_pending_bytes`` — beyond it the write-back is dropped and counted. A
  single PUT per object, so an object is never visible half-written. The copy is indexed (and so
  reported durable) only once the PUT succeeded.
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
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from typing import Any

import xxhash

from kvfabric.cacheserver.config import ObjectStoreTierConfig
from kvfabric.cacheserver.engine.base import MissReason, ReadResult, TierName, TierUsage, read_miss_counter
from kvfabric.cacheserver.engine.blockfile import (
    HEADER_SIZE,
    BlockHeader,
    CorruptBlock,
    DestinationFailed,
    pack_header,
    payload_checksum,
    unpack_header,
    write_at,
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
from kvfabric.cacheserver.engine.ordering import Generations
from kvfabric.cacheserver.engine.periodic import start_periodic
from kvfabric.cacheserver.engine.stats import Counters
from kvfabric.cacheserver.engine.ttl import bucket_of, expired_buckets

__all__ = ["ObjectEntry", "ObjectStoreTier", "object_path", "parse_object_path"]

log = logging.getLogger(__name__)
NAME = TierName.OBJECT
BLOCKS = "blocks"
TOMBSTONES = "tombstones"


@dataclass(slots=True)
class ObjectEntry:
    """Index entry of one object."""

    bucket: int
    size: int
    """Whole object size (header + payload)."""
    gen: int = 0

    @property
    def length(self) -> int:
        """Payload bytes."""
        return self.size - HEADER_SIZE


def object_path(bid: BlockId, bucket: int, gen: int = 0) -> str:
    """The object name of generation ``gen`` of ``bid`` in ``bucket`` (relative to the prefix)."""
    return f"{BLOCKS}/{bid.namespace}/{bucket}/{bid.key}.{gen}"


def parse_object_path(path: str) -> tuple[BlockId, int, int] | None:
    """Inverse of :func:`object_path` for a listed path (which may still carry the prefix)."""
    parts = path.split("/")
    if len(parts) < 4 or parts[-4] != BLOCKS or not parts[-2].isdigit():
        return None
    key, _, gen = parts[-1].partition(".")
    if not gen.isdigit():
        return None
    try:
        return BlockId.parse(parts[-3], key), int(parts[-2]), int(gen)
    except InvalidId:
        return None


@dataclass(frozen=True, slots=True)
class _Part:
    """One ranged GET of a read: the object's size and e-tag as the store gave them, and its payload bytes."""

    total: int
    etag: str | None
    body: memoryview


def part_ranges(size: int, part_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges of a ranged-GET load: as many as ``part_bytes`` needs, of equal length.

    Equal parts, not ``part_bytes`` pieces plus a remainder: a 32 MiB chunk is an object of 32 MiB +
    4 KiB (its header), which would otherwise be four 8 MiB requests and a fifth of 4 KiB, and the load
    would wait for the big ones while one connection idles.
    """
    n = max(1, -(-size // part_bytes))
    step = -(-size // n)
    return [(s, min(s + step, size)) for s in range(0, size, step)]


def _tombstone_path(bid: BlockId, gen: int) -> str:
    return f"{TOMBSTONES}/{bid.namespace}/{bid.key}.{gen}"


def _parse_tombstone(path: str) -> tuple[BlockId, int] | None:
    parts = path.split("/")
    if len(parts) < 3 or parts[-3] != TOMBSTONES:
        return None
    key, _, gen = parts[-1].partition(".")
    try:
        return (BlockId.parse(parts[-2], key), int(gen)) if gen.isdigit() else None
    except InvalidId:
        return None


class ObjectStoreTier:
    """Blocks as S3 objects, with an in-memory index, budget, watermarks, journal and clock."""

    durable = True

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
        generations: Generations | None = None,
        on_delete: Callable[[BlockId, int], None] | None = None,
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
        self.generations = generations or Generations(lambda: self.clock.now() or time.time())
        self.on_delete = on_delete
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
        # A hand-over's freeze pauses eviction and expiry (the janitor holds the lock while it runs).
        self._paused = False
        self._janitor_lock = threading.Lock()
        self._last_scan = 0.0
        self._scan_recent: set[BlockId] | None = None

    @property
    def name(self) -> TierName:
        """``object``."""
        return NAME

    # --- lifecycle -----------------------------------------------------------------------------------

    def start(self, *, background: bool = True) -> None:
        """Sync the clock, mark the journal's current end, build the index from a listing, start loops.

        An unreachable store is not fatal: the tier starts empty and catches up on its next rescan.
        """
        self.clock.sync()
        try:
            # Tail from the current ends *before* listing, so nothing written meanwhile is missed.
            self.journal.skip_to_end()
            self.rescan(apply=False)
        except ObjectStoreError as exc:
            # The first rescan once the store answers (journal_tick: no scan yet) reads the
            # tombstones before it indexes anything, as this one would have.
            log.warning("object store unreachable at start-up", extra={"reason": str(exc)})
        if background:
            # Own threads: a hung object store never delays the disk tiers' janitor.
            self._spawn("object-journal", self.journal_tick, self.cfg.journal_poll_seconds)
            self._spawn("object-janitor", self.janitor_tick, self.janitor_seconds)

    def _spawn(self, name: str, fn: Callable[[], None], every: float) -> None:
        self._threads.append(start_periodic(name, fn, every, self._stop, log))

    def close(self) -> None:
        """Finish the running uploads (queued ones are dropped), publish the last journal segment, stop."""
        self._stop.set()
        # Uploads not started yet are dropped (a dropped write-back costs a recompute); the running ones
        # finish within their request timeout, so a hung store cannot hold a shutdown for long.
        self._uploads.shutdown(wait=True, cancel_futures=True)
        self._parts.shutdown(wait=True)
        for th in self._threads:
            th.join(timeout=10)
        self.journal.close()

    # --- index ---------------------------------------------------------------------------------------

    def scan(self) -> int:
        """Rebuild the index from one listing of ``blocks/``; returns the number of objects indexed."""
        found: list[tuple[BlockId, int, int, int]] = []
        bad: list[str] = []
        stale: list[str] = []
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
            bid, bucket, gen = parsed
            if meta["size"] < HEADER_SIZE:
                bad.append(object_path(bid, bucket, gen))
                continue
            if not self.generations.admits(bid, gen):
                stale.append(object_path(bid, bucket, gen))
                continue
            self.generations.observe(gen)
            found.append((bid, bucket, int(meta["size"]), gen))
        # Oldest bucket first (LRU order approximated by age); per key the newest generation wins.
        found.sort(key=lambda t: (t[1], t[3]))
        dupes: list[str] = []
        with self._lock:
            recent = {b: self._index[b] for b in self._scan_recent or () if b in self._index}
            self._scan_recent = None
            self._index.clear()
            self._by_bucket.clear()
            self._used = 0
            for bid, bucket, size, gen in found:
                old = self._index.get(bid)
                if old is not None:
                    # A refresh raced with us (same generation, two buckets) or an older generation
                    # was left behind: keep the newest generation, in the newest bucket.
                    if old.gen > gen:
                        dupes.append(object_path(bid, bucket, gen))
                        continue
                    dupes.append(object_path(bid, old.bucket, old.gen))
                self._add_locked(bid, ObjectEntry(bucket, size, gen))
            for bid, entry in recent.items():
                self._add_locked(bid, entry)
            self._last_scan = time.monotonic()
        if bad:
            self.counters.inc("checksum_failures", NAME, len(bad))
        self._delete_quietly(bad + dupes + stale)
        log.info("tier index rebuilt", extra={"tier": NAME, "blocks": len(found), "used": self._used})
        return len(found)

    def rescan(self, *, apply: bool = True) -> int:
        """Read the tombstones, then rebuild the index from a listing; returns the objects indexed.

        Every rebuild goes through here, not only the one at start-up: a server whose journal had a
        gap (or that could not reach the store at start) missed ``T`` events too, and a listing alone
        would index an older copy still in the bucket that one of them superseded — deleted bytes
        served. With ``apply`` (a running server) each delete learned here also reaches this server's
        other tiers (its DRAM may hold the deleted copy), as a ``T`` event would have.
        """
        self._load_tombstones(apply=apply)
        return self.scan()

    def _load_tombstones(self, *, apply: bool = False) -> int:
        """Learn the tombstone objects (deletes are kept for two TTLs); returns how many were new.

        Tombstones older than two TTLs are deleted. With ``apply``, each new one is applied like a
        ``T`` event: to every tier of this server through ``on_delete`` (or to this tier alone).
        """
        now = self.clock.now()
        old: list[str] = []
        learned: list[tuple[BlockId, int]] = []
        for meta in self.client.list(f"{TOMBSTONES}/"):
            parsed = _parse_tombstone(meta["path"])
            if parsed is None:
                continue
            if now is not None and meta["last_modified"].timestamp() < now - 2 * self.ttl_seconds:
                old.append(meta["path"].split(f"{TOMBSTONES}/", 1)[-1])
                continue
            if self.generations.tombstone(*parsed):
                learned.append(parsed)
        self._delete_quietly([f"{TOMBSTONES}/{p}" for p in old])
        if apply:
            for bid, gen in learned:
                if self.on_delete is not None:
                    self.on_delete(bid, gen)
                else:
                    self.purge(bid, gen)
        if learned:
            log.info("tombstones loaded", extra={"tier": NAME, "tombstones": len(learned)})
        return len(learned)

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
            deletes: list[Event] = []
            for ev in events:
                if ev.op == "P" and ev.bid is not None:
                    cur = self._index.get(ev.bid)
                    if (cur is None or cur.gen <= ev.gen) and self.generations.admits(ev.bid, ev.gen):
                        self.generations.observe(ev.gen)
                        self._add_locked(ev.bid, ObjectEntry(ev.bucket, HEADER_SIZE + ev.length, ev.gen))
                elif ev.op == "T" and ev.bid is not None:
                    deletes.append(ev)
                elif ev.op == "D" and ev.bid is not None:
                    self._drop_locked(ev.bid)
                elif ev.op == "X":
                    for bid in list(self._by_bucket.get(ev.bucket, ())):
                        self._drop_locked(bid)
        # A delete made on another server reaches every tier of this one (DRAM, disks, us) through
        # the store; outside the lock, since the store calls back into purge().
        for ev in deletes:
            assert ev.bid is not None
            if self.on_delete is not None:
                self.on_delete(ev.bid, ev.gen)
            else:
                self.generations.tombstone(ev.bid, ev.gen)
                self.purge(ev.bid, ev.gen)

    def entry(self, bid: BlockId) -> ObjectEntry | None:
        """The index entry of ``bid`` or None."""
        with self._lock:
            return self._index.get(bid)

    def has(self, bid: BlockId) -> bool:
        """Index-only presence, False while the breaker skips an unavailable store (lookups miss)."""
        return bid in self._index and self.client.available()  # a dict lookup is atomic: no lock

    def generation(self, bid: BlockId) -> int | None:
        """Generation of the indexed copy (index only)."""
        entry = self._index.get(bid)
        return None if entry is None else entry.gen

    def length(self, bid: BlockId) -> int | None:
        """Payload length of the indexed copy (index only)."""
        entry = self._index.get(bid)
        return None if entry is None else entry.length

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

    def read_into(self, bid: BlockId, dest: memoryview, *, timeout: float | None = None) -> ReadResult:
        """Fetch ``bid``'s payload into ``dest`` with parallel ranged GETs and verify it.

        A failure is a miss with a reason, never an exception; a corrupt object is deleted.
        """

        def put(offset: int, data: memoryview) -> None:
            dest[offset : offset + len(data)] = data

        return self._read(bid, put, len(dest), timeout)

    def read_into_fd(
        self, bid: BlockId, fd: int, *, room: int | None = None, timeout: float | None = None
    ) -> ReadResult:
        """Like :meth:`read_into`, into the start of file ``fd`` (a promotion's fresh memfd).

        Each part is ``pwrite``n at its offset as it arrives: the memfd's pages are allocated by the
        write, without the zeroing and page faults of copying into a fresh mapping. Raises
        :class:`~kvfabric.cacheserver.engine.blockfile.DestinationFailed` (after every part in flight
        has finished) when writing into ``fd`` fails: the object is fine, the DRAM side is not.
        """
        return self._read(bid, lambda offset, data: write_at(fd, data, offset), room, timeout)

    def _read(
        self,
        bid: BlockId,
        put: Callable[[int, memoryview], None],
        room: int | None,
        timeout: float | None,
    ) -> ReadResult:
        """Fetch, place (``put(payload offset, bytes)``) and verify ``bid``'s payload; ``room``: dest size."""
        entry = self.entry(bid)
        if entry is None:
            return ReadResult.missed(MissReason.ABSENT)
        if not self.client.available():
            return self._miss(MissReason.IO_ERROR)
        if not self.generations.admits(bid, entry.gen):
            self._forget(bid, entry)
            return self._miss(MissReason.STALE)
        if room is not None and room < entry.length:
            # The caller sized ``dest`` from an entry that a journal event has since replaced with a
            # longer copy: a miss (the caller asks again), never an exception (an UNKNOWN to the client).
            return self._miss(MissReason.STALE)
        deadline = time.monotonic() + (timeout if timeout is not None else self.cfg.retry_timeout_seconds)
        path = object_path(bid, entry.bucket, entry.gen)
        size, part = entry.size, self.cfg.part_bytes
        ranges = part_ranges(size, part)
        head = bytearray(HEADER_SIZE)

        def fetch(start: int, end: int) -> _Part:
            data, total, etag = self.client.get_range(path, start, end, timeout=deadline - time.monotonic())
            got = memoryview(data)
            if len(got) != end - start:
                raise CorruptBlock(f"range {start}-{end} returned {len(got)} bytes")
            cut = max(0, min(HEADER_SIZE - start, len(got)))
            head[start : start + cut] = got[:cut]
            body = got[cut:]
            if len(body):
                put(start + cut - HEADER_SIZE, body)
            return _Part(total, etag, body)

        futures: list[Future[_Part]] = [self._parts.submit(fetch, s, e) for s, e in ranges[1:]]
        hasher = xxhash.xxh3_128()
        first: _Part | None = None
        etags: set[str | None] = set()
        first_exc: BaseException | None = None
        try:
            # The payload checksum runs here, over the parts in order, while the later ones are
            # still being fetched: part 0 by this thread, the rest by the pool.
            for i in range(len(ranges)):
                got = fetch(*ranges[0]) if i == 0 else futures[i - 1].result()
                first = first or got
                etags.add(got.etag)
                hasher.update(got.body)
        except BaseException as exc:
            first_exc = exc
        finally:
            # A part still writing into the destination after we return would write into a file the
            # caller already reuses: cancel the parts not started, wait for those in flight (each is
            # bounded by the request timeout and the retry budget).
            for fut in futures:
                fut.cancel()
            wait_all(futures)
        if first is not None and first.total != size and not isinstance(first_exc, ObjectMissing):
            # The store says the object has another size than the index: truncated or replaced.
            return self._corrupt(bid, entry, f"object is {first.total} bytes, index says {size}")
        if isinstance(first_exc, DestinationFailed):
            raise first_exc
        if first_exc is not None:
            return self._read_failed(bid, entry, first_exc)
        if len(etags) > 1:
            return self._miss(MissReason.STALE)  # overwritten between our GETs: not corruption
        try:
            header = unpack_header(memoryview(head))
        except CorruptBlock as exc:
            return self._corrupt(bid, entry, str(exc))
        if header.bid != bid or header.length != entry.length or header.gen != entry.gen:
            return self._corrupt(bid, entry, "header names another block, length or generation")
        if hasher.digest() != header.checksum:
            return self._corrupt(bid, entry, "payload checksum mismatch")
        if not self.generations.admits(bid, header.gen):
            self._forget(bid, entry)
            return self._miss(MissReason.STALE)
        self.counters.inc("bytes_read", NAME, header.length)
        return ReadResult(header.length, header.gen)

    def _miss(self, reason: MissReason) -> ReadResult:
        self.counters.inc(read_miss_counter(reason), NAME)
        return ReadResult.missed(reason)

    def _read_failed(self, bid: BlockId, entry: ObjectEntry, exc: BaseException) -> ReadResult:
        if isinstance(exc, CorruptBlock):
            return self._corrupt(bid, entry, str(exc))
        if isinstance(exc, ObjectMissing):
            # Deleted or moved by another server (a stale hint): forget it, a miss.
            self._forget(bid, entry)
            self.counters.inc("stale_index", NAME)
            return self._miss(MissReason.ABSENT)
        self.counters.inc("object_errors", "get")
        log.warning("object read failed", extra={"key": bid.key, "reason": str(exc) or repr(exc)})
        return self._miss(MissReason.IO_ERROR)

    def _corrupt(self, bid: BlockId, entry: ObjectEntry, reason: str) -> ReadResult:
        log.warning("removing corrupt object", extra={"tier": NAME, "key": bid.key, "reason": reason})
        self.counters.inc("checksum_failures", NAME)
        self._forget(bid, entry)
        self._delete_quietly([object_path(bid, entry.bucket, entry.gen)])
        self.journal.append([Event("D", bid)])
        return self._miss(MissReason.CORRUPT)

    def _forget(self, bid: BlockId, entry: ObjectEntry) -> None:
        with self._lock:
            cur = self._index.get(bid)
            if cur is not None and cur.bucket == entry.bucket and cur.gen == entry.gen:
                self._drop_locked(bid)

    def get(self, bid: BlockId) -> bytes | None:
        """The verified payload or None."""
        entry = self.entry(bid)
        if entry is None:
            return None
        buf = bytearray(max(entry.length, 1))
        return bytes(buf[: entry.length]) if self.read_into(bid, memoryview(buf)).ok else None

    # --- writes --------------------------------------------------------------------------------------

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
        """Queue an asynchronous upload of generation ``gen``; False if refused or dropped.

        ``bucket``/``created_at`` from the store are ignored: the object's TTL bucket follows the
        object store's clock, so that every server sharing the bucket agrees on it.
        """
        del bucket, created_at
        cur = self.generation(bid)
        if (cur is not None and cur >= gen) or not self.generations.admits(bid, gen) or self._stop.is_set():
            return False
        body = self._body(bid, payload, gen, checksum)
        if body is None:
            return False
        with self._lock:
            if bid in self._pending:
                return True  # an upload of this block is already queued
            if self._pending_bytes + len(body) > self.cfg.max_pending_bytes:
                self.counters.inc("dropped_writebacks", NAME)
                return False
            self._pending_bytes += len(body)
            self._pending.add(bid)
        try:
            self._uploads.submit(self._upload, bid, gen, body)
        except RuntimeError:  # shutting down
            self._unpend(bid, len(body))
            return False
        return True

    def _body(self, bid: BlockId, payload: memoryview, gen: int, checksum: bytes | None) -> bytearray | None:
        now = self.clock.now()
        if now is None:
            # Without the store's clock a skewed node would stamp the block into a bucket another
            # server expires at once (or keeps too long): skip it instead.
            return None
        b = bucket_of(now, self.bucket_seconds)
        header = BlockHeader(bid, len(payload), checksum or payload_checksum(payload), now, b, gen)
        body = bytearray(header.file_size)
        body[:HEADER_SIZE] = pack_header(header)
        body[HEADER_SIZE:] = payload
        return body

    def _unpend(self, bid: BlockId, nbytes: int) -> None:
        with self._lock:
            self._pending_bytes -= nbytes
            self._pending.discard(bid)

    def _upload(self, bid: BlockId, gen: int, body: bytearray) -> None:
        try:
            # The queue is bounded by max_pending_bytes (that is where slowness drops stores); a
            # queued upload waits for a PUT slot, which the journal and the clock share.
            if not self._commit(bid, gen, body, wait=self.cfg.request_timeout_seconds):
                self.counters.inc("dropped_writebacks", NAME)
        except Exception:
            self.counters.inc("dropped_writebacks", NAME)
            log.exception("object write-back failed", extra={"key": bid.key})
        finally:
            self._unpend(bid, len(body))

    def put(
        self, bid: BlockId, payload: bytes | bytearray | memoryview, *, bucket: int | None = None
    ) -> bool:
        """Synchronous store with a fresh generation (tests, tools); ``bucket`` overrides the TTL bucket."""
        gen = self.generations.next()
        body = self._body(bid, memoryview(payload).cast("B"), gen, None)
        if body is None:
            return False
        if bucket is not None:
            h = unpack_header(memoryview(body)[:HEADER_SIZE])
            h = BlockHeader(bid, h.length, h.checksum, h.created_at, bucket, gen)
            body[:HEADER_SIZE] = pack_header(h)
        return self._commit(bid, gen, body, wait=self.cfg.request_timeout_seconds)

    def _commit(self, bid: BlockId, gen: int, body: bytearray, *, wait: float) -> bool:
        """PUT one object now and index it; False if refused (budget, a newer copy) or failed."""
        header = unpack_header(memoryview(body)[:HEADER_SIZE])
        b, size = header.bucket, len(body)
        if not self._reserve(size):
            return False
        try:
            self.client.put(object_path(bid, b, gen), memoryview(body), wait=wait)
        except ObjectStoreBusy:
            self._unreserve(size)
            return False
        except ObjectStoreError as exc:
            self._unreserve(size)
            self.counters.inc("object_errors", "put")
            log.warning("object write failed", extra={"key": bid.key, "reason": str(exc)})
            return False
        with self._lock:
            self._reserved -= size
            old = self._index.get(bid)
            superseded = (old is not None and old.gen > gen) or not self.generations.admits(bid, gen)
            if not superseded:
                self._add_locked(bid, ObjectEntry(b, size, gen))
        if superseded:
            # A newer copy or a delete landed while we uploaded: ours must never be served.
            self._delete_quietly([object_path(bid, b, gen)])
            return False
        if old is not None and (old.bucket, old.gen) != (b, gen):
            self._delete_quietly([object_path(bid, old.bucket, old.gen)])
        self.counters.inc("bytes_uploaded", NAME, header.length)
        self.journal.append([Event("P", bid, b, header.length, gen)])
        return True

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

    def delete(self, bid: BlockId, gen: int | None = None) -> bool:
        """Delete copies older than ``gen`` (all if None), journaled for the other servers.

        With a generation (a client's delete through the store) a tombstone object is left too, so a
        server that starts later, or an upload still in flight elsewhere, cannot resurrect the copy.
        """
        if gen is not None:
            self.journal.append([Event("T", bid, gen=gen)])
            try:
                self.client.put(_tombstone_path(bid, gen), b"", wait=5.0)
            except ObjectStoreError as exc:
                log.warning("tombstone not written", extra={"key": bid.key, "reason": str(exc)})
        with self._lock:
            entry = self._index.get(bid)
            if entry is None or (gen is not None and entry.gen >= gen):
                return False
            self._drop_locked(bid)
        self._delete_quietly([object_path(bid, entry.bucket, entry.gen)])
        if gen is None:
            self.journal.append([Event("D", bid)])
        return True

    def purge(self, bid: BlockId, gen: int) -> bool:
        """Apply a delete made on another server: drop an older copy from the index and the bucket.

        The deleting server removed only the copy *its* index knew; the one indexed here may be
        another (an upload it had not heard of, another bucket), so it is deleted here too (a
        DELETE is idempotent: at worst a duplicate request). The tombstone is that server's.
        """
        with self._lock:
            entry = self._index.get(bid)
            if entry is None or entry.gen >= gen:
                return False
            self._drop_locked(bid)
        self._delete_quietly([object_path(bid, entry.bucket, entry.gen)])
        return True

    def _delete_quietly(self, paths: list[str]) -> None:
        try:
            self.client.delete(paths)
        except ObjectStoreError as exc:
            # A leftover object is repaired by expiry or the next rescan; it is never served wrongly.
            log.warning("object delete failed", extra={"objects": len(paths), "reason": str(exc)})

    def evict(self, target_bytes: int) -> list[BlockId]:
        """Delete oldest-bucket-first (LRU within a bucket) until usage is at most ``target_bytes``."""
        victims: list[tuple[BlockId, int, int]] = []
        with self._lock:
            for b in sorted(self._by_bucket):
                if self._used + self._reserved <= target_bytes:
                    break
                members = self._by_bucket[b]
                for bid in [k for k in self._index if k in members]:
                    if self._used + self._reserved <= target_bytes:
                        break
                    entry = self._drop_locked(bid)
                    victims.append((bid, b, entry.gen if entry is not None else 0))
        if victims:
            self._delete_quietly([object_path(bid, b, g) for bid, b, g in victims])
            self.counters.inc("evictions", NAME, len(victims))
            self.journal.append([Event("D", bid) for bid, _, _ in victims])
        return [bid for bid, _, _ in victims]

    def _store_bucket(self) -> int | None:
        now = self.clock.now()
        return None if now is None else bucket_of(now, self.bucket_seconds)

    def wants_refresh(self, bid: BlockId, bucket: int) -> bool:
        """Whether the copy is in an older TTL bucket than the object store's current one (index only).

        ``bucket`` (the store's clock) is ignored: this tier's buckets follow the object store's clock.
        """
        del bucket
        cur = self._store_bucket()
        entry = self._index.get(bid)
        return cur is not None and entry is not None and entry.bucket < cur

    def refresh(self, bid: BlockId, bucket: int) -> bool:
        """Schedule the move into the current bucket (True if scheduled); see :meth:`touch`."""
        del bucket
        return self.touch(bid)

    def touch(self, bid: BlockId) -> bool:
        """Mark ``bid`` recently used, and refresh it into the store's current TTL bucket.

        The move runs in the background (server-side COPY + DELETE), at most once per bucket.
        """
        cur = self._store_bucket()
        with self._lock:
            entry = self._index.get(bid)
            if entry is None:
                return False
            self._index.move_to_end(bid)
            if cur is None or entry.bucket >= cur or bid in self._refreshing:
                return False
            self._refreshing.add(bid)
        try:
            self._uploads.submit(self._refresh, bid, ObjectEntry(entry.bucket, entry.size, entry.gen), cur)
        except RuntimeError:
            with self._lock:
                self._refreshing.discard(bid)
            return False
        return True

    def _refresh(self, bid: BlockId, old: ObjectEntry, new: int) -> None:
        try:
            self.client.copy(object_path(bid, old.bucket, old.gen), object_path(bid, new, old.gen), wait=1.0)
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
            moved = cur is not None and (cur.bucket, cur.gen) == (old.bucket, old.gen)
            if moved:
                self._add_locked(bid, ObjectEntry(new, old.size, old.gen))
        self._delete_quietly([object_path(bid, old.bucket, old.gen)])
        if moved:
            self.journal.append([Event("P", bid, new, old.length, old.gen)])

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
                members = [(bid, self._index[bid].gen) for bid in self._by_bucket.get(b, ())]
                for bid, _ in members:
                    self._drop_locked(bid)
            self._delete_quietly([object_path(bid, b, g) for bid, g in members])
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
        # A rescan also deletes damaged and superseded objects: not while quiesced for a hand-over.
        if not self._paused and (gap or time.monotonic() - self._last_scan > self.cfg.rescan_seconds):
            with contextlib.suppress(ObjectStoreError):
                self.rescan()

    def tick(self) -> None:
        """Do nothing on the store's janitor thread.

        This tier's janitor (:meth:`janitor_tick`) runs on its own thread, so a hung object store never
        delays the other tiers' eviction and expiry.
        """

    def janitor_tick(self) -> None:
        """Sync the store's clock, evict above the high watermark, expire old buckets (not while quiesced)."""
        with self._janitor_lock:
            if self._paused:
                return
            self.clock.sync()
            u = self.usage()
            if u.used_bytes > u.high_bytes:
                self.evict(int(u.capacity_bytes * u.low_watermark))
            self.expire()

    def quiesce(self, timeout: float) -> bool:
        """Stop changing the store for a hand-over: eviction and expiry pause, queued uploads land.

        The store's own freeze already refuses new writes, deletes and refreshes; this covers what
        the tier does on its own threads. True once nothing of this server writes the store.
        """
        with self._janitor_lock:  # waits for a janitor pass in progress
            self._paused = True
        return self.flush(timeout)

    def resume(self) -> None:
        """Evict and expire again (the hand-over did not happen)."""
        with self._janitor_lock:
            self._paused = False

    def extra_stats(self) -> dict[str, Any]:
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
