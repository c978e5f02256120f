"""Serving block and staging descriptors to same-node clients (the block socket).

See :mod:`kvfabric.rpc.blockproto` for the exchange. One thread per connection: engine processes on
a node are few, each keeps one connection, and a request is a dictionary lookup and a ``sendmsg``.
A name is a capability the gRPC socket handed to a caller of ``ShmLoad``/``ShmStoreBegin``; a
load's name resolves for as long as its block is resident, a staging name until its lease is
committed, aborted or reaped. The peer's ``SO_PEERCRED`` is read at accept time and logged with any
refusal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvfabric.cacheserver.transport.indexpub import MAX_CONNECTIONS, Peer, listen_unix
from kvfabric.rpc import blockproto as bp

__all__ = ["BlockSocket", "Resolver"]

log = logging.getLogger(__name__)

SEND_TIMEOUT_SECONDS = 5

Resolver = Callable[[str], tuple[int, int] | None]
"""name -> (a descriptor the socket closes after sending, payload length), or None if gone."""


class BlockSocket:
    """Hands out memfd descriptors by handle name on a ``SOCK_SEQPACKET`` Unix socket."""

    def __init__(self, path: Path, resolve: Resolver) -> None:
        self.path = path
        self.resolve = resolve
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()

    def start(self) -> None:
        """Bind (replacing a stale socket file) and accept in a daemon thread."""
        self._sock = listen_unix(self.path, socket.SOCK_SEQPACKET)
        self._thread = threading.Thread(target=self._accept_loop, name="block-socket", daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        """Open client connections."""
        with self._lock:
            return len(self._conns)

    def _accept_loop(self) -> None:
        assert self._sock is not None
        failures = 0
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:
                if self._stop.is_set():
                    return
                # EMFILE, ENOBUFS, ECONNABORTED...: transient; never stop serving same-node clients.
                # Logged once per run of failures (and every 100th), not ten times a second.
                failures += 1
                if failures % 100 == 1:
                    log.warning("block socket accept failed", extra={"error": str(exc), "failures": failures})
                time.sleep(0.1)
                continue
            failures = 0
            with self._lock:
                full = len(self._conns) >= MAX_CONNECTIONS
                if not full:
                    self._conns.add(conn)
            if full:
                with contextlib.suppress(OSError):
                    conn.send(bytes([bp.BAD_REQUEST]) + b"too many clients")
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="block-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            peer = Peer(pid, uid, gid)
            # A client that sends requests but never reads the answers cannot hold this thread (and
            # the descriptors in flight) for longer than this: the send fails, the connection closes.
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_TIMEOUT_SECONDS, 0))
            while not self._stop.is_set():
                data = conn.recv(bp.MAX_MESSAGE + 1)
                if not data:
                    return
                names = bp.parse_request(data) if len(data) <= bp.MAX_MESSAGE else None
                if names is None:
                    log.info("block socket: bad request", extra={"pid": peer.pid, "uid": peer.uid})
                    conn.send(bytes([bp.BAD_REQUEST]) + b"bad request")
                    return
                self._answer(conn, names)
        except OSError as exc:
            if not self._stop.is_set():
                log.info("block socket connection failed", extra={"error": str(exc)})
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _answer(self, conn: socket.socket, names: list[str]) -> None:
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
            socket.send_fds(conn, [bytes(status)], fds)
        finally:
            for fd in fds:
                os.close(fd)

    def close(self) -> None:
        """Stop serving, drop every connection and remove the socket file."""
        self._stop.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
