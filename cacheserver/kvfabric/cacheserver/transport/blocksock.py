"""Serving block and staging descriptors to same-node clients (the block socket).

See :mod:`kvfabric.rpc.blockproto` for the exchange. A name is a capability the gRPC socket handed
to a caller of ``ShmLoad``/``ShmStoreBegin``; a load's name resolves for as long as its block is
resident, a staging name until its lease is committed, aborted or reaped. The peer's ``SO_PEERCRED``
is read at accept time and logged with any refusal.

One thread serves every connection (a selector loop over non-blocking sockets): a request is a
dictionary lookup and a ``sendmsg``, so nothing is gained by a thread per connection, and a thread
started per connection is a thread that cannot be started at the pod's pids limit — which used to
kill the accept loop and with it every same-node load and store until a restart. Nothing a single
connection does or suffers (a failure to register it, a bad request, a send that fails, a bug in
answering it) reaches further than that connection: it is closed, logged, and the loop goes on.
The loop turns at least every :data:`TICK_SECONDS`; :meth:`BlockSocket.alive` says whether it still
does (readiness), ``last_error`` what last went wrong, and ``heartbeat`` is called on every turn.

Connections are bounded in all (``max_connections``) and per client (``max_connections_per_client``;
a client is the id it names itself by, see :mod:`kvfabric.cacheserver.transport.holdbook`). Neither
bound may let one same-node process deny the socket to the others, whatever it opens: a connection
that sends no request within :data:`FIRST_REQUEST_SECONDS` of its accept is closed, and a connection
accepted at the total bound closes the least recently active idle connection that holds no block
(no answer waiting, no request unread) to take its place, else the least recently active busy one
that holds no block (a request unread, or a client that stopped reading its answers: that request
fails once and kvfabric's client asks again on a fresh connection); only when every connection holds
blocks is the newcomer refused. At
most half the bound's connections may hold blocks (a hold beyond is lent), so that half can always
make room. Closing an idle connection costs its client a reconnect
(kvfabric's client reconnects once, transparently, on a connection the server closed). One over the
per-client bound is answered :data:`~kvfabric.rpc.blockproto.REFUSED` and closed. (Connections from
another pid namespace, another pod, cannot be told apart per process: each is its own client for the
per-client bound; the eviction above is what keeps them from filling the total.) A client that stops
reading its answers stops being read (its requests wait in its own socket) and is dropped once an
answer has waited :data:`SEND_TIMEOUT_SECONDS` to be sent.

Descriptors sent and not yet received are charged by the kernel to the server's user, all its
processes together, and past its open-files limit every ``sendmsg`` carrying descriptors fails
(``ETOOMANYREFS``), for every client of every server of that user on the node. A client that sent
requests and never read the answers would make them pile up in its socket; so the exchange is one
request at a time: a connection whose last answer is still unread is not read (its next request
waits in its socket) until its client has received that answer (looked at every
:data:`TICK_SECONDS`), and is dropped once it has waited :data:`SEND_TIMEOUT_SECONDS`. The
descriptors of answers not yet received are bounded in all (``max_unread_fds``, by default an
eighth of the descriptor limit, on at most twice ``max_connections`` connections) and per peer uid
(an eighth of each; counted by :mod:`~kvfabric.cacheserver.transport.unreadbook`): a load's
answer beyond is refused (its client raises ``CacheOverloaded`` and falls back), a store's begin is
answered busy (a dropped store), and a connection closed while its answer is unread is watched
until its client reads it or hangs up (the descriptors are in flight until then, whatever the
server closes). Tenants that run as the same uid share that uid's share.

A connection may *hold* the blocks it loads (``KVBH1``) within its client's budget in bytes and in
blocks, and the tier's share of both (:mod:`~kvfabric.cacheserver.transport.holdbook`), so its client
can keep them mapped across loads; the DRAM tier keeps a held block's memory charged until the
release. The socket releases all of a connection's holds when it closes, whatever the client did: a
client that dies (or forgets) cannot leave memory or descriptors the server does not count.

A connection may also *store* (``KVSB1``/``KVSC1``/``KVSA1``, see the protocol module) when the
server gives the socket a store handler. The loop only parses such a request: the handler runs it on
the store pool (a begin may stat a shared volume or allocate pages; a commit seals and indexes), and
the loop sends the answer when it is done. Meanwhile that connection is not read (one request at a
time per connection, as for loads) and every other connection is served: a slow store never holds a
load behind it. Store requests queued or being served are bounded in all (``max_store_jobs``): a
begin beyond is answered at once as unavailable (busy), never queued, and its client counts a failed
store (a commit is bounded by the store slot the handler takes before queueing it).
A request whose connection is gone (its client hung up, or it was closed for a newcomer) by the time
the pool starts it is skipped, and a begin served for a connection gone by the time it is answered
has its lease aborted: a client that sends a store and hangs up leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import select
import selectors
import socket
import struct
import termios
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kvfabric.cacheserver.engine.dram import descriptor_budget
from kvfabric.cacheserver.transport.holdbook import HoldBook, Holds, anonymous_client
from kvfabric.cacheserver.transport.indexpub import listen_unix, peer_of
from kvfabric.cacheserver.transport.socketfile import SocketFile
from kvfabric.cacheserver.transport.unreadbook import UnreadBook
from kvfabric.rpc import blockproto as bp

__all__ = ["BlockLimits", "BlockSocket", "Holds", "Resolver", "StoreAnswer", "StoreHandler"]

log = logging.getLogger(__name__)

SEND_TIMEOUT_SECONDS = 5.0
"""How long an answer may wait for its client to read (then the connection is dropped)."""
FIRST_REQUEST_SECONDS = 1.0
"""How long a new connection may stay silent before its first request (then it is closed)."""
NEW_CONNECTION_GRACE_SECONDS = 0.1
"""A connection this young that sent nothing yet is closed for a newcomer only when no other can be."""
TICK_SECONDS = 0.5
"""The loop turns at least this often (send deadlines, the heartbeat, a paused accept)."""
ACCEPT_PAUSE_SECONDS = 0.1
"""After a failed ``accept`` (``EMFILE``...), accepting pauses this long; connections are still served."""
SETTLE_SECONDS = 0.05
"""An answer beyond the unread bound looks again at every connection at most this often (each look
is an ``ioctl`` per connection counted; a client at its bound asking again and again must not make
the loop spend its time looking)."""
UNREAD_DESCRIPTOR_SHARE = 1 / 8
"""Share of the descriptor limit that answers not yet received may carry (see the module doc)."""

Resolver = Callable[[str], tuple[int, int] | None]
"""name -> (a descriptor the socket closes after sending, payload length), or None if gone."""


class StoreAnswer(NamedTuple):
    """A store request's answer, computed by the store handler."""

    msg: bytes
    fds: list[int]
    """Descriptors sent with it (the socket closes them after sending)."""
    undo: Callable[[], None] | None = None
    """Called on the loop when the answer cannot be delivered (a begun lease is aborted)."""


StoreHandler = Callable[[bp.StoreBegin | bp.StoreEnd, Callable[[], bool]], "Future[StoreAnswer]"]
"""``(a parsed store request, gone)`` -> its answer, computed off the loop's thread (the store pool).
Called on the loop's thread; ``gone()`` (any thread) says whether the request's connection is gone,
so the handler skips work nobody waits for."""


@dataclass(frozen=True, slots=True)
class BlockLimits:
    """What the block socket serves at most (``shm.*`` in the server configuration)."""

    max_connections: int = 1024
    """Connections served at once, all clients together."""
    max_connections_per_client: int = 8
    """Connections one client may have open at once."""
    hold_bytes_per_client: int = 0
    """Bytes of blocks one client may hold (0: nothing is held)."""
    hold_blocks_per_client: int | None = None
    """Blocks one client may hold; None: a quarter of the tier's share of held blocks (at least 1)."""
    max_store_jobs: int = 16
    """Store requests queued or being served at once, all connections together; a begin beyond is
    answered unavailable (busy) at once."""
    max_unread_fds: int | None = None
    """Descriptors in answers sent and not yet received, all connections together (one peer uid: an
    eighth); None: :data:`UNREAD_DESCRIPTOR_SHARE` of the descriptor limit."""


@dataclass(eq=False, slots=True)
class _Conn:
    sock: socket.socket
    pid: int
    uid: int
    client: str | None = None
    """Set by the connection's first request."""
    named: str | None = None
    """The id the client named itself by, if any."""
    pending: tuple[bytes, list[int], Callable[[], None] | None] | None = None
    """An answer the client has not taken yet (its descriptors are ours until sent), and what undoes
    it if it is never sent (a store's begun lease)."""
    since: float = 0.0
    opened: float = 0.0
    """``time.monotonic()`` of the accept (the first-request deadline counts from it)."""
    working: bool = False
    """A store request of this connection is being served off the loop (the connection is not read)."""
    paused: float = 0.0
    """``time.monotonic()`` since when it is not read, its last answer unread (0: it is read)."""


class BlockSocket:
    """Hands out memfd descriptors by handle name on a ``SOCK_SEQPACKET`` Unix socket."""

    def __init__(
        self,
        path: Path,
        resolve: Resolver,
        holds: Holds | None = None,
        limits: BlockLimits | None = None,
        stores: StoreHandler | None = None,
    ) -> None:
        self.path = path
        self.resolve = resolve
        self.stores = stores
        # Store answers computed off the loop, waiting for it to send them (any thread appends).
        self._done: deque[tuple[_Conn, Future[StoreAnswer]]] = deque()
        self._store_jobs = 0  # loop thread only: store requests handed to the handler, not answered
        self.limits = limits or BlockLimits()
        # Loop thread only: connections (open or closed, see _drop) whose last answer's descriptors
        # are not received yet, and their sum in all and per peer uid. At least eight answers'
        # worth in all, so that a uid's eighth is an eighth even at a low limit; connections, open
        # or closed, with an answer not received yet cost an ``ioctl`` per look (_settle), so they
        # are bounded too.
        self._unread: UnreadBook[_Conn] = UnreadBook(
            self.limits.max_unread_fds or max(8 * bp.MAX_NAMES, descriptor_budget(UNREAD_DESCRIPTOR_SHARE)),
            2 * self.limits.max_connections,
        )
        self._settled_at = 0.0  # time.monotonic() of the last look at all of them
        self.holds = holds
        self._book: HoldBook | None = None
        if holds is not None and self.limits.hold_bytes_per_client > 0:
            blocks = self.limits.hold_blocks_per_client
            if blocks is None:
                blocks = max(1, holds.max_held_blocks // 4)
            # Half the connections at most may hold: the other half can always make room for a
            # newcomer at the total bound (a connection holding something is never closed for one).
            self._book = HoldBook(
                holds,
                self.limits.hold_bytes_per_client,
                blocks,
                max_holding_connections=max(1, self.limits.max_connections // 2),
            )
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, _Conn] = {}
        self._per_client: dict[str, int] = {}
        self._waiting: set[_Conn] = set()  # connections with an answer not sent yet
        # Loop thread only. Every connection, least recently active first (moved to the end on each
        # request): the first with nothing at stake makes room for a newcomer at the total bound.
        self._recent: OrderedDict[_Conn, None] = OrderedDict()
        # Connections that have sent no request yet, oldest first (the first-request deadline).
        self._silent: OrderedDict[_Conn, None] = OrderedDict()
        self._file: SocketFile | None = None
        self._sel: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._accept_paused_until = 0.0
        self._accept_failures = 0
        self.heartbeat: Callable[[], None] | None = None
        """Called on every turn of the loop (at least every :data:`TICK_SECONDS`), from its thread."""
        self.last_turn = 0.0
        """``time.monotonic()`` of the loop's last completed turn (0: not started)."""
        self.last_error: str | None = None
        """What last went wrong in the loop itself or with a connection (None: nothing yet)."""

    @property
    def max_unread_fds(self) -> int:
        """Descriptors in answers not received yet, all connections together (see :meth:`_room`)."""
        return self._unread.max_fds

    @property
    def max_unread_connections(self) -> int:
        """Connections, open or closed, with an answer not received yet."""
        return self._unread.max_connections

    @property
    def hold_blocks_per_client(self) -> int:
        """Blocks one client may hold (0 when nothing is held)."""
        return 0 if self._book is None else self._book.blocks_per_client

    def publish(self) -> None:
        """Rename the bound socket onto the path: clients reach this socket from now on."""
        assert self._file is not None
        self._file.publish()

    def start(self, *, publish: bool = True) -> None:
        """Bind and serve in a daemon thread; ``publish``: at the path at once (else :meth:`publish`)."""
        self._sock, self._file = listen_unix(self.path, socket.SOCK_SEQPACKET)
        self._sock.setblocking(False)
        self._sel = selectors.DefaultSelector()  # epoll: no descriptor-number limit as select() has
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)  # a wake-up never waits: one already queued wakes the loop
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        if publish:
            self.publish()
        self.last_turn = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="block-socket", daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        """Open client connections."""
        with self._lock:
            return len(self._conns)

    @property
    def unread_descriptors(self) -> int:
        """Descriptors sent in answers that were not received yet when last looked at."""
        return self._unread.total

    def alive(self, within: float = 4 * TICK_SECONDS) -> bool:
        """Whether the loop serves: started, not closed, and it turned in the last ``within`` seconds."""
        return (
            self._thread is not None
            and self._thread.is_alive()
            and not self._stop.is_set()
            and time.monotonic() - self.last_turn <= within
        )

    # --- the loop ------------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._turn()
                except Exception as exc:  # the loop itself must never die; back off, go on
                    # (and no heartbeat: a loop that fails every turn serves nobody, alive() says so)
                    self._failed("block socket loop failed", exc)
                    self._stop.wait(0.1)
                    continue
                self.last_turn = time.monotonic()
                if self.heartbeat is not None:
                    try:
                        self.heartbeat()
                    except Exception as exc:
                        self._failed("block socket heartbeat failed", exc)
        finally:
            self._close_all()

    def _failed(self, what: str, exc: BaseException) -> None:
        self.last_error = f"{what}: {exc!r}"
        log.warning(what, extra={"error": repr(exc)}, exc_info=exc)

    def _turn(self) -> None:
        assert self._sel is not None
        events = self._sel.select(TICK_SECONDS)
        for key, mask in events:
            if key.data is None:
                self._accept_some()
            elif key.data == "wake":
                assert self._wake_r is not None
                with contextlib.suppress(OSError):
                    self._wake_r.recv(64)
            else:
                conn: _Conn = key.data
                try:
                    if mask & selectors.EVENT_WRITE:
                        self._flush(conn)
                    if mask & selectors.EVENT_READ and conn.pending is None and conn.sock in self._conns:
                        if conn in self._unread and not self._received(conn):
                            self._pause(conn)  # asked again before reading the last answer
                        else:
                            self._read(conn)
                except Exception as exc:  # one connection's failure is its own
                    self._drop(conn, exc)
        while self._done:
            conn, job = self._done.popleft()
            try:
                self._stored(conn, job)
            except Exception as exc:
                self._drop(conn, exc)
        now = time.monotonic()
        for conn in [c for c in self._waiting if c.pending is not None]:
            if now - conn.since > SEND_TIMEOUT_SECONDS:
                # A client that does not read its answers is not served any more.
                log.info("block socket: a client does not read", extra={"pid": conn.pid, "uid": conn.uid})
                self._drop(conn, None)
        while self._silent:
            conn = next(iter(self._silent))
            if now - conn.opened <= FIRST_REQUEST_SECONDS:
                break
            # Silent since its accept: it costs a slot and serves nobody (an idle or hostile peer).
            log.info("block socket: no request in time", extra={"pid": conn.pid, "uid": conn.uid})
            self._drop(conn, None)
        if now - self._settled_at >= TICK_SECONDS:
            self._settle()
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            assert self._sock is not None
            self._sel.register(self._sock, selectors.EVENT_READ, None)

    def _accept_some(self) -> None:
        assert self._sock is not None
        assert self._sel is not None
        for _ in range(64):  # a burst at a time; the others are served in between
            try:
                sock, _ = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if self._stop.is_set():
                    return
                # EMFILE, ENOBUFS, ECONNABORTED...: transient; the connection stays in the backlog.
                # Logged once per run of failures (and every 100th), not ten times a second; accepting
                # pauses meanwhile, serving does not.
                self._accept_failures += 1
                if self._accept_failures % 100 == 1:
                    log.warning(
                        "block socket accept failed",
                        extra={"error": str(exc), "failures": self._accept_failures},
                    )
                self.last_error = f"accept: {exc!r}"
                self._sel.unregister(self._sock)
                self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE_SECONDS
                return
            self._accept_failures = 0
            try:
                self._open(sock)
            except Exception as exc:  # that connection's failure only
                self._failed("block socket: cannot serve a new connection", exc)
                with self._lock:
                    self._conns.pop(sock, None)
                with contextlib.suppress(Exception):
                    assert self._sel is not None
                    self._sel.unregister(sock)
                sock.close()

    def _open(self, sock: socket.socket) -> None:
        assert self._sel is not None
        peer = peer_of(sock)
        with self._lock:
            full = len(self._conns) >= self.limits.max_connections
        if full:
            idle = self._idlest()
            if idle is None:
                log.info("block socket: too many connections", extra={"pid": peer.pid, "uid": peer.uid})
                _refuse(sock, b"too many connections")
                sock.close()
                return
            # Room for the newcomer: the idle connection's client pays a reconnect at most, where
            # refusing would let whoever opened the most connections first deny everyone else.
            log.info(
                "block socket: closed an idle connection to admit a new one",
                extra={"pid": idle.pid, "uid": idle.uid, "new_pid": peer.pid, "new_uid": peer.uid},
            )
            self._drop(idle, None)
        sock.setblocking(False)
        conn = _Conn(sock, peer.pid, peer.uid, opened=time.monotonic())
        with self._lock:
            self._conns[sock] = conn
        self._recent[conn] = None
        self._silent[conn] = None
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _idlest(self) -> _Conn | None:
        """The least recently active connection with nothing at stake, if any (see the module doc).

        Else the least recently active one that is busy: a request waits unread on it, or its client
        stopped reading its answers (dropped in :data:`SEND_TIMEOUT_SECONDS` anyway); else one
        accepted less than :data:`NEW_CONNECTION_GRACE_SECONDS` ago that sent nothing yet. Only
        connections holding blocks are never closed for a newcomer.
        """
        busy: _Conn | None = None
        young: _Conn | None = None
        now = time.monotonic()
        for conn in self._recent:
            if self._book is not None and self._book.holding(conn):
                continue
            if conn.pending is not None or conn.working:
                busy = busy or conn
                continue
            if now - conn.opened < NEW_CONNECTION_GRACE_SECONDS and conn in self._silent:
                # Accepted a moment ago: its first request is on its way (a client sends it right
                # after connecting). Taken last: else, with every other connection busy, each
                # newcomer closed the one before it, a well-behaved client's reconnect included.
                young = young or conn
                continue
            try:
                waiting = conn.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return conn  # nothing unread: idle
            except OSError:
                return conn  # broken: closing it loses nothing
            if not waiting:
                return conn  # its client hung up already
            # A request waits unread. Closing it fails that request once (kvfabric's client asks a
            # load again on a fresh connection; a store fails and is not resent); protecting it
            # instead would let a client that keeps a request queued on every connection refuse
            # every newcomer for ever.
            busy = busy or conn
        return busy or young

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(bp.MAX_MESSAGE + 1)
        except BlockingIOError:
            return
        except OSError as exc:
            if not self._stop.is_set():
                log.info("block socket connection failed", extra={"error": str(exc)})
            self._drop(conn, None)
            return
        if not data:
            self._drop(conn, None)
            return
        self._recent.move_to_end(conn)
        self._silent.pop(conn, None)
        if self.stores is not None and bp.is_store_request(data):
            self._store(conn, data)
            return
        req = bp.parse_request(data) if len(data) <= bp.MAX_MESSAGE else None
        if req is None:
            self._bad(conn, "request")
            return
        if not self._admit(conn, req.client, "request"):
            return
        if req.hold:
            msg, fds = self._answer_holding(conn, req)
        else:
            msg, fds = self._answer(req.names)
        self._send(conn, msg, fds)

    def _admit(self, conn: _Conn, client: str | None, what: str) -> bool:
        """Whether a parsed request of ``client`` may be served on ``conn`` (binding it on its first).

        A request naming another client than the connection's is a bad request: refused, closed.
        """
        if client is not None and conn.client is not None and client != conn.named:
            self._bad(conn, what)
            return False
        return conn.client is not None or self._bind(conn, client)

    def _bad(self, conn: _Conn, what: str) -> None:
        log.info(f"block socket: bad {what}", extra={"pid": conn.pid, "uid": conn.uid})
        _refuse(conn.sock, b"bad request", status=bp.BAD_REQUEST)
        self._drop(conn, None)

    def _store(self, conn: _Conn, data: bytes) -> None:
        """Hand a store request to the store handler; its answer is sent by :meth:`_stored`."""
        assert self.stores is not None
        assert self._sel is not None
        req = bp.parse_store_request(data) if len(data) <= bp.MAX_MESSAGE else None
        if req is None:
            self._bad(conn, "store request")
            return
        if not self._admit(conn, req.client, "store request"):
            return
        if isinstance(req, bp.StoreBegin) and self._gone(conn):
            # Sent, then hung up (its request still readable): nobody waits for the answer, and a
            # begin not served holds nothing. (A commit or an abort still goes to the handler, which
            # sees the client gone and aborts the lease now rather than when it expires.)
            self._drop(conn, None)
            return
        if isinstance(req, bp.StoreBegin) and self._store_jobs >= self.limits.max_store_jobs:
            # Refused at once rather than queued: a queue nobody bounds is a queue one tenant fills
            # (connect, send a begin, hang up...) and every other tenant's store waits out its deadline.
            # Only begins: a commit is bounded by the store slots it takes before queueing (none
            # free: dropped at once), and refusing it would leave its client's lease to expire.
            log.info("block socket: store refused, too many queued", extra={"pid": conn.pid, "uid": conn.uid})
            self._send(conn, bp.encode_store_error(bp.BUSY, "busy: too many stores queued"), [])
            return
        # Not read until answered: one request at a time per connection (and no busy selector loop
        # over a readable socket nobody reads).
        conn.working = True
        self._sel.unregister(conn.sock)
        self._store_jobs += 1
        try:
            job = self.stores(req, lambda: self._gone(conn))
        except BaseException:
            self._store_jobs -= 1
            conn.working = False
            self._sel.register(conn.sock, selectors.EVENT_READ, conn)
            raise
        job.add_done_callback(lambda j: self._finished(conn, j))

    def _gone(self, conn: _Conn) -> bool:
        """(Any thread.) Whether ``conn`` is closed here or its client hung up."""
        # Under the lock: a connection still listed is not closed yet (``_drop`` unlists it first),
        # so its descriptor is its own while polled. An unread connection is out of the selector:
        # only a poll notices its client's hang-up.
        with self._lock:
            if conn.sock not in self._conns:
                return True
            poller = select.poll()
            poller.register(conn.sock, select.POLLHUP | select.POLLERR)
            return any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in poller.poll(0))

    def _finished(self, conn: _Conn, job: Future[StoreAnswer]) -> None:
        """(Any thread.) A store request's answer is ready: the loop sends it."""
        self._done.append((conn, job))
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"s")

    def _stored(self, conn: _Conn, job: Future[StoreAnswer]) -> None:
        """(The loop.) Send a store request's answer, if its connection is still there."""
        self._store_jobs -= 1
        try:
            msg, fds, undo = job.result()
        except Exception as exc:  # the handler's failure: this request's, answered as such
            self._failed("block socket: a store request failed", exc)
            msg = bp.encode_store_error(bp.UNAVAILABLE, "the server could not serve this store")
            fds, undo = [], None
        conn.working = False
        if bool(fds) and conn.sock in self._conns and not self._room(conn, len(fds)):
            # Its staging descriptors would pass the unread bound: a store dropped under pressure
            # (busy, as when too many are queued), not a failure; the connection stays. Nobody can
            # commit what this answer began: its lease goes now, not in 30 s.
            _close_fds(fds)
            msg, fds = bp.encode_store_error(bp.BUSY, "busy: too many answers unread on this node"), []
            _undo(undo)
            undo = None
        if conn.sock in self._conns and not self._gone(conn):
            assert self._sel is not None
            self._sel.register(conn.sock, selectors.EVENT_READ, conn)
            # Sent, kept until its client reads (a client that reads it late still gets it), or
            # undone by _send or _drop if it never reaches its client.
            self._send(conn, msg, fds, undo)
        else:
            _close_fds(fds)
            self._drop(conn, None)  # its client hung up while it was not read
            _undo(undo)

    def _bind(self, conn: _Conn, named: str | None) -> bool:
        """Make ``conn`` its client's (on its first request); False if that client has too many."""
        client = f"id:{named}" if named is not None else anonymous_client(conn.pid, conn.uid, conn)
        with self._lock:
            count = self._per_client.get(client, 0)
            full = count >= self.limits.max_connections_per_client
            if not full:
                self._per_client[client] = count + 1
                conn.client, conn.named = client, named
        if full:
            log.info(
                "block socket: too many connections from one client",
                extra={"pid": conn.pid, "uid": conn.uid, "client": client},
            )
            _refuse(conn.sock, b"too many connections from this client")
            self._drop(conn, None)
            return False
        if self._book is not None:
            self._book.open(conn, client)
        return True

    def _send(self, conn: _Conn, msg: bytes, fds: list[int], undo: Callable[[], None] | None = None) -> None:
        """Send an answer, or keep it until its client reads; ``undo`` runs if it is never delivered.

        Whether refused here, failed, or kept and then dropped with its connection (:meth:`_drop`),
        an answer that never reaches its client is undone exactly once: a store's begun lease goes
        at once instead of when it expires.
        """
        if fds and not self._room(conn, len(fds)):
            _close_fds(fds)
            log.info(
                "block socket: too many descriptors unread, answer refused",
                extra={"pid": conn.pid, "uid": conn.uid, "unread": self._unread.total},
            )
            _refuse(conn.sock, b"too many answers unread on this node")
            self._drop(conn, None)
            _undo(undo)
            return
        try:
            socket.send_fds(conn.sock, [msg], fds)
        except BlockingIOError:
            # The client's queue is full: keep the answer, stop reading it, send when it reads.
            conn.pending, conn.since = (msg, fds, undo), time.monotonic()
            self._waiting.add(conn)
            assert self._sel is not None
            self._sel.modify(conn.sock, selectors.EVENT_WRITE, conn)
            return
        except OSError as exc:
            _close_fds(fds)
            if not self._stop.is_set():
                log.info("block socket connection failed", extra={"error": str(exc)})
            self._drop(conn, None)
            _undo(undo)
            return
        _close_fds(fds)
        if fds:
            self._unread.add(conn, conn.uid, len(fds))

    # --- descriptors in flight -----------------------------------------------------------------------

    def _received(self, conn: _Conn) -> bool:
        """Whether ``conn``'s client has received every answer sent (then they are counted no more)."""
        if _unsent_bytes(conn.sock) > 0:
            return False
        self._unread.remove(conn)
        return True

    def _pause(self, conn: _Conn) -> None:
        """Stop reading ``conn`` until its client has received its last answer (see :meth:`_settle`)."""
        assert self._sel is not None
        self._sel.unregister(conn.sock)
        conn.paused = time.monotonic()

    def _room(self, conn: _Conn, n: int) -> bool:
        """Whether an answer of ``n`` descriptors on ``conn`` stays within the unread bounds.

        In all, :attr:`max_unread_fds` descriptors on at most :attr:`max_unread_connections`
        connections; per peer uid an eighth of each (:class:`UnreadBook`). Counts are taken lazily
        (a client's answer is uncounted on its next request, or when the loop looks at all of
        them): past a bound, this uid's own connections are looked at first (their cost is its
        own), then all of them, at most every :data:`SETTLE_SECONDS`.
        """
        book = self._unread
        if book.fits(conn, conn.uid, n):
            return True
        own = book.connections(conn.uid)
        if own:
            self._settle(own)
            if book.fits(conn, conn.uid, n):
                return True
        if time.monotonic() - self._settled_at < SETTLE_SECONDS:
            return False  # looked at them all a moment ago (a client at its bound asking again)
        self._settle()
        return book.fits(conn, conn.uid, n)

    def _settle(self, conns: list[_Conn] | None = None) -> None:
        """Uncount the answers received since (and resume, drop or close what that settles).

        A paused connection whose client received its answer is read again, one that waited too
        long is dropped, a closed one with nothing left in flight is closed (a client that hung up
        has nothing queued any more). One ``ioctl`` per connection looked at: ``conns``, else every
        connection with an answer counted (every :data:`TICK_SECONDS`, and when an answer would
        pass a bound, at most every :data:`SETTLE_SECONDS`).
        """
        now = time.monotonic()
        if conns is None:
            conns = self._unread.connections()
            self._settled_at = now
        for conn in conns:
            received = self._received(conn)
            if conn.sock not in self._conns:
                if received:
                    conn.sock.close()
            elif conn.paused and received:
                conn.paused = 0.0
                assert self._sel is not None
                self._sel.register(conn.sock, selectors.EVENT_READ, conn)
            elif conn.paused and now - conn.paused > SEND_TIMEOUT_SECONDS:
                log.info("block socket: a client does not read", extra={"pid": conn.pid, "uid": conn.uid})
                self._drop(conn, None)

    def _flush(self, conn: _Conn) -> None:
        if conn.pending is None or conn.sock not in self._conns:
            return
        msg, fds, undo = conn.pending
        conn.pending, since = None, conn.since
        self._waiting.discard(conn)
        assert self._sel is not None
        self._sel.modify(conn.sock, selectors.EVENT_READ, conn)
        self._send(conn, msg, fds, undo)
        if conn in self._waiting:
            # Still would block (a socket can be writable and yet short of room for this answer):
            # it has waited since it first did, so a client that never reads is dropped in time.
            conn.since = since

    def _drop(self, conn: _Conn, exc: BaseException | None) -> None:
        """Close one connection and release everything it had (idempotent)."""
        if exc is not None:
            self._failed("block socket connection failed", exc)
        with self._lock:
            if self._conns.pop(conn.sock, None) is None:
                return
            self._recent.pop(conn, None)
            self._silent.pop(conn, None)
            if conn.client is not None:
                left = self._per_client[conn.client] - 1
                if left:
                    self._per_client[conn.client] = left
                else:
                    del self._per_client[conn.client]
        try:
            if self._sel is not None:
                with contextlib.suppress(KeyError, ValueError, OSError):
                    self._sel.unregister(conn.sock)
            if conn in self._unread and not self._stop.is_set() and not self._received(conn):
                # Its last answer's descriptors stay in flight until its client reads or hangs up,
                # whatever happens to this end: keep counting them (closed in _settle).
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)  # its client reads them, then EOF
            else:
                conn.sock.close()
            pending, conn.pending = conn.pending, None
            self._waiting.discard(conn)
            if pending is not None:  # an answer its client never took
                _close_fds(pending[1])
                _undo(pending[2])
        finally:
            # A closed connection holds nothing, whatever its client did (died, forgot, misbehaved).
            if self._book is not None:
                self._book.close(conn)

    def _close_all(self) -> None:
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            with contextlib.suppress(Exception):
                self._drop(conn, None)
        for conn in self._unread.connections():
            if conn.sock.fileno() >= 0:
                conn.sock.close()
        self._unread.clear()
        if self._sel is not None:
            self._sel.close()

    # --- answers -------------------------------------------------------------------------------------

    def _answer(self, names: list[str]) -> tuple[bytes, list[int]]:
        status = bytearray()
        fds: list[int] = []
        try:
            for name in names:
                got = self.resolve(name)
                if got is None:
                    status.append(bp.GONE)
                else:
                    status.append(bp.FOUND)
                    fds.append(got[0])
        except BaseException:
            _close_fds(fds)
            raise
        return bytes(status), fds

    def _answer_holding(self, conn: _Conn, req: bp.Request) -> tuple[bytes, list[int]]:
        book = self._book
        if book is not None:
            for name in req.release:
                book.release(conn, name)  # only this connection's own holds: never another client's
        if not req.names:
            return bytes([bp.RELEASED]), []
        status = bytearray()
        fds: list[int] = []
        try:
            for name in req.names:
                if book is None:
                    lent = self.resolve(name)
                    got = None if lent is None else (lent[0], lent[1], 0)
                else:
                    got = book.hold(conn, name)
                if got is None:
                    status.append(bp.GONE)
                    continue
                fds.append(got[0])
                status.append(bp.FOUND if got[2] else bp.LENT)
        except BaseException:
            _close_fds(fds)
            raise
        return bytes(status), fds

    def close(self) -> None:
        """Stop serving, drop every connection and remove the socket file if it is still this one."""
        self._stop.set()
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
        for s in (self._wake_r, self._wake_w):
            if s is not None:
                s.close()
        if self._file is not None:
            self._file.remove()


def _refuse(sock: socket.socket, reason: bytes, *, status: int = bp.REFUSED) -> None:
    """Tell a client why it is not served (best effort: it may not be reading), then the caller closes."""
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        sock.send(bytes([status]) + reason)


def _unsent_bytes(sock: socket.socket) -> int:
    """Bytes sent on ``sock`` its peer has not received yet (``SIOCOUTQ``; 0 once it hung up)."""
    try:
        got = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError):
        return 0  # closed: nothing of it is counted any more
    return int(struct.unpack("i", got)[0])


def _undo(undo: Callable[[], None] | None) -> None:
    """Undo an answer that never reached its client (a begun lease); its failure is only logged."""
    if undo is None:
        return
    try:
        undo()
    except Exception:  # the lease then expires on its own; the loop must go on
        log.warning("block socket: undoing an undelivered answer failed", exc_info=True)


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
