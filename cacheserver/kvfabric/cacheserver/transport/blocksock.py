"""Serving block and staging descriptors to same-node clients (the block socket).

See :mod:`kvfabric.rpc.blockproto` for the exchange. One thread per connection: engine processes on
a node are few, each keeps one connection, and a request is a dictionary lookup and a ``sendmsg``.
A name is a capability the gRPC socket handed to a caller of ``ShmLoad``/``ShmStoreBegin``; a
load's name resolves for as long as its block is resident, a staging name until its lease is
committed, aborted or reaped. The peer's ``SO_PEERCRED`` is read at accept time and logged with any
refusal.

A connection may *hold* the blocks it loads (``KVBH1``) up to ``hold_budget`` bytes, so its client can
keep them mapped across loads; the DRAM tier keeps a held block's memory charged until the release.
The socket remembers each connection's holds and releases them all when the connection closes,
whatever the client did: a client that dies (or forgets) cannot leave memory the server does not
count.
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
from typing import Protocol

from kvfabric.cacheserver.transport.indexpub import MAX_CONNECTIONS, listen_unix, peer_of
from kvfabric.cacheserver.transport.socketfile import SocketFile
from kvfabric.rpc import blockproto as bp

__all__ = ["BlockSocket", "Holds", "Resolver"]

log = logging.getLogger(__name__)

SEND_TIMEOUT_SECONDS = 5

Resolver = Callable[[str], tuple[int, int] | None]
"""name -> (a descriptor the socket closes after sending, payload length), or None if gone."""


class Holds(Protocol):
    """Where held blocks are accounted (the DRAM tier)."""

    def hold_by_name(self, name: str, budget: int) -> tuple[int, int, int] | None:
        """``(descriptor, length, bytes held)`` of a block (0: not held, over ``budget``); None if gone."""
        ...

    def release(self, name: str, times: int = 1) -> None:
        """Release ``times`` holds of ``name``."""
        ...


class BlockSocket:
    """Hands out memfd descriptors by handle name on a ``SOCK_SEQPACKET`` Unix socket."""

    def __init__(
        self, path: Path, resolve: Resolver, holds: Holds | None = None, hold_budget: int = 0
    ) -> None:
        self.path = path
        self.resolve = resolve
        self.holds = holds
        self.hold_budget = hold_budget if holds is not None else 0
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._file: SocketFile | None = None

    def publish(self) -> None:
        """Rename the bound socket onto the path: clients reach this socket from now on."""
        assert self._file is not None
        self._file.publish()

    def start(self, *, publish: bool = True) -> None:
        """Bind and accept in a daemon thread; ``publish``: at the path at once (else :meth:`publish`)."""
        self._sock, self._file = listen_unix(self.path, socket.SOCK_SEQPACKET)
        if publish:
            self.publish()
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
        held = _Held()
        try:
            peer = peer_of(conn)
            # A client that sends requests but never reads the answers cannot hold this thread (and
            # the descriptors in flight) for longer than this: the send fails, the connection closes.
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_TIMEOUT_SECONDS, 0))
            while not self._stop.is_set():
                data = conn.recv(bp.MAX_MESSAGE + 1)
                if not data:
                    return
                req = bp.parse_request(data) if len(data) <= bp.MAX_MESSAGE else None
                if req is None:
                    log.info("block socket: bad request", extra={"pid": peer.pid, "uid": peer.uid})
                    conn.send(bytes([bp.BAD_REQUEST]) + b"bad request")
                    return
                if req.hold:
                    self._answer_holding(conn, req, held)
                else:
                    self._answer(conn, req.names)
        except OSError as exc:
            if not self._stop.is_set():
                log.info("block socket connection failed", extra={"error": str(exc)})
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            # A closed connection holds nothing, whatever its client did (died, forgot, misbehaved).
            # (``held`` only ever fills when there is a tier to hold in.)
            for name, times in held.all():
                assert self.holds is not None
                self.holds.release(name, times)

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

    def _answer_holding(self, conn: socket.socket, req: bp.Request, held: _Held) -> None:
        for name in req.release:
            if held.drop(name):
                assert self.holds is not None  # held only fills when there is a tier to hold in
                self.holds.release(name)  # only this connection's own holds: never another client's
        if not req.names:
            conn.send(bytes([bp.RELEASED]))
            return
        status = bytearray()
        fds: list[int] = []
        try:
            for name in req.names:
                if self.holds is None:
                    lent = self.resolve(name)
                    got = None if lent is None else (lent[0], lent[1], 0)
                else:
                    # A block this connection holds already costs its budget nothing more.
                    left = self.hold_budget - held.bytes + held.size_of(name)
                    got = self.holds.hold_by_name(name, left)
                if got is None:
                    status.append(bp.GONE)
                    continue
                fd, _length, size = got
                fds.append(fd)
                if size:
                    held.add(name, size)
                status.append(bp.FOUND if size else bp.LENT)
            socket.send_fds(conn, [bytes(status)], fds)
        finally:
            for fd in fds:
                os.close(fd)

    def close(self) -> None:
        """Stop serving, drop every connection and remove the socket file if it is still this one."""
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
        if self._file is not None:
            self._file.remove()


class _Held:
    """One connection's holds: how often it holds each block, and their bytes (each block once)."""

    def __init__(self) -> None:
        self._times: dict[str, int] = {}
        self._size: dict[str, int] = {}
        self.bytes = 0

    def size_of(self, name: str) -> int:
        """Bytes ``name`` costs this connection's budget now (0 if it does not hold it)."""
        return self._size.get(name, 0)

    def add(self, name: str, size: int) -> None:
        if name not in self._times:
            self._size[name] = size
            self.bytes += size
        self._times[name] = self._times.get(name, 0) + 1

    def drop(self, name: str) -> bool:
        """Forget one hold of ``name``; False if this connection does not hold it."""
        times = self._times.get(name)
        if times is None:
            return False
        if times > 1:
            self._times[name] = times - 1
        else:
            del self._times[name]
            self.bytes -= self._size.pop(name)
        return True

    def all(self) -> list[tuple[str, int]]:
        """Every held name and how often (what closing the connection releases)."""
        return list(self._times.items())
