"""The reply bound and the suspicion's verdicts (pure: no server; the process tests are in
``test_client_suspect_server.py``)."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfabric.client.hangwatch import HangWatch
from kvfabric.client.suspicion import ReplyClock, Suspicion, Verdict, verdict

MS = 1_000_000


def test_the_bound_is_the_floor_until_replies_are_slower_and_never_above_the_ceiling() -> None:
    clock = ReplyClock(floor_s=0.003, factor=4.0, ceiling_s=0.5, window=10)
    assert clock.bound() == 0.003
    for _ in range(10):
        clock.record(0.0002)  # a live same-node server: 0.2 ms
    assert clock.bound() == 0.003
    for _ in range(10):
        clock.record(0.002)  # a loaded machine: 2 ms replies
    assert clock.bound() == pytest.approx(0.008)
    for _ in range(10):
        clock.record(1.0)  # a server slower than the staleness bound: the heartbeat decides
    assert clock.bound() == 0.5


@given(st.lists(st.floats(0, 2, allow_nan=False), max_size=100))
def test_the_bound_lies_between_the_floor_and_the_ceiling(samples: list[float]) -> None:
    clock = ReplyClock(floor_s=0.003, ceiling_s=0.5)
    for s in samples:
        clock.record(s)
        assert 0.003 <= clock.bound() <= 0.5


def test_bad_settings_are_refused_naming_the_value() -> None:
    with pytest.raises(ValueError, match="reply floor 0"):
        ReplyClock(floor_s=0)
    with pytest.raises(ValueError, match=r"reply factor 0\.5"):
        ReplyClock(factor=0.5)


def test_verdicts() -> None:
    stale = 500 * MS
    since = 1000 * MS
    assert verdict(since, since - 10 * MS, since + 20 * MS, stale) is Verdict.SUSPECT
    assert verdict(since, since + 1, since + 20 * MS, stale) is Verdict.CLEARED  # beat after it
    assert verdict(since, since - 10 * MS, since - 10 * MS + stale + 1, stale) is Verdict.HUNG  # stale
    assert verdict(since, None, since + 20 * MS, stale) is Verdict.SUSPECT  # no table to read
    assert verdict(since, None, since + stale + 1, stale) is Verdict.HUNG


def test_a_suspicion_ends_cleared_or_confirmed_and_counts_how() -> None:
    s = Suspicion(500 * MS)
    beat = [0]
    assert not s.active(lambda ns: beat[0], 0)
    s.suspect("ns", 100 * MS)
    s.suspect("ns", 101 * MS)  # a second give-up while suspect: counted, same suspicion
    assert s.active(lambda ns: beat[0], 120 * MS)
    beat[0] = 150 * MS
    assert not s.active(lambda ns: beat[0], 160 * MS)
    assert (s.suspected, s.cleared, s.confirmed) == (2, 1, 0)
    s.suspect("ns", 200 * MS)
    assert s.active(lambda ns: beat[0], 600 * MS)
    assert not s.active(lambda ns: beat[0], 651 * MS)  # the last beat (150 ms) is stale
    assert (s.suspected, s.cleared, s.confirmed) == (3, 1, 1)


def test_a_false_suspicion_doubles_the_floor_and_replies_in_time_halve_it_back() -> None:
    clock = ReplyClock(floor_s=0.003, factor=4.0, ceiling_s=0.02, relax_after=4)
    clock.missed()
    assert clock.bound() == pytest.approx(0.006)
    for _ in range(3):
        clock.missed()
    assert clock.bound() == 0.02  # capped
    for _ in range(4):
        clock.record(0.0001)
    assert clock.bound() == pytest.approx(0.01)
    for _ in range(12):
        clock.record(0.0001)
    assert clock.bound() == 0.003


def test_a_doubled_floor_also_halves_after_a_minute_of_replies_in_time() -> None:
    """An engine with few loads does not keep a doubled floor for the 1024 replies it takes."""
    now = [0.0]
    clock = ReplyClock(floor_s=0.003, factor=4.0, ceiling_s=0.5, clock=lambda: now[0])
    clock.missed()
    clock.missed()
    assert clock.bound() == pytest.approx(0.012)
    now[0] = 59.0
    clock.record(0.0001)
    assert clock.bound() == pytest.approx(0.012)  # not yet a minute since the last change
    now[0] = 61.0
    clock.record(0.0001)
    assert clock.bound() == pytest.approx(0.006)
    now[0] = 90.0
    clock.record(0.0001)
    assert clock.bound() == pytest.approx(0.006)  # a minute from the last halving, not the miss
    now[0] = 122.0
    clock.record(0.0001)
    assert clock.bound() == pytest.approx(0.003)


def test_a_cleared_suspicion_tells_the_clock() -> None:
    clock = ReplyClock(floor_s=0.003)
    s = Suspicion(500 * MS, on_cleared=clock.missed)
    s.suspect("ns", 100 * MS)
    assert not s.active(lambda ns: 120 * MS, 130 * MS)
    assert clock.bound() == pytest.approx(0.006)


class _AliveIndex:
    def alive(self, namespace: str) -> bool | None:
        return True


class _Call:
    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> bool:
        self.cancelled.set()
        return True


def test_the_watch_cancels_a_call_with_no_first_reply_by_its_bound_and_leaves_one_that_replied() -> None:
    watch = HangWatch(_AliveIndex(), poll_seconds=10.0)  # type: ignore[arg-type]
    try:
        late, quick = _Call(), _Call()
        with watch.watching("ns", quick, reply_by=time.monotonic() + 0.05) as wq:
            wq.reply()
            with watch.watching("ns", late, reply_by=time.monotonic() + 0.01) as wl:
                # Long before the 10 s poll: the watch wakes for the reply bound.
                assert late.cancelled.wait(5.0)
                assert (wl.slow, wl.hung) == (True, False)
            time.sleep(0.1)  # past the quick call's bound: it replied, so it stays
            assert not quick.cancelled.is_set()
            assert not wq.slow
    finally:
        watch.close()
