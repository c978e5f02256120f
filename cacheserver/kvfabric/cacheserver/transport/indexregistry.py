"""Which namespaces get a published table: the policy, apart from the memfds (pure, no I/O, no clock).

The index socket is reachable by every process on the node (mode 0666), and a namespace is a string
any of them can make up, and any of them may store blocks under. So a table is a bounded resource
handed out by rule, ranked by how recently a client *asked* for it (storing a block is not asking):

* **Only for namespaces the server knows**: one with at least one block in the store, or one a
  client described over gRPC (``Describe``). A request for any other namespace is refused (the
  client asks over RPC, as for any refusal), so made-up names create nothing.
* **At most** ``capacity`` tables. A request for a known namespace always gets a table: to make room,
  the table asked for least recently goes, whether it lists blocks or not, even one a client still
  holds (the publisher retires it, so that client fetches again, which counts as asking). So a
  namespace nobody asks for (e.g. blocks stored under made-up names) cannot keep an engine that asks
  for its own from getting one. The evicted table's blocks stay in the store, and a table made again
  lists them (the publisher keeps them while the namespace has no table).
* A block arriving for a namespace without a table takes a free place, or the place of an empty
  table nobody holds; it evicts nothing else (a store is not a use). Otherwise the namespace gets
  its table when a client asks for it.
* **Reclaimed when idle**: an empty table that no connection holds is dropped ``idle_seconds`` after
  its last use.

The caller passes ``now`` (monotonic seconds) so that the model-based test drives time.

:func:`connection_to_evict` is the rule both same-node sockets (index and residency feed) bound
held connections by: per peer process and in all, the oldest of whoever holds most giving way.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["Admit", "Decision", "TableRegistry", "connection_to_evict"]

_K = TypeVar("_K")
_V = TypeVar("_V")


def connection_to_evict(
    held_by_peer: Mapping[_K, Mapping[Any, _V]], peer: _K, held: int, *, own_bound: int, total_bound: int
) -> _V | None:
    """Before ``peer`` holds one more connection: the one to close first, or None if there is room.

    ``held_by_peer``: each peer's held connections, oldest first; ``held``: all of them. Over its own
    bound, the peer's own oldest goes; at the total bound, the oldest of the peer holding the most.
    Nobody is refused, and a peer holding few connections (an engine) loses none to one hoarding many.
    """
    own = held_by_peer.get(peer, {})
    if len(own) >= own_bound:
        return next(iter(own.values()))
    if held >= total_bound and held_by_peer:
        most = max(held_by_peer.values(), key=len)
        return next(iter(most.values()))
    return None


class Admit(enum.Enum):
    """What to do about a table request."""

    SERVE = "serve"  # the table exists: hand it out
    CREATE = "create"  # create it (after dropping ``Decision.evicted``), then hand it out
    UNKNOWN = "unknown"  # the server does not know the namespace: refuse
    FULL = "full"  # no room that may be made (only for a block arriving, never for a request)


@dataclass(frozen=True, slots=True)
class Decision:
    """An admission and the tables to drop before acting on it (retire them if held)."""

    admit: Admit
    evicted: tuple[str, ...] = ()


@dataclass(slots=True)
class _Entry:
    requested: float  # when a client last asked for this table (or it was made): the eviction rank
    last_used: float  # requested, released or emptied: the idle clock of reclaim
    populated: bool = False  # at least one block
    holders: int = 0  # open connections that were handed this namespace's table


@dataclass
class TableRegistry:
    """The set of namespaces with a table, and the rules above. Not thread-safe (the publisher locks)."""

    capacity: int
    idle_seconds: float
    _entries: dict[str, _Entry] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError("capacity must be at least 1")

    def __contains__(self, namespace: object) -> bool:
        return namespace in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def namespaces(self) -> list[str]:
        """Namespaces with a table, sorted."""
        return sorted(self._entries)

    def holders(self, namespace: str) -> int:
        """Connections holding ``namespace``'s table (0 if it has none)."""
        entry = self._entries.get(namespace)
        return entry.holders if entry is not None else 0

    def populated(self, namespace: str) -> bool:
        """Whether ``namespace`` has a table with at least one block."""
        entry = self._entries.get(namespace)
        return entry is not None and entry.populated

    def requested(self, namespace: str) -> float | None:
        """When a client last asked for ``namespace``'s table (or it was made); None if it has none."""
        entry = self._entries.get(namespace)
        return entry.requested if entry is not None else None

    # --- decisions -----------------------------------------------------------------------------------

    def request(self, namespace: str, *, known: bool, populated: bool = False, now: float) -> Decision:
        """A client asks for ``namespace``'s table.

        ``known``: described over gRPC; ``populated``: the store holds blocks of it (the publisher
        keeps them while it has no table). Either entitles it to a table, at the expense of the
        table asked for least recently when all places are taken.
        """
        entry = self._entries.get(namespace)
        if entry is not None:
            entry.requested = entry.last_used = now
            return Decision(Admit.SERVE)
        if not (known or populated):
            return Decision(Admit.UNKNOWN)
        evicted = self._make_room(self._least_recently_requested())
        self._entries[namespace] = _Entry(now, now, populated=populated)
        return Decision(Admit.CREATE, evicted)

    def block_added(self, namespace: str, *, now: float) -> Decision:
        """The store holds a block of ``namespace`` that its table (if any) does not list yet."""
        entry = self._entries.get(namespace)
        if entry is not None:
            entry.populated = True  # not a use: storing does not keep a table from eviction
            return Decision(Admit.SERVE)
        victim = self._unused_empty()
        if len(self._entries) >= self.capacity and victim is None:
            return Decision(Admit.FULL)
        evicted = self._make_room(victim)
        self._entries[namespace] = _Entry(now, now, populated=True)
        return Decision(Admit.CREATE, evicted)

    def emptied(self, namespace: str, *, now: float) -> None:
        """``namespace``'s table lists no block any more (it may now be reclaimed when idle)."""
        entry = self._entries.get(namespace)
        if entry is not None:
            entry.populated = False
            entry.last_used = now

    def hold(self, namespace: str) -> None:
        """A connection was handed ``namespace``'s table and stays open."""
        entry = self._entries.get(namespace)
        if entry is not None:
            entry.holders += 1

    def release(self, namespace: str, *, now: float) -> None:
        """A connection that held ``namespace``'s table closed."""
        entry = self._entries.get(namespace)
        if entry is not None and entry.holders > 0:
            entry.holders -= 1
            entry.last_used = now

    def reclaim(self, now: float) -> list[str]:
        """Drop (and return) every empty table no connection holds, idle for ``idle_seconds``."""
        gone = [
            ns
            for ns, e in self._entries.items()
            if not e.populated and e.holders == 0 and now - e.last_used >= self.idle_seconds
        ]
        for ns in gone:
            del self._entries[ns]
        return gone

    # --- helpers -------------------------------------------------------------------------------------

    def _least_recently_requested(self) -> str | None:
        """The table to evict for a request: asked for least recently; among equals, unheld and empty."""
        ranked = [(e.requested, e.holders > 0, e.populated, ns) for ns, e in self._entries.items()]
        return min(ranked)[3] if ranked else None

    def _unused_empty(self) -> str | None:
        """The table a block arriving may take the place of: empty, unheld, asked for least recently."""
        ranked = [(e.requested, ns) for ns, e in self._entries.items() if not e.populated and e.holders == 0]
        return min(ranked)[1] if ranked else None

    def _make_room(self, victim: str | None) -> tuple[str, ...]:
        if len(self._entries) < self.capacity or victim is None:
            return ()
        del self._entries[victim]
        return (victim,)
