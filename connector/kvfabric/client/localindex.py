"""Answering lookups from the index the same-node cache server publishes, without a call.

The server hands each namespace's table to a client as a read-only memfd over its index socket
(:mod:`kvfabric.cacheserver.transport.indexpub`, layout :mod:`kvfabric.rpc.indextable`); the client maps it
read-only and answers ``lookup`` in microseconds. :meth:`LocalIndex.lookup` returns None whenever it
cannot answer (no table yet, the table was replaced and cannot be fetched again now, the writer kept
changing it): the caller then asks over gRPC, as remote clients always do. A table whose server
hung up its index socket (the process died) or whose heartbeat stopped (a hung server) raises
:class:`CacheUnavailable` at once, so a dead or hung server costs a lookup microseconds, not its
deadline. A false positive (a fingerprint collision, or a block
evicted after the answer) is a load miss, which the connector already handles.

The lookups answered from a table are reported to the server in batches (at most one small write per
``report_interval_s`` and table, on the connection that holds the table, never waiting), so its
lookup metrics and the pool's hit rate count them as they count RPC lookups; a server too old to
count them is sent none.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvfabric.client.errors import CacheUnavailable
from kvfabric.client.results import LookupResult
from kvfabric.rpc import fdpass
from kvfabric.rpc import indextable as it

try:  # numpy comes with the engine extra (and vLLM); without it, the reference probe answers
    from kvfabric.client import indexprobe

    VECTOR_PROBE = True
except ImportError:  # pragma: no cover - every test environment has numpy
    VECTOR_PROBE = False

if TYPE_CHECKING:
    from kvfabric.client.indexprobe import Words

__all__ = ["VECTOR_PROBE", "LocalIndex"]

_ATTEMPTS = 4  # seqlock retries before handing the lookup to the RPC
_NAMES = ("", *(it.TIER_NAMES[c] for c in (1, 2, 3)))


@dataclass(slots=True)
class _Mapped:
    map: mmap.mmap
    words: memoryview
    epoch: int
    conn: socket.socket
    """The connection the table came over: the server keeps it open while it lives."""
    poll: select.poll
    slots: Words | None = None
    """The table's slots as a numpy array (:func:`indexprobe.slots_of`), None without numpy."""
    reports: bool = False
    """Whether the server counts the lookups reported on ``conn``."""
    counts: list[int] = field(default_factory=lambda: [0, 0, 0])
    """Lookups, hit keys and missed keys answered from the table and not reported yet."""
    reported_at: int = field(default_factory=time.monotonic_ns)
    unsent: bytes = b""
    lock: threading.Lock = field(default_factory=threading.Lock)
    polling: threading.Lock = field(default_factory=threading.Lock)
    """Held around :attr:`poll`: one ``select.poll`` object raises if two threads poll it at once
    (a lookup and the hang watch, which share a client's table)."""

    def poll_now(self) -> list[tuple[int, int]] | None:
        """The connection's events now (non-blocking); None while another thread is polling it."""
        if not self.polling.acquire(blocking=False):
            return None
        try:
            return self.poll.poll(0)
        finally:
            self.polling.release()

    def count(self, hits: int, keys: int, now_ns: int, interval_ns: int) -> None:
        """Count one lookup answered from the table; report the batch once ``interval_ns`` passed."""
        with self.lock:
            c = self.counts
            c[0] += 1
            c[1] += hits
            c[2] += keys - hits
            if now_ns - self.reported_at >= interval_ns:
                self._report(now_ns)

    def report(self) -> None:
        """Report what was counted now (before the connection is closed, or for a test)."""
        with self.lock:
            self._report(time.monotonic_ns())

    def _report(self, now_ns: int) -> None:
        # Never waits: a full socket buffer keeps the rest for the next report, a broken connection
        # loses the batch (metrics, not answers).
        self.reported_at = now_ns
        c = self.counts
        data = self.unsent + (it.encode_report(*c) if c[0] else b"")
        self.counts = [0, 0, 0]
        if not data:
            return
        try:
            sent = self.conn.send(data, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except BlockingIOError:
            sent = 0
        except OSError:
            sent = len(data)
        self.unsent = data[sent:]

    def server_gone(self) -> bool:
        """Whether the server hung up (its process exited): one non-blocking poll.

        False while another thread polls the connection: that one sees the hang-up.
        """
        return bool(self.poll_now())

    def evicted(self) -> bool:
        """Whether the server closed this connection to make room for another client's (it still serves)."""
        try:
            notice = self.conn.recv(len(it.EVICTED), socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:
            return False
        return notice == it.EVICTED

    def hang_up(self) -> None:
        """Report what is counted, then close the connection (the mapping stays: a reader may use it)."""
        if self.reports:
            self.report()
        self.conn.close()

    def close(self) -> None:
        self.slots = None  # its view of the mapping must go before the mapping can be closed
        self.words.release()
        with contextlib.suppress(BufferError):
            self.map.close()
        self.hang_up()


class LocalIndex:
    """The published tables of one server, mapped on demand per namespace. Thread-safe."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        stale_after_s: float = 0.5,
        fetch_timeout_s: float = 0.25,
        refetch_interval_s: float = 1.0,
        report_interval_s: float = 1.0,
    ) -> None:
        """``socket_path`` is the server's index socket; ``stale_after_s`` how old a heartbeat may be."""
        self.path = Path(socket_path)
        self.stale_ns = int(stale_after_s * 1e9)
        self.fetch_timeout = fetch_timeout_s
        self.refetch_interval = refetch_interval_s
        self.report_ns = int(report_interval_s * 1e9)
        self._maps: dict[str, _Mapped] = {}
        self._next_fetch: dict[str, float] = {}
        self._fetching: set[str] = set()
        self._closed = False  # a background fetch that ends after close() closes what it mapped
        self._lock = threading.Lock()
        self.answered = 0
        """Lookups answered from a table (for benchmarks and tests)."""
        self.epoch: int | None = None
        """The epoch (a random number per server process) of the table mapped last."""
        self.restarts = 0
        """How often the server process ended (hung up) or a table came from another one (a restart).

        Not counted: a hung server (a stale heartbeat), which is the same process when it recovers."""

    def lookup(self, namespace: str, raw_keys: bytes, *, fetch: bool = True) -> LookupResult | None:
        """Leading present keys of ``raw_keys`` (the keys' 32-byte digests, concatenated), or None.

        None means "ask over RPC". Raises :class:`CacheUnavailable` when the server hung up or its
        heartbeat stopped. ``fetch=False``: never talk to the server (a table not mapped yet, or
        replaced, is None): for callers on a latency-critical thread.
        """
        m = self._maps.get(namespace)
        if m is None:
            if not fetch:
                return None
            m = self._fetch_now(namespace)
            if m is None:
                return None
        fps: Words | list[int] = (
            indexprobe.fingerprint_array(raw_keys) if VECTOR_PROBE else it.fingerprints_raw(raw_keys)
        )
        words = m.words
        for _ in range(_ATTEMPTS):
            if words[it.W_STATE] != it.LIVE:
                # Replaced (grown) or its server stopped: fetch the current table once.
                if not fetch:
                    return None
                m = self._replace(namespace, m)
                if m is None:
                    return None
                words = m.words
                continue
            try:
                slots = m.slots  # (read once: close() on another thread drops it)
                if slots is None or isinstance(fps, list):  # without numpy: the reference probe
                    tiers = list(map(_NAMES.__getitem__, it.lookup_prefix(words, list(fps))))
                else:
                    tiers = indexprobe.tier_names(indexprobe.lookup_prefix(words, slots, fps))
            except it.Inconsistent:
                continue
            if words[it.W_STATE] != it.LIVE:
                # Retired after the check above but before the probe read the sequence counter: the
                # probe read the old table consistently, and what it found may be gone from the new.
                continue
            if m.server_gone():
                evicted = m.evicted()  # read before the connection is closed
                self._drop(namespace, m)
                if evicted:  # the server lives: ask over RPC, fetch the table again later
                    return None
                self.restarts += 1  # its successor, if any, is another process
                raise CacheUnavailable("the cache server closed its index socket (it exited)")
            now = time.monotonic_ns()
            age = now - words[it.W_HEARTBEAT]
            if age > self.stale_ns:
                self._refetch_later(namespace)
                raise CacheUnavailable(
                    f"the cache server's published index has had no heartbeat for {age / 1e6:.0f} ms"
                )
            self.answered += 1
            if m.reports:
                m.count(len(tiers), len(fps), now, self.report_ns)
            return LookupResult(len(tiers), tiers)
        return None

    def alive(self, namespace: str) -> bool | None:
        """Whether the server publishing ``namespace``'s table still beats (None: no table mapped).

        False once it hung up or its heartbeat is older than ``stale_after_s``; None as well when the
        server closed the table's connection for another client's (it still serves). No lock, and a
        syscall only when the connection is readable: for a watchdog polling it while a load waits.
        """
        m = self._maps.get(namespace)
        if m is None or m.words[it.W_STATE] != it.LIVE:
            # No table, or one the server replaced (grown: only live tables are stamped): unknown.
            return None
        events = m.poll_now() or []  # (busy: another thread is polling it; the heartbeat still tells)
        if any(ev & select.POLLNVAL for _, ev in events):
            return None  # that table's connection was closed here (replaced meanwhile): unknown
        if events:
            # Readable: the server hung up, or closed this connection to make room for another
            # client's (it still serves: a load waiting on it must not be given up for that).
            return None if m.evicted() else False
        return time.monotonic_ns() - m.words[it.W_HEARTBEAT] <= self.stale_ns

    def heartbeat(self, namespace: str) -> int | None:
        """The last heartbeat (``time.monotonic_ns()``) of ``namespace``'s live table; None if none mapped.

        One word read, no lock, no syscall: how a suspect server is seen to be alive again
        (:mod:`kvfabric.client.suspicion`).
        """
        m = self._maps.get(namespace)
        if m is None or m.words[it.W_STATE] != it.LIVE:
            return None
        return int(m.words[it.W_HEARTBEAT])

    # --- fetching tables -----------------------------------------------------------------------------

    def _fetch_now(self, namespace: str) -> _Mapped | None:
        now = time.monotonic()
        if now < self._next_fetch.get(namespace, 0.0):
            return None
        with self._lock:
            m = self._maps.get(namespace)
            if m is not None:
                return m
            m = self._fetch(namespace)
            if m is None:
                self._next_fetch[namespace] = time.monotonic() + self.refetch_interval
                return None
            if self._closed:
                # Closed while this thread fetched (a start-up warm-up on an I/O thread, say):
                # nobody would close what it mapped.
                m.close()
                return None
            self._install(namespace, m)
            return m

    def _install(self, namespace: str, m: _Mapped) -> None:
        # Under the lock. Another epoch is another server process: it knows none of what this
        # process's clients told the old one (namespace descriptions), which the client sends again.
        self._maps[namespace] = m
        if self.epoch is not None and m.epoch != self.epoch:
            self.restarts += 1
        self.epoch = m.epoch

    def _replace(self, namespace: str, old: _Mapped) -> _Mapped | None:
        with self._lock:
            if self._maps.get(namespace) is old:
                del self._maps[namespace]
                self._next_fetch.pop(namespace, None)
        # The mapping is left to the garbage collector: another thread may still be reading it.
        old.hang_up()
        return self._fetch_now(namespace)

    def _drop(self, namespace: str, old: _Mapped) -> None:
        # The server is gone: forget its table; fetch again (a successor) at most once per interval.
        with self._lock:
            if self._maps.get(namespace) is old:
                del self._maps[namespace]
            self._next_fetch[namespace] = time.monotonic() + self.refetch_interval
        old.conn.close()

    def _refetch_later(self, namespace: str) -> None:
        # A stale table: perhaps a new server process answers the socket now. Try in the background
        # (at most once per interval), never on the lookup's path: a hung server's socket still
        # accepts connections and would cost the fetch timeout.
        now = time.monotonic()
        with self._lock:
            if namespace in self._fetching or now < self._next_fetch.get(namespace, 0.0):
                return
            self._fetching.add(namespace)
            self._next_fetch[namespace] = now + self.refetch_interval

        def run() -> None:
            try:
                m = self._fetch(namespace)
                if m is not None:
                    with self._lock:
                        old = self._maps.get(namespace)
                        if self._closed:
                            m.close()  # the reader was closed meanwhile: nobody would close it
                        elif old is None or old.epoch != m.epoch or old.words[it.W_STATE] != it.LIVE:
                            self._install(namespace, m)
                            if old is not None:
                                old.hang_up()
                        else:
                            m.conn.close()
            finally:
                with self._lock:
                    self._fetching.discard(namespace)

        threading.Thread(target=run, name="kvfabric-index-fetch", daemon=True).start()

    def _fetch(self, namespace: str) -> _Mapped | None:
        """Ask the index socket for ``namespace``'s table and map it read-only; None on any failure."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.settimeout(self.fetch_timeout)
            s.connect(str(self.path))
            s.sendall(it.REQUEST_PREFIX + namespace.encode("ascii") + b"\n")
            msg, fds, _flags = fdpass.recv_fds(s, 128, 1)
        except OSError:
            s.close()
            return None
        mapped = self._map(msg, fds, s)
        if mapped is None:
            s.close()
        return mapped

    def _map(self, msg: bytes, fds: list[int], conn: socket.socket) -> _Mapped | None:
        if not fds:
            return None
        fd = fds[0]
        try:
            if msg[:1] != b"\x00":
                return None
            reports = msg[:2] == it.REPORTS_ACCEPTED
            size = os.fstat(fd).st_size
            if size < it.table_bytes(2):
                return None
            mp = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError:
            return None
        finally:
            for extra in fds:
                os.close(extra)
        words = memoryview(mp).cast("Q")
        hdr = it.header(words)
        if hdr["magic"] != it.MAGIC or hdr["version"] != it.VERSION or it.table_bytes(hdr["capacity"]) > size:
            words.release()
            mp.close()
            return None
        poll = select.poll()
        poll.register(conn, select.POLLIN | select.POLLHUP | select.POLLERR)
        slots = indexprobe.slots_of(mp, hdr["capacity"]) if VECTOR_PROBE else None
        return _Mapped(mp, words, hdr["epoch"], conn, poll, slots, reports)

    def close(self) -> None:
        """Unmap every table (and any a background fetch still brings)."""
        with self._lock:
            self._closed = True
            maps = list(self._maps.values())
            self._maps.clear()
        for m in maps:
            m.close()
