"""Loads that notice a hung server: cancelled when its published heartbeat stops, not at the deadline.

A same-node lookup answered from the published index notices a hung server within the heartbeat's
staleness bound (0.5 s), but a load already waiting on that server's gRPC stream would wait for its
own deadline — seconds, the prefill it was meant to save. :class:`HangWatch` polls the heartbeat of
the table each in-flight load's namespace is published in (one thread per client, started on first
use, asleep while nothing is in flight) and cancels the loads of a server that stopped beating; the
load then fails as ``CacheUnavailable`` and the connector recomputes, as for any failed load.

A load may also name the moment by which its server's first reply is due (``reply_by``,
:mod:`kvfabric.client.suspicion`): the watch wakes for it and cancels the load if no reply came
(:attr:`Watched.slow`), milliseconds after the hang instead of the staleness bound.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterator
from typing import Protocol

from kvfabric.client.localindex import LocalIndex

log = logging.getLogger(__name__)

__all__ = ["LATE_S", "POLL_SECONDS", "HangWatch"]

POLL_SECONDS = 0.02
"""How often in-flight loads look at their server's heartbeat."""
LATE_S = 0.001
"""How much later than it meant to the watch may wake before it counts the delay as this process's."""


class Cancellable(Protocol):
    """A call that can be cancelled from another thread (a gRPC call object)."""

    def cancel(self) -> bool:
        """Cancel the call."""
        ...


class Watched:
    """One watched call: whether the watch cancelled it, and why."""

    def __init__(self, namespace: str, call: Cancellable, reply_by: float | None = None) -> None:
        self.namespace = namespace
        self.call = call
        self.reply_by = reply_by
        """``time.monotonic()`` by which the server's first reply is due (None: no such bound)."""
        self.replied = False
        self.hung = False
        """Cancelled because the server's heartbeat stopped."""
        self.slow = False
        """Cancelled because the first reply was not there by :attr:`reply_by`."""

    def reply(self) -> None:
        """The server's first reply came: the call is watched for a stopped heartbeat only."""
        self.replied = True


class HangWatch:
    """Cancels watched calls whose server's published heartbeat stopped."""

    def __init__(self, index: LocalIndex, *, poll_seconds: float = POLL_SECONDS) -> None:
        self.index = index
        self.poll = poll_seconds
        self._lock = threading.Lock()
        self._calls: set[Watched] = set()
        self._wake = threading.Event()  # set while calls are in flight
        self._kick = threading.Event()  # a new call, or close()
        self._thread: threading.Thread | None = None
        self._closed = False

    @contextlib.contextmanager
    def watching(
        self, namespace: str, call: Cancellable, *, reply_by: float | None = None
    ) -> Iterator[Watched]:
        """Watch ``call`` (a load of ``namespace``) for as long as the block runs.

        ``reply_by``: cancel it (marked :attr:`Watched.slow`) if :meth:`Watched.reply` was not called
        by then (``time.monotonic()``).
        """
        w = Watched(namespace, call, reply_by)
        with self._lock:
            self._calls.add(w)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="kvfabric-hangwatch", daemon=True)
                self._thread.start()
        self._wake.set()
        self._kick.set()
        try:
            yield w
        finally:
            with self._lock:
                self._calls.discard(w)

    def _run(self) -> None:
        woke_by = math.inf  # when this thread meant to wake last
        while True:
            with self._lock:
                if self._closed:
                    return
                calls = list(self._calls)
                if not calls:
                    self._wake.clear()
            if not calls:
                self._wake.wait()
                woke_by = math.inf
                continue
            now = time.monotonic()
            # Woken late: this process was starved of a core (or of the GIL) that long, and the
            # threads that take a reply in were too: a reply due meanwhile gets that much longer.
            late = now - woke_by if now - woke_by > LATE_S else 0.0
            woke_by = math.inf
            sleep = self.poll
            for w in calls:
                if w.reply_by is not None and not w.replied and not (w.hung or w.slow):
                    if late and now >= w.reply_by:
                        w.reply_by += late
                    if now >= w.reply_by:
                        w.slow = True
                        w.call.cancel()
                        continue
                    sleep = min(sleep, w.reply_by - now)
                # None (no table mapped): unknown, left to the call's own deadline.
                try:
                    hung = not w.hung and self.index.alive(w.namespace) is False
                except Exception:  # the watch must outlive any one check: log it, keep watching
                    log.exception("hang watch: checking the published index failed")
                    continue
                if hung and not w.slow:
                    w.hung = True
                    w.call.cancel()
            # A load that starts meanwhile with an earlier reply bound sets _kick: no oversleeping it.
            woke_by = time.monotonic() + sleep
            self._kick.wait(sleep)
            self._kick.clear()

    def close(self) -> None:
        """Stop the watch thread."""
        with self._lock:
            self._closed = True
        self._kick.set()
        self._wake.set()
