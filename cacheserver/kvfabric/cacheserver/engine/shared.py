"""The shared-volume tier: a directory tier plus everything that makes several servers agree on it.

:class:`SharedTier` wraps a :class:`~kvfabric.cacheserver.engine.disk.DiskTier` (oldest bucket first)
and owns what only the shared volume has:

* its **journal** (``journals/<server_id>.log``): every write, refresh, eviction and delete of this
  server is appended; a background thread tails the other servers' journals into the index;
* its **lease** (``leases/<server_id>``) and **bucket ownership**: only the live owner of a bucket
  expires it (see ttl.py);
* the removal of **departed servers' files** (leases, clocks, journals, temp directories) once they
  have not changed for a generous margin (see departed.py);
* **tombstones** (``tombstones/<bucket>/<namespace>_<key>.<gen>``): a delete leaves one on the volume
  and journals a ``T`` record; every server applies a ``T`` to *all* its tiers through the store's
  ``on_delete`` callback, and a server that was down reads the tombstone files at start-up, before
  any tier rebuilds its index. Tombstones expire a bucket after the blocks they could supersede.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from kvfabric.cacheserver.engine.base import ReadResult, TierName, TierUsage
from kvfabric.cacheserver.engine.departed import DepartedServers, departed_after
from kvfabric.cacheserver.engine.disk import DiskTier, Expiry
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.journal import Event, JournalReader, JournalWriter
from kvfabric.cacheserver.engine.ordering import Generations
from kvfabric.cacheserver.engine.stats import Counters
from kvfabric.cacheserver.engine.ttl import PeerClocks, drop_lease, owner_of, touch_lease

__all__ = ["STALE_TMP_SECONDS", "SharedTier"]

log = logging.getLogger(__name__)
STALE_TMP_SECONDS = 3600.0


class SharedTier:
    """The shared volume as a :class:`~kvfabric.cacheserver.engine.base.BackingTier`."""

    durable = True

    def __init__(
        self,
        disk: Callable[[Callable[[list[BlockId]], None]], DiskTier],
        *,
        server_id: str,
        expiry: Expiry,
        generations: Generations,
        counters: Counters,
        lease_seconds: float,
        journal_poll_seconds: float,
        on_delete: Callable[[BlockId, int], None],
    ) -> None:
        # The disk tier is built here so its eviction callback is this tier's journal, from birth.
        self.disk = disk(self._journal_evictions)
        self.root: Path = self.disk.root
        self.has: Callable[[BlockId], bool] = self.disk.has  # lock-free index check (lookup hot path)
        self.server_id = server_id
        self.expiry = expiry
        self.generations = generations
        self.counters = counters
        self.lease_seconds = lease_seconds
        self.journal_poll_seconds = journal_poll_seconds
        self._on_delete = on_delete
        self.lease_dir = self.root / "leases"
        self.peers = PeerClocks(self.lease_dir, server_id, lease_seconds)
        expiry.clock.attach_peers(self.peers)
        self.tomb_dir = self.root / "tombstones"
        self._reader = JournalReader(self.root / "journals", server_id)
        # Departed servers' leases, clocks, journals and temp directories go after a generous margin.
        self.departed = DepartedServers(self.root, server_id, departed_after(lease_seconds))
        self.journal: JournalWriter | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._poll_lock = threading.Lock()  # the tailer thread, and anyone calling poll() directly

    @property
    def name(self) -> TierName:
        """``shared``."""
        return TierName.SHARED

    # --- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Tail journals from their ends, read tombstones, rebuild the index, start the tailer."""
        # Tail from the current ends *before* scanning, so nothing written meanwhile is missed.
        self._reader.skip_to_end()
        self.journal = JournalWriter(self.root / "journals", self.server_id)
        touch_lease(self.lease_dir, self.server_id, self.expiry.clock.local)
        self.peers.observe()
        self._load_tombstones()
        self.disk.scan()
        self._thread = threading.Thread(target=self._tail_loop, name="journal-tail", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop tailing, give up the lease, close the journal."""
        self.close_for_successor()
        drop_lease(self.lease_dir, self.server_id)

    def resume_after_successor(self) -> None:
        """Reopen the journal: a successor that started replaced the file this server appended to."""
        if self.journal is not None:
            self.journal.close()
            self.journal = JournalWriter(self.root / "journals", self.server_id)
        touch_lease(self.lease_dir, self.server_id, self.expiry.clock.local)

    def close_for_successor(self) -> None:
        """Stop tailing and close the journal, keeping the lease: the successor (same server id) holds it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.journal is not None:
            self.journal.close()

    def _tail_loop(self) -> None:
        while not self._stop.wait(self.journal_poll_seconds):
            try:
                self.poll()
            except Exception:
                log.exception("journal tail failed")

    def poll(self) -> None:
        """Apply the other servers' new journal records (deletes to every tier of this server)."""
        with self._poll_lock:
            events = self._reader.poll()
            if not events:
                return
            for ev in events:
                # Tombstones first: a P in the same batch that a T supersedes must not be indexed.
                if ev.op == "T" and ev.bid is not None:
                    self.generations.tombstone(ev.bid, ev.gen)
            self.disk.apply(events)
            for ev in events:
                if ev.op == "T" and ev.bid is not None:
                    self._on_delete(ev.bid, ev.gen)

    # --- tombstones ----------------------------------------------------------------------------------

    def _load_tombstones(self, *, apply: bool = False) -> int:
        """Learn the tombstones on the volume; with ``apply``, apply new ones to every tier.

        At start-up this runs before any index is rebuilt; the janitor runs it again, so a ``T``
        record a tailer missed (a journal rotated between two polls) is honoured within a tick.
        """
        n = 0
        with contextlib.suppress(FileNotFoundError):
            for bdir in os.scandir(self.tomb_dir):
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    for f in os.scandir(bdir.path):
                        stem, _, gen = f.name.rpartition(".")
                        bid = BlockId.from_filename(f"{stem}.blk")
                        if bid is not None and gen.isdigit() and self.generations.tombstone(bid, int(gen)):
                            n += 1
                            if apply:
                                self._on_delete(bid, int(gen))
        if n:
            log.info("tombstones loaded", extra={"tier": self.name, "tombstones": n})
        return n

    def _write_tombstone(self, bid: BlockId, gen: int) -> None:
        bucket = self.expiry.current_bucket()
        if bucket is None:
            bucket = 0  # clock unknown: the oldest bucket, expired at the first chance (a hint only)
        d = self.tomb_dir / str(bucket)
        try:
            d.mkdir(parents=True, exist_ok=True)
            stem = bid.filename.removesuffix(".blk")
            fd = os.open(d / f"{stem}.{gen}", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
            os.close(fd)
        except OSError:
            log.warning("cannot write tombstone", extra={"key": bid.key})

    def _expire_tombstones(self) -> None:
        # A tombstone must outlive every copy it supersedes: those sit in its bucket or older ones,
        # so it goes one bucket after them.
        with contextlib.suppress(FileNotFoundError):
            buckets = [int(e.name) for e in os.scandir(self.tomb_dir) if e.name.isdigit()]
            for b in self.expiry.expired([b - 1 for b in buckets]):
                shutil.rmtree(self.tomb_dir / str(b + 1), ignore_errors=True)

    # --- the BackingTier interface -------------------------------------------------------------------

    def contains(self, bid: BlockId) -> bool:
        """Whether the index holds ``bid``."""
        return self.disk.contains(bid)

    def confirm(self, bid: BlockId) -> bool:
        """Whether the indexed file is still on the volume (a ``stat``; see ``ConfirmsPresence``)."""
        return self.disk.confirm(bid)

    def generation(self, bid: BlockId) -> int | None:
        """Generation of the indexed copy."""
        return self.disk.generation(bid)

    def length(self, bid: BlockId) -> int | None:
        """Payload length of the indexed copy."""
        return self.disk.length(bid)

    def get(self, bid: BlockId) -> bytes | None:
        """The verified payload, or None."""
        return self.disk.get(bid)

    def read_into(self, bid: BlockId, dest: memoryview) -> ReadResult:
        """Read and verify into ``dest``."""
        return self.disk.read_into(bid, dest)

    def read_into_fd(self, bid: BlockId, fd: int, *, room: int | None = None) -> ReadResult:
        """Read and verify into the start of file ``fd`` (read and write overlapped)."""
        return self.disk.read_into_fd(bid, fd, room=room)

    def put(self, bid: BlockId, payload: bytes | bytearray | memoryview, *, bucket: int) -> bool:
        """Write a payload into ``bucket`` (journaled)."""
        ok = self.disk.put(bid, payload, bucket=bucket)
        if ok:
            self._journal_put(bid, bucket)
        return ok

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
        """Write a copy and journal it; refused while volume time is unknown."""
        if self.expiry.clock.now() is None:
            # Without the volume's clock a skewed local clock would stamp the block into a bucket
            # another server expires at once (or keeps too long): skip it instead.
            return False
        ok = self.disk.write(bid, payload, gen=gen, bucket=bucket, created_at=created_at, checksum=checksum)
        if ok:
            self._journal_put(bid, bucket)
        return ok

    def _journal_put(self, bid: BlockId, bucket: int) -> None:
        entry = self.disk.entry(bid)
        if entry is not None and self.journal is not None:
            self.journal.append([Event("P", bid, bucket, entry.length, entry.gen)])

    def delete(self, bid: BlockId, gen: int | None = None) -> bool:
        """Delete copies older than ``gen`` and tell every server (a ``T`` record and a tombstone)."""
        found = self.disk.delete(bid, gen)
        if gen is not None:
            self._write_tombstone(bid, gen)
            if self.journal is not None:
                self.journal.append([Event("T", bid, gen=gen)])
        elif found and self.journal is not None:
            self.journal.append([Event("D", bid)])
        return found

    def purge(self, bid: BlockId, gen: int) -> bool:
        """A delete from another server: it removed the files; drop the index entry only."""
        return self.disk.forget(bid, gen)

    def usage(self) -> TierUsage:
        """Occupancy as far as the index knows (every server's blocks)."""
        return self.disk.usage()

    def evict(self, target_bytes: int) -> list[BlockId]:
        """Evict oldest bucket first (journaled by the disk tier's callback)."""
        return self.disk.evict(target_bytes)

    def _journal_evictions(self, bids: list[BlockId]) -> None:
        if self.journal is not None:
            self.journal.append([Event("D", b) for b in bids])

    def wants_refresh(self, bid: BlockId, bucket: int) -> bool:
        """Whether the copy sits in an older bucket."""
        return self.disk.wants_refresh(bid, bucket)

    def refresh(self, bid: BlockId, bucket: int) -> bool:
        """Move the copy into ``bucket`` and journal the move."""
        moved = self.disk.refresh(bid, bucket)
        if moved:
            self._journal_put(bid, bucket)
        return moved

    def tick(self) -> None:
        """Renew the lease, evict above the watermark, expire owned buckets, reap dead temp files.

        Also removes departed servers' files, and recreates ours if a server that took us for
        departed removed them (engine/departed.py).
        """
        touch_lease(self.lease_dir, self.server_id, self.expiry.clock.local)
        if self.journal is not None and self.journal.reopen_if_removed():
            log.warning(
                "journal was removed (taken for departed): started a new one", extra={"tier": self.name}
            )
        self.disk.tmp_dir.mkdir(parents=True, exist_ok=True)
        self.peers.observe()
        try:
            self.departed.reap()
        except OSError as exc:  # a cleanup: never at the cost of this tick's eviction and expiry
            log.warning("cannot remove departed servers' files", extra={"reason": str(exc)})
        self.disk.evict_above_high()
        if self.expiry.clock.expiry_now() is None:
            return  # clock unknown: never expire (never early)
        # Liveness by watching leases change, never by comparing their mtimes with our clock.
        live = [*self.peers.live(), self.server_id]
        for b in self.expiry.expired(self.disk.bucket_dirs()):
            if owner_of(b, live) != self.server_id:
                continue
            gone = self.disk.expire_bucket(b)
            if gone is not None:
                if self.journal is not None:
                    self.journal.append([Event("X", bucket=b)])
                log.info(
                    "bucket expired",
                    extra={"tier": self.name, "bucket": b, "blocks": len(gone), "server_id": self.server_id},
                )
        self._expire_tombstones()
        self._load_tombstones(apply=True)
        self.disk.reap_stale_tmp(STALE_TMP_SECONDS, self._clock_of)

    def _clock_of(self, server_id: str) -> float | None:
        """The clock that stamped a server's files: its own if live, else the expiry clock."""
        clock = self.expiry.clock
        if server_id == self.server_id:
            return clock.now()
        peer = self.peers.clock_of(server_id)
        return clock.expiry_now() if peer is None else peer
