"""Store staging for same-node clients: the handshake, through memfds the server owns.

1. ``ShmStoreBegin`` — the server creates one staging memfd per key it can take, *allocates its
   pages* (``fallocate``), and returns a 128-bit random name for each under a lease. Keys already
   stored, or that do not fit in ``arena_bytes``, get no name (present / dropped).
2. The client trades the names for writable descriptors on the block socket
   (:mod:`kvfabric.cacheserver.transport.blocksock`) and writes each payload into its memfd (one
   copy, into pages that already exist). A begin made on the block socket itself gets the
   descriptors in its answer (:func:`kvfabric.cacheserver.service.block_stores`).
3. ``ShmStoreCommit`` — the server *seals* each staging memfd (no write, resize or writable mapping
   is possible afterwards, by anyone), checks its size, and puts the memfd itself into DRAM as the
   block (:meth:`TieredStore.put_sealed`): no second copy. A client still mapping its memfd writable,
   or one that resized it, has that key refused (``invalid_staging``), never a torn block.

Why the pages are allocated by the server at step 1: a memfd's pages are charged to the memory cgroup
of the process that allocates them, and stay charged there. Allocated by the server, the block's
memory counts against the cache server's limit, not the engine pod's that writes into it — which is
what the commit's copy into a fresh block used to ensure, at the price of a second page allocation
and a second copy of every stored byte. (A client that frees pages of its memfd before the commit,
by shrinking it or punching holes, and writes them again allocates those pages itself: it pays for
them, no one else does.) A client that keeps its staging descriptor after the commit holds the
block's descriptor, as a client that loaded the block does.

No file exists anywhere: a client can reach only the memfds named to it, and only until the commit.
A lease not committed in ``slot_lease_seconds`` (client died, hung, or lost the reply) is reclaimed by
:meth:`StagingArena.reap`.

A staging memfd that does not become a block (aborted, expired, or refused at the commit) is
*truncated to nothing* before the server closes it: its pages are the server's, and a client that
kept a descriptor of it would otherwise keep them alive, charged to the server, while the arena's
budget was already given back — begin, keep, abandon, repeat, and the server is OOM-killed. A client
that sealed its memfd against shrinking (``F_SEAL_SHRINK``) makes the truncation fail: those bytes are
*quarantined*, never given back to the budget for the server's lifetime, so what such a client can pin
is bounded by ``arena_bytes`` (it fills the arena; stores are dropped and engines recompute).

The page allocation happens ahead of the begin where it can: a thread of the arena keeps a few
staging memfds allocated (``prealloc_bytes`` at most, of the lengths recent begins asked for:
:mod:`kvfabric.cacheserver.transport.stagingpool`), and a begin hands those out, so the RPC itself
allocates nothing. Pooled memfds are charged to the budget; the thread allocates only while the
pool's whole size stays free beside them (a guess must not take a store's room), and a begin that
finds no room closes pooled memfds first. A pooled memfd has never been seen by a client; once
handed out it follows its lease as above and never returns to the pool.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfabric.cacheserver.engine.dram import descriptor_budget, new_memfd, seal
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.stats import Counters
from kvfabric.cacheserver.engine.tiered import TieredStore
from kvfabric.cacheserver.transport.stagingpool import StagingPool, charge

__all__ = ["BeginResult", "StagingArena", "UnknownLease"]

STAGING_PREFIX = "s_"

_log = logging.getLogger(__name__)


class UnknownLease(KeyError):  # noqa: N818 - mirrors NOT_FOUND
    """Commit or abort of a lease that does not exist (expired or never issued)."""


@dataclass(slots=True)
class _Slot:
    bid: BlockId
    name: str
    length: int
    fd: int

    @property
    def charge(self) -> int:
        """Bytes of the arena's budget this staging takes (at least a page)."""
        return charge(self.length)


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
    """Hands out staging memfds under leases, within a byte budget."""

    def __init__(
        self,
        budget_bytes: int,
        lease_seconds: float,
        counters: Counters,
        *,
        prealloc_bytes: int = 0,
        prealloc_thread: bool = True,
    ) -> None:
        """Budget ``budget_bytes``; ``prealloc_bytes`` of staging kept allocated ahead of begins.

        The pool takes at most a quarter of the budget (0: none). ``prealloc_thread`` False leaves
        the filling to :meth:`refill` (tests).
        """
        self.budget = budget_bytes
        self.lease_seconds = lease_seconds
        self.counters = counters
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._leases: dict[str, _Lease] = {}
        self._used = 0
        """Bytes of the budget charged: leased, quarantined, pooled and being allocated for the pool."""
        self.pool = StagingPool(min(prealloc_bytes, budget_bytes // 4))
        self._filling = 0
        self._closed = False
        self._pool_work = False
        self._prealloc_thread = prealloc_thread
        self._thread: threading.Thread | None = None
        self._quarantined = 0
        self._slots = 0
        # A quarter of the descriptor limit (the DRAM tier takes half).
        self.max_slots = descriptor_budget(0.25)
        self._by_name: dict[str, _Slot] = {}

    @property
    def used_bytes(self) -> int:
        """Bytes of the budget taken: staging memfds leased, plus the quarantined ones."""
        with self._lock:
            return self._used - self.pool.bytes - self._filling

    @property
    def pooled_bytes(self) -> int:
        """Bytes of the budget taken by staging allocated ahead of begins (the pool)."""
        with self._lock:
            return self.pool.bytes + self._filling

    @property
    def quarantined_bytes(self) -> int:
        """Bytes of abandoned staging a client sealed against shrinking: charged for good (see module doc)."""
        with self._lock:
            return self._quarantined

    def begin(self, bids: list[BlockId], lengths: list[int], present: list[bool]) -> BeginResult:
        """Create staging memfds for the keys that are not present and fit in the budget."""
        names: list[str] = []
        slots: list[_Slot] = []
        dropped = n_present = 0
        nbytes = 0
        try:
            for bid, length, is_present in zip(bids, lengths, present, strict=True):
                if is_present:
                    n_present += 1
                    names.append("")
                    continue
                # At least a page each, and a bounded count: a flood of tiny stores cannot take
                # every descriptor of the server.
                cost = charge(length)
                fd, fits, evicted = self._reserve(length)
                for fd_ in evicted:
                    os.close(fd_)  # never handed out: closing frees its pages
                if not fits:
                    dropped += 1
                    names.append("")
                    continue
                if fd is None:
                    fd = _allocated_memfd(length)
                    self.counters.inc("staging_memfds", "allocated_on_begin")
                else:
                    self.counters.inc("staging_memfds", "preallocated")
                if fd is None:
                    with self._lock:
                        self._used -= cost
                        self._slots -= 1
                    dropped += 1
                    names.append("")
                    continue
                nbytes += cost
                name = f"{STAGING_PREFIX}{secrets.token_hex(16)}"
                names.append(name)
                slots.append(_Slot(bid, name, length, fd))
        except BaseException:
            self._release(_Lease(slots, 0.0, nbytes, dropped, n_present))
            raise
        lease_id = secrets.token_hex(16)
        with self._lock:
            for slot in slots:
                self._by_name[slot.name] = slot
            self._leases[lease_id] = _Lease(
                slots, time.monotonic() + self.lease_seconds, nbytes, dropped, n_present
            )
            if self.pool.max_bytes:
                self.pool.want([n for n, p in zip(lengths, present, strict=True) if not p])
                self._wake_pool()
        if dropped:
            self.counters.inc("dropped_stores", "arena", dropped)
        return BeginResult(lease_id, names, lengths, dropped, n_present)

    def _reserve(self, length: int) -> tuple[int | None, bool, list[int]]:
        """Charge one staging of ``length``: ``(pooled memfd or None, fits, pooled memfds to close)``.

        A pooled memfd of the length carries its charge already. Otherwise the charge must fit,
        pooled memfds closed to make room if needed: pre-allocation never costs a store.
        """
        cost = charge(length)
        evicted: list[int] = []
        with self._lock:
            fd = self.pool.take(length) if length else None
            if fd is not None:
                return fd, True, evicted
            if not (
                self._used - self.pool.bytes + cost <= self.budget
                and self._slots - self.pool.count < self.max_slots
            ):
                return None, False, evicted  # not even an empty pool makes room: keep the pool
            while not (self._used + cost <= self.budget and self._slots < self.max_slots):
                ev = self.pool.evict()
                if ev is None:
                    return None, False, evicted
                self._used -= charge(ev[0])
                self._slots -= 1
                evicted.append(ev[1])
            self._used += cost
            self._slots += 1
        return None, True, evicted

    def _wake_pool(self) -> None:
        """(Under the lock.) Let the pool's thread look again; start it on the first call."""
        self._pool_work = True
        self._cv.notify_all()
        if self._thread is None and self._prealloc_thread and not self._closed:
            self._thread = threading.Thread(target=self._keep_pool, name="staging-prealloc", daemon=True)
            self._thread.start()

    def _keep_pool(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._pool_work:
                    self._cv.wait()
                if self._closed:
                    return
                self._pool_work = False
            try:
                self.refill()
            except Exception:  # the pool is an optimisation: begins allocate for themselves
                _log.exception("pre-allocating staging memfds failed")

    def refill(self) -> None:
        """Bring the pool to what recent begins asked for, within the budget (on the caller's thread)."""
        while self._fill_step():
            pass

    def _fill_step(self) -> bool:
        """Free one surplus pooled memfd or allocate one wanted; False when there is nothing to do."""
        with self._lock:
            if self._closed:
                return False
            length = 0
            extra = self.pool.surplus()
            if extra is not None:
                self._used -= charge(extra[0])
                self._slots -= 1
            else:
                wanted = self.pool.next_fill()
                if wanted is None:
                    return False
                length = wanted
                cost = charge(length)
                # Only while the pool's whole size stays free beside it: pre-allocation is a guess,
                # and a store that arrives meanwhile must still find its room.
                if self._used + cost + self.pool.max_bytes > self.budget or self._slots >= self.max_slots:
                    return False
                self._used += cost
                self._slots += 1
                self._filling += cost
        if extra is not None:
            os.close(extra[1])
            return True
        fd: int | None = None
        try:
            fd = _allocated_memfd(length)
        finally:
            with self._lock:
                self._filling -= cost
                keep = fd is not None and not self._closed
                if keep:
                    assert fd is not None
                    self.pool.add(length, fd)
                else:
                    self._used -= cost
                    self._slots -= 1
        if fd is not None and not keep:
            os.close(fd)
        return keep

    def dup_by_name(self, name: str) -> tuple[int, int] | None:
        """``(writable descriptor, length)`` of a leased staging memfd, or None once committed or gone."""
        with self._lock:
            slot = self._by_name.get(name)
            if slot is None:
                return None
            return os.dup(slot.fd), slot.length

    def _take(self, lease_id: str) -> _Lease:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                # From here on no client can get a descriptor of these memfds.
                for slot in lease.slots:
                    self._by_name.pop(slot.name, None)
        if lease is None:
            raise UnknownLease(lease_id)
        return lease

    def commit(self, lease_id: str, store: TieredStore) -> tuple[int, int, int]:
        """Seal staged payloads and put each memfd into DRAM as its block; ``(accepted, dropped, bytes)``."""
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
        src = slot.fd
        if os.fstat(src).st_size != slot.length:
            # Checked before sealing too: refused unsealed, the memfd can still be truncated (freed).
            self.counters.inc("invalid_staging")
            return False
        try:
            # Sealed first: the client keeps its descriptor, and must not change a byte from here on.
            seal(src)
        except OSError as exc:
            if exc.errno not in (errno.EBUSY, errno.EPERM):
                raise
            # EBUSY: the client still maps it writable; EPERM: it sealed it itself (F_SEAL_SEAL).
            self.counters.inc("invalid_staging")
            return False
        if os.fstat(src).st_size != slot.length:
            # The client truncated or grew its staging memfd: refuse rather than store garbage.
            self.counters.inc("invalid_staging")
            return False

        # The memfd becomes the block: the store owns the descriptor from here on.
        slot.fd = -1
        return store.put_sealed(slot.bid, src, slot.length)

    def abort(
        self, lease_id: str, *, release: Callable[[Callable[[], None]], None] | None = None
    ) -> tuple[int, int]:
        """Discard a lease's staging memfds; returns ``(accepted, dropped)`` as a commit would report.

        Keys that were already stored count as accepted; every staged key counts as dropped.
        ``release``: runs the freeing of the memfds (e.g. on another thread); default: here, now.
        """
        lease = self._take(lease_id)
        if release is None:
            self._release(lease)
        else:
            release(lambda: self._release(lease))
        return lease.present, lease.dropped + len(lease.slots)

    def _release(self, lease: _Lease) -> None:
        kept = 0
        for slot in lease.slots:
            if slot.fd >= 0:  # -1: committed, the store owns it
                try:
                    if not _freed(slot):
                        kept += slot.charge
                finally:
                    os.close(slot.fd)
                    slot.fd = -1
        with self._lock:
            self._used -= lease.nbytes - kept
            self._quarantined += kept
            self._slots -= len(lease.slots)
            if self.pool.max_bytes:
                self._wake_pool()  # room again, perhaps for the pool
        if kept:
            self.counters.inc("quarantined_staging", "", kept)

    def reap(self) -> int:
        """Reclaim expired leases (their clients died or gave up); returns how many."""
        now = time.monotonic()
        with self._lock:
            dead = [k for k, v in self._leases.items() if v.expires < now]
            leases = [self._leases.pop(k) for k in dead]
            for lease in leases:
                for slot in lease.slots:
                    self._by_name.pop(slot.name, None)
        for lease in leases:
            self._release(lease)
        if leases:
            self.counters.inc("expired_leases", "", len(leases))
        return len(leases)

    def close(self) -> None:
        """Drop every lease and the pool; stop the pool's thread."""
        with self._lock:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
            leases = list(self._leases.values())
            self._leases.clear()
            self._by_name.clear()
        if thread is not None:
            thread.join()  # at most one allocation in flight
        for lease in leases:
            self._release(lease)
        with self._lock:
            pooled = self.pool.drain()
            for n, _fd in pooled:
                self._used -= charge(n)
                self._slots -= 1
        for _n, fd in pooled:
            os.close(fd)


def _freed(slot: _Slot) -> bool:
    """Free an abandoned staging memfd's pages, even those a client still holds a descriptor of.

    False when it cannot be (the client sealed it against shrinking): its pages stay alive as long
    as the client's descriptor does, and the caller keeps them charged.
    """
    try:
        os.ftruncate(slot.fd, 0)
    except OSError as exc:
        # EPERM: sealed against shrinking. Any other failure is kept charged too: the budget must
        # never be given back for pages that may still be alive.
        try:
            seals = fcntl.fcntl(slot.fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = -1
        # The client's identity is not known here (the gRPC peer of a unix socket carries none); the
        # seals say what it did. Logged per staging memfd: at most arena_bytes / page of them, ever.
        _log.warning(
            "staging memfd %s (%d bytes) abandoned and cannot be freed (%s; seals 0x%x: sealed against "
            "shrinking by its client, or resized by it during the commit): quarantined, its bytes stay "
            "charged to the staging arena",
            slot.name[:10],
            slot.length,
            errno.errorcode.get(exc.errno or 0, exc.errno),
            seals,
        )
        return False
    return True


def _allocated_memfd(length: int) -> int | None:
    """A staging memfd of ``length`` bytes whose pages this process allocated (charged to its cgroup).

    None when out of descriptors or memory, as for :func:`new_memfd`: the key is dropped.
    """
    fd = new_memfd("staging", length)
    if fd is None or not length:
        return fd
    try:
        os.posix_fallocate(fd, 0, length)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
            return None
        raise
    except BaseException:
        os.close(fd)
        raise
    return fd
