"""Store staging in the shared-memory arena: the handshake for same-node stores.

1. ``ShmStoreBegin`` — the server creates one staging file per key it can take (``s_<128-bit token>``
   in the arena directory, which clients can traverse but not list) and returns the names under a
   lease. Keys already stored, or that do not fit in ``arena_bytes``, get no file (present / dropped).
2. The client writes each payload into its file (one copy).
3. ``ShmStoreCommit`` — the server copies each staging file into a fresh DRAM block (in-kernel
   ``copy_file_range``), then deletes the staging files. Copying rather than adopting the file means a
   client can never modify bytes that other clients read: it only ever holds write access to its own
   staging files, which are gone once committed.

A lease not committed in ``slot_lease_seconds`` (client died, hung, or lost the reply) is reclaimed by
:meth:`StagingArena.reap`; staging files of a previous server process are removed at start-up.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.stats import Counters
from kvfabric.cacheserver.engine.tiered import TieredStore

__all__ = ["BeginResult", "StagingArena", "UnknownLease"]

STAGING_PREFIX = "s_"


class UnknownLease(KeyError):  # noqa: N818 - mirrors NOT_FOUND
    """Commit or abort of a lease that does not exist (expired or never issued)."""


@dataclass(slots=True)
class _Slot:
    bid: BlockId
    name: str
    length: int


@dataclass(slots=True)
class _Lease:
    slots: list[_Slot]
    expires: float
    nbytes: int
    dropped: int
    present: int
    done: bool = field(default=False)


@dataclass(frozen=True, slots=True)
class BeginResult:
    """What ShmStoreBegin returns."""

    lease_id: str
    names: list[str]
    """Parallel to the keys; "" = do not write."""
    lengths: list[int]
    dropped: int
    present: int


class StagingArena:
    """Hands out staging files under leases, within a byte budget."""

    def __init__(self, directory: Path, budget_bytes: int, lease_seconds: float, counters: Counters) -> None:
        self.dir = directory
        self.budget = budget_bytes
        self.lease_seconds = lease_seconds
        self.counters = counters
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._used = 0
        directory.mkdir(parents=True, exist_ok=True)
        for e in os.scandir(directory):
            if e.name.startswith(STAGING_PREFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.path)

    @property
    def used_bytes(self) -> int:
        """Bytes of staging files currently leased."""
        with self._lock:
            return self._used

    def begin(self, bids: list[BlockId], lengths: list[int], present: list[bool]) -> BeginResult:
        """Create staging files for the keys that are not present and fit in the budget."""
        names: list[str] = []
        slots: list[_Slot] = []
        dropped = n_present = 0
        nbytes = 0
        for bid, length, is_present in zip(bids, lengths, present, strict=True):
            if is_present:
                n_present += 1
                names.append("")
                continue
            with self._lock:
                fits = self._used + length <= self.budget
                if fits:
                    self._used += length
            if not fits:
                dropped += 1
                names.append("")
                continue
            name = f"{STAGING_PREFIX}{secrets.token_hex(16)}"
            try:
                fd = os.open(self.dir / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                try:
                    # The engine pod may run as another user; the unguessable name is the capability.
                    os.fchmod(fd, 0o666)
                    os.ftruncate(fd, length)
                finally:
                    os.close(fd)
            except OSError:
                with self._lock:
                    self._used -= length
                dropped += 1
                names.append("")
                continue
            nbytes += length
            names.append(name)
            slots.append(_Slot(bid, name, length))
        lease_id = secrets.token_hex(16)
        with self._lock:
            self._leases[lease_id] = _Lease(
                slots, time.monotonic() + self.lease_seconds, nbytes, dropped, n_present
            )
        if dropped:
            self.counters.inc("dropped_stores", "arena", dropped)
        return BeginResult(lease_id, names, lengths, dropped, n_present)

    def _take(self, lease_id: str) -> _Lease:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise UnknownLease(lease_id)
        return lease

    def commit(self, lease_id: str, store: TieredStore) -> tuple[int, int, int]:
        """Copy staged payloads into DRAM blocks; returns ``(accepted, dropped, bytes stored)``."""
        lease = self._take(lease_id)
        accepted, dropped, nbytes = lease.present, lease.dropped, 0
        try:
            for slot in lease.slots:
                if self._commit_one(slot, store):
                    accepted += 1
                    nbytes += slot.length
                else:
                    dropped += 1
        finally:
            self._release(lease)
        return accepted, dropped, nbytes

    def _commit_one(self, slot: _Slot, store: TieredStore) -> bool:
        try:
            src = os.open(self.dir / slot.name, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            if os.fstat(src).st_size != slot.length:
                # The client truncated or grew its staging file: refuse rather than store garbage.
                self.counters.inc("invalid_staging")
                return False

            def fill(dst: int) -> None:
                done = 0
                while done < slot.length:
                    n = _copy(src, dst, slot.length - done, done)
                    if n <= 0:
                        raise OSError("staging file shorter than announced")
                    done += n

            return store.put_with(slot.bid, slot.length, fill)
        finally:
            os.close(src)

    def abort(self, lease_id: str) -> tuple[int, int]:
        """Discard a lease's staging files; returns ``(accepted, dropped)`` as a commit would report.

        Keys that were already stored count as accepted; every staged key counts as dropped.
        """
        lease = self._take(lease_id)
        self._release(lease)
        return lease.present, lease.dropped + len(lease.slots)

    def _release(self, lease: _Lease) -> None:
        for slot in lease.slots:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.dir / slot.name)
        with self._lock:
            self._used -= lease.nbytes

    def reap(self) -> int:
        """Reclaim expired leases (their clients died or gave up); returns how many."""
        now = time.monotonic()
        with self._lock:
            dead = [k for k, v in self._leases.items() if v.expires < now]
            leases = [self._leases.pop(k) for k in dead]
        for lease in leases:
            self._release(lease)
        if leases:
            self.counters.inc("expired_leases", "", len(leases))
        return len(leases)

    def close(self) -> None:
        """Drop every lease."""
        with self._lock:
            leases = list(self._leases.values())
            self._leases.clear()
        for lease in leases:
            self._release(lease)


def _copy(src: int, dst: int, count: int, offset: int) -> int:
    try:
        return os.copy_file_range(src, dst, count, offset, offset)
    except OSError:
        # Kernels or filesystems without copy_file_range between these files: copy through memory.
        data = os.pread(src, min(count, 8 << 20), offset)
        return os.pwrite(dst, data, offset) if data else 0
