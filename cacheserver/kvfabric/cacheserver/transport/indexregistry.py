"""Which namespaces get a published table: the policy, apart from the memfds (pure, no I/O, no clock).

The index socket is reachable by every process on the node (mode 0666), and a namespace is a string
any of them can make up. So a table is a bounded resource handed out by rule:

* **Only for namespaces the server knows**: one with at least one block (the store published it),
  or one a client described over gRPC (``Describe``). A request for any other namespace is refused
  (the client asks over RPC, as for any refusal), so made-up names create nothing.
* **At most** ``capacity`` tables. A namespace with blocks outranks an empty one: to make room for it
  the least recently used empty table goes, even one a client still holds (the publisher retires
  it, so that client fetches again). A table with blocks is never evicted (its blocks would become
  invisible to same-node lookups); when all tables have blocks, a further namespace gets none and
  its clients ask over RPC.
* **Reclaimed when idle**: an empty table that no connection holds is dropped ``idle_seconds`` after
  its last use.

The caller passes ``now`` (monotonic seconds) so that the model-based test drives time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["Admit", "Decision", "TableRegistry"]


class Admit(enum.Enum):
    """What to do about a table request."""

    SERVE = "serve"  # the table exists: hand it out
    CREATE = "create"  # create it (after dropping ``Decision.evicted``), then hand it out
    UNKNOWN = "unknown"  # the server does not know the namespace: refuse
    FULL = "full"  # no room that may be made: refuse


@dataclass(frozen=True, slots=True)
class Decision:
    """An admission and the tables to drop before acting on it (retire them if held)."""

    admit: Admit
    evicted: tuple[str, ...] = ()


@dataclass(slots=True)
class _Entry:
    populated: bool = False  # at least one block
    holders: int = 0  # open connections that were handed this namespace's table
    last_used: float = 0.0


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

    # --- decisions -----------------------------------------------------------------------------------

    def request(self, namespace: str, *, known: bool, now: float) -> Decision:
        """A client asks for ``namespace``'s table; ``known``: described over gRPC."""
        entry = self._entries.get(namespace)
        if entry is not None:
            entry.last_used = now
            return Decision(Admit.SERVE)
        if not known:
            return Decision(Admit.UNKNOWN)
        # An empty namespace may take the place of an empty table no client holds, nothing else.
        victim = self._victim(held_too=False)
        if len(self._entries) >= self.capacity and victim is None:
            return Decision(Admit.FULL)
        evicted = self._make_room(victim)
        self._entries[namespace] = _Entry(last_used=now)
        return Decision(Admit.CREATE, evicted)

    def block_added(self, namespace: str, *, now: float) -> Decision:
        """The store holds a block of ``namespace`` that its table (if any) does not list yet."""
        entry = self._entries.get(namespace)
        if entry is not None:
            entry.populated = True
            entry.last_used = now
            return Decision(Admit.SERVE)
        victim = self._victim(held_too=True)
        if len(self._entries) >= self.capacity and victim is None:
            return Decision(Admit.FULL)
        evicted = self._make_room(victim)
        self._entries[namespace] = _Entry(populated=True, last_used=now)
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

    def _victim(self, *, held_too: bool) -> str | None:
        """The empty table to evict first: not held before held, then least recently used."""
        candidates = [
            (e.holders > 0, e.last_used, ns)
            for ns, e in self._entries.items()
            if not e.populated and (held_too or e.holders == 0)
        ]
        return min(candidates)[2] if candidates else None

    def _make_room(self, victim: str | None) -> tuple[str, ...]:
        if len(self._entries) < self.capacity or victim is None:
            return ()
        del self._entries[victim]
        return (victim,)
