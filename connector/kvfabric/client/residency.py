"""Following a same-node cache server's residency feed (:mod:`kvfabric.rpc.residency`).

:class:`ResidencyFeedClient` subscribes to one namespace, sends the metadata of the chunks this
process stores, and reads the server's ordered changes without blocking the caller longer than
the timeout it passes. A closed connection (the server restarted or went away) reads as
:class:`~kvfabric.client.errors.CacheUnavailable`; the caller reconnects and starts again from the
new snapshot (a new ``epoch``). So does a server that stops reading: metadata waiting to be sent is
bounded (:data:`MAX_OUTBOUND`), and past it the connection counts as lost. One :meth:`read` parses
at most :data:`MAX_READ_PER_CALL` bytes, so a caller's step stays short however much arrived.
"""

from __future__ import annotations

import contextlib
import select
import socket
from pathlib import Path
from typing import Any

from kvfabric.client.errors import CacheUnavailable
from kvfabric.rpc.kvledger import ChunkMeta
from kvfabric.rpc.residency import Change, FrameReader, encode_meta, frame

__all__ = ["MAX_OUTBOUND", "MAX_READ_PER_CALL", "FeedMessage", "ResidencyFeedClient"]

MAX_OUTBOUND = 8 << 20  # bytes of metadata not yet taken by the server (a hung server is lost past it)
MAX_READ_PER_CALL = 4 << 20  # bytes received and parsed per read(); the rest waits for the next

FeedMessage = Change | tuple[str, Any]
"""A change, or ``("hello", epoch)`` / ``("synced", None)`` / ``("error", text)``."""


class ResidencyFeedClient:
    """One subscription to a namespace's residency changes."""

    def __init__(self, path: str | Path, namespace: str, *, connect_timeout: float = 1.0) -> None:
        """Connect to the feed socket at ``path`` and subscribe to ``namespace``."""
        self.namespace = namespace
        self.epoch: int | None = None
        try:
            # Inside the try: out of descriptors (EMFILE) is an unavailable feed, like any other.
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        except OSError as exc:
            raise CacheUnavailable(f"residency feed at {path}: {exc}") from exc
        try:
            self._sock.settimeout(connect_timeout)
            self._sock.connect(str(path))
            self._sock.sendall(frame(["sub", namespace]))
            self._sock.setblocking(False)
        except OSError as exc:
            self._sock.close()
            raise CacheUnavailable(f"residency feed at {path}: {exc}") from exc
        self._reader = FrameReader()
        self._out = bytearray()
        self._eof = False

    def describe(self, key: str, meta: ChunkMeta | bytes) -> None:
        """Attach ``meta`` (or its :func:`~kvfabric.rpc.residency.encode_meta` bytes) to the chunk ``key``.

        Queued; sent now as far as the socket takes it, the rest by :meth:`read` or :meth:`flush`.
        CacheUnavailable once more than :data:`MAX_OUTBOUND` bytes wait (the server stopped reading).
        """
        raw = meta if isinstance(meta, bytes) else encode_meta(meta)
        self._out += frame(["meta", key, raw])
        self.flush()
        if len(self._out) > MAX_OUTBOUND:
            self._out.clear()
            self._eof = True
            raise CacheUnavailable(f"the residency feed took no metadata for {MAX_OUTBOUND} bytes: lost")

    def flush(self) -> None:
        """Send what the socket takes now without blocking."""
        while self._out:
            try:
                n = self._sock.send(self._out)
            except BlockingIOError:
                return
            except OSError as exc:
                raise CacheUnavailable(f"residency feed: {exc}") from exc
            del self._out[:n]

    def read(self, timeout: float = 0.0) -> list[FeedMessage]:
        """The messages that arrived, waiting up to ``timeout`` seconds for the first."""
        if self._eof:
            raise CacheUnavailable("the cache server closed its residency feed")
        self.flush()
        ready, _, _ = select.select([self._sock], [], [], timeout)
        out: list[FeedMessage] = []
        budget = MAX_READ_PER_CALL
        while ready and budget > 0:
            try:
                data = self._sock.recv(min(1 << 20, budget))
            except BlockingIOError:
                break
            except OSError as exc:
                raise CacheUnavailable(f"residency feed: {exc}") from exc
            if not data:
                self._eof = True  # what arrived before the hang-up is returned first
                if not out:
                    raise CacheUnavailable("the cache server closed its residency feed")
                break
            budget -= len(data)
            for message in self._reader.feed(data):
                out.append(self._parse(message))
        return out

    def _parse(self, message: list[Any]) -> FeedMessage:
        kind = message[0]
        if kind == "hello":
            self.epoch = int(message[1])
            return ("hello", self.epoch)
        if kind in ("synced", "error"):
            return (kind, message[1] if len(message) > 1 else None)
        return Change.from_wire(message)

    def close(self) -> None:
        """Unsubscribe (close the connection)."""
        with contextlib.suppress(OSError):
            self._sock.close()
