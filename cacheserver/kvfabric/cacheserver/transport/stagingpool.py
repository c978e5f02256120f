"""Staging memfds allocated ahead of the stores that will take them (the arena's pool).

The most expensive server step of a same-node store is the page allocation of its staging memfds
(``fallocate``: the kernel allocates and zeroes every page). The pool moves it off
``ShmStoreBegin``: a thread of the arena (:class:`~kvfabric.cacheserver.transport.arena.StagingArena`)
keeps a few memfds allocated, of the lengths recent begins asked for, and a begin hands those out.

What this module decides, without locks or I/O (the arena's lock guards it): which lengths to keep
and how many of each, which memfd a begin takes, which ones are surplus. The memfds it holds are
ones no client has seen; a memfd handed out belongs to its lease from then on (sealed into a block,
or emptied and closed) and never comes back here. Pooled memfds are charged to the arena's budget
like leased ones.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["PAGE", "StagingPool", "charge"]

PAGE = 4096
MAX_LENGTHS = 4
"""Distinct lengths kept (an engine stores whole chunks of one length, and a tail of another)."""


def charge(length: int) -> int:
    """Bytes of the arena's budget a staging memfd of ``length`` takes (at least a page)."""
    return max(length, PAGE)


class StagingPool:
    """Pre-allocated staging memfds by length, and how many of each length to keep.

    Not thread-safe: the arena calls it under its lock.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        """Charge of the memfds held."""
        self._fds: dict[int, list[int]] = {}
        # length -> memfds wanted (the most keys of that length one begin asked for), most recent last.
        self._wanted: OrderedDict[int, int] = OrderedDict()

    @property
    def count(self) -> int:
        """Memfds held."""
        return sum(len(v) for v in self._fds.values())

    def take(self, length: int) -> int | None:
        """A held memfd of exactly ``length`` bytes (its charge leaves the pool), or None."""
        fds = self._fds.get(length)
        if not fds:
            return None
        fd = fds.pop()
        self.bytes -= charge(length)
        return fd

    def want(self, lengths: list[int]) -> None:
        """Remember what one begin asked for: the next begins are likely to ask the same."""
        counts: dict[int, int] = {}
        for n in lengths:
            if n > 0:
                counts[n] = counts.get(n, 0) + 1
        for n, k in counts.items():
            self._wanted[n] = max(k, self._wanted.pop(n, 0))
        while len(self._wanted) > MAX_LENGTHS:
            self._wanted.popitem(last=False)

    def _allotment(self) -> dict[int, int]:
        """Memfds to keep per length: the most recent lengths first, within ``max_bytes``."""
        left, out = self.max_bytes, {}
        for n in reversed(self._wanted):
            k = min(self._wanted[n], left // charge(n))
            out[n] = k
            left -= k * charge(n)
        return out

    def surplus(self) -> tuple[int, int] | None:
        """``(length, fd)`` of a held memfd beyond its length's allotment (removed), or None."""
        allot = self._allotment()
        for n, fds in self._fds.items():
            if fds and len(fds) > allot.get(n, 0):
                self.bytes -= charge(n)
                return n, fds.pop()
        return None

    def next_fill(self) -> int | None:
        """The length to allocate next (most recent first), or None while the pool holds its allotment."""
        allot = self._allotment()
        for n in reversed(self._wanted):
            if len(self._fds.get(n, ())) < allot.get(n, 0):
                return n
        return None

    def add(self, length: int, fd: int) -> None:
        """Hold a freshly allocated memfd of ``length`` bytes (charged to the pool)."""
        self._fds.setdefault(length, []).append(fd)
        self.bytes += charge(length)

    def evict(self) -> tuple[int, int] | None:
        """``(length, fd)`` of a held memfd to free for a begin's room, least recent length first."""
        for n in list(self._fds):
            if n not in self._wanted:
                fds = self._fds[n]
                if fds:
                    self.bytes -= charge(n)
                    return n, fds.pop()
        for n in self._wanted:
            if self._fds.get(n):
                fds = self._fds[n]
                self.bytes -= charge(n)
                return n, fds.pop()
        return None

    def drain(self) -> list[tuple[int, int]]:
        """Every held ``(length, fd)`` (removed); the pool forgets what it wanted."""
        out = [(n, fd) for n, fds in self._fds.items() for fd in fds]
        self._fds.clear()
        self._wanted.clear()
        self.bytes = 0
        return out
