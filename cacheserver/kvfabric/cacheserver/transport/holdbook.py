"""Who holds which blocks on the block socket, within which budgets (the books of ``KVBH1``).

A same-node client keeps a loaded block mapped across loads by *holding* it
(:mod:`kvfabric.rpc.blockproto`); the DRAM tier keeps a held block charged, and its descriptor open,
until the last hold is released. Each held block therefore costs the server bytes *and* a
descriptor, and both are budgeted at two levels:

- **per client**: at most ``bytes_per_client`` bytes and ``blocks_per_client`` blocks, whatever
  number of connections the client opens. A client is the id it names itself by (``@<id>``, the
  gRPC socket's ``kvfabric-client`` id), or, for a connection naming none, what its peer credentials
  tell apart (:func:`anonymous_client`). A block the client holds already (on any of its connections)
  costs nothing more.
- **connections holding**: at most ``max_holding_connections`` connections hold anything at once
  (the block socket passes half its connection bound). A connection that holds something is never
  closed to make room for a newcomer, so without this bound one process could hold a single tiny
  block on every connection (each naming its own id) and have every newcomer refused. A hold
  beyond it is lent instead, as below.
- **in all**: the tier's share (:data:`~kvfabric.cacheserver.engine.dram.HELD_SHARE` of its bytes and
  of its descriptor cap), which the tier enforces itself (``hold_by_name``).

A hold beyond either budget is refused: the block is *lent* (sent, not held), and the client copies
it and unmaps, as it always could. Holds belong to the connection that took them: only it may release
them, and closing it releases all of them, whatever its client did.

Pure bookkeeping over a :class:`Holds` (the DRAM tier); no sockets. Not thread-safe: the block socket
calls it from its one loop thread (the tier locks itself).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["HoldBook", "Holds", "anonymous_client"]


class Holds(Protocol):
    """Where held blocks are accounted (the DRAM tier)."""

    max_held_blocks: int
    """The most blocks all clients together may hold (the tier's share of its descriptor cap)."""

    def hold_by_name(self, name: str, budget: int) -> tuple[int, int, int] | None:
        """``(descriptor, length, bytes held)`` of a block (0: not held, over ``budget``); None if gone."""
        ...

    def release(self, name: str, times: int = 1) -> None:
        """Release ``times`` holds of ``name``."""
        ...


def anonymous_client(pid: int, uid: int, conn: Hashable) -> str:
    """The client a connection that names no id belongs to, from its ``SO_PEERCRED``.

    A peer process this server can see (pid > 0: the same pid namespace) is one client however many
    connections it opens. A pid of 0 is a process in another pid namespace (another pod): all such
    look alike, so each connection is its own client there (sharing one budget among every old
    client on the node would starve them), bounded by the server-wide caps.
    """
    return f"pid:{pid}" if pid > 0 else f"conn:{uid}:{id(conn):x}"


@dataclass(slots=True)
class _Client:
    times: dict[str, int] = field(default_factory=dict)
    """Held name -> holds of it across the client's connections."""
    size: dict[str, int] = field(default_factory=dict)
    bytes: int = 0
    conns: int = 0


@dataclass(slots=True)
class _Conn:
    client: str
    times: dict[str, int] = field(default_factory=dict)


class HoldBook:
    """Holds per connection and per client, within the per-client budgets; the tier keeps the totals."""

    def __init__(
        self,
        holds: Holds,
        bytes_per_client: int,
        blocks_per_client: int,
        max_holding_connections: int | None = None,
    ) -> None:
        self.holds = holds
        self.bytes_per_client = bytes_per_client
        self.blocks_per_client = blocks_per_client
        self.max_holding_connections = max_holding_connections
        """Connections that may hold anything at once (None: no bound)."""
        self.holding_connections = 0
        """Connections holding at least one block now."""
        self._clients: dict[str, _Client] = {}
        self._conns: dict[Hashable, _Conn] = {}

    def open(self, conn: Hashable, client: str) -> None:
        """Start the books of connection ``conn``, which belongs to ``client``."""
        assert conn not in self._conns
        self._conns[conn] = _Conn(client)
        self._clients.setdefault(client, _Client()).conns += 1

    def hold(self, conn: Hashable, name: str) -> tuple[int, int, int] | None:
        """Send and, within the budgets, hold the block ``name`` for ``conn``.

        ``(descriptor, length, bytes held)`` as the tier's ``hold_by_name`` (0 bytes: lent, not
        held); None if the block is gone. The caller sends and closes the descriptor.
        """
        c = self._conns[conn]
        client = self._clients[c.client]
        if (
            not c.times
            and self.max_holding_connections is not None
            and self.holding_connections >= self.max_holding_connections
        ):
            left = 0  # enough connections hold already: this one is lent, and stays closable
        elif name in client.times:
            # Held by this client already: it costs the client's budget nothing more.
            left = self.bytes_per_client - client.bytes + client.size[name]
        elif len(client.times) >= self.blocks_per_client:
            left = 0  # out of blocks (descriptors): nothing more may be held, whatever its size
        else:
            left = self.bytes_per_client - client.bytes
        got = self.holds.hold_by_name(name, left)
        if got is not None and got[2]:
            if not c.times:
                self.holding_connections += 1
            c.times[name] = c.times.get(name, 0) + 1
            if name not in client.times:
                client.size[name] = got[2]
                client.bytes += got[2]
            client.times[name] = client.times.get(name, 0) + 1
        return got

    def holding(self, conn: Hashable) -> bool:
        """Whether ``conn`` holds any block (closing it would release something its client uses)."""
        c = self._conns.get(conn)
        return c is not None and bool(c.times)

    def release(self, conn: Hashable, name: str) -> bool:
        """Release one of ``conn``'s own holds of ``name``; False (nothing done) if it has none."""
        c = self._conns[conn]
        times = c.times.get(name)
        if times is None:
            return False
        if times > 1:
            c.times[name] = times - 1
        else:
            del c.times[name]
            if not c.times:
                self.holding_connections -= 1
        self._forget(c.client, name, 1)
        self.holds.release(name)
        return True

    def close(self, conn: Hashable) -> None:
        """Release everything ``conn`` holds and forget it (unknown connections are ignored)."""
        c = self._conns.pop(conn, None)
        if c is None:
            return
        client = self._clients[c.client]
        client.conns -= 1
        if c.times:
            self.holding_connections -= 1
        try:
            for name, times in c.times.items():
                self._forget(c.client, name, times)
                self.holds.release(name, times)
        finally:
            if not client.conns and not client.times:
                del self._clients[c.client]

    def _forget(self, client_id: str, name: str, times: int) -> None:
        client = self._clients[client_id]
        left = client.times[name] - times
        if left:
            client.times[name] = left
        else:
            del client.times[name]
            client.bytes -= client.size.pop(name)

    def usage(self, client: str) -> tuple[int, int]:
        """``(bytes, blocks)`` ``client`` holds now."""
        got = self._clients.get(client)
        return (0, 0) if got is None else (got.bytes, len(got.times))

    def held_by(self, conn: Hashable) -> dict[str, int]:
        """What ``conn`` holds: name -> how often."""
        c = self._conns.get(conn)
        return {} if c is None else dict(c.times)

    def clients(self) -> list[str]:
        """Every client with an open connection or a hold."""
        return list(self._clients)
