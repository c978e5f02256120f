"""The residency feed: ordered per-tier changes of every chunk, streamed to same-node connectors.

Routers credit an engine with the chunks of its node's cache (KV events, ``docs/routing.md``); only
the cache server knows when a chunk enters or leaves a tier (a store, a write-back, a promotion, an
eviction, a TTL expiry, a delete, another server's delete on the shared volume). The store calls
:meth:`ResidencyFeed.changed` after every membership change (the same hook the published index
follows); the feed reads the block's tiers *then* (lock-free index checks), diffs them with what it
last told subscribers and queues ``stored``/``removed`` records, under one lock, so every
subscriber sees one order and the last record for a block is its current state.

Connectors attach :class:`~kvfabric.rpc.kvledger.ChunkMeta` (the engine's block hashes, parent,
tokens, ``extra_keys``, LoRA) to the chunks they store; the feed keeps it while any tier holds the
chunk (metadata for a chunk not resident yet waits in a table bounded in entries and bytes, the
oldest dropped first, and only for a namespace the server knows) and sends it with every
``stored`` record, so an engine can announce a chunk its sibling stored. One chunk's metadata is at
most :data:`~kvfabric.rpc.residency.MAX_META_BYTES`. The local disk keeps each chunk's metadata with
its copy (:meth:`ResidencyFeed.encoded` is what a write-back writes; the start-up scan hands it back
to :meth:`ResidencyFeed.restore`), so after a restart the snapshot names what the disk kept; names
that arrive after the write-back are handed to :attr:`ResidencyFeed.on_named`, which rewrites the
disk copy with them, and a chunk that leaves every tier for a moment (DRAM evicted before its
write-back landed) keeps its names in the pending table.

:class:`FeedSocket` serves it on a Unix stream socket beside the gRPC socket
(:func:`kvfabric.rpc.residency.residency_socket_for`), same exposure as the index socket (mode
0666 in the server-owned directory; ``authorize(namespace, peer)`` decides which namespaces a peer
may follow, all by default). Connections are bounded per peer process
(:data:`MAX_CONNECTIONS_PER_PEER`) and in all (:data:`MAX_CONNECTIONS`), by the index socket's rule
(:func:`~kvfabric.cacheserver.transport.indexregistry.connection_to_evict`): the oldest connection
of the peer holding the most is closed to make room, so one process hoarding connections cannot
keep an engine off the feed. A subscriber that falls :data:`MAX_QUEUED_BYTES` of live records
behind is disconnected: it reconnects and starts again from a snapshot, rather than the server
buffering without bound (the snapshot itself does not count against that bound, so a namespace
larger than it still reaches ``synced``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import secrets
import socket
import threading
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from kvfabric.cacheserver.engine.base import TierName
from kvfabric.cacheserver.engine.ids import BlockId, InvalidId
from kvfabric.cacheserver.transport.indexpub import Peer, listen_unix, peer_bound, peer_key, peer_of
from kvfabric.cacheserver.transport.indexregistry import connection_to_evict
from kvfabric.cacheserver.transport.socketfile import SocketFile
from kvfabric.rpc.kvevents import DecodeError
from kvfabric.rpc.kvledger import ChunkMeta
from kvfabric.rpc.residency import (
    MAX_CLIENT_FRAME,
    MAX_META_BYTES,
    Change,
    FrameReader,
    decode_meta,
    encode_meta,
    frame,
)

__all__ = ["FeedSocket", "FeedStats", "ResidencyFeed", "Subscription"]

log = logging.getLogger(__name__)

MAX_QUEUED_BYTES = 32 << 20  # live records one subscriber may be behind before it is disconnected
MAX_PENDING_META = 65_536  # metadata entries for chunks not (yet) resident
MAX_PENDING_BYTES = 16 << 20  # and their bytes (the oldest goes first past either)
MAX_NAMES_BYTES = 256 << 20  # metadata of resident chunks (limits.max_resident_names_bytes)
_OVERHEAD = 96  # bytes a queued frame or a pending entry costs beyond its payload (objects, links)
MAX_CONNECTIONS = 256
MAX_CONNECTIONS_PER_PEER = 16  # one engine process follows the few namespaces it serves
REQUEST_DEADLINE_SECONDS = 2.0


class FeedStats(NamedTuple):
    """The feed's numbers as the metrics export them."""

    subscribers: int
    """Subscriptions to a namespace the server knows (described, or holding a chunk) whose snapshot
    was delivered: the engines following the feed."""
    records: int
    """Records queued to subscribers so far."""
    pending_bytes: int
    """Bytes of metadata held for chunks not stored yet."""
    names_bytes: int
    """Bytes of the metadata of resident chunks."""
    names_dropped: dict[str, int]
    """Names of resident chunks dropped, by reason (``undecodable``, ``memory_bound``)."""


class Subscription:
    """One subscriber's queue of frames."""

    def __init__(self, namespace: str, max_queued_bytes: int) -> None:
        """An open subscription to ``namespace``."""
        self.namespace = namespace
        self._frames: deque[bytes] = deque()
        self._cond = threading.Condition()
        self._max = max_queued_bytes
        self._bytes = 0  # live bytes queued (the snapshot is not counted)
        self.closed = False
        self.overflowed = False
        self.delivered = False
        """Whether its snapshot (through ``synced``) was written to the subscriber's socket."""

    def push(self, frames: Iterable[bytes], *, counted: bool = True) -> None:
        """Queue ``frames``; past the byte bound (``counted`` ones only) the subscription closes."""
        with self._cond:
            if self.closed:
                return
            for f in frames:
                self._frames.append(f)
                if counted:
                    self._bytes += len(f) + _OVERHEAD
            if self._bytes > self._max:
                self.overflowed = self.closed = True
                self._frames.clear()
                self._bytes = 0
            self._cond.notify()

    def take(self, timeout: float) -> list[bytes] | None:
        """The queued frames (waiting up to ``timeout``); None once closed."""
        with self._cond:
            if not self._frames and not self.closed:
                self._cond.wait(timeout)
            if self.closed:
                return None
            out = list(self._frames)
            self._frames.clear()
            self._bytes = 0
            return out

    def close(self) -> None:
        """Stop queueing; wake the sender."""
        with self._cond:
            self.closed = True
            self._cond.notify()


class ResidencyFeed:
    """What every tier holds, per block, and the subscribers to each namespace's changes."""

    def __init__(
        self,
        tiers_of: Callable[[BlockId], list[str]],
        *,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
        max_pending_meta: int = MAX_PENDING_META,
        max_pending_bytes: int = MAX_PENDING_BYTES,
        max_names_bytes: int = MAX_NAMES_BYTES,
        known: Callable[[str], bool] | None = None,
    ) -> None:
        """``tiers_of(bid)``: the tiers indexing ``bid`` now, fastest first (index only).

        ``known(namespace)``: whether a client described the namespace (metadata for a chunk not
        resident yet is kept only for it, or for a namespace with a resident chunk).
        ``max_names_bytes``: the most the metadata of resident chunks may take; past it the names
        attached longest ago are dropped (their chunks stay served, unannounced until described
        again) and counted in :attr:`names_dropped`.
        """
        self._tiers_of = tiers_of
        self._max_queued = max_queued_bytes
        self._max_pending = max_pending_meta
        self._max_pending_bytes = max_pending_bytes
        self._known = known or (lambda namespace: False)
        self.pending_bytes = 0
        """Bytes of the metadata waiting for its chunk (bounded by ``max_pending_bytes``)."""
        self.refused = 0
        """Metadata dropped: for a namespace the server does not know."""
        self._max_names_bytes = max_names_bytes
        self.names_bytes = 0
        """Bytes of the metadata of resident chunks (bounded by ``max_names_bytes``)."""
        self._resident_per_ns: dict[str, int] = {}
        self.epoch = secrets.randbits(63)
        self._lock = threading.Lock()
        self._tiers: dict[BlockId, tuple[str, ...]] = {}
        # Metadata is kept encoded (about 1.6 KiB for 256 tokens, sent as is with every record),
        # with what :meth:`match` walks by: the content key, the chunk's token count, its last hash.
        self._names: OrderedDict[BlockId, _Names] = OrderedDict()  # attached longest ago first
        self._pending: OrderedDict[BlockId, _Names] = OrderedDict()  # oldest first
        self.names_dropped = {"undecodable": 0, "memory_bound": 0}
        """Names dropped while their chunk stays resident: read back from disk and not decodable,
        or the oldest past ``max_names_bytes``."""
        self.on_named: Callable[[BlockId], None] | None = None
        """Called (outside the lock) after a describe gave a resident chunk new names (disk rewrites)."""
        self._subs: dict[str, set[Subscription]] = {}
        # (namespace, parent hash, digest of the tokens, LoRA) -> the resident block they name, for
        # plain-text chunks (no extra keys), and per namespace the token lengths chunks have.
        self._by_content: dict[_ContentKey, BlockId] = {}
        self._lengths: dict[str, Counter[int]] = {}  # -> how many described chunks have each length
        self.records = 0
        """Records queued to subscribers (each subscriber counted), snapshots included."""

    def changed(self, bids: Iterable[BlockId]) -> None:
        """Record ``bids`` as the store holds them now (after every membership change)."""
        with self._lock:
            for bid in bids:
                now = tuple(self._tiers_of(bid))
                prev = self._tiers.get(bid, ())
                if now == prev:
                    continue
                if now:
                    if not prev:
                        self._resident_per_ns[bid.namespace] = self._resident_per_ns.get(bid.namespace, 0) + 1
                    self._tiers[bid] = now
                    if bid in self._pending:
                        self._set_meta(bid, self._pop_pending(bid))
                else:
                    del self._tiers[bid]
                    left = self._resident_per_ns.pop(bid.namespace) - 1
                    if left:
                        self._resident_per_ns[bid.namespace] = left
                    names = self._names.get(bid)
                    self._set_meta(bid, None)
                    if names is not None:
                        # Waits like names described early: a copy being written back (DRAM evicted
                        # first) or stored again takes them back when a tier indexes it.
                        self._pend(bid, names)
                subs = self._subs.get(bid.namespace)
                if subs:
                    raw = self._raw(bid)
                    changes = [Change("stored", bid.key, t, meta_bin=raw) for t in now if t not in prev]
                    changes += [Change("removed", bid.key, t) for t in prev if t not in now]
                    frames = [frame(c.to_wire()) for c in changes]
                    self.records += len(frames) * len(subs)
                    for sub in subs:
                        sub.push(frames)

    def describe(
        self, bid: BlockId, meta: ChunkMeta, raw: bytes | None = None, *, persist: bool = True
    ) -> None:
        """Attach ``meta`` (``raw``: its encoding) to ``bid``; subscribers get it per tier holding it.

        With ``persist``, new names for a resident chunk are handed to :attr:`on_named` too.
        """
        raw = encode_meta(meta) if raw is None else raw
        if len(raw) > MAX_META_BYTES:
            raise ValueError(f"meta: at most {MAX_META_BYTES} bytes per chunk, this one {len(raw)}")
        known = self._known(bid.namespace)  # outside the lock: it takes its own
        with self._lock:
            tiers = self._tiers.get(bid)
            if tiers is None:
                if not (known or bid.namespace in self._resident_per_ns):
                    self.refused += 1  # a made-up namespace reserves nothing
                    return
                self._pend(bid, _names_of(bid.namespace, meta, raw))
                return
            if self._raw(bid) == raw:
                return
            self._set_meta(bid, _names_of(bid.namespace, meta, raw))
            subs = self._subs.get(bid.namespace)
            if subs:
                frames = [frame(Change("stored", bid.key, t, meta_bin=raw).to_wire()) for t in tiers]
                self.records += len(frames) * len(subs)
                for sub in subs:
                    sub.push(frames)
        if persist and self.on_named is not None:
            self.on_named(bid)  # outside the lock: the disk copy may predate these names

    def encoded(self, bid: BlockId) -> bytes | None:
        """``bid``'s metadata as a connector sent it, while a tier holds it (what the disk keeps)."""
        return self._raw(bid)

    def restore(self, bid: BlockId, raw: bytes) -> None:
        """Attach metadata kept with ``bid``'s copy on disk (the start-up scan).

        Metadata that does not decode is dropped and counted (``names_dropped["undecodable"]``),
        never served: the chunk is then announced only once a connector describes it again. The
        names restored count against ``max_names_bytes`` like any.
        """
        try:
            if len(raw) > MAX_META_BYTES:
                raise ValueError(f"meta: at most {MAX_META_BYTES} bytes per chunk, this one {len(raw)}")
            meta = decode_meta(raw)
        except ValueError as exc:
            with self._lock:
                self.names_dropped["undecodable"] += 1
            log.warning("dropping metadata read back from disk", extra={"key": bid.key, "error": str(exc)})
            return
        self.describe(bid, meta, raw, persist=False)  # the disk copy has them already

    def _raw(self, bid: BlockId) -> bytes | None:
        names = self._names.get(bid)
        return None if names is None else names.raw

    def _pend(self, bid: BlockId, names: _Names) -> None:
        """Keep ``names`` until a tier indexes ``bid`` (under the lock; the oldest go past the bounds)."""
        if bid in self._pending:
            self._pop_pending(bid)
        self._pending[bid] = names
        self.pending_bytes += len(names.raw) + _OVERHEAD
        while len(self._pending) > self._max_pending or self.pending_bytes > self._max_pending_bytes:
            self._pop_pending(next(iter(self._pending)))

    def _pop_pending(self, bid: BlockId) -> _Names:
        names = self._pending.pop(bid)
        self.pending_bytes -= len(names.raw) + _OVERHEAD
        return names

    def _set_meta(self, bid: BlockId, names: _Names | None) -> None:
        """Attach (or with None drop) ``bid``'s metadata, keeping the content index equal to it."""
        old = self._names.pop(bid, None)
        if old is not None:
            self.names_bytes -= len(old.raw) + _OVERHEAD
        if old is not None and old.content is not None:
            if self._by_content.get(old.content) == bid:
                del self._by_content[old.content]
            lengths = self._lengths[bid.namespace]
            lengths[old.tokens] -= 1
            if lengths[old.tokens] <= 0:  # the query walks only the lengths chunks have now
                del lengths[old.tokens]
                if not lengths:
                    del self._lengths[bid.namespace]
        if names is None:
            return
        self._names[bid] = names
        self.names_bytes += len(names.raw) + _OVERHEAD
        if names.content is not None:
            self._by_content[names.content] = bid
            self._lengths.setdefault(bid.namespace, Counter())[names.tokens] += 1
        while self.names_bytes > self._max_names_bytes:
            # The chunk stays resident and served; only routers stop hearing of it (a subscriber
            # told of it already keeps what it was told; a new one gets it without names).
            self.names_dropped["memory_bound"] += 1
            self._set_meta(next(iter(self._names)), None)

    def match(self, namespace: str, token_ids: list[int], lora_name: str | None = None) -> dict[str, int]:
        """Tokens of the longest prefix of ``token_ids`` resident per tier, and in any tier (``any``).

        Walks chunk by chunk from the start of the prompt, each named by its parent block's hash and
        its tokens as a connector described it; a tier's count stops at the first chunk it does not
        hold. Only plain-text chunks (no ``extra_keys``: no cache salt, multimodal input or prompt
        embeddings) of ``lora_name`` match: a salted chunk must never answer an unsalted prompt.
        """
        with self._lock:
            lengths = sorted(self._lengths.get(namespace, ()), reverse=True)
            matched: dict[str, int] = {t.value: 0 for t in TierName} | {"any": 0}
            alive: set[str] | None = None
            parent: Any = None
            pos = 0
            while pos < len(token_ids):
                bid = None
                for n in lengths:
                    if pos + n <= len(token_ids):
                        digest = _tokens_digest(token_ids[pos : pos + n])
                        bid = self._by_content.get((namespace, parent, digest, lora_name))
                        if bid is not None:
                            break
                tiers = self._tiers.get(bid) if bid is not None else None
                walk = self._names.get(bid) if bid is not None else None
                if tiers is None or walk is None:
                    break
                alive = set(tiers) if alive is None else alive & set(tiers)
                for t in alive:
                    matched[t] += walk.tokens
                matched["any"] += walk.tokens
                parent = walk.last_hash
                pos += walk.tokens
            return matched

    def subscribe(self, namespace: str) -> Subscription:
        """A subscription to ``namespace``: hello, the snapshot, ``synced``, then live changes."""
        sub = Subscription(namespace, self._max_queued)
        with self._lock:
            frames = [frame(["hello", self.epoch, namespace])]
            for bid, tiers in self._tiers.items():
                if bid.namespace == namespace:
                    raw = self._raw(bid)
                    frames += [frame(Change("stored", bid.key, t, meta_bin=raw).to_wire()) for t in tiers]
            frames.append(frame(["synced"]))
            self.records += len(frames) - 2
            # Not counted against the live bound: a namespace larger than it still reaches synced
            # (what it costs is bounded by the namespace's resident chunks and the connection bounds).
            sub.push(frames, counted=False)
            self._subs.setdefault(namespace, set()).add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Forget ``sub`` (and close it)."""
        sub.close()
        with self._lock:
            subs = self._subs.get(sub.namespace)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[sub.namespace]

    def stats(self) -> FeedStats:
        """What the metrics export (:class:`FeedStats`)."""
        with self._lock:
            delivered = {ns: sum(s.delivered for s in subs) for ns, subs in self._subs.items()}
            resident = set(self._resident_per_ns)
            stats = FeedStats(0, self.records, self.pending_bytes, self.names_bytes, dict(self.names_dropped))
        # Only followers of a namespace the server knows, their snapshot delivered, count as engines
        # (status.cache.routingSubscribers): a connection to a made-up namespace is nobody's engine.
        # known() takes its own lock: called outside ours.
        followers = sum(n for ns, n in delivered.items() if n and (ns in resident or self._known(ns)))
        return stats._replace(subscribers=followers)


class FeedSocket:
    """Serves the feed on a Unix stream socket: a thread per connection (bounded), two per subscriber."""

    def __init__(
        self,
        path: Path,
        feed: ResidencyFeed,
        *,
        authorize: Callable[[str, Peer], bool] | None = None,
        max_connections: int = MAX_CONNECTIONS,
        max_connections_per_peer: int = MAX_CONNECTIONS_PER_PEER,
    ) -> None:
        """Serve ``feed`` at ``path`` (bound by :meth:`start`)."""
        self.path = path
        self.feed = feed
        self.authorize = authorize or (lambda namespace, peer: True)
        self.max_connections = max_connections
        self.max_connections_per_peer = max_connections_per_peer
        self._sock: socket.socket | None = None
        self._file: SocketFile | None = None
        self._stop = threading.Event()
        self._conns: dict[socket.socket, tuple[int, int]] = {}  # -> its peer
        self._by_peer: dict[tuple[int, int], dict[socket.socket, socket.socket]] = {}  # oldest first
        self.evicted = 0
        """Connections closed to make room for another (per-peer or total bound)."""
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self, *, publish: bool = True) -> None:
        """Bind and accept in a daemon thread; with ``publish``, at the path now (else :meth:`publish`)."""
        sock, self._file = listen_unix(self.path, socket.SOCK_STREAM)
        sock.settimeout(0.25)
        self._sock = sock
        if publish:
            self.publish()
        self._thread = threading.Thread(target=self._accept_loop, name="residency-feed", daemon=True)
        self._thread.start()

    def publish(self) -> None:
        """Rename the bound socket onto the path: clients reach this socket from now on."""
        assert self._file is not None
        self._file.publish()

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                self._stop.wait(0.1)  # EMFILE and the like: pause rather than spin
                continue
            try:
                peer = peer_key(peer_of(conn))
            except OSError:
                conn.close()
                continue
            with self._lock:
                victim = connection_to_evict(
                    self._by_peer,
                    peer,
                    len(self._conns),
                    own_bound=peer_bound(peer, self.max_connections_per_peer, self.max_connections),
                    total_bound=self.max_connections,
                )
                if victim is not None:
                    self._forget(victim)
                    self.evicted += 1
                    with contextlib.suppress(OSError):
                        victim.shutdown(socket.SHUT_RDWR)  # its threads end and close it
                self._conns[conn] = peer
                self._by_peer.setdefault(peer, {})[conn] = conn
            threading.Thread(target=self._serve, args=(conn,), name="residency-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        sub: Subscription | None = None
        try:
            conn.settimeout(REQUEST_DEADLINE_SECONDS)
            reader = FrameReader(MAX_CLIENT_FRAME)
            messages: list[list[Any]] = []
            while not messages:
                data = conn.recv(65536)
                if not data:
                    return
                messages = reader.feed(data)
            first, rest = messages[0], messages[1:]
            namespace = _namespace_of(first)  # ValueError naming what is wrong
            if not self.authorize(namespace, peer_of(conn)):
                _send_error(conn, f"sub namespace: this process may not follow {namespace}")
                return
            sub = self.feed.subscribe(namespace)
            sender = threading.Thread(target=self._send, args=(conn, sub), name="residency-send", daemon=True)
            sender.start()
            conn.settimeout(None)
            for message in rest:
                self._handle(namespace, message)
            while not self._stop.is_set() and not sub.closed:
                data = conn.recv(1 << 20)
                if not data:
                    return
                for message in reader.feed(data):
                    self._handle(namespace, message)
        except (OSError, DecodeError, ValueError) as exc:
            if not self._stop.is_set():
                log.debug("residency feed connection closed", extra={"error": str(exc)})
                with contextlib.suppress(OSError):
                    _send_error(conn, str(exc))
        finally:
            if sub is not None:
                self.feed.unsubscribe(sub)
            with self._lock:
                self._forget(conn)
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def _forget(self, conn: socket.socket) -> None:
        """Stop counting ``conn`` (under ``_lock``; idempotent)."""
        peer = self._conns.pop(conn, None)
        if peer is None:
            return
        mine = self._by_peer.get(peer)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self._by_peer[peer]

    def _handle(self, namespace: str, message: list[Any]) -> None:
        if message[0] != "meta":
            raise ValueError(f'message kind: after "sub" only "meta" messages are read, not {message[0]!r}')
        if len(message) != 3:
            raise ValueError(f'meta message: ["meta", <key>, <meta>], not {len(message)} fields')
        if not isinstance(message[1], str):
            raise ValueError("meta key: a string of 64 hex digits")
        try:
            bid = BlockId.parse(namespace, message[1])
        except InvalidId as exc:
            raise ValueError(f"meta key: {exc}") from None
        raw = message[2]
        if isinstance(raw, bytes) and len(raw) > MAX_META_BYTES:  # before decoding it
            raise ValueError(f"meta: at most {MAX_META_BYTES} bytes per chunk, this one {len(raw)}")
        self.feed.describe(bid, decode_meta(raw), raw)

    def _send(self, conn: socket.socket, sub: Subscription) -> None:
        try:
            while not self._stop.is_set():
                frames = sub.take(0.25)
                if frames is None:
                    break
                if frames:
                    conn.sendall(b"".join(frames))
                    sub.delivered = True  # the first batch holds the whole snapshot, synced included
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes the reader: the connection is over

    def close(self) -> None:
        """Stop accepting, close every connection and remove the socket file."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._sock is not None:
            self._sock.close()
        if self._file is not None:
            self._file.remove()


_ContentKey = tuple[str, Any, bytes, str | None]


@dataclass(frozen=True, slots=True)
class _Names:
    """A chunk's metadata as sent (``raw``), and what :meth:`ResidencyFeed.match` walks by.

    The decoded metadata is not kept: only the content key, the token count and the last hash.
    """

    raw: bytes
    content: _ContentKey | None  # None: a chunk the query must never match
    tokens: int
    last_hash: Any


def _tokens_digest(tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(array("I", tokens).tobytes(), digest_size=16).digest()


def _names_of(namespace: str, meta: ChunkMeta, raw: bytes) -> _Names:
    plain = meta.extra_keys is None or all(k is None or k == (meta.lora_name,) for k in meta.extra_keys)
    # A hybrid chunk is stored as one object per group kind, all named by the same parent and tokens:
    # only the full-attention object holds the whole chunk, so only it may answer the query (a
    # sliding-window or chunked-local object filed under the same content would replace it).
    plain = plain and all(g.kind in (None, "full_attention") for g in meta.groups)
    content = (
        (namespace, meta.parent_block_hash, _tokens_digest(meta.token_ids), meta.lora_name) if plain else None
    )
    return _Names(raw, content, len(meta.token_ids), meta.block_hashes[-1])


def _namespace_of(message: list[Any]) -> str:
    """The namespace a ``["sub", <namespace>]`` message follows; ValueError naming what is wrong."""
    if message[0] != "sub":
        raise ValueError(f'message kind: the first message is ["sub", <namespace>], not {message[0]!r}')
    if len(message) != 2:
        raise ValueError(f'sub message: ["sub", <namespace>], not {len(message)} fields')
    if not isinstance(message[1], str):
        raise ValueError("sub namespace: a string of 64 hex digits")
    try:
        BlockId.parse(message[1], "0" * 64)
    except InvalidId as exc:
        raise ValueError(f"sub namespace: {exc}") from None
    return message[1]


def _send_error(conn: socket.socket, text: str) -> None:
    conn.sendall(frame(["error", text]))
