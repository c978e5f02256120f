"""Kept mappings of loaded blocks: a repeated same-node load copies at memory speed.

Mapping a 32 MiB sealed memfd and unmapping it again costs about three times the copy itself (8,192
page-table entries to build and tear down; docs/performance.md), so a client that loads the same hot
prefix again and again keeps the read-only mapping of each block it loaded, by handle name, up to a
byte budget (least recently used first out).

Why a kept mapping can never serve a wrong byte: a handle name names one sealed block for its whole
life — names are 128-bit random tokens, never reused, and a sealed memfd can never change or shrink.
A load copies from a kept mapping only when the server has just named that block for the key asked,
so the bytes are exactly the ones a fresh fetch would have returned.

Why it never makes the server use memory it does not count: a kept mapping keeps the block's pages
alive after the server evicts it, so every kept block is *held* on the block socket
(:mod:`kvfabric.rpc.blockproto`, ``KVBH1``) and the server keeps it charged to its DRAM budget until
it is released here (or the connection closes). A block the server would not let this client hold
is copied and unmapped as before.

The books stay equal: the cache makes room *before* it asks to hold a block (the releases ride on
that very request, and the server applies them first), counts page-rounded sizes like the server,
and drops every release that belongs to a closed connection (by its epoch), so a release meant for
a closed connection never drops a hold of the next one.
"""

from __future__ import annotations

import mmap
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

__all__ = ["Lease", "MappingCache"]


PAGE = 4096


def charged(length: int) -> int:
    """Bytes a block of ``length`` costs a hold budget (the server rounds up to a page)."""
    return max(PAGE, -(-length // PAGE) * PAGE)


@dataclass(slots=True)
class _Kept:
    mapping: mmap.mmap
    length: int
    key: str | None
    epoch: int
    users: int = 0
    doomed: bool = False
    sealed: bool = False
    """Its memfd was sealed against writes when mapped: only then may its bytes be lent (read in
    place after they were verified)."""
    lent: bool = False
    """Lent at least once: a borrower's tensor may still point into it (see :meth:`close`)."""
    view: memoryview = field(init=False)

    def __post_init__(self) -> None:
        self.view = memoryview(self.mapping)[: self.length]

    @property
    def size(self) -> int:
        return charged(self.length)

    def close(self) -> None:
        if self.lent:
            # A tensor made over a lease (torch.frombuffer) holds a reference to the view, not a
            # buffer export: closing the mapping under it would leave it pointing at unmapped
            # memory (a segfault on the next read, e.g. of a traceback's locals after a failed
            # scatter). So a lent mapping is never unmapped here: it goes with its last reference,
            # at once on the normal path (the scatter's tensors die when it returns).
            return
        self.view.release()
        self.mapping.close()


class Lease:
    """Read-only bytes of one loaded block, lent to the caller until :meth:`release` (idempotent).

    A lease of a kept mapping pins it: eviction does not drop it while the lease is out, and a
    mapping once lent is unmapped only with its last reference (see ``_Kept.close``). A lease may
    also own a private copy (a block this client could not hold or that was not sealed): then
    releasing it only drops the reference.
    """

    __slots__ = ("_done", "_lock", "_on_release", "view")

    def __init__(self, view: memoryview, on_release: Callable[[], None] | None = None) -> None:
        self.view = view
        self._on_release = on_release
        self._lock = threading.Lock()
        self._done = False

    def release(self) -> None:
        """Give the bytes back; the view must not be used afterwards."""
        with self._lock:
            if self._done:
                return
            self._done = True
        if self._on_release is not None:
            self._on_release()


def release_all(leases: Iterable[Lease]) -> None:
    """Release every lease of ``leases``."""
    for lease in leases:
        lease.release()


class MappingCache:
    """Read-only mappings of held blocks by handle name, at most ``budget_bytes`` of them (LRU).

    Thread-safe. Copies run outside the lock; a mapping evicted while a copy reads it is unmapped by
    that copy when it ends. Evicted names queue for release (:meth:`take_releases`), sent with the
    channel's next request.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self._by_key: dict[str, str] = {}
        self._bytes = 0
        self._releases: list[str] = []  # names the current connection holds and no mapping keeps
        self.epoch = 0
        """Bumped by :meth:`clear`: holds of an older connection are neither kept nor released."""

    @property
    def kept_bytes(self) -> int:
        """Bytes (page-rounded) of the mappings kept now."""
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def kept(self, name: str, length: int) -> bool:
        """Whether the block ``name`` of ``length`` bytes is kept here now (no recency change)."""
        with self._lock:
            kept = self._kept.get(name)
            return kept is not None and kept.length == length

    def copy(self, name: str, length: int, target: memoryview) -> bool:
        """Copy the kept block ``name`` into ``target``; False when it is not kept here."""
        with self._lock:
            kept = self._kept.get(name)
            if kept is None or kept.length != length:
                return False
            self._kept.move_to_end(name)
            kept.users += 1
        try:
            target[:length] = kept.view
        finally:
            self._give_back(name, kept)
        return True

    def borrow(self, name: str, length: int) -> Lease | None:
        """Lend the kept block ``name``'s bytes, pinned until the lease is released; None if not kept.

        Only a block kept as sealed is lent: its bytes cannot change while lent, so what the
        borrower verified is what it reads afterwards.
        """
        with self._lock:
            kept = self._kept.get(name)
            if kept is None or kept.length != length or not kept.sealed:
                return None
            self._kept.move_to_end(name)
            kept.users += 1
            kept.lent = True
        return Lease(kept.view, lambda: self._give_back(name, kept))

    def _give_back(self, name: str, kept: _Kept) -> None:
        with self._lock:
            kept.users -= 1
            last = kept.doomed and kept.users == 0
        if last:
            self._close(name, kept)

    def named(self, key: str, name: str) -> None:
        """The server named ``key``'s block ``name``: a mapping of its older block goes now.

        That older name will never be named again (it was evicted, deleted or replaced), so its
        hold would only pin memory.
        """
        with self._lock:
            old = self._by_key.get(key)
            gone = self._forget_locked(old) if old is not None and old != name and old in self._kept else None
        if gone is not None:
            self._close_unless_used(*gone)

    def make_room(self, length: int) -> bool:
        """Evict least recently used mappings until one of ``length`` fits; False if it never can."""
        size = charged(length)
        if size > self.budget:
            return False
        gone: list[tuple[str, _Kept]] = []
        with self._lock:
            while self._kept and self._bytes + size > self.budget:
                gone.append(self._forget_locked(next(iter(self._kept))))
        for n, k in gone:
            self._close_unless_used(n, k)
        return True

    def give_up_one(self) -> None:
        """Release the least recently used mapping (the server lent a block: its share is full)."""
        with self._lock:
            gone = self._forget_locked(next(iter(self._kept))) if self._kept else None
        if gone is not None:
            self._close_unless_used(*gone)

    def keep(
        self,
        name: str,
        mapping: mmap.mmap,
        length: int,
        *,
        key: str | None = None,
        epoch: int,
        sealed: bool = False,
    ) -> bool:
        """Keep ``mapping`` of the held block ``name`` (the caller gives it up); False if refused.

        ``key`` (namespace and key, any stable string) is what the block is the payload of (see
        :meth:`named`). ``epoch`` is :attr:`epoch` when the hold was taken. Refused (too large for
        the budget, or the connection that held it closed since): the caller unmaps it and, if the
        epoch is still current, releases the hold (:meth:`release_later`). ``sealed``: the block's
        memfd was sealed against writes (checked by the caller); only such a block is ever lent.
        """
        return self._keep(name, mapping, length, key, epoch, sealed=sealed, lend=False) is not None

    def keep_lent(
        self, name: str, mapping: mmap.mmap, length: int, *, key: str | None = None, epoch: int
    ) -> Lease | None:
        """:meth:`keep` a sealed block, and lend it at once (no eviction can come between); None if refused.

        The caller checked the seals. Refused also when the same block is kept already, unsealed.
        """
        got = self._keep(name, mapping, length, key, epoch, sealed=True, lend=True)
        if got is None:
            return None
        kname, kept = got
        return Lease(kept.view, lambda: self._give_back(kname, kept))

    def _keep(
        self,
        name: str,
        mapping: mmap.mmap,
        length: int,
        key: str | None,
        epoch: int,
        *,
        sealed: bool,
        lend: bool,
    ) -> tuple[str, _Kept] | None:
        kept = _Kept(mapping, length, key, epoch, sealed=sealed)
        if kept.size > self.budget:
            return None
        gone: list[tuple[str, _Kept]] = []
        with self._lock:
            if epoch != self.epoch:
                return None  # that connection's holds were released when it closed
            if name in self._kept:
                if lend and not self._kept[name].sealed:
                    return None  # never lend one kept unsealed; the caller drops this hold
                # Another thread kept the same block meanwhile (held twice): drop this one's hold.
                gone.append((name, kept))
                kept = self._kept[name]
            else:
                self._kept[name] = kept
                self._bytes += kept.size
                if key is not None:
                    old = self._by_key.get(key)
                    self._by_key[key] = name
                    if old is not None and old in self._kept:
                        gone.append(self._forget_locked(old))
            if lend:
                kept.users += 1  # before any eviction below: a lent mapping is never unmapped
                kept.lent = True
            while self._bytes > self.budget:
                gone.append(self._forget_locked(next(iter(self._kept))))
        for n, k in gone:
            self._close_unless_used(n, k)
        return name, kept

    def clear(self) -> None:
        """Unmap everything: the connection that held them is gone, and with it all of its holds.

        Releases queued for it are dropped, and those of mappings still in use are never sent (their
        epoch is old): a release must never drop a hold the next connection took of the same block.
        """
        with self._lock:
            self.epoch += 1
            gone = [self._forget_locked(name) for name in list(self._kept)]
            self._releases.clear()
        for n, k in gone:
            self._close_unless_used(n, k)

    def take_releases(self, most: int) -> list[str]:
        """Up to ``most`` names of the current connection whose mappings are gone, to release."""
        with self._lock:
            out, self._releases = self._releases[:most], self._releases[most:]
            return out

    def release_later(self, name: str, epoch: int) -> None:
        """Queue the release of a hold taken at ``epoch`` whose mapping was not kept."""
        with self._lock:
            if epoch == self.epoch:  # an older connection's holds went with it
                self._releases.append(name)

    def pending_releases(self) -> int:
        """How many releases of the current connection wait to be sent."""
        with self._lock:
            return len(self._releases)

    def _forget_locked(self, name: str) -> tuple[str, _Kept]:
        kept = self._kept.pop(name)
        self._bytes -= kept.size
        if kept.key is not None and self._by_key.get(kept.key) == name:
            del self._by_key[kept.key]
        return name, kept

    def _close_unless_used(self, name: str, kept: _Kept) -> None:
        with self._lock:
            if kept.users:
                kept.doomed = True  # the copy reading it closes it when it ends
                return
        self._close(name, kept)

    def _close(self, name: str, kept: _Kept) -> None:
        kept.close()
        with self._lock:
            if kept.epoch == self.epoch:
                self._releases.append(name)
