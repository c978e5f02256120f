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

from kvfabric.cacheserver.transport.unreadbook import UnreadBook
from kvfabric.rpc import blockproto as bp

MAX_FDS = 16 * bp.MAX_NAMES
MAX_CONNS = 32
SHARE = 8  # each uid's share is an eighth: written here, not taken from the module under test
UIDS = 12  # 12 uids' shares (128 descriptors, 8 connections each) are more than the totals
conns = st.integers(0, 60)
uids = st.integers(0, UIDS - 1)
sizes = st.one_of(st.integers(1, 2), st.integers(1, bp.MAX_NAMES))


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
            and sum(mine) + n <= max(bp.MAX_NAMES, MAX_FDS // SHARE)
            and len(mine) + new <= max(8, MAX_CONNS // SHARE)
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
        for uid in range(UIDS):
            assert set(self.book.connections(uid)) == {c for c, (u, _) in self.model.items() if u == uid}
        # What it let in never passes the bounds.
        assert self.book.total <= MAX_FDS
        assert len(self.book) <= MAX_CONNS
        for uid in range(UIDS):
            assert sum(d for u, d in self.model.values() if u == uid) <= MAX_FDS // SHARE
            assert sum(1 for u, _ in self.model.values() if u == uid) <= 8


Book.TestCase.settings = settings(max_examples=80, stateful_step_count=150, deadline=None)
test_the_unread_book_keeps_the_models_counts = Book.TestCase


def test_one_uid_cannot_take_another_uids_share() -> None:
    book: UnreadBook[str] = UnreadBook(MAX_FDS, MAX_CONNS)
    i = 0
    while book.fits(f"hog{i}", 1, bp.MAX_NAMES):
        book.add(f"hog{i}", 1, bp.MAX_NAMES)
        i += 1
    assert book.total == MAX_FDS // SHARE  # its eighth, and not a descriptor more
    assert book.fits("other", 2, bp.MAX_NAMES)
    book.clear()
    for i in range(MAX_CONNS):  # one descriptor on each of many connections
        if book.fits(f"c{i}", 1, 1):
            book.add(f"c{i}", 1, 1)
    assert len(book) == 8  # at least 8 connections per uid (an eighth of 32 is 4)
    assert book.fits("other", 2, 1)


def test_the_totals_bound_all_uids_together() -> None:
    book: UnreadBook[str] = UnreadBook(MAX_FDS, MAX_CONNS)
    for uid in range(UIDS):  # each uid's whole share, while the total lets it
        while book.fits(f"{uid}-{len(book.connections(uid))}", uid, bp.MAX_NAMES):
            book.add(f"{uid}-{len(book.connections(uid))}", uid, bp.MAX_NAMES)
    assert book.total == MAX_FDS
    assert not book.fits("late", UIDS, 1)  # a uid with nothing in flight waits for the total too
    book.clear()
    for i in range(4 * MAX_CONNS):  # one descriptor per connection: the connection bound refuses
        uid = i % UIDS
        if book.fits(f"c{i}", uid, 1):
            book.add(f"c{i}", uid, 1)
    assert len(book) == MAX_CONNS
    assert not book.fits("late", UIDS, 1)


def test_a_connection_keeps_its_peer_uid() -> None:
    book: UnreadBook[str] = UnreadBook(MAX_FDS, MAX_CONNS)
    book.add("c", 1, 3)
    with pytest.raises(ValueError, match="peer uid"):
        book.add("c", 2, 3)
