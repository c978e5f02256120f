"""Publishing the lookup index to same-node engines: one sealed, read-only memfd table per namespace.

The table layout is :mod:`kvfabric.rpc.indextable`. This module owns the tables on the server side:

* :class:`IndexPublisher` keeps one table per namespace in a memfd. The store calls
  :meth:`IndexPublisher.changed` after every change to a block's membership (put, delete, eviction,
  expiry, a promotion, another server's journal); the publisher asks the store for the block's
  fastest tier *then* (under its lock, so the last writer always publishes the latest truth) and
  writes the slot before the store acknowledges anything. A table that would pass half full is
  copied into one twice the size, which is then handed out, and the old one is marked retired.
  A heartbeat thread stamps every table, so a reader can tell a hung or dead server from a live one.
* :class:`IndexSocket` serves the tables over a Unix socket next to the gRPC socket
  (:func:`kvfabric.rpc.indextable.index_socket_for`): a client sends ``KVIX1 <namespace>`` and a newline and
  receives a read-only descriptor of that namespace's table (``SCM_RIGHTS``); the connection then
  stays open, so a client sees this process die at once (a hang up) rather than after a heartbeat
  timeout. The memfd is sealed
  against growing, shrinking and any *new* writable mapping (``F_SEAL_FUTURE_WRITE``), and the
  descriptor sent is a read-only reopening of it, so no client can write the table others read.
  ``authorize(namespace, peer)`` (the peer's ``SO_PEERCRED``) decides which namespaces a peer may
  see; it allows all by default, like the gRPC socket today.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.transport.socketfile import SocketFile
from kvfabric.rpc import indextable as it

__all__ = ["IndexPublisher", "IndexSocket", "Peer", "listen_unix", "peer_of"]

log = logging.getLogger(__name__)

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1
HEARTBEAT_SECONDS = 0.05
MAX_CONNECTIONS = 4096  # engine processes x namespaces on one node: far fewer


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
        """A new read-only descriptor of the table (the caller closes it)."""
        try:
            # A fresh open file description without write access: mmap(PROT_WRITE) on it fails
            # even where F_SEAL_FUTURE_WRITE is not available.
            return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return os.dup(self.fd)

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
    """The server's published index: one table per namespace, kept equal to the store's index."""

    def __init__(
        self,
        resolve: Callable[[BlockId], str | None],
        *,
        initial_capacity: int = 1024,
        max_tables: int = 1024,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
    ) -> None:
        """``resolve(bid)`` returns the fastest tier holding ``bid`` now (index only), or None."""
        self._resolve = resolve
        self._initial = initial_capacity
        self._max_tables = max_tables
        self._heartbeat = heartbeat_seconds
        self.epoch = secrets.randbits(64)
        self._lock = threading.Lock()
        self._tables: dict[str, _Table] = {}
        self._retired: list[_Table] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- writes --------------------------------------------------------------------------------------

    def changed(self, bids: Iterable[BlockId]) -> None:
        """Republish ``bids`` as the store holds them now (call after every membership change)."""
        with self._lock:
            for bid in bids:
                tier = self._resolve(bid)
                table = self._tables.get(bid.namespace)
                if table is None:
                    if tier is None:
                        continue
                    table = self._create(bid.namespace)
                    if table is None:
                        continue
                fp = it.fingerprint(bid.key)
                code = it.TIER_CODES[tier] if tier is not None else 0
                if code and table.writer.needs_growth() and not table.writer.get(fp):
                    table = self._grow(table)
                table.writer.set(fp, code)

    def _create(self, namespace: str) -> _Table | None:
        if len(self._tables) >= self._max_tables:
            return None  # clients of further namespaces use the RPC lookup
        table = _Table(namespace, self._initial, self.epoch)
        self._tables[namespace] = table
        return table

    def _grow(self, old: _Table) -> _Table:
        new = _Table(old.namespace, old.writer.capacity * 2, self.epoch)
        new.writer.load(old.writer.items())
        self._tables[old.namespace] = new
        old.writer.retire()
        self._retired.append(old)  # kept mapped: readers still hold it until they refetch
        del self._retired[:-8]
        return new

    # --- reads ---------------------------------------------------------------------------------------

    def table_fd(self, namespace: str) -> int | None:
        """A read-only descriptor of ``namespace``'s table (created empty if new); None if at the limit."""
        with self._lock:
            table = self._tables.get(namespace) or self._create(namespace)
            return None if table is None else table.read_only_fd()

    def namespaces(self) -> list[str]:
        """Namespaces with a table."""
        with self._lock:
            return sorted(self._tables)

    def tier_of(self, bid: BlockId) -> str | None:
        """What the published table says about ``bid`` (tests)."""
        with self._lock:
            table = self._tables.get(bid.namespace)
            code = table.writer.get(it.fingerprint(bid.key)) if table is not None else 0
        return it.TIER_NAMES.get(code)

    # --- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the heartbeat thread."""
        self._thread = threading.Thread(target=self._beat_loop, name="index-heartbeat", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """Stamp every live table with the current time."""
        now = time.monotonic_ns()
        with self._lock:
            for table in self._tables.values():
                table.writer.beat(now)

    def _beat_loop(self) -> None:
        while not self._stop.wait(self._heartbeat):
            self.beat()

    def close(self) -> None:
        """Retire every table (readers fall back to RPC) and release them."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            tables = [*self._tables.values(), *self._retired]
            self._tables.clear()
            self._retired.clear()
        for table in tables:
            table.writer.retire()
            table.close()


class IndexSocket:
    """Serves table descriptors on a Unix socket, one short exchange per connection (a thread)."""

    def __init__(
        self,
        path: Path,
        publisher: IndexPublisher,
        *,
        authorize: Callable[[str, Peer], bool] | None = None,
    ) -> None:
        self.path = path
        self.publisher = publisher
        self.authorize = authorize or (lambda namespace, peer: True)
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._file: SocketFile | None = None

    def publish(self) -> None:
        """Rename the bound socket onto the path: clients reach this socket from now on."""
        assert self._file is not None
        self._file.publish()

    def start(self, *, publish: bool = True) -> None:
        """Bind and serve in a daemon thread; with ``publish``, at the path at once (else :meth:`publish`)."""
        sock, self._file = listen_unix(self.path, socket.SOCK_STREAM)
        sock.setblocking(False)
        self._sock = sock
        if publish:
            self.publish()
        self._thread = threading.Thread(target=self._serve, name="index-socket", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._sock, *self._conns], [], [], 0.2)
            except (OSError, ValueError):
                if self._stop.is_set():
                    return
                self._conns = [c for c in self._conns if c.fileno() >= 0]
                continue
            for r in ready:
                if r is self._sock:
                    self._accept()
                else:
                    # A client hung up (or sent more than one request): forget the connection.
                    self._conns.remove(r)
                    r.close()

    def _accept(self) -> None:
        assert self._sock is not None
        try:
            conn, _ = self._sock.accept()
        except (TimeoutError, BlockingIOError):
            return
        except OSError:
            if not self._stop.is_set():
                log.exception("index socket accept failed")
            return
        try:
            if self._answer(conn):
                # Kept open: when this process dies the kernel closes it, and the client knows at
                # once (its next lookup polls it) instead of after a heartbeat timeout.
                self._conns.append(conn)
                return
        except OSError as exc:
            log.info("index socket exchange failed", extra={"error": str(exc)})
        conn.close()

    def _answer(self, conn: socket.socket) -> bool:
        """One request; True if a table was sent (the connection is then kept open)."""
        conn.settimeout(1.0)  # a client that sends nothing cannot hold the thread
        data = b""
        while not data.endswith(b"\n") and len(data) < 128:
            part = conn.recv(128 - len(data))
            if not part:
                return False
            data += part
        namespace = _parse_request(data)
        if namespace is None:
            conn.sendall(b"\x01bad request\n")
            return False
        if not self.authorize(namespace, peer_of(conn)):
            conn.sendall(b"\x02permission denied\n")
            return False
        if len(self._conns) >= MAX_CONNECTIONS:
            conn.sendall(b"\x03too many clients\n")
            return False
        fd = self.publisher.table_fd(namespace)
        if fd is None:
            conn.sendall(b"\x03too many namespaces\n")
            return False
        try:
            socket.send_fds(conn, [b"\x00"], [fd])
        finally:
            os.close(fd)
        return True

    def close(self) -> None:
        """Stop serving and remove the socket file if it is still this one (not a successor's)."""
        self._stop.set()
        if self._sock is not None:
            self._sock.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._conns = []
        if self._file is not None:
            self._file.remove()


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
