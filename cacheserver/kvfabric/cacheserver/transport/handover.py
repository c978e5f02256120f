"""Handing a running server's DRAM to its successor on the same node (rollouts without a cold cache).

A DaemonSet rollout with ``maxSurge`` starts the new cache-server pod on a node while the old one
still serves, and deletes the old pod only once the new one is ready. The new server asks the old
one for its state over the *hand-over socket* (``<socket name>.handover``, ``SOCK_SEQPACKET``, mode
0600, in ``handover.socket_dir``: a directory only cache servers reach, never a consumer), before it
scans its disks:

1. successor → ``KVHO1 begin``. The predecessor checks the peer runs as its own uid
   (``SO_PEERCRED``), freezes its store (stores dropped, deletes refused, write-backs flushed:
   :meth:`TieredStore.freeze <kvfabric.cacheserver.engine.tiered.TieredStore.freeze>`) and answers
   with JSON messages: ``head`` (its generation clock), ``tombs`` (its deletes, in batches),
   ``blocks`` (index entries, each batch with one sealed memfd per entry over ``SCM_RIGHTS``, at most
   :data:`FDS_PER_MESSAGE`), then ``end``.
2. The successor learns the clock and deletes, scans its disks (nothing of the predecessor writes
   to them any more), adopts the memfds into its DRAM tier, binds its sockets under fresh names,
   freezes its own store and sends ``done``; the predecessor commits (it will never thaw again)
   and answers ``go``.
3. The successor renames its sockets onto the paths (replacing the predecessor's files in one
   step: a client connecting from now on reaches it, none ever finds no socket) and sends
   ``published``. Meanwhile both serve loads, of the same frozen state.
4. The predecessor closes its listeners and every connection (clients reconnect to the paths: the
   successor) and answers ``released``; only then does the successor take changes (thaw), so
   nothing the old server still answers can contradict a delete the new one takes.

Failures, and why none leaves two servers serving one node's disks:

* the successor goes away, or does not say ``done`` within ``successor_timeout``: the predecessor
  thaws and serves on (catching up on what the freeze held back);
* the predecessor cannot freeze in time (it answers ``abort``), the exchange breaks, or after
  ``done`` the predecessor is still offering (it had timed out and thawed): the successor exits
  with an error instead of serving beside it, and its restart tries again;
* the predecessor dies at any point (nothing listens on the hand-over socket any more): the
  successor starts as if there were none, from its disks.

A successor that finds no hand-over socket, or nothing listening on it, starts from its disks as
before. The memfds are the same memory: nothing is copied, and the bytes are sealed, so the successor
serves exactly what was stored.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.tiered import TieredStore
from kvfabric.cacheserver.transport.indexpub import peer_of
from kvfabric.cacheserver.transport.socketfile import SocketFile
from kvfabric.rpc.fdpass import recv_fds

__all__ = ["FDS_PER_MESSAGE", "HandoverFailed", "HandoverOffer", "Inbound", "handover_socket_for", "receive"]

log = logging.getLogger(__name__)

BEGIN = b"KVHO1 begin\n"
DONE = b"KVHO1 done\n"
GO = b"KVHO1 go\n"
PUBLISHED = b"KVHO1 published\n"
RELEASED = b"KVHO1 released\n"
FDS_PER_MESSAGE = 253
"""The kernel's ``SCM_MAX_FD``: descriptors one message may carry."""
TOMBS_PER_MESSAGE = 512
MAX_MESSAGE = 1 << 20


def handover_socket_for(unix_socket: str | os.PathLike[str]) -> Path:
    """Where the hand-over socket of the server listening on ``unix_socket`` is (beside it)."""
    p = Path(unix_socket)
    return p.with_name(p.name + ".handover")


def _send(conn: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(msg, separators=(",", ":")).encode()
    if fds:
        socket.send_fds(conn, [data], fds)
    else:
        conn.sendall(data)


class HandoverFailed(RuntimeError):  # noqa: N818 - reads better at the call sites
    """A live predecessor did not hand over: the successor must not serve beside it (exit, retry)."""


class HandoverOffer:
    """The predecessor's side: offers the store to one successor at a time.

    ``on_done`` runs (on the offer's thread) once a successor took over; the server then closes its
    listeners and connections and calls :meth:`release`.
    """

    def __init__(
        self,
        path: Path,
        store: TieredStore,
        on_done: Callable[[], None],
        *,
        freeze_timeout: float = 30.0,
        successor_timeout: float = 600.0,
    ) -> None:
        self.path = path
        self.store = store
        self.on_done = on_done
        self.freeze_timeout = freeze_timeout
        self.successor_timeout = successor_timeout
        self.handed_over = threading.Event()
        self._released = threading.Event()
        self._sock: socket.socket | None = None
        self._file = SocketFile(path)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        """Bind (mode 0600: only the server's own uid may connect) and accept in a daemon thread."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            old = os.umask(0o177)
            try:
                sock.bind(str(self._file.bound))
            finally:
                os.umask(old)
            sock.listen(2)
            self._file.publish()
        except BaseException:
            sock.close()
            self._file.remove()
            raise
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, name="handover", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Say the listeners and connections are closed: the successor may serve now."""
        self._released.set()

    def close(self) -> None:
        """Stop offering; remove the socket file unless a successor's has that name now."""
        self._stop.set()
        self._released.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._file.remove()

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
                    log.exception("hand-over failed")
                finally:
                    if not self.handed_over.is_set():
                        self.store.thaw()  # serve on (a no-op if it never froze)

    def _serve(self, conn: socket.socket) -> None:
        uid = peer_of(conn).uid
        if uid != os.getuid():
            log.warning("hand-over refused: the peer runs as another user", extra={"uid": uid})
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
        conn.settimeout(30)
        _send(conn, {"t": "head", "last_gen": snap.last_gen, "blocks": len(snap.blocks)})
        tombs = snap.tombstones
        for i in range(0, len(tombs), TOMBS_PER_MESSAGE):
            items = [[b.namespace, b.key, g] for b, g in tombs[i : i + TOMBS_PER_MESSAGE]]
            _send(conn, {"t": "tombs", "items": items})
        sent = 0
        for i in range(0, len(snap.blocks), FDS_PER_MESSAGE):
            # Duplicated per batch, so at most one batch of extra descriptors is ever open. A block
            # evicted meanwhile (a load's promotion made room) is simply not sent.
            entries: list[list[Any]] = []
            fds: list[int] = []
            try:
                for bid, name, _length, gen in snap.blocks[i : i + FDS_PER_MESSAGE]:
                    got = self.store.dram.dup_by_name(name)
                    if got is not None:
                        fds.append(got[0])
                        entries.append([bid.namespace, bid.key, got[1], gen])
                if fds:
                    _send(conn, {"t": "blocks", "items": entries}, fds)
            finally:
                for fd in fds:
                    os.close(fd)
            sent += len(fds)
        _send(conn, {"t": "end"})
        # The successor scans its disks now (loads are still served here meanwhile), but not forever:
        # a hung successor must not keep this server frozen.
        conn.settimeout(self.successor_timeout)
        try:
            answer = conn.recv(64)
        except TimeoutError:
            answer = b""
        if answer != DONE:
            log.warning("the successor did not take over: thawing and serving on")
            return
        # Committed: never thawed from here, whatever the successor does next.
        self.handed_over.set()
        log.info("handing over to the successor", extra={"blocks": sent})
        with contextlib.suppress(OSError):
            conn.settimeout(30)
            conn.sendall(GO)
            conn.recv(64)  # "published" (or the successor died: retire all the same)
        self.on_done()
        # Answer once nothing of ours serves any more: the successor takes changes from then on.
        if self._released.wait(30):
            with contextlib.suppress(OSError):
                conn.sendall(RELEASED)
        log.info("handed over to the successor")


@dataclass
class Inbound:
    """What a successor received: :meth:`commit`, publish, :meth:`published`; or :meth:`close`."""

    conn: socket.socket
    path: Path
    last_gen: int
    tombstones: list[tuple[BlockId, int]] = field(default_factory=list)
    blocks: list[tuple[BlockId, int, int, int]] = field(default_factory=list)
    """``(bid, fd, length, gen)``, least recently used first; ownership passes to whoever adopts them."""

    def commit(self, timeout: float = 30.0) -> None:
        """Say ``done``: the predecessor commits to retiring (before our sockets are published).

        Raises :class:`HandoverFailed` if it did not and is still offering (it timed out and thawed):
        serving now would put two servers on one node's disks. A predecessor that died meanwhile is
        fine: nothing serves beside us.
        """
        try:
            self.conn.settimeout(timeout)
            self.conn.sendall(DONE)
            answer = self.conn.recv(64)
        except OSError:
            answer = b""
        if answer == GO:
            return
        self.conn.close()
        if _offering(self.path):
            raise HandoverFailed("the predecessor is still serving: it did not take the hand-over")
        log.warning("the predecessor went away during the hand-over; serving")

    def published(self, timeout: float = 30.0) -> None:
        """Say our sockets are published, and wait until the predecessor answers nothing any more."""
        try:
            self.conn.settimeout(timeout)
            self.conn.sendall(PUBLISHED)
            self.conn.recv(64)  # "released", or the predecessor is gone: either way it serves nothing
        except OSError:
            pass
        finally:
            self.conn.close()

    def close(self) -> None:
        """Give up: the predecessor thaws and serves on. Closes descriptors not adopted yet."""
        self.conn.close()
        for _b, fd, _l, _g in self.blocks:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.blocks = []


def _offering(path: Path) -> bool:
    """Whether a server still accepts hand-over connections at ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


def receive(path: Path, timeout: float = 60.0) -> Inbound | None:
    """Ask a predecessor listening at ``path`` for its state; None if there is none (or it died).

    ``timeout`` bounds each message (the first waits for the predecessor's write-backs to settle).
    Raises :class:`HandoverFailed` when a predecessor is alive but the hand-over did not happen (it
    aborted, or the exchange broke): the caller must not serve beside it.
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
        if peer_of(sock).uid != os.getuid():
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
                    raise HandoverFailed(f"the predecessor aborted the hand-over: {msg.get('reason')}")
                if kind == "head":
                    inbound = Inbound(sock, path, int(msg["last_gen"]))
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
    except (OSError, ValueError, KeyError, TypeError, HandoverFailed) as exc:
        if inbound is not None:
            inbound.close()
        else:
            sock.close()
        if isinstance(exc, HandoverFailed) or _offering(path):
            raise HandoverFailed(f"a live predecessor did not hand over: {exc}") from exc
        log.warning("the predecessor went away during the hand-over; starting from the disks")
        return None
