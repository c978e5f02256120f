"""A same-node server that does not answer in time is *suspect*: give up on it in milliseconds.

A load waits for the server's first reply (the ``ShmLoad`` stream's headers, a block-socket answer).
A same-node server that runs sends it within a millisecond or so; a hung one never does, and its
published heartbeat only reads as stopped after the staleness bound (0.5 s), which a first request
after the hang would pay in full. So each client keeps a :class:`ReplyClock` — a high percentile of
its recent first-reply latencies (the second slowest of the last 64) — and gives a load up once
``max(floor, factor x that)`` passed
without a reply. The load fails (the connector recomputes what was not loaded) and the server turns
suspect (:class:`Suspicion`): its lookups and loads fail at once, with no table probe and no call,
until its heartbeat is seen to advance past the moment of suspicion (it was only slow: cleared) or
goes stale (it is hung: the published index's own check says so from then on).

A false suspicion — a live server delayed past the bound, on a loaded machine — costs one request's
hit and the lookups of about one heartbeat period (50 ms), never a wrong answer; and it doubles the
floor in use (:meth:`ReplyClock.missed`), so a machine too loaded for the floor stops paying it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from enum import Enum

__all__ = ["REPLY_FACTOR", "REPLY_FLOOR_S", "ReplyClock", "Suspicion", "Verdict", "verdict"]

REPLY_FLOOR_S = 0.025
"""The shortest wait for a first reply (seconds). A live same-node server answers in well under a
millisecond when idle, but a busy Python thread in it delays an answer by the interpreter's switch
interval (5 ms) per thread ahead of it: measured p50 5.1 ms with one busy thread, so a 3 ms floor
turned a neighbour's lookup flood into false suspicions. 25 ms leaves room for a few such waits."""
REPLY_FACTOR = 4.0
"""How many times the recent high-percentile reply latency a load waits before giving up."""
_WINDOW = 64
_QUANTILE = 0.98  # of 64 replies, the second slowest: the tail, less one outlier
_RELAX_AFTER = 1024
"""Replies in time after which a floor doubled by a false suspicion is halved again: slowly, since a
machine that delayed a live server past the floor once is likely to do it again."""
_RELAX_AFTER_S = 60.0
"""Or this long since the floor last changed, with replies in time meanwhile: an engine with few
loads does not keep a doubled floor for thousands of them."""


class ReplyClock:
    """How long to wait for a server's first reply: ``max(floor, factor x p98 of recent replies)``.

    Capped at ``ceiling`` (the staleness bound: beyond it the heartbeat tells anyway). A false
    suspicion (:meth:`missed`: the server was slow, not hung) doubles the floor in use, up to the
    ceiling, so a machine too loaded for the configured floor pays for it a few times, not on every
    request; each ``relax_after`` replies in time, or ``relax_after_s`` seconds with replies in time,
    halve it again, down to the configured floor.
    Thread-safe.
    """

    def __init__(
        self,
        *,
        floor_s: float = REPLY_FLOOR_S,
        factor: float = REPLY_FACTOR,
        ceiling_s: float = 0.5,
        window: int = _WINDOW,
        relax_after: int = _RELAX_AFTER,
        relax_after_s: float = _RELAX_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < floor_s <= ceiling_s:
            raise ValueError(f"reply floor {floor_s!r} s must be > 0 and <= the ceiling {ceiling_s!r} s")
        if factor < 1:
            raise ValueError(f"reply factor {factor!r} must be >= 1")
        self.floor = floor_s
        self.factor = factor
        self.ceiling = ceiling_s
        self.relax_after = relax_after
        self.relax_after_s = relax_after_s
        self._now = clock
        self._changed = clock()  # when the floor in use last changed
        self._recent: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._floor_now = floor_s
        self._in_time = 0  # replies since the floor in use last changed
        self._bound = floor_s

    def record(self, seconds: float) -> None:
        """Count one first reply that took ``seconds``."""
        with self._lock:
            self._recent.append(max(0.0, seconds))
            self._in_time += 1
            if self._floor_now > self.floor and (
                self._in_time >= self.relax_after or self._now() - self._changed >= self.relax_after_s
            ):
                self._floor_now = max(self.floor, self._floor_now / 2)
                self._in_time = 0
                self._changed = self._now()
            self._update()

    def missed(self) -> None:
        """A suspicion turned out false (the server was slow): wait longer from now on."""
        with self._lock:
            self._floor_now = min(self.ceiling, self._floor_now * 2)
            self._in_time = 0
            self._changed = self._now()
            self._update()

    def _update(self) -> None:
        high = 0.0
        if self._recent:
            ordered = sorted(self._recent)
            high = ordered[min(len(ordered) - 1, int(_QUANTILE * len(ordered)))]
        self._bound = min(self.ceiling, max(self._floor_now, self.factor * high))

    def bound(self) -> float:
        """Seconds to wait for the next first reply."""
        return self._bound


class Verdict(Enum):
    """What a suspect server's heartbeat says now."""

    SUSPECT = "suspect"
    CLEARED = "cleared"  # it beat after the suspicion: it was only slow
    HUNG = "hung"  # no beat for the staleness bound: the published index reports it from now on


def verdict(since_ns: int, heartbeat_ns: int | None, now_ns: int, stale_ns: int) -> Verdict:
    """The verdict on a server suspected at ``since_ns`` whose last heartbeat is ``heartbeat_ns``.

    Hung once the heartbeat is stale (as the published index judges it); ``heartbeat_ns`` None (no
    table mapped to read it from): suspect until the staleness bound passed since the suspicion.
    """
    if heartbeat_ns is not None and heartbeat_ns > since_ns:
        return Verdict.CLEARED
    if now_ns - (since_ns if heartbeat_ns is None else heartbeat_ns) > stale_ns:
        return Verdict.HUNG
    return Verdict.SUSPECT


class Suspicion:
    """Whether a client's server is suspect, and how suspicions ended (counters). Thread-safe."""

    def __init__(self, stale_ns: int, on_cleared: Callable[[], None] | None = None) -> None:
        """``on_cleared``: called when a suspicion turns out false (:meth:`ReplyClock.missed`)."""
        self.stale_ns = stale_ns
        self._on_cleared = on_cleared
        self._lock = threading.Lock()
        self._since: int | None = None
        self._namespace = ""
        self.suspected = 0
        """Loads given up for want of a first reply (each made the server suspect)."""
        self.cleared = 0
        """Suspicions the heartbeat cleared (the server was slow, not hung: a false suspicion)."""
        self.confirmed = 0
        """Suspicions that ran into the staleness bound (the server was hung)."""

    def suspect(self, namespace: str, now_ns: int) -> None:
        """A load of ``namespace`` got no first reply in time (at ``now_ns``)."""
        with self._lock:
            self.suspected += 1
            if self._since is None:
                self._since = now_ns
                self._namespace = namespace

    def active(self, heartbeat: Callable[[str], int | None], now_ns: int) -> bool:
        """Whether the server is suspect now; ``heartbeat(namespace)`` reads its published heartbeat."""
        since = self._since
        if since is None:  # the common case: no lock, no read
            return False
        with self._lock:
            since = self._since
            if since is None:
                return False
            v = verdict(since, heartbeat(self._namespace), now_ns, self.stale_ns)
            if v is Verdict.SUSPECT:
                return True
            if v is Verdict.CLEARED:
                self.cleared += 1
                if self._on_cleared is not None:
                    self._on_cleared()
            else:
                self.confirmed += 1
            self._since = None
            return False
