"""The descriptors a socket has sent that its clients have not received yet: counted, and bounded.

The kernel charges descriptors in flight on Unix sockets to the sending user, all its processes
together, and past that user's open-files limit every ``sendmsg`` carrying a descriptor fails
(``ETOOMANYREFS``) for every client of every server of that user on the node. So the block socket
(:mod:`kvfabric.cacheserver.transport.blocksock`) counts each connection's answer until its client
has received it, and refuses an answer that would pass a bound: in all, ``max_fds`` descriptors on
at most ``max_connections`` connections, and per peer uid an eighth of each (at least one answer's
:data:`~kvfabric.rpc.blockproto.MAX_NAMES` on 8 connections), so one tenant (uid) cannot take the
whole bound from the others.

Bookkeeping only, no I/O: whether an answer was received (an ``ioctl``) is the socket's to find out,
and it tells this book (:meth:`UnreadBook.remove`). ``tests/cacheserver/test_cacheserver_unreadbook.py``
checks it against a model of the counts.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

from kvfabric.rpc import blockproto as bp

__all__ = ["UID_SHARE", "UnreadBook"]

UID_SHARE = 8
"""Each peer uid may have this fraction (1/8) of both bounds in flight."""

C = TypeVar("C", bound=Hashable)


class UnreadBook(Generic[C]):
    """Descriptors in answers not yet received, per connection, per peer uid and in all.

    A connection is counted from its first counted answer until :meth:`remove`, whether it is still
    open or closed with its answer in flight. Not thread-safe: one loop owns it.
    """

    def __init__(self, max_fds: int, max_connections: int) -> None:
        """``max_fds`` descriptors in all, on at most ``max_connections`` connections."""
        self.max_fds = max_fds
        self.max_connections = max_connections
        self.fds_per_uid = max(bp.MAX_NAMES, max_fds // UID_SHARE)
        """Descriptors one peer uid may have in flight."""
        self.conns_per_uid = max(8, max_connections // UID_SHARE)
        """Connections of one peer uid that may have answers in flight."""
        self.total = 0
        """Descriptors in flight, all connections together."""
        self._conns: dict[C, tuple[int, int]] = {}  # conn -> (uid, descriptors)
        self._by_uid: dict[int, tuple[int, int]] = {}  # uid -> (descriptors, connections)

    def __len__(self) -> int:
        """Connections with descriptors in flight."""
        return len(self._conns)

    def __contains__(self, conn: object) -> bool:
        return conn in self._conns

    def of(self, conn: C) -> int:
        """Descriptors counted for ``conn`` (0 if none)."""
        got = self._conns.get(conn)
        return 0 if got is None else got[1]

    def connections(self, uid: int | None = None) -> list[C]:
        """The connections counted (of peer ``uid`` only, if given), oldest first."""
        if uid is None:
            return list(self._conns)
        if uid not in self._by_uid:
            return []
        return [c for c, (u, _) in self._conns.items() if u == uid]

    def fits(self, conn: C, uid: int, n: int) -> bool:
        """Whether ``n`` more descriptors on ``conn`` (of peer ``uid``) stay within every bound."""
        new = 0 if conn in self._conns else 1
        fds, conns = self._by_uid.get(uid, (0, 0))
        return (
            self.total + n <= self.max_fds
            and len(self._conns) + new <= self.max_connections
            and fds + n <= self.fds_per_uid
            and conns + new <= self.conns_per_uid
        )

    def add(self, conn: C, uid: int, n: int) -> None:
        """Count ``n`` descriptors sent on ``conn`` (its peer being ``uid``)."""
        fds, conns = self._by_uid.get(uid, (0, 0))
        got = self._conns.get(conn)
        if got is None:
            conns += 1
            had = 0
        else:
            if got[0] != uid:
                raise ValueError("a connection's peer uid does not change")
            had = got[1]
        self._conns[conn] = (uid, had + n)
        self.total += n
        self._by_uid[uid] = (fds + n, conns)

    def remove(self, conn: C) -> None:
        """Count nothing for ``conn`` any more (its client received everything, or hung up)."""
        got = self._conns.pop(conn, None)
        if got is None:
            return
        uid, n = got
        self.total -= n
        fds, conns = self._by_uid[uid]
        if conns > 1:
            self._by_uid[uid] = (fds - n, conns - 1)
        else:
            del self._by_uid[uid]

    def clear(self) -> None:
        """Count nothing (the socket closed)."""
        self._conns.clear()
        self._by_uid.clear()
        self.total = 0
