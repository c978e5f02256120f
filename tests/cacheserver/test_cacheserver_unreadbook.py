"""The unread-descriptor book against a model: counts in all and per uid, and the bounds it enforces.

The block socket refuses an answer when :meth:`UnreadBook.fits` says no, and one tenant's unread
answers must never be able to take another's share. A count that drifted (a connection removed
twice, added under another uid) would either refuse every tenant for good or let one pass the
kernel's limit; the state machine checks every count after every step.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvfabric.cacheserver.transport.unreadbook import UID_SHARE, UnreadBook
from kvfabric.rpc import blockproto as bp

MAX_FDS = 16 * bp.MAX_NAMES
MAX_CONNS = 128
conns = st.integers(0, 40)
uids = st.integers(0, 3)
sizes = st.integers(1, bp.MAX_NAMES)


class Book(RuleBasedStateMachine):
    """Adds and removes as the socket makes them, only when the book says they fit."""

    def __init__(self) -> None:
        super().__init__()
        self.book: UnreadBook[int] = UnreadBook(MAX_FDS, MAX_CONNS)
        self.model: dict[int, tuple[int, int]] = {}  # conn -> (uid, descriptors)
        self.uid_of: dict[int, int] = {}  # a connection's peer never changes

    def _uid(self, conn: int, uid: int) -> int:
        return self.uid_of.setdefault(conn, uid)

    @rule(conn=conns, uid=uids, n=sizes)
    def send(self, conn: int, uid: int, n: int) -> None:
        uid = self._uid(conn, uid)
        fits = self.book.fits(conn, uid, n)
        mine = [d for c, (u, d) in self.model.items() if u == uid]
        new = conn not in self.model
        expected = (
            sum(d for _, d in self.model.values()) + n <= MAX_FDS
            and len(self.model) + new <= MAX_CONNS
            and sum(mine) + n <= max(bp.MAX_NAMES, MAX_FDS // UID_SHARE)
            and len(mine) + new <= max(8, MAX_CONNS // UID_SHARE)
        )
        assert fits == expected
        if fits:
            self.book.add(conn, uid, n)
            _, had = self.model.get(conn, (uid, 0))
            self.model[conn] = (uid, had + n)

    @rule(conn=conns)
    def received(self, conn: int) -> None:
        self.book.remove(conn)  # also for a connection with nothing counted: a no-op
        self.model.pop(conn, None)

    @rule()
    def clear(self) -> None:
        self.book.clear()
        self.model.clear()

    @invariant()
    def counts_are_the_models(self) -> None:
        assert self.book.total == sum(d for _, d in self.model.values())
        assert len(self.book) == len(self.model)
        assert set(self.book.connections()) == set(self.model)
        for conn, (_, n) in self.model.items():
            assert conn in self.book
            assert self.book.of(conn) == n
        for uid in range(4):
            assert set(self.book.connections(uid)) == {c for c, (u, _) in self.model.items() if u == uid}
        # What it let in never passes the bounds.
        assert self.book.total <= MAX_FDS
        assert len(self.book) <= MAX_CONNS
        for uid in range(4):
            assert sum(d for u, d in self.model.values() if u == uid) <= MAX_FDS // UID_SHARE


Book.TestCase.settings = settings(max_examples=60, stateful_step_count=80, deadline=None)
test_the_unread_book_keeps_the_models_counts = Book.TestCase


def test_one_uid_cannot_take_another_uids_share() -> None:
    book: UnreadBook[str] = UnreadBook(MAX_FDS, MAX_CONNS)
    i = 0
    while book.fits(f"hog{i}", 1, bp.MAX_NAMES):
        book.add(f"hog{i}", 1, bp.MAX_NAMES)
        i += 1
    assert book.total == MAX_FDS // UID_SHARE  # its eighth, and not a descriptor more
    assert book.fits("other", 2, bp.MAX_NAMES)


def test_a_connection_keeps_its_peer_uid() -> None:
    book: UnreadBook[str] = UnreadBook(MAX_FDS, MAX_CONNS)
    book.add("c", 1, 3)
    with pytest.raises(ValueError, match="peer uid"):
        book.add("c", 2, 3)
