"""Handing a running server's DRAM to its successor on the same node (rollouts without a cold cache).

A DaemonSet rollout with ``maxSurge`` starts the new cache-server pod on a node while the old one
still serves, and deletes the old pod only once the new one is ready. The new server asks the old
one for its state over the *hand-over socket* (``<socket>.handover``, ``SOCK_SEQPACKET``, mode 0600,
in the server-owned socket directory), before it scans its disks:

1. successor → ``KVHO1 begin``. The predecessor checks the peer runs as its own uid
   (``SO_PEERCRED``), freezes its store (stores dropped, deletes refused, write-backs flushed:
   :meth:`TieredStore.freeze <kvfabric.cacheserver.engine.tiered.TieredStore.freeze>`) and answers
   with JSON messages: ``head`` (its generation clock), ``tombs`` (its deletes, in batches),
   ``blocks`` (index entries, each batch with one sealed memfd per entry over ``SCM_RIGHTS``, at most
   :data:`FDS_PER_MESSAGE`), then ``end``.
2. The successor learns the clock and deletes, scans its disks (nothing of the predecessor writes
   to them any more), adopts the memfds into its DRAM tier, binds the server's sockets (which
   replaces the predecessor's socket files: new connections reach the successor) and sends
   ``done``.
3. The predecessor then closes its listeners and every connection (clients reconnect to the same
   paths, now the successor's), leaves the socket files alone, and idles until it is terminated.

If the successor disconnects before ``done`` (it crashed, or gave up), the predecessor thaws and
goes on serving. If the predecessor cannot freeze in time, it answers ``abort`` and the successor
starts as if there were none. A successor that finds no hand-over socket, or nothing listening on
it (the predecessor was killed), starts from its disks as before. The memfds are the same memory:
nothing is copied, and the bytes are sealed, so the successor serves exactly what was stored.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.tiered import TieredStore
from kvfabric.rpc.fdpass import recv_fds

__all__ = ["FDS_PER_MESSAGE", "HandoverOffer", "Inbound", "handover_socket_for", "receive"]

log = logging.getLogger(__name__)

BEGIN = b"KVHO1 begin\n"
DONE = b"KVHO1 done\n"
FDS_PER_MESSAGE = 253
"""The kernel's ``SCM_MAX_FD``: descriptors one message may carry."""
TOMBS_PER_MESSAGE = 512
MAX_MESSAGE = 1 << 20


def handover_socket_for(unix_socket: str | os.PathLike[str]) -> Path:
    """Where the hand-over socket of the server listening on ``unix_socket`` is (beside it)."""
    p = Path(unix_socket)
    return p.with_name(p.name + ".handover")


def _peer_uid(conn: socket.socket) -> int:
    _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return int(uid)


def _send(conn: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(msg, separators=(",", ":")).encode()
    if fds:
        socket.send_fds(conn, [data], fds)
    else:
        conn.sendall(data)


class HandoverOffer:
    """The predecessor's side: offers the store to one successor at a time.

    ``on_done`` runs (on the offer's thread) once a successor took over; the server then retires.
    """

    def __init__(
        self,
        path: Path,
        store: TieredStore,
        on_done: Callable[[], None],
        *,
        freeze_timeout: float = 30.0,
    ) -> None:
        self.path = path
        self.store = store
        self.on_done = on_done
        self.freeze_timeout = freeze_timeout
        self.handed_over = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        """Bind (mode 0600: only the server's own uid may connect) and accept in a daemon thread."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old)
        sock.listen(2)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, name="handover", daemon=True)
        self._thread.start()

    def close(self, *, unlink: bool = True) -> None:
        """Stop offering; remove the socket file unless a successor owns that name now."""
        self._stop.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if unlink and not self.handed_over.is_set():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set() and not self.handed_over.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                try:
                    self._serve(conn)
                except Exception:
                    log.exception("hand-over failed; serving on")
                    self.store.thaw()

    def _serve(self, conn: socket.socket) -> None:
        if _peer_uid(conn) != os.getuid():
            log.warning("hand-over refused: the peer runs as another user", extra={"uid": _peer_uid(conn)})
            return
        conn.settimeout(5)
        if conn.recv(64) != BEGIN:
            return
        log.info("a successor asked for a hand-over: freezing")
        if not self.store.freeze(self.freeze_timeout):
            log.warning("hand-over aborted: storage did not settle in time")
            _send(conn, {"t": "abort", "reason": "storage did not settle"})
            return
        snap = self.store.export()
        sent = 0
        try:
            conn.settimeout(30)
            _send(conn, {"t": "head", "last_gen": snap.last_gen, "blocks": len(snap.blocks)})
            tombs = snap.tombstones
            for i in range(0, len(tombs), TOMBS_PER_MESSAGE):
                items = [[b.namespace, b.key, g] for b, g in tombs[i : i + TOMBS_PER_MESSAGE]]
                _send(conn, {"t": "tombs", "items": items})
            blocks = snap.blocks
            for i in range(0, len(blocks), FDS_PER_MESSAGE):
                batch = blocks[i : i + FDS_PER_MESSAGE]
                items = [[b.namespace, b.key, length, gen] for b, _fd, length, gen in batch]
                _send(conn, {"t": "blocks", "items": items}, [fd for _b, fd, _l, _g in batch])
                sent += len(batch)
            _send(conn, {"t": "end"})
        finally:
            for _b, fd, _l, _g in snap.blocks:
                os.close(fd)
        # The successor scans its disks now; it may take a while, and we keep serving loads meanwhile.
        conn.settimeout(None)
        answer = conn.recv(64)
        if answer != DONE:
            log.warning("the successor went away before taking over: thawing and serving on")
            self.store.thaw()
            return
        log.info("handed over to the successor", extra={"blocks": sent})
        self.handed_over.set()
        self.on_done()


@dataclass
class Inbound:
    """What a successor received: call :meth:`finish` once it serves, :meth:`close` if it gives up."""

    conn: socket.socket
    last_gen: int
    tombstones: list[tuple[BlockId, int]] = field(default_factory=list)
    blocks: list[tuple[BlockId, int, int, int]] = field(default_factory=list)
    """``(bid, fd, length, gen)``, least recently used first; ownership passes to whoever adopts them."""

    def finish(self) -> None:
        """Tell the predecessor this server took over (its sockets are bound)."""
        try:
            self.conn.sendall(DONE)
        finally:
            self.conn.close()

    def close(self) -> None:
        """Give up: the predecessor thaws and serves on. Closes descriptors not adopted yet."""
        self.conn.close()
        for _b, fd, _l, _g in self.blocks:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.blocks = []


def receive(path: Path, timeout: float = 60.0) -> Inbound | None:
    """Ask a predecessor listening at ``path`` for its state; None if there is none (or it refused).

    ``timeout`` bounds each message (the first waits for the predecessor's write-backs to settle).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(1.0)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError, PermissionError, TimeoutError) as exc:
        sock.close()
        log.info("no predecessor to take over from", extra={"reason": type(exc).__name__})
        return None
    inbound: Inbound | None = None
    try:
        if _peer_uid(sock) != os.getuid():
            log.warning("hand-over socket served by another user: ignored")
            sock.close()
            return None
        sock.settimeout(timeout)
        sock.sendall(BEGIN)
        while True:
            data, fds, flags = recv_fds(sock, MAX_MESSAGE, FDS_PER_MESSAGE)
            try:
                if not data:
                    raise ConnectionError("the predecessor closed the hand-over")
                if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
                    raise OSError("a hand-over message was truncated (out of descriptors?)")
                msg = json.loads(data)
                kind = msg.get("t")
                if kind == "abort":
                    log.warning("the predecessor aborted the hand-over", extra={"reason": msg.get("reason")})
                    sock.close()
                    return None
                if kind == "head":
                    inbound = Inbound(sock, int(msg["last_gen"]))
                elif inbound is None:
                    raise ValueError("hand-over message before its head")
                elif kind == "tombs":
                    inbound.tombstones.extend((BlockId.parse(ns, k), int(g)) for ns, k, g in msg["items"])
                elif kind == "blocks":
                    items = msg["items"]
                    if len(items) != len(fds):
                        raise ValueError("hand-over batch with a descriptor count unlike its entries")
                    parsed = [(BlockId.parse(ns, k), int(length), int(gen)) for ns, k, length, gen in items]
                    inbound.blocks.extend(
                        (bid, fd, length, gen) for (bid, length, gen), fd in zip(parsed, fds, strict=True)
                    )
                    fds = []  # the inbound owns them now
                elif kind == "end":
                    log.info(
                        "received the predecessor's state",
                        extra={"blocks": len(inbound.blocks), "tombstones": len(inbound.tombstones)},
                    )
                    return inbound
                else:
                    raise ValueError(f"unknown hand-over message {kind!r}")
            finally:
                for fd in fds:
                    os.close(fd)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("hand-over failed; starting from the disks", extra={"reason": str(exc)})
        if inbound is not None:
            inbound.close()
        else:
            sock.close()
        return None
