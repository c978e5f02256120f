"""A directory tier of block files: local NVMe (LRU) or a shared volume (oldest bucket first).

Layout under the tier's root::

    buckets/<bucket>/<namespace>_<key>.blk   block files (see blockfile.py), one directory per TTL bucket
    tmp/<server_id>/<random>.tmp             blocks being written (renamed into a bucket when complete)

The index lives in memory and is rebuilt at start-up from block headers only (and the names a block
carries after its payload, handed to ``on_meta``: the residency feed serves them again). Reads verify both
checksums; a block that fails is deleted, counted and reported as a miss (with a reason: corrupt,
stale, stale-handle, io-error). Ordering: every entry carries its copy's generation; a write commits
(renames into place) only if no newer copy is indexed and no newer delete is known, checked under the
tier's commit lock, which deletes also take. Capacity: a put that would
take usage above the high watermark first evicts down to the low watermark; a put is also refused
when the filesystem itself is nearly full (``min_free_fraction``) or reports ENOSPC — a refused
write-back is a dropped copy, never an error.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvfabric.cacheserver.engine.base import MissReason, ReadResult, TierName, TierUsage, read_miss_counter
from kvfabric.cacheserver.engine.blockfile import (
    ALIGN,
    HEADER_SIZE,
    BlockHeader,
    CorruptBlock,
    aligned_buffer,
    make_dir_durable,
    payload_checksum,
    read_block_into,
    read_block_to_fd,
    read_header,
    read_header_and_meta,
    unpack_header,
    write_block,
)
from kvfabric.cacheserver.engine.faults import IoFaults
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.journal import Event
from kvfabric.cacheserver.engine.ordering import Generations
from kvfabric.cacheserver.engine.stats import Counters
from kvfabric.cacheserver.engine.ttl import SharedClock, bucket_of, expired_buckets

__all__ = ["DiskEntry", "DiskTier", "Expiry"]

log = logging.getLogger(__name__)
EXPIRED_PREFIX = ".expired-"


@dataclass(slots=True)
class DiskEntry:
    """Index entry of one block file."""

    bucket: int
    size: int
    """Whole file size (header + payload + names)."""
    gen: int = 0
    """Generation of the copy (block header)."""
    meta_size: int = 0
    """Bytes of the names after the payload."""

    @property
    def length(self) -> int:
        """Payload bytes."""
        return self.size - HEADER_SIZE - self.meta_size


@dataclass(frozen=True, slots=True)
class Expiry:
    """When a tier's buckets expire: the clock and the TTL arithmetic (see ttl.py)."""

    clock: SharedClock
    ttl_seconds: int
    bucket_seconds: int

    def expired(self, buckets: list[int]) -> list[int]:
        """Buckets older than the TTL now; none while the clock is unknown (never early)."""
        now = self.clock.expiry_now()
        if now is None:
            return []
        return expired_buckets(buckets, now, ttl_seconds=self.ttl_seconds, bucket_seconds=self.bucket_seconds)

    def current_bucket(self) -> int | None:
        """The bucket of now, or None while the clock is unknown."""
        now = self.clock.now()
        return None if now is None else bucket_of(now, self.bucket_seconds)


class DiskTier:
    """Block files in bucket directories, with an in-memory index, budget and watermarks.

    A :class:`~kvfabric.cacheserver.engine.base.BackingTier` on its own (the local disk); the
    shared tier wraps one (:class:`~kvfabric.cacheserver.engine.shared.SharedTier`). ``on_evicted``
    is told what capacity eviction removed; ``expiry`` makes :meth:`tick` expire old buckets.
    """

    durable = True

    def __init__(
        self,
        name: str,
        root: Path,
        capacity_bytes: int,
        *,
        server_id: str,
        high_watermark: float = 0.9,
        low_watermark: float = 0.75,
        policy: Literal["lru", "oldest_bucket"] = "lru",
        min_free_fraction: float = 0.05,
        direct_io: bool = True,
        counters: Counters | None = None,
        generations: Generations | None = None,
        expiry: Expiry | None = None,
        on_evicted: Callable[[list[BlockId]], None] | None = None,
        faults: IoFaults | None = None,
    ) -> None:
        self.name = TierName(name)
        self.generations = generations or Generations(time.time)
        self.expiry = expiry
        self._on_evicted = on_evicted
        self.faults = faults or IoFaults()
        # Held across a block's final rename and by deletes: "no newer copy, no newer delete" is
        # checked and made true in one step. Separate from the index lock so lookups never wait on I/O.
        self._commit_lock = threading.Lock()
        self.root = root
        self.capacity = capacity_bytes
        self.high = high_watermark
        self.low = low_watermark
        self.policy = policy
        self.min_free_fraction = min_free_fraction
        self.direct_io = direct_io
        self.counters = counters or Counters()
        self.buckets_dir = root / "buckets"
        self.tmp_dir = root / "tmp" / server_id
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockId, DiskEntry] = OrderedDict()
        self.on_change: Callable[[list[BlockId]], None] | None = None
        """Called with a block whenever the index gains or loses it (the published index listens)."""
        self.on_meta: Callable[[BlockId, bytes], None] | None = None
        """Called by :meth:`scan` with the names a block file carries (verified), after indexing it."""
        # Lock-free contains() for the lookup hot path: the index's own C-level membership test (128
        # keys per lookup; a Python method around it cost 4x). Atomic under the GIL; a moment stale at
        # worst, which a lookup tolerates (the load that follows re-checks under the lock).
        self.has: Callable[[BlockId], bool] = self._index.__contains__
        self._by_bucket: dict[int, set[BlockId]] = {}
        self._used = 0
        self._reserved = 0
        self.buckets_dir.mkdir(parents=True, exist_ok=True)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)

    # --- start-up ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Rebuild the index from block headers (the BackingTier interface)."""
        self.scan()

    def close(self) -> None:
        """Nothing to release: every write is complete when it returns."""

    def scan(self) -> int:
        """Rebuild the index from block headers and remove this server's leftover temp files.

        Returns the number of blocks indexed. Corrupt headers, misplaced files and copies that a
        known delete superseded are deleted; of two copies of one key the newer generation stays.
        """
        removed_tmp = 0
        for e in os.scandir(self.tmp_dir):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(e.path)
                removed_tmp += 1
        found: list[tuple[BlockId, int, BlockHeader, bytes | None]] = []
        with_meta = self.on_meta is not None
        for bdir in os.scandir(self.buckets_dir):
            if bdir.name.startswith(EXPIRED_PREFIX):
                # A bucket claimed for expiry by a server that died mid-delete: finish the job.
                shutil.rmtree(bdir.path, ignore_errors=True)
                continue
            if not bdir.name.isdigit() or not bdir.is_dir(follow_symlinks=False):
                continue
            bucket = int(bdir.name)
            for f in os.scandir(bdir.path):
                bid = BlockId.from_filename(f.name)
                if bid is None:
                    continue
                try:
                    header, meta = read_header_and_meta(Path(f.path), with_meta=with_meta)
                    if header.bid != bid:
                        raise CorruptBlock("header names another block")
                except CorruptBlock as exc:
                    log.warning("removing corrupt block file", extra={"path": f.path, "reason": str(exc)})
                    self.counters.inc("checksum_failures", self.name)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f.path)
                    continue
                except FileNotFoundError:
                    continue
                if not self.generations.admits(bid, header.gen):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f.path)
                    continue
                self.generations.observe(header.gen)
                if with_meta and header.meta_length and meta is None:
                    log.warning("dropping a block's names that fail their checksum", extra={"key": bid.key})
                    self.counters.inc("meta_failures", self.name)
                found.append((bid, bucket, header, meta))
        found.sort(key=lambda t: (t[1], t[2].created_at))  # oldest first: LRU order approximated by age
        with self._lock:
            for bid, bucket, header, _ in found:
                gen = header.gen
                old = self._index.get(bid)
                if old is not None:
                    # Two copies (a concurrent write into another bucket): keep the newer one.
                    loser = bucket if old.gen > gen else old.bucket
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._path(bid, loser))
                    if old.gen > gen:
                        continue
                    self._drop_locked(bid)
                self._add_locked(bid, DiskEntry(bucket, header.file_size, gen, header.meta_length))
        if self.on_meta is not None:
            self._restore_meta([(bid, bucket, h, m) for bid, bucket, h, m in found if m is not None])
        log.info(
            "tier index rebuilt",
            extra={"tier": self.name, "blocks": len(found), "removed_tmp": removed_tmp, "used": self._used},
        )
        return len(found)

    def _restore_meta(self, named: list[tuple[BlockId, int, BlockHeader, bytes]]) -> None:
        """Hand ``on_meta`` the names of the copies among ``named`` the index kept (verified when read).

        Names that failed their check were dropped and counted (``meta_failures``) by the scan; the
        block still serves: its payload has its own checksum, and the names only tell routers what
        it is.
        """
        assert self.on_meta is not None
        for bid, bucket, header, meta in named:
            entry = self._index.get(bid)
            if entry is None or entry.bucket != bucket or entry.gen != header.gen:
                continue  # the other copy of two won
            self.on_meta(bid, meta)

    def reap_stale_tmp(self, older_than_s: float, clock_of: Callable[[str], float | None]) -> int:
        """Remove temp files older than ``older_than_s`` seconds (left by servers that died mid-write).

        A file's age is measured on the clock of the server whose directory holds it
        (``clock_of(server_id)``; None: leave it): on a client-stamped filesystem that server's
        clock stamped the file, so a server whose own clock is off never reaps a live write.
        """
        n = 0
        with contextlib.suppress(FileNotFoundError):
            for sdir in os.scandir(self.tmp_dir.parent):
                now = clock_of(sdir.name)
                if now is None:
                    continue
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    for f in os.scandir(sdir.path):
                        with contextlib.suppress(FileNotFoundError):
                            if now - f.stat().st_mtime > older_than_s:
                                os.unlink(f.path)
                                n += 1
        return n

    # --- index helpers -------------------------------------------------------------------------------

    def _path(self, bid: BlockId, bucket: int) -> Path:
        return self.buckets_dir / str(bucket) / bid.filename

    def _add_locked(self, bid: BlockId, entry: DiskEntry) -> None:
        old = self._index.pop(bid, None)
        if old is not None:
            self._used -= old.size
            self._by_bucket.get(old.bucket, set()).discard(bid)
        self._index[bid] = entry
        self._used += entry.size
        self._by_bucket.setdefault(entry.bucket, set()).add(bid)
        if self.on_change is not None:
            self.on_change([bid])

    def _drop_locked(self, bid: BlockId) -> DiskEntry | None:
        entry = self._index.pop(bid, None)
        if entry is not None:
            self._used -= entry.size
            members = self._by_bucket.get(entry.bucket)
            if members is not None:
                members.discard(bid)
                if not members:
                    del self._by_bucket[entry.bucket]
            if self.on_change is not None:
                self.on_change([bid])
        return entry

    def entry(self, bid: BlockId) -> DiskEntry | None:
        """Return the index entry of a block, or None."""
        with self._lock:
            return self._index.get(bid)

    def generation(self, bid: BlockId) -> int | None:
        """Generation of the indexed copy, or None."""
        entry = self._index.get(bid)
        return None if entry is None else entry.gen

    def length(self, bid: BlockId) -> int | None:
        """Payload length of the indexed copy, or None."""
        entry = self._index.get(bid)
        return None if entry is None else entry.length

    def buckets(self) -> list[int]:
        """Buckets holding at least one indexed block, oldest first."""
        with self._lock:
            return sorted(self._by_bucket)

    def bucket_dirs(self) -> list[int]:
        """Bucket directories present on disk (includes buckets the index has not heard of)."""
        out = []
        with contextlib.suppress(FileNotFoundError):
            for e in os.scandir(self.buckets_dir):
                if e.name.isdigit():
                    out.append(int(e.name))
        return sorted(out)

    # --- Tier interface ------------------------------------------------------------------------------

    def contains(self, bid: BlockId) -> bool:
        """Whether the index holds ``bid`` (no filesystem access)."""
        with self._lock:
            return bid in self._index

    def confirm(self, bid: BlockId) -> bool:
        """Whether the indexed file of ``bid`` is still there with its size (one ``stat``).

        A vanished file (removed by another server whose ``D`` record never reached us) drops the
        entry (``stale_index``); any other error answers False too: a store then goes ahead, which
        costs a copy, while a wrong "present" would cost the block.
        """
        entry = self.entry(bid)
        if entry is None:
            return False
        try:
            st = os.stat(self._path(bid, entry.bucket))
        except FileNotFoundError:
            self._forget(bid, entry.bucket)
            self.counters.inc("stale_index", self.name)
            return False
        except OSError:
            return False
        return st.st_size == entry.size

    def get(self, bid: BlockId) -> bytes | None:
        """Return the verified payload, or None."""
        entry = self.entry(bid)
        if entry is None:
            return None
        buf = aligned_buffer(entry.length)
        try:
            res = self.read_into(bid, memoryview(buf))
            return buf[: res.length] if res.ok else None
        finally:
            buf.close()

    def read_into(self, bid: BlockId, dest: memoryview) -> ReadResult:
        """Read and verify a block into ``dest`` (page-aligned, room for the payload rounded up to 4 KiB).

        Every failure is a miss with a reason, and the entry is dropped (and counted per reason):
        a vanished file (deleted or expired elsewhere), a corrupt one (deleted), a copy older than the
        index or a tombstone allows, ESTALE, or any other I/O error — including a file whose length
        is not the one the index promised.
        """

        def read(path: Path, entry: DiskEntry) -> BlockHeader:
            if len(dest) < -(-entry.length // ALIGN) * ALIGN:
                raise ValueError(f"destination holds {len(dest)} bytes, index says {entry.length}")
            return read_block_into(path, bid, dest, length=entry.length, direct=self.direct_io)

        return self._read_verified(bid, read)

    def read_into_fd(self, bid: BlockId, fd: int, *, room: int | None = None) -> ReadResult:
        """Like :meth:`read_into`, into the start of file ``fd`` (a fresh memfd of the block's length).

        Read and write overlap in pieces (:func:`~kvfabric.cacheserver.engine.blockfile.read_block_to_fd`):
        what a promotion into DRAM uses.
        """
        return self._read_verified(
            bid,
            lambda path, entry: read_block_to_fd(path, bid, fd, length=entry.length, direct=self.direct_io),
            room=room,
        )

    def _read_verified(
        self, bid: BlockId, read: Callable[[Path, DiskEntry], BlockHeader], *, room: int | None = None
    ) -> ReadResult:
        entry = self.entry(bid)
        if entry is None:
            return ReadResult.missed(MissReason.ABSENT)
        if room is not None and entry.length > room:
            return ReadResult.missed(MissReason.STALE)  # replaced by a longer copy: the caller asks again
        path = self._path(bid, entry.bucket)
        try:
            self.faults.before_read()
            header = read(path, entry)  # refuses a file whose length is not the index's
        except FileNotFoundError:
            # Deleted or expired by another server before its journal entry reached us.
            return self._miss(bid, entry, MissReason.ABSENT)
        except CorruptBlock as exc:
            log.warning(
                "corrupt block removed", extra={"tier": self.name, "path": str(path), "reason": str(exc)}
            )
            self.counters.inc("checksum_failures", self.name)
            self._forget(bid, entry.bucket)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return self._miss(bid, entry, MissReason.CORRUPT)
        except (OSError, ValueError) as exc:
            stale = isinstance(exc, OSError) and exc.errno == errno.ESTALE
            log.warning("block read failed", extra={"tier": self.name, "path": str(path), "reason": str(exc)})
            return self._miss(bid, entry, MissReason.STALE_HANDLE if stale else MissReason.IO_ERROR)
        if header.gen < entry.gen or not self.generations.admits(bid, header.gen):
            # Another server's older write-back renamed over a newer copy, or a delete superseded it.
            return self._miss(bid, entry, MissReason.STALE)
        with self._lock:
            if bid in self._index:
                self._index.move_to_end(bid)
        return ReadResult(header.length, header.gen)

    def _miss(self, bid: BlockId, entry: DiskEntry, reason: MissReason) -> ReadResult:
        self._forget(bid, entry.bucket)
        self.counters.inc(read_miss_counter(reason), self.name)
        return ReadResult.missed(reason)

    def _forget(self, bid: BlockId, bucket: int) -> None:
        with self._lock:
            cur = self._index.get(bid)
            if cur is not None and cur.bucket == bucket:
                self._drop_locked(bid)

    def put(self, bid: BlockId, payload: bytes | bytearray | memoryview, *, bucket: int) -> bool:
        """Write a block atomically into ``bucket``; False if it does not fit (the Tier interface)."""
        view = memoryview(payload).cast("B")
        return self.write(
            bid,
            view,
            gen=self.generations.next(),
            bucket=bucket,
            created_at=time.time(),
            checksum=payload_checksum(view),
        )

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
        """Write a copy of generation ``gen`` atomically into ``bucket`` (``meta``: its names).

        False if it does not fit (budget or disk full), or if a newer copy or delete of the key is
        known when it would commit: the final rename happens under the commit lock after re-checking
        both, and a copy left in another bucket is removed with it.
        """
        header = self.write_header(
            bid, payload, gen=gen, bucket=bucket, created_at=created_at, checksum=checksum, meta=meta
        )
        return header is not None

    def write_header(
        self,
        bid: BlockId,
        payload: bytes | bytearray | memoryview | mmap.mmap,
        *,
        gen: int,
        bucket: int,
        created_at: float,
        checksum: bytes | None = None,
        meta: bytes | None = None,
    ) -> BlockHeader | None:
        """:meth:`write`, returning the header written (None when refused)."""
        length = memoryview(payload).nbytes
        meta_size = len(meta) if meta else 0
        size = HEADER_SIZE + length + meta_size
        if not self._fresh(bid, gen):
            return None
        if not self._reserve(size):
            self.counters.inc("writes_refused", self.name)
            return None
        stale_copy: list[Path] = []

        def commit(tmp: Path, final: Path) -> bool:
            self.faults.before_commit()
            with self._commit_lock:
                if not self._fresh(bid, gen):
                    return False
                os.rename(tmp, final)
                self.faults.during_commit()
                with self._lock:
                    old = self._index.get(bid)
                    if old is not None and old.bucket != bucket:
                        stale_copy.append(self._path(bid, old.bucket))
                    self._add_locked(bid, DiskEntry(bucket, size, gen, meta_size))
                for p in stale_copy:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(p)
            return True

        try:
            if not self._disk_has_room(size):
                self.counters.inc("writes_refused", self.name)
                return None
            try:
                header = write_block(
                    self.tmp_dir,
                    self._path(bid, bucket),
                    bid,
                    payload,
                    created_at=created_at,
                    bucket=bucket,
                    checksum=checksum,
                    gen=gen,
                    commit=commit,
                    meta=meta,
                    direct=self.direct_io,
                )
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    self.counters.inc("writes_refused", self.name)
                    return None
                raise
            if header is None:
                self.counters.inc("writes_superseded", self.name)
            return header
        finally:
            with self._lock:
                self._reserved -= size

    def rewrite_names(self, bid: BlockId, meta: bytes | None) -> bool:
        """Make ``meta`` the names kept with ``bid``'s indexed copy; True once the copy carries them.

        Names that arrive after the copy was written: the copy is written again, same generation,
        bucket and payload, with the new names, to a temp file renamed over it (the write path's
        atomicity: a crash leaves the old file or the new one, never a mix). It commits only while
        the index still lists that very copy; a copy already carrying ``meta`` is left alone.
        """
        with self._lock:
            entry = self._index.get(bid)
        if entry is None:
            return False
        path = self._path(bid, entry.bucket)
        try:
            with open(path, "rb", buffering=0) as f:
                data = f.read()
            header = unpack_header(data)
        except (FileNotFoundError, CorruptBlock):
            return False
        if header.bid != bid or header.gen != entry.gen or len(data) != header.file_size:
            return False
        if data[HEADER_SIZE + header.length :] == (meta or b""):
            return True
        payload = memoryview(data)[HEADER_SIZE : HEADER_SIZE + header.length]
        size = HEADER_SIZE + header.length + (len(meta) if meta else 0)
        with self._lock:
            self._reserved += size  # the temp file, until it replaces the copy
        try:

            def commit(tmp: Path, final: Path) -> bool:
                with self._commit_lock:
                    with self._lock:
                        cur = self._index.get(bid)
                        if cur is None or cur.gen != header.gen or cur.bucket != header.bucket:
                            return False  # evicted, deleted or replaced meanwhile: nothing to rename
                    os.rename(tmp, final)
                    with self._lock:
                        self._add_locked(bid, DiskEntry(header.bucket, size, header.gen, len(meta or b"")))
                return True

            written = write_block(
                self.tmp_dir,
                path,
                bid,
                payload,
                created_at=header.created_at,
                bucket=header.bucket,
                checksum=header.checksum,
                gen=header.gen,
                commit=commit,
                meta=meta,
                direct=self.direct_io,
            )
        except OSError as exc:
            log.warning("could not rewrite a block's names", extra={"key": bid.key, "error": str(exc)})
            return False
        finally:
            payload.release()
            with self._lock:
                self._reserved -= size
        return written is not None

    def _fresh(self, bid: BlockId, gen: int) -> bool:
        """Whether a copy of ``gen`` is newer than the indexed one and every known delete."""
        cur = self._index.get(bid)
        return (cur is None or cur.gen < gen) and self.generations.admits(bid, gen)

    def _disk_has_room(self, size: int) -> bool:
        try:
            st = os.statvfs(self.root)
        except OSError:
            return False
        total = st.f_blocks * st.f_frsize
        free = st.f_bavail * st.f_frsize
        return free - size - ALIGN >= total * self.min_free_fraction

    def _reserve(self, size: int) -> bool:
        high = int(self.capacity * self.high)
        if size > high:
            return False
        with self._lock:
            if self._used + self._reserved + size <= high:
                self._reserved += size
                return True
        self.evict(max(0, min(int(self.capacity * self.low), high - size)))
        with self._lock:
            if self._used + self._reserved + size <= high:
                self._reserved += size
                return True
        return False

    def delete(self, bid: BlockId, gen: int | None = None) -> bool:
        """Delete a block's copies older than ``gen`` (all if None): index entry and file.

        With a generation (a delete request) every bucket directory is swept for a copy the index
        does not know (one another server wrote), so no stale copy comes back at the next scan.
        """
        with self._commit_lock:
            with self._lock:
                cur = self._index.get(bid)
                entry = self._drop_locked(bid) if cur is not None and (gen is None or cur.gen < gen) else None
            if entry is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._path(bid, entry.bucket))
            if gen is not None:
                for b in self.bucket_dirs():
                    if entry is not None and b == entry.bucket:
                        continue
                    path = self._path(bid, b)
                    try:
                        if read_header(path).gen < gen:
                            os.unlink(path)
                    except (FileNotFoundError, CorruptBlock):
                        continue
        return entry is not None

    def purge(self, bid: BlockId, gen: int) -> bool:
        """Apply a delete learned from another server: the same as :meth:`delete` here."""
        return self.delete(bid, gen)

    def forget(self, bid: BlockId, gen: int) -> bool:
        """Drop the index entry if its copy is older than ``gen`` (no filesystem access)."""
        with self._commit_lock, self._lock:
            cur = self._index.get(bid)
            if cur is None or cur.gen >= gen:
                return False
            self._drop_locked(bid)
            return True

    def usage(self) -> TierUsage:
        """Return the current occupancy (as far as the index knows)."""
        with self._lock:
            return TierUsage(self.name, self._used, self.capacity, len(self._index), self.high, self.low)

    def evict(self, target_bytes: int) -> list[BlockId]:
        """Evict until usage is at most ``target_bytes``: LRU, or oldest bucket first."""
        victims: list[tuple[BlockId, DiskEntry]] = []
        with self._lock:
            if self.policy == "lru":
                while self._index and self._used + self._reserved > target_bytes:
                    bid = next(iter(self._index))
                    entry = self._drop_locked(bid)
                    assert entry is not None
                    victims.append((bid, entry))
            else:
                for bucket in sorted(self._by_bucket):
                    if self._used + self._reserved <= target_bytes:
                        break
                    # Within the oldest bucket, least recently used first.
                    members = self._by_bucket[bucket]
                    order = [b for b in self._index if b in members]
                    for bid in order:
                        if self._used + self._reserved <= target_bytes:
                            break
                        entry = self._drop_locked(bid)
                        assert entry is not None
                        victims.append((bid, entry))
        for bid, entry in victims:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(bid, entry.bucket))
        if victims:
            self.counters.inc("evictions", self.name, len(victims))
            if self._on_evicted is not None:
                self._on_evicted([bid for bid, _ in victims])
        return [bid for bid, _ in victims]

    def evict_above_high(self) -> None:
        """Evict down to the low watermark if usage is above the high one."""
        u = self.usage()
        if u.used_bytes > u.high_bytes:
            self.evict(int(u.capacity_bytes * u.low_watermark))

    def tick(self) -> None:
        """Janitor work: evict above the high watermark; expire buckets older than the TTL."""
        self.evict_above_high()
        if self.expiry is None:
            return
        for b in self.expiry.expired(self.bucket_dirs()):
            gone = self.expire_bucket(b)
            if gone is not None:
                log.info("bucket expired", extra={"tier": self.name, "bucket": b, "blocks": len(gone)})

    # --- TTL -----------------------------------------------------------------------------------------

    def wants_refresh(self, bid: BlockId, bucket: int) -> bool:
        """Whether the indexed copy sits in an older bucket than ``bucket``."""
        entry = self._index.get(bid)
        return entry is not None and entry.bucket < bucket

    def refresh(self, bid: BlockId, bucket: int) -> bool:
        """Move a block into ``bucket`` (a hit keeps it alive); True if it moved."""
        with self._lock:
            entry = self._index.get(bid)
            if entry is None or entry.bucket >= bucket:
                return False
            old_bucket = entry.bucket
        src, dst = self._path(bid, old_bucket), self._path(bid, bucket)
        try:
            make_dir_durable(dst.parent)  # a new bucket's entry in buckets/ before a block moves in
            with self._commit_lock:
                os.rename(src, dst)
        except FileNotFoundError:
            self._forget(bid, old_bucket)
            return False
        with self._lock:
            cur = self._index.get(bid)
            if cur is not None and cur.bucket == old_bucket:
                self._add_locked(bid, DiskEntry(bucket, cur.size, cur.gen, cur.meta_size))
        return True

    def expire_bucket(self, bucket: int) -> list[BlockId] | None:
        """Delete a whole bucket; None if another server claimed it first.

        The claim is an atomic rename of the directory, so exactly one server expires a bucket.
        """
        src = self.buckets_dir / str(bucket)
        claimed = self.buckets_dir / f"{EXPIRED_PREFIX}{bucket}-{os.urandom(4).hex()}"
        try:
            os.rename(src, claimed)
        except FileNotFoundError:
            self.forget_bucket(bucket)
            return None
        shutil.rmtree(claimed, ignore_errors=True)
        gone = self.forget_bucket(bucket)
        self.counters.inc("expired_buckets", self.name)
        self.counters.inc("expirations", self.name, len(gone))
        return gone

    def forget_bucket(self, bucket: int) -> list[BlockId]:
        """Drop a bucket's index entries (it was expired, here or elsewhere)."""
        with self._lock:
            members = list(self._by_bucket.get(bucket, ()))
            for bid in members:
                self._drop_locked(bid)
        return members

    # --- journal events from other servers -----------------------------------------------------------

    def apply(self, events: list[Event]) -> None:
        """Update the index from other servers' journal events (no filesystem access).

        A ``P`` of an older generation than the indexed copy, or one a known delete superseded, is
        ignored; ``T`` (deletes) is applied by the shared tier, which owns the journal.
        """
        forget: list[int] = []
        with self._lock:
            for ev in events:
                if ev.op == "P" and ev.bid is not None:
                    self.generations.observe(ev.gen)
                    cur = self._index.get(ev.bid)
                    if (cur is None or cur.gen <= ev.gen) and self.generations.admits(ev.bid, ev.gen):
                        self._add_locked(ev.bid, DiskEntry(ev.bucket, HEADER_SIZE + ev.length, ev.gen))
                elif ev.op == "D" and ev.bid is not None:
                    self._drop_locked(ev.bid)
                elif ev.op == "X":
                    forget.append(ev.bucket)
        for b in forget:
            self.forget_bucket(b)
