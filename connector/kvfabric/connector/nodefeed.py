"""An engine's KV events follow its node's cache server: what the residency feed says, announced.

The scheduler-side connector keeps one :class:`NodeResidency` per engine. It subscribes to the
node server's residency feed (:mod:`kvfabric.rpc.residency`) for the engine's namespace and keeps
the engine's :class:`~kvfabric.rpc.kvledger.EventLedger` equal to the server's residency, so vLLM's
publisher (which supplies the endpoint identity, sequence numbers and replay) sends:

* a ``BlockStored`` when a chunk enters an announced tier (DRAM, local NVMe), whichever engine on
  the node stored it: the storing connector attaches the chunk's metadata, the server hands it to
  every subscriber, so sibling engines get the credit too (a sibling's chunk waits until the chunk
  holding its parent block is announced: routers drop an event whose parent they do not know). This
  engine's own store is announced in DRAM in the step that hands it over and withdrawn if the feed
  does not confirm it within ``confirm_seconds`` (the server dropped it);
* a ``BlockRemoved`` when it leaves (eviction, TTL expiry, a delete, a restart), on the engine step
  after the server applied it (:meth:`NodeResidency.poll` runs in every ``take_events()``);
* on start (and after the server restarted: a new epoch) the node's current residency once, in
  prefix order, at most ``announce_per_step`` chunks per engine step, and the withdrawal of what
  the new snapshot no longer holds. A dropped connection withdraws DRAM at once (a restarted server
  has lost it; a successor that adopted it announces it again).

Metadata this engine stored is remembered (bounded) and described again to a restarted server,
whose metadata lived in memory. Non-blocking: every socket operation here returns at once.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Protocol

from kvfabric.client.errors import CacheUnavailable
from kvfabric.client.residency import ResidencyFeedClient
from kvfabric.rpc.kvledger import DEFAULT_MAX_KEYS, ChunkMeta, EventLedger, GroupTag
from kvfabric.rpc.residency import Change, decode_meta, encode_meta, meta_head, residency_socket_for

__all__ = ["FeedClient", "NodeResidency", "node_residency_for"]

log = logging.getLogger(__name__)

ANNOUNCED_TIERS = ("dram", "local_disk")
ANNOUNCE_PER_STEP = 128  # chunks decoded and announced per engine step (~0.1 ms each)
RETRY_SECONDS = 1.0  # after a failed connect; doubled per failure in a row, up to MAX_RETRY_SECONDS
MAX_RETRY_SECONDS = 30.0
STABLE_SECONDS = 30.0  # a connection that lived this long ends a run of failures (reconnect at once)
CONFIRM_SECONDS = 3.0  # a store the feed has not confirmed by then was dropped: withdrawn
CONNECT_TIMEOUT_SECONDS = 0.05
MAX_ORPHANS = 4096  # parents awaited by siblings' chunks (the oldest is given up)


class FeedClient(Protocol):
    """What :class:`NodeResidency` needs of a feed connection (:class:`ResidencyFeedClient`)."""

    def describe(self, key: str, meta: ChunkMeta | bytes) -> None:
        """Attach metadata (or its encoding) to a chunk."""

    def read(self, timeout: float = 0.0) -> list[Any]:
        """Messages that arrived (CacheUnavailable once the connection is gone)."""

    def close(self) -> None:
        """Hang up."""


class NodeResidency:
    """Keeps an engine's event ledger equal to its node cache server's residency."""

    def __init__(
        self,
        connect: Callable[[], FeedClient],
        ledger: EventLedger,
        *,
        announce_per_step: int = ANNOUNCE_PER_STEP,
        retry_seconds: float = RETRY_SECONDS,
        confirm_seconds: float = CONFIRM_SECONDS,
        remember: int = DEFAULT_MAX_KEYS,
        groups: Iterable[GroupTag] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Follow the feed ``connect()`` opens; announce into ``ledger``.

        ``groups``: this engine's model's KV cache groups (``vllmevents.group_tags``). Relayed
        metadata naming any other group is not this model's (engines sharing a namespace share the
        model): it is dropped and counted in :attr:`foreign_groups_dropped`, so one forged message
        cannot multiply every engine's events. Metadata without groups (one full-attention group)
        is always read.
        """
        self.groups = frozenset(groups)
        self._connect = connect
        self.ledger = ledger
        self.announce_per_step = announce_per_step
        self.retry_seconds = retry_seconds
        self.confirm_seconds = confirm_seconds
        self._unconfirmed: OrderedDict[str, float] = OrderedDict()  # key -> when to give up waiting
        self._remember = remember
        self._clock = clock
        self._client: FeedClient | None = None
        self._next_try = 0.0
        self._failures = 0  # connects failed or connections lost in a row (the backoff's exponent)
        self._synced_at: float | None = None
        self.epoch: int | None = None
        self._snapshot: list[Change] | None = None  # being read (between hello and synced)
        self.resident: dict[str, set[str]] = {}  # what the server said, announced tiers only
        self._metas: OrderedDict[str, bytes] = OrderedDict()
        self._own: OrderedDict[str, None] = OrderedDict()  # keys this engine stored (bounded likewise)
        self._orphans: dict[Any, list[tuple[str, str]]] = {}  # parent hash -> chunks waiting for it
        self._backlog: deque[tuple[str, str]] = deque()
        self.synced = False
        self.unconfirmed_withdrawn = 0
        self.foreign_groups_dropped = 0
        """Relayed chunks dropped unannounced: their metadata named groups this model does not have."""
        """Stores announced but not confirmed by the server in time (dropped there), withdrawn."""

    @property
    def connected(self) -> bool:
        """Whether the feed is followed now (its snapshot read)."""
        return self._client is not None and self.synced

    def describe(self, key: str, meta: ChunkMeta) -> None:
        """This engine hands ``key`` to the server: name it there, and announce it in DRAM now.

        A store lands in DRAM first, so it is announced in this step (an engine that goes idle
        after its last step would otherwise hold the announcement until its next request); the
        feed confirms it, and a store the server never confirms within ``confirm_seconds`` (dropped
        under back-pressure) is withdrawn.
        """
        raw = encode_meta(meta)
        self._remember_meta(key, raw)
        self._own[key] = None
        self._own.move_to_end(key)
        while len(self._own) > self._remember:
            self._own.popitem(last=False)
        if self._client is None and self._clock() >= self._next_try:
            self._open()  # an engine's first store can come before its first take_events()
        if key in self.resident:
            # The server holds it already (a store of it is dropped as present): credit what the
            # feed said it holds, and let the feed decide the rest.
            for tier in self.resident[key]:
                self._announce(key, tier)
        elif self._client is not None or self.epoch is None:
            # (Not while a server this engine followed is away: its stores fail meanwhile.)
            self.ledger.stored(key, "dram", meta)
        if self._client is not None and key not in self.resident:
            # In flight: a snapshot that does not list it yet must not withdraw it.
            self._unconfirmed[key] = self._clock() + self.confirm_seconds
            self._unconfirmed.move_to_end(key)  # deadlines stay in order
        if self._client is not None:
            try:
                self._client.describe(key, raw)
            except CacheUnavailable:
                self._lost()

    def _remember_meta(self, key: str, raw: bytes) -> None:
        """Keep a chunk's encoded metadata (about 1.6 KiB for 256 tokens; decoded only to announce)."""
        self._metas[key] = raw
        self._metas.move_to_end(key)
        while len(self._metas) > self._remember:
            self._metas.popitem(last=False)

    def in_flight(self, key: str) -> bool:
        """Whether ``key`` is announced on the strength of this engine's store, not yet confirmed."""
        return key in self._unconfirmed

    def poll(self) -> None:
        """Apply what the feed sent since the last call, and announce the next part of a backlog."""
        if self._client is None and self._clock() >= self._next_try:
            self._open()
        if self._client is not None:
            try:
                for message in self._client.read(0.0):
                    self._apply(message)
            except CacheUnavailable:
                self._lost()
            except ValueError as exc:  # a malformed message (DecodeError included): start again
                log.warning(
                    "the residency feed sent what this connector cannot read", extra={"error": str(exc)}
                )
                self._lost()
        self._expire_unconfirmed()
        self._drain()

    def _expire_unconfirmed(self) -> None:
        now = self._clock()
        while self._unconfirmed:
            key, deadline = next(iter(self._unconfirmed.items()))
            if deadline > now:
                return
            del self._unconfirmed[key]
            if self.connected and "dram" not in self.resident.get(key, ()):
                self.unconfirmed_withdrawn += 1
                self.ledger.removed(key, "dram")

    def close(self) -> None:
        """Stop following (the ledger keeps its credit)."""
        if self._client is not None:
            self._client.close()
            self._client = None

    # --- the feed ----------------------------------------------------------------------------------

    def _open(self) -> None:
        try:
            self._client = self._connect()
        except CacheUnavailable as exc:
            self._back_off()
            log.debug("no residency feed", extra={"error": str(exc)})
            return
        self.synced = False

    def _back_off(self) -> None:
        """Wait longer before each retry of a feed that keeps failing (a restart is retried at once)."""
        delay = 0.0 if self._failures == 0 else self.retry_seconds * 2 ** (self._failures - 1)
        self._failures = min(self._failures + 1, 32)
        self._next_try = self._clock() + min(delay, MAX_RETRY_SECONDS)

    def _lost(self) -> None:
        """The server hung up: it restarted or went away, and its DRAM with it."""
        if self._client is not None:
            self._client.close()
        self._client = None
        self.synced = False
        self._snapshot = None
        if self._synced_at is not None and self._clock() - self._synced_at >= STABLE_SECONDS:
            self._failures = 0  # it served a while: a restart, reconnect on the next step
        self._synced_at = None
        # A feed lost again and again (refused, evicted, overflowing) is retried ever later, rather
        # than withdrawing and re-announcing this engine's DRAM credit every step.
        self._back_off()
        self.ledger.cleared("dram")
        self._unconfirmed.clear()
        for tiers in self.resident.values():
            tiers.discard("dram")
        self._backlog = deque((k, t) for k, t in self._backlog if t != "dram")

    def _apply(self, message: Any) -> None:
        if isinstance(message, tuple):
            kind, value = message
            if kind == "hello":
                self.epoch = int(value)
                self._snapshot = []
            elif kind == "synced" and self._snapshot is not None:
                self._synced(self._snapshot)
                self._snapshot = None
            elif kind == "error":
                log.warning("the residency feed refused this connector", extra={"error": str(value)})
            return
        if not isinstance(message, Change) or message.tier not in ANNOUNCED_TIERS:
            return
        if message.has_meta and message.key not in self._metas:
            raw = message.meta_bin  # kept encoded: decoded when (and if) it is announced
            if raw is not None:
                self._remember_meta(message.key, raw)
        if self._snapshot is not None:
            self._snapshot.append(message)
            return
        tiers = self.resident.setdefault(message.key, set())
        if message.op == "stored":
            tiers.add(message.tier)
            if message.tier == "dram":
                self._unconfirmed.pop(message.key, None)
            if self._backlog:
                self._backlog.append((message.key, message.tier))  # after its parents
            else:
                self._announce(message.key, message.tier)
        else:
            tiers.discard(message.tier)
            if not tiers:
                del self.resident[message.key]
            self.ledger.removed(message.key, message.tier)

    def _synced(self, snapshot: list[Change]) -> None:
        """A snapshot replaces what this engine believed: withdraw what it lacks, queue the rest."""
        now: dict[str, set[str]] = {}
        for change in snapshot:
            now.setdefault(change.key, set()).add(change.tier)
        for tier in ANNOUNCED_TIERS:
            for key in self.ledger.keys_in(tier):
                in_flight = tier == "dram" and key in self._unconfirmed
                if tier not in now.get(str(key), ()) and not in_flight:
                    self.ledger.removed(key, tier)
        self.resident = now
        self._unconfirmed = OrderedDict(
            (k, d) for k, d in self._unconfirmed.items() if "dram" not in now.get(k, ())
        )
        self._backlog = deque(self._prefix_order([(c.key, c.tier) for c in snapshot]))
        self.synced = True
        self._synced_at = self._clock()
        # A restarted server lost the metadata of what its disk kept: describe what this engine knows.
        if self._client is not None:
            for change in snapshot:
                meta = self._metas.get(change.key)
                if not change.has_meta and meta is not None:
                    self._client.describe(change.key, meta)

    def _head(self, key: str) -> tuple[tuple[Any, ...], Any] | None:
        raw = self._metas.get(key)
        if raw is None:
            return None
        try:
            return meta_head(raw)
        except ValueError:
            return None

    def _prefix_order(self, entries: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """``entries`` with every chunk after the chunk holding its parent block (stable otherwise)."""
        heads = {key: self._head(key) for key, _ in entries}
        owner: dict[Hashable, str] = {}
        for key, head in heads.items():
            if head is not None:
                for h in head[0]:
                    owner.setdefault(h, key)
        depth: dict[str, int] = {}
        for key, _ in entries:
            chain: list[str] = []
            k: str | None = key
            while k is not None and k not in depth and k not in chain:
                chain.append(k)
                head = heads.get(k) if k in heads else self._head(k)
                parent = head[1] if head is not None else None
                k = owner.get(parent) if parent is not None else None
            base = depth.get(k, -1) if k is not None else -1
            for i, c in enumerate(reversed(chain)):
                depth[c] = base + 1 + i
        return sorted(entries, key=lambda e: depth.get(e[0], 0))

    def _drain(self) -> None:
        n = 0
        while self._backlog and n < self.announce_per_step:
            key, tier = self._backlog.popleft()
            if tier in self.resident.get(key, ()):
                n += self._announce(key, tier)

    def _announce(self, key: str, tier: str) -> int:
        raw = self._metas.get(key)
        if raw is None:
            return 0  # named later: the storing connector's metadata comes with a new record
        if self.ledger.holds(key, tier):
            return 0  # announced already (this engine's own store): nothing to decode
        meta = decode_meta(raw)
        if key not in self._own and not self.groups.issuperset(meta.groups):
            self.foreign_groups_dropped += 1
            if self.foreign_groups_dropped == 1:  # the first only: a forger would flood the log
                log.warning(
                    "the residency feed relayed a chunk named in KV cache groups this model lacks; "
                    "it is not announced",
                    extra={"key": key},
                )
            del self._metas[key]  # not this model's: never decoded again
            return 0
        parent = meta.parent_block_hash
        if key not in self._own and parent is not None and not self.ledger.announced(parent):
            # A sibling's chunk whose prefix this engine is not credited with (yet): routers drop
            # an event whose parent they do not know. It waits for its parent (bounded).
            self._orphans.setdefault(parent, []).append((key, tier))
            while len(self._orphans) > MAX_ORPHANS:
                del self._orphans[next(iter(self._orphans))]
            return 0
        self.ledger.stored(key, tier, meta)
        n = 1
        # Any of its blocks may be a waiting chunk's parent: a hybrid model's sliding-window object
        # starts inside the span whose full-attention object holds its parent.
        for h in meta.block_hashes:
            for child, child_tier in self._orphans.pop(h, []):
                if child_tier in self.resident.get(child, ()):
                    n += self._announce(child, child_tier)
        return n


def node_residency_for(
    socket: str | None, namespace: str, ledger: EventLedger, groups: Iterable[GroupTag] = ()
) -> NodeResidency | None:
    """The follower of the cache server at Unix socket ``socket`` (None without a socket).

    ``groups``: the engine's model's KV cache groups (relayed metadata naming others is dropped).
    """
    if socket is None:
        return None
    path = residency_socket_for(socket)
    return NodeResidency(
        lambda: ResidencyFeedClient(path, namespace, connect_timeout=CONNECT_TIMEOUT_SECONDS),
        ledger,
        groups=groups,
    )
