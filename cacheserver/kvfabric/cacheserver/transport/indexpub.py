"""Publishing the lookup index to same-node engines: one sealed, read-only memfd table per namespace.

The table layout is :mod:`kvfabric.rpc.indextable`. This module owns the tables on the server side:

* :class:`IndexPublisher` keeps one table per namespace in a memfd. The store calls
  :meth:`IndexPublisher.changed` after every change to a block's membership (put, delete, eviction,
  expiry, a promotion, another server's journal); the publisher asks the store for the block's
  fastest tier *then* (under its lock, so the last writer always publishes the latest truth) and
  writes the slot before the store acknowledges anything. A table that would pass a quarter full is
  copied into one twice the size, which is then handed out, and the old one is marked retired.
  A heartbeat thread stamps every table, so a reader can tell a hung or dead server from a live one.
* :class:`IndexSocket` serves the tables over a Unix socket next to the gRPC socket
  (:func:`kvfabric.rpc.indextable.index_socket_for`): a client sends ``KVIX1 <namespace>`` and a newline and
  receives a read-only descriptor of that namespace's table (``SCM_RIGHTS``); the connection then
  stays open, so a client sees this process die at once (a hang up) rather than after a heartbeat
  timeout. Only a namespace the server knows (it holds a block of it, or a client described it over
  gRPC) gets a table, at most :data:`MAX_TABLES` of them, the one asked for least recently giving
  way, and empty idle ones are reclaimed (:mod:`~kvfabric.cacheserver.transport.indexregistry`);
  any refusal sends the client to the RPC lookup. Held connections are bounded per peer
  (:data:`MAX_CONNECTIONS_PER_PEER`) and in all (:data:`MAX_CONNECTIONS`): at either bound the
  oldest held connection of the peer holding the most goes (told
  :data:`~kvfabric.rpc.indextable.EVICTED` first), so a client that hoards connections cannot
  keep an engine from its table. One thread serves every client without blocking on any (epoll):
  a request has :data:`REQUEST_DEADLINE_SECONDS` from the accept to arrive whole. The memfd is sealed
  against growing, shrinking and any *new* writable mapping (``F_SEAL_FUTURE_WRITE``), and the
  descriptor sent is a read-only reopening of it, so no client can write the table others read.
  ``authorize(namespace, peer)`` (the peer's ``SO_PEERCRED``) decides which namespaces a peer may
  see; it allows all by default, like the gRPC socket today.
  With ``on_lookups``, a client holding a table reports the lookups it answered from it, in batches
  on that connection (:data:`~kvfabric.rpc.indextable.REPORT_PREFIX`), and the server adds them to the
  lookup counters an RPC lookup feeds: its metrics and the pool's hit rate see same-node lookups.
  Reports are bounded per connection (:class:`~kvfabric.rpc.indextable.ReportBudget`) to what the
  client could have done with RPC lookups; a line beyond that is dropped and counted
  (``on_report_dropped(reason)``), and the connection kept.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.transport.indexregistry import Admit, TableRegistry, connection_to_evict
from kvfabric.cacheserver.transport.socketfile import SocketFile
from kvfabric.rpc import indextable as it

__all__ = ["IndexPublisher", "IndexSocket", "Peer", "listen_unix", "peer_bound", "peer_key", "peer_of"]

log = logging.getLogger(__name__)

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1
HEARTBEAT_SECONDS = 0.05
MAX_CONNECTIONS = 1024  # connections holding a table: engine processes x namespaces on one node, far fewer
MAX_CONNECTIONS_PER_PEER = 64  # held by one process (namespaces an engine uses at once: a few)
MAX_PENDING = 128  # connections whose request has not arrived yet (the oldest is closed past this)
MAX_REQUEST = 128  # bytes: the prefix, a 64-character namespace and the newline fit
REQUEST_DEADLINE_SECONDS = 1.0  # from accept to the whole request, however it trickles in
MAX_TABLES = 256  # namespaces with a table (a descriptor each); see indexregistry
TABLE_IDLE_SECONDS = 60.0  # an empty table no connection holds is dropped this long after its last use
RECLAIM_INTERVAL_SECONDS = 1.0
_SLOT_FP = ~3  # a slot holds the fingerprint with its low 2 bits replaced by the tier code
REPORT_READ_BYTES = 4096  # per wake and held connection: a flood of reports delays no other client
IDLE_WAKE_SECONDS = 0.25  # the serving loop wakes at least this often (expiry, stop)
ACCEPTS_PER_WAKE = 64
ACCEPT_PAUSE_SECONDS = 0.1  # after a failed accept (EMFILE...): the listener is not watched meanwhile


@dataclass(frozen=True, slots=True)
class Peer:
    """The credentials of a client process on the index socket (``SO_PEERCRED``)."""

    pid: int
    uid: int
    gid: int


class _Table:
    """One namespace's memfd, mapped writable by the server only."""

    def __init__(self, namespace: str, capacity: int, epoch: int) -> None:
        self.namespace = namespace
        size = it.table_bytes(capacity)
        self.fd = os.memfd_create(f"kvfabric-index-{namespace[:16]}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self.words = memoryview(self.map).cast("Q")
            it.init_table(self.words, capacity, epoch, time.monotonic_ns())
            self.writer = it.TableWriter(self.words)
            _seal(self.fd)
        except BaseException:
            os.close(self.fd)
            raise

    def read_only_fd(self) -> int:
        """A new read-only descriptor of the table (the caller closes it); ``OSError`` if none can be made.

        A fresh open file description without write access: mmap(PROT_WRITE) on it fails even where
        F_SEAL_FUTURE_WRITE is not available. There is no fallback: a duplicate of the server's own
        descriptor would be writable, so without /proc the request is refused (the client asks over RPC).
        """
        fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY:
            os.close(fd)
            raise PermissionError("the reopened table descriptor is not read-only")
        return fd

    def close(self) -> None:
        self.words.release()
        with contextlib.suppress(BufferError):
            self.map.close()
        os.close(self.fd)


def _seal(fd: int) -> None:
    seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
    except OSError:
        # A kernel without F_SEAL_FUTURE_WRITE: the read-only descriptor still keeps clients out.
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals | fcntl.F_SEAL_SEAL)


class IndexPublisher:
    """The server's published index: one table per namespace, kept equal to the store's index.

    Which namespaces get a table, how many, and when one is dropped is
    :class:`~kvfabric.cacheserver.transport.indexregistry.TableRegistry`'s policy.
    """

    def __init__(
        self,
        resolve: Callable[[BlockId], str | None],
        *,
        known: Callable[[str], bool] | None = None,
        initial_capacity: int = 1024,
        max_tables: int = MAX_TABLES,
        idle_seconds: float = TABLE_IDLE_SECONDS,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
    ) -> None:
        """``resolve(bid)``: the fastest tier holding ``bid`` now (index only), or None.

        ``known(namespace)``: whether a client described ``namespace`` over gRPC; an empty namespace
        gets a table only then (default: never; a namespace with blocks always may).
        """
        self._resolve = resolve
        self._known = known or (lambda namespace: False)
        self._initial = initial_capacity
        self._heartbeat = heartbeat_seconds
        self.epoch = secrets.randbits(64)
        self._lock = threading.Lock()
        self._registry = TableRegistry(max_tables, idle_seconds)
        self._tables: dict[str, _Table] = {}
        self._lineage: dict[str, int] = {}  # namespace -> serial of its registry entry (holds follow it)
        # Namespaces holding blocks but no table (evicted, or none free when their blocks came):
        # slot fingerprint (low 2 bits clear) -> tier code, kept current, so a table made for them
        # again lists every block.
        self._offline: dict[str, dict[int, int]] = {}
        self._serial = 0
        self._retired: list[_Table] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reclaimed = 0
        """Tables dropped because they were empty and idle, or evicted for another namespace."""

    # --- writes --------------------------------------------------------------------------------------

    def changed(self, bids: Iterable[BlockId]) -> None:
        """Republish ``bids`` as the store holds them now (call after every membership change)."""
        now = time.monotonic()
        with self._lock:
            for bid in bids:
                tier = self._resolve(bid)
                ns = bid.namespace
                table = self._tables.get(ns)
                fp = it.fingerprint(bid.key)
                code = it.TIER_CODES[tier] if tier is not None else 0
                if table is None:
                    if tier is None:
                        self._forget_offline(ns, fp & _SLOT_FP)
                        continue
                    decision = self._registry.block_added(ns, now=now)
                    if decision.admit is not Admit.CREATE:
                        # No place free: kept aside until a client asks for this namespace's table.
                        self._offline.setdefault(ns, {})[fp & _SLOT_FP] = code
                        continue
                    table = self._create(ns, decision.evicted)
                if code and table.writer.needs_growth() and not table.writer.get(fp):
                    table = self._grow(table)
                table.writer.set(fp, code)
                if code:
                    self._registry.block_added(ns, now=now)
                elif table.writer.count == 0:
                    self._registry.emptied(ns, now=now)

    def _forget_offline(self, namespace: str, fp: int) -> None:
        blocks = self._offline.get(namespace)
        if blocks is not None:
            blocks.pop(fp, None)
            if not blocks:
                del self._offline[namespace]

    def _create(self, namespace: str, evicted: Iterable[str]) -> _Table:
        for gone in evicted:
            self._drop(gone)
        blocks = self._offline.pop(namespace, {})
        capacity = self._initial
        while it.MAX_FILL * (len(blocks) + 1) > capacity:  # room for the next block
            capacity *= 2
        table = _Table(namespace, capacity, self.epoch)
        table.writer.load([fp | code for fp, code in blocks.items()])
        self._tables[namespace] = table
        self._serial += 1
        self._lineage[namespace] = self._serial
        return table

    def _drop(self, namespace: str) -> None:
        """Retire and release ``namespace``'s table (its readers keep their own mapping and fetch again)."""
        table = self._tables.pop(namespace)
        self._lineage.pop(namespace, None)
        listed = table.writer.items()
        if listed:  # evicted with blocks: they stay in the store, and in its next table
            self._offline[namespace] = {v & _SLOT_FP: v & 3 for v in listed}
        table.writer.retire()
        table.close()
        self.reclaimed += 1

    def _grow(self, old: _Table) -> _Table:
        new = _Table(old.namespace, old.writer.capacity * 2, self.epoch)
        new.writer.load(old.writer.items())
        self._tables[old.namespace] = new
        old.writer.retire()
        self._retired.append(old)  # kept mapped: readers still hold it until they refetch
        for gone in self._retired[:-8]:
            gone.close()
        del self._retired[:-8]
        return new

    # --- reads ---------------------------------------------------------------------------------------

    def request(self, namespace: str) -> tuple[int, int] | Admit:
        """A read-only descriptor of ``namespace``'s table and its hold token, or why there is none.

        The caller closes the descriptor and, while its connection stays open, has the table held:
        it calls :meth:`release` with the token when that connection closes. Raises ``OSError`` when
        no read-only descriptor can be made (nothing is held then).
        """
        with self._lock:
            decision = self._registry.request(
                namespace,
                known=self._known(namespace),
                populated=namespace in self._offline,
                now=time.monotonic(),
            )
            if decision.admit is Admit.CREATE:
                self._create(namespace, decision.evicted)
            elif decision.admit is not Admit.SERVE:
                return decision.admit
            fd = self._tables[namespace].read_only_fd()
            self._registry.hold(namespace)
            return fd, self._lineage[namespace]

    def release(self, namespace: str, token: int) -> None:
        """A connection handed ``namespace``'s table (``token`` from :meth:`request`) closed."""
        with self._lock:
            if self._lineage.get(namespace) == token:
                self._registry.release(namespace, now=time.monotonic())

    def table_fd(self, namespace: str) -> int | None:
        """A read-only descriptor of ``namespace``'s table, or None (refused); not held (tests)."""
        got = self.request(namespace)
        if isinstance(got, Admit):
            return None
        self.release(namespace, got[1])
        return got[0]

    def namespaces(self) -> list[str]:
        """Namespaces with a table."""
        with self._lock:
            return sorted(self._tables)

    def descriptors(self) -> int:
        """Memfds this publisher holds open (live and retired tables)."""
        with self._lock:
            return len(self._tables) + len(self._retired)

    def tier_of(self, bid: BlockId) -> str | None:
        """What the published table says about ``bid`` (tests)."""
        with self._lock:
            table = self._tables.get(bid.namespace)
            code = table.writer.get(it.fingerprint(bid.key)) if table is not None else 0
        return it.TIER_NAMES.get(code)

    # --- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the heartbeat thread (which also reclaims idle tables)."""
        self._thread = threading.Thread(target=self._beat_loop, name="index-heartbeat", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """Stamp every live table with the current time."""
        now = time.monotonic_ns()
        with self._lock:
            for table in self._tables.values():
                table.writer.beat(now)

    def reclaim(self) -> list[str]:
        """Drop the tables the registry finds empty, unheld and idle; return their namespaces."""
        with self._lock:
            gone = self._registry.reclaim(time.monotonic())
            for ns in gone:
                self._drop(ns)
            return gone

    def _beat_loop(self) -> None:
        next_reclaim = time.monotonic()
        while not self._stop.wait(self._heartbeat):
            self.beat()
            if time.monotonic() >= next_reclaim:
                self.reclaim()
                next_reclaim = time.monotonic() + RECLAIM_INTERVAL_SECONDS

    def close(self) -> None:
        """Retire every table (readers fall back to RPC) and release them."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            tables = [*self._tables.values(), *self._retired]
            self._tables.clear()
            self._retired.clear()
            self._offline.clear()
        for table in tables:
            table.writer.retire()
            table.close()


@dataclass(slots=True)
class _Conn:
    """One client connection of the index socket: waiting for its request, or holding a table."""

    sock: socket.socket
    deadline: float  # monotonic: the whole request must have arrived by then (from accept)
    buf: bytes = b""
    namespace: str = ""  # set once a table was handed out: the connection then holds it
    token: int = 0
    peer: tuple[int, int] = (0, 0)  # (uid, pid) of the client, pid 0 when not visible from here
    budget: it.ReportBudget | None = None  # what its lookup reports may still claim (once held)


class IndexSocket:
    """Serves table descriptors on a Unix socket: one thread, non-blocking, every client at once.

    Every connection is non-blocking and multiplexed with ``epoll`` (:mod:`selectors`; no limit on
    descriptor numbers, unlike ``select``). A request must arrive whole within
    :data:`REQUEST_DEADLINE_SECONDS` of the accept, whatever pace the client sends it at, and at most
    :data:`MAX_PENDING` requests wait at once (the oldest goes first), so a slow or silent client
    delays no other. A connection handed a table is kept; what its client sends on it afterwards is
    lookup reports (with ``on_lookups``; anything else, or any byte without it, closes it, as does the
    client hanging up).
    """

    def __init__(
        self,
        path: Path,
        publisher: IndexPublisher,
        *,
        authorize: Callable[[str, Peer], bool] | None = None,
        request_deadline: float = REQUEST_DEADLINE_SECONDS,
        on_lookups: Callable[[str, int, int, int], object] | None = None,
        on_report_dropped: Callable[[str], object] | None = None,
        max_keys_per_lookup: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``on_lookups(namespace, lookups, hit_keys, missed_keys)``: count lookups a client reports.

        ``on_report_dropped(reason)``: a report line beyond what its client could have looked up
        (:meth:`kvfabric.rpc.indextable.ReportBudget.admit`'s reasons) was dropped.
        ``max_keys_per_lookup``: the RPC's bound (``limits.max_keys_per_request``).
        """
        self.path = path
        self.publisher = publisher
        self.on_lookups = on_lookups
        self.on_report_dropped = on_report_dropped
        self.max_keys_per_lookup = max_keys_per_lookup
        self._clock = clock
        self.reports_dropped: dict[str, int] = {}
        """Report lines dropped, by reason (``implausible``, ``rate``)."""
        self.authorize = authorize or (lambda namespace, peer: True)
        self.request_deadline = request_deadline
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._file: SocketFile | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._pending: dict[int, _Conn] = {}  # by descriptor, oldest first
        self._held: dict[int, _Conn] = {}
        self._by_peer: dict[tuple[int, int], dict[int, _Conn]] = {}  # held, by peer, oldest first
        self.evicted = 0
        """Held connections closed to make room for another client's."""
        self._sel: selectors.BaseSelector | None = None
        self._accept_resume = 0.0
        self._accept_failures = 0
        self.served = 0
        """Tables handed out (tests and benchmarks)."""

    @property
    def connections(self) -> int:
        """Open client connections (waiting and holding)."""
        return len(self._pending) + len(self._held)

    def publish(self) -> None:
        """Rename the bound socket onto the path: clients reach this socket from now on."""
        assert self._file is not None
        self._file.publish()

    def start(self, *, publish: bool = True) -> None:
        """Bind and serve in a daemon thread; with ``publish``, at the path at once (else :meth:`publish`)."""
        sock, self._file = listen_unix(self.path, socket.SOCK_STREAM)
        sock.setblocking(False)
        self._sock = sock
        self._sel = selectors.DefaultSelector()
        self._sel.register(sock, selectors.EVENT_READ, None)
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, self._wake_r)
        if publish:
            self.publish()
        self._thread = threading.Thread(target=self._serve, name="index-socket", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        assert self._sel is not None
        try:
            while not self._stop.is_set():
                for key, _ in self._sel.select(self._timeout()):
                    if key.data is None:
                        self._accept()
                    elif isinstance(key.data, _Conn):
                        self._readable(key.data)
                    # else: the wake-up socket (close): the loop condition ends the loop
                self._expire()
        except Exception:
            log.exception("index socket loop failed")
        finally:
            for conn in [*self._pending.values(), *self._held.values()]:
                self._close(conn)

    def _timeout(self) -> float:
        now = time.monotonic()
        wait = IDLE_WAKE_SECONDS
        if self._pending:
            wait = min(wait, next(iter(self._pending.values())).deadline - now)
        if self._accept_resume:
            wait = min(wait, self._accept_resume - now)
        return max(wait, 0.0)

    def _accept(self) -> None:
        assert self._sock is not None
        assert self._sel is not None
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                sock, _ = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if self._stop.is_set():
                    return
                # EMFILE, ENOBUFS, a shut-down listener...: the listener stays readable, so stop
                # watching it for a moment rather than spin on it; the health probe reports it.
                # Logged once per run of failures (and every 100th), not ten times a second.
                self._accept_failures += 1
                if self._accept_failures % 100 == 1:
                    log.warning(
                        "index socket accept failed",
                        extra={"error": str(exc), "failures": self._accept_failures},
                    )
                self._sel.unregister(self._sock)
                self._accept_resume = time.monotonic() + ACCEPT_PAUSE_SECONDS
                return
            self._accept_failures = 0
            sock.setblocking(False)
            if len(self._pending) >= MAX_PENDING:
                self._close(next(iter(self._pending.values())))  # the oldest waits no longer
            conn = _Conn(sock, time.monotonic() + self.request_deadline)
            self._pending[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _readable(self, conn: _Conn) -> None:
        if conn.namespace:
            # A held connection: lookup reports, or its client hung up (or broke the protocol).
            self._reports(conn)
            return
        try:
            part = conn.sock.recv(MAX_REQUEST - len(conn.buf))
        except BlockingIOError:
            return
        except OSError:
            self._close(conn)
            return
        if not part:
            self._close(conn)
            return
        conn.buf += part
        if conn.buf.endswith(b"\n") or len(conn.buf) >= MAX_REQUEST:
            del self._pending[conn.sock.fileno()]
            try:
                served = self._answer(conn)
            except OSError as exc:
                log.info("index socket exchange failed", extra={"error": str(exc)})
                served = False
            except Exception:
                # A bug answering one request must not end the loop that serves every engine's tables.
                log.exception("index socket: answering a request failed; that connection is closed")
                served = False
            if served:
                conn.buf = b""  # from now on: the start of a lookup report
                conn.budget = it.ReportBudget(self.max_keys_per_lookup, self._clock())
                # Kept open: when this process dies the kernel closes it, and the client knows at
                # once (its next lookup polls it) instead of after a heartbeat timeout.
                self._held[conn.sock.fileno()] = conn
                self._by_peer.setdefault(conn.peer, {})[conn.sock.fileno()] = conn
            else:
                self._close(conn, pending=False)

    def _reports(self, conn: _Conn) -> None:
        """Count the whole report lines a held connection sent; close it on a hang-up or anything else."""
        try:
            part = conn.sock.recv(REPORT_READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            part = b""
        if not part or self.on_lookups is None:
            self._close(conn, pending=False)
            return
        *lines, conn.buf = (conn.buf + part).split(b"\n")
        now = self._clock()
        for line in lines:
            counts = it.parse_report(line)
            if counts is None:
                self._close(conn, pending=False)
                return
            if conn.budget is None:  # pragma: no cover - every held connection has one
                conn.budget = it.ReportBudget(self.max_keys_per_lookup, now)
            refused = conn.budget.admit(*counts, now=now)
            if refused is not None:
                self._dropped_report(refused)
                continue
            try:
                self.on_lookups(conn.namespace, *counts)
            except Exception:  # counting must never end the loop that serves every engine's tables
                log.exception("index socket: counting reported lookups failed")
        if len(conn.buf) >= it.MAX_REPORT_LINE:  # no line is that long
            self._close(conn, pending=False)

    def _dropped_report(self, reason: str) -> None:
        self.reports_dropped[reason] = self.reports_dropped.get(reason, 0) + 1
        if self.on_report_dropped is not None:
            try:
                self.on_report_dropped(reason)
            except Exception:  # counting must never end the loop that serves every engine's tables
                log.exception("index socket: counting a dropped lookup report failed")

    def _answer(self, conn: _Conn) -> bool:
        """Answer a whole request; True if a table was sent (the connection then holds it)."""
        namespace = _parse_request(conn.buf)
        if namespace is None:
            return _refuse(conn.sock, b"\x01bad request\n")
        peer = peer_of(conn.sock)
        if not self.authorize(namespace, peer):
            return _refuse(conn.sock, b"\x02permission denied\n")
        try:
            got = self.publisher.request(namespace)
        except OSError as exc:  # no read-only descriptor could be made: never hand out another kind
            log.warning("index socket: no read-only table descriptor", extra={"error": str(exc)})
            return _refuse(conn.sock, b"\x05table unavailable\n")
        if got is Admit.UNKNOWN:
            return _refuse(conn.sock, b"\x04unknown namespace\n")
        if isinstance(got, Admit):
            return _refuse(conn.sock, b"\x03too many namespaces\n")
        fd, token = got
        try:
            # Room is made only for a request that is served (a refused one evicts nobody), and
            # inside this block, so that whatever fails lets the descriptor and the hold go.
            conn.peer = peer_key(peer)
            self._make_room(conn.peer)
            # A fresh connection's send buffer always has room for one byte and a descriptor.
            ok = it.REPORTS_ACCEPTED if self.on_lookups is not None else b"\x00"
            socket.send_fds(conn.sock, [ok], [fd])
        except BaseException:
            self.publisher.release(namespace, token)
            raise
        finally:
            os.close(fd)
        conn.namespace, conn.token = namespace, token
        self.served += 1
        return True

    def _make_room(self, peer: tuple[int, int]) -> None:
        """Before ``peer`` holds one more connection: close the oldest held one of whoever is over a bound.

        Over its own bound, the peer's own oldest goes; at the total bound, the oldest of the peer
        holding the most. Nobody is refused, and a peer holding few connections (an engine) loses
        none to one hoarding many. Peers seen with pid 0 (another pid namespace) share one bound per
        uid, as large as the total: their processes cannot be told apart.
        """
        victim = connection_to_evict(
            self._by_peer, peer, len(self._held), own_bound=peer_bound(peer), total_bound=MAX_CONNECTIONS
        )
        if victim is None:
            return
        with contextlib.suppress(OSError):
            victim.sock.send(
                it.EVICTED
            )  # the client tells this from a hang-up: fetch again, not "server gone"
        self.evicted += 1
        self._close(victim, pending=False)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            oldest = next(iter(self._pending.values()))
            if oldest.deadline > now:
                break
            self._close(oldest)
        if self._accept_resume and now >= self._accept_resume and self._sock is not None:
            self._accept_resume = 0.0
            if self._sock.fileno() >= 0 and self._sel is not None:
                self._sel.register(self._sock, selectors.EVENT_READ, None)

    def _close(self, conn: _Conn, *, pending: bool = True) -> None:
        fd = conn.sock.fileno()
        if pending:
            self._pending.pop(fd, None)
        if self._held.pop(fd, None) is not None:
            self.publisher.release(conn.namespace, conn.token)
            mine = self._by_peer.get(conn.peer)
            if mine is not None:
                mine.pop(fd, None)
                if not mine:
                    del self._by_peer[conn.peer]
        if self._sel is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(conn.sock)
        conn.sock.close()

    def close(self) -> None:
        """Stop serving and remove the socket file if it is still this one (not a successor's)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sel is not None:
            self._sel.close()
        if self._sock is not None:
            self._sock.close()
        self._wake_r.close()
        self._wake_w.close()
        if self._file is not None:
            self._file.remove()


def _refuse(sock: socket.socket, message: bytes) -> bool:
    with contextlib.suppress(OSError):
        sock.send(message)
    return False


def peer_key(peer: Peer) -> tuple[int, int]:
    """Whom a held connection counts against: (uid, pid), or (uid, 0) for a pid this namespace cannot see."""
    return (peer.uid, max(peer.pid, 0))


def peer_bound(
    key: tuple[int, int], per_peer: int = MAX_CONNECTIONS_PER_PEER, total: int = MAX_CONNECTIONS
) -> int:
    """Held connections one peer may have: a process's bound, or the total for a uid-only peer."""
    return per_peer if key[1] else total


def peer_of(conn: socket.socket) -> Peer:
    """The process at the other end of a connected Unix socket (``SO_PEERCRED``, set by the kernel)."""
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return Peer(pid, uid, gid)


def listen_unix(path: Path, kind: int) -> tuple[socket.socket, SocketFile]:
    """A listening Unix socket of ``kind`` for ``path``, bound under a fresh name: publish it to serve.

    Mode 0666: engine pods may run as another user. The directory guards the socket (server-owned,
    mounted read-only by consumers, so none can unlink or replace it).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    file = SocketFile(path)
    sock = socket.socket(socket.AF_UNIX, kind | socket.SOCK_CLOEXEC)
    try:
        sock.bind(str(file.bound))
        os.chmod(file.bound, 0o666)  # noqa: S103
        sock.listen(64)
    except BaseException:
        sock.close()
        file.remove()
        raise
    return sock, file


def _parse_request(data: bytes) -> str | None:
    prefix = it.REQUEST_PREFIX
    if not data.startswith(prefix) or not data.endswith(b"\n"):
        return None
    ns = data[len(prefix) : -1].decode("ascii", "replace")
    try:
        BlockId.parse(ns, "0" * 64)
    except ValueError:
        return None
    return ns
