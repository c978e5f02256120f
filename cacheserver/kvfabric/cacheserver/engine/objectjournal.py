"""Journal segments and the clock of the object-store tier (what servers share is only a bucket).

They replace the shared volume's journal files and clock file.

Objects cannot be appended to, so each server writes its events (the same ``P``/``D``/``X`` lines as
the shared volume's journal, :mod:`kvfabric.cacheserver.engine.journal`) in small immutable
*segments*, ``journal/<server_id>/<incarnation>/<seq>``, at most one per poll interval, and deletes
its own segments once they are older than the retention. Every server lists ``journal/`` once per
poll interval (one LIST request, whatever the number of blocks) and reads the segments it has not
seen. A missing sequence number (a reader that was paused past the retention) is reported so the
tier can rebuild its index from a full listing. As on the shared volume the journal is a hint, never
the truth: a stale entry costs a miss, and every read verifies the block.

The clock: each server PUTs ``clock/<server_id>`` and reads its ``Last-Modified`` back, so TTL
buckets follow the object store's clock, never a node's (skewed nodes expire nothing early).
``Last-Modified`` has one-second resolution and is rounded down, which can only make expiry late.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

from kvfabric.cacheserver.engine.journal import Event, format_event, parse_lines
from kvfabric.cacheserver.engine.objectclient import ObjectClient, ObjectMissing, ObjectStoreError

__all__ = ["ObjectClock", "ObjectJournal"]

log = logging.getLogger(__name__)
JOURNAL = "journal"
CLOCK = "clock"


class ObjectClock:
    """Object-store time: the server's ``Last-Modified`` of our clock object, extrapolated locally."""

    def __init__(self, client: ObjectClient, server_id: str) -> None:
        self.client = client
        self.path = f"{CLOCK}/{server_id}"
        self._lock = threading.Lock()
        self._offset: float | None = None  # store time minus time.monotonic()

    def sync(self) -> float | None:
        """Touch the clock object and read its time back; None (and unknown) if the store fails."""
        try:
            t0 = time.monotonic()
            self.client.put(self.path, b"", wait=5.0)
            meta = self.client.head(self.path)
            t1 = time.monotonic()
        except ObjectStoreError as exc:
            log.warning("object-store clock unavailable", extra={"reason": str(exc)})
            with self._lock:
                self._offset = None
            return None
        stamp = meta["last_modified"].timestamp()
        with self._lock:
            # The stamp was taken between t0 and t1; assuming t0 keeps the clock from running ahead.
            self._offset = stamp - t0 if t1 - t0 < 5.0 else None
        return self.now()

    def now(self) -> float | None:
        """Current object-store time, or None when unknown."""
        with self._lock:
            off = self._offset
        return None if off is None else time.monotonic() + off


@dataclass
class _Stream:
    last_seq: int = -1
    segments: list[str] = field(default_factory=list)


class ObjectJournal:
    """This server's journal writer and the reader of everyone else's segments."""

    def __init__(self, client: ObjectClient, server_id: str, *, retention_seconds: float = 120.0) -> None:
        self.client = client
        self.server_id = server_id
        self.incarnation = f"{int(time.time() * 1000):013d}-{os.urandom(4).hex()}"
        self.retention = retention_seconds
        self._lock = threading.Lock()
        self._pending: list[Event] = []
        self._seq = 0
        self._written: list[tuple[float, str]] = []  # (monotonic time, path) of our own segments
        self._streams: dict[str, _Stream] = {}
        self.dropped_events = 0

    # --- writer --------------------------------------------------------------------------------------

    def append(self, events: list[Event]) -> None:
        """Queue events; :meth:`flush` publishes them (the tier calls it every poll interval)."""
        with self._lock:
            self._pending.extend(events)

    def flush(self) -> bool:
        """Write the queued events as one segment and drop expired own segments; False on failure."""
        with self._lock:
            events, self._pending = self._pending, []
        ok = True
        if events:
            path = f"{JOURNAL}/{self.server_id}/{self.incarnation}/{self._seq:012d}"
            body = b"".join(format_event(e) for e in events)
            try:
                self.client.put(path, body, wait=5.0)
                self._seq += 1
                self._written.append((time.monotonic(), path))
            except ObjectStoreError as exc:
                # Lost events cost other servers misses (or stale hits that verify and miss) only.
                self.dropped_events += len(events)
                log.warning("journal segment not written", extra={"reason": str(exc), "events": len(events)})
                ok = False
        cutoff = time.monotonic() - self.retention
        old = [p for t, p in self._written if t < cutoff]
        if old:
            try:
                self.client.delete(old)
                self._written = [(t, p) for t, p in self._written if t >= cutoff]
            except ObjectStoreError:
                ok = False
        return ok

    def close(self) -> None:
        """Flush what is queued (best effort)."""
        self.flush()

    # --- reader --------------------------------------------------------------------------------------

    def _list(self) -> dict[str, list[tuple[int, str]]]:
        streams: dict[str, list[tuple[int, str]]] = {}
        for meta in self.client.list(f"{JOURNAL}/"):
            parts = meta["path"].split("/")
            # <prefix...>/journal/<server>/<incarnation>/<seq>: take the last four.
            if len(parts) < 4 or parts[-4] != JOURNAL or not parts[-1].isdigit():
                continue
            server, inc, seq = parts[-3], parts[-2], int(parts[-1])
            if server == self.server_id and inc == self.incarnation:
                continue
            streams.setdefault(f"{server}/{inc}", []).append((seq, meta["path"]))
        return streams

    def skip_to_end(self) -> None:
        """Mark every existing segment as seen (called before the start-up listing of blocks)."""
        for name, segs in self._list().items():
            self._streams[name] = _Stream(last_seq=max(s for s, _ in segs))

    def poll(self) -> tuple[list[Event], bool]:
        """New events of other servers, and whether a gap means events were missed (then rescan)."""
        events: list[Event] = []
        gap = False
        for name, segs in self._list().items():
            if name.split("/", 1)[0] == self.server_id:
                continue  # an earlier incarnation of this server: the start-up listing covers it
            st = self._streams.setdefault(name, _Stream())
            fresh = sorted(s for s in segs if s[0] > st.last_seq)
            for seq, path in fresh:
                if seq != st.last_seq + 1 and not (st.last_seq == -1 and seq == 0):
                    gap = True
                try:
                    data = self.client.get(self._relative(path), timeout=5.0)
                except ObjectMissing:
                    gap = True  # deleted before we read it
                    st.last_seq = seq
                    continue
                except ObjectStoreError:
                    break  # try again next poll
                events.extend(parse_lines(data))
                st.last_seq = seq
        return events, gap

    def _relative(self, path: str) -> str:
        # Listing returns paths relative to the store's prefix already; keep the journal/... tail.
        i = path.find(f"{JOURNAL}/")
        return path[i:] if i >= 0 else path
