"""The resilience layer: deadlines enforced by the caller, retries, circuit breaker, reasons."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from kvfabric.connector.resilient import CircuitBreaker, Endpoint, Reason, ResilientCache, Transport
from kvfabric.testing.memtransport import MemoryTransport

NS = "a" * 64
KEYS = ["b" * 64, "c" * 64]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fake() -> Iterator[MemoryTransport]:
    t = MemoryTransport()
    yield t
    t.release.set()  # free threads parked in a "hung" call


def _const(t: MemoryTransport) -> Callable[[], Transport]:
    return lambda: t


def make(*transports: MemoryTransport, retries: int = 1, failures: int = 3) -> ResilientCache:
    eps = [Endpoint(f"ep{i}", _const(t), CircuitBreaker(failures, 60.0)) for i, t in enumerate(transports)]
    return ResilientCache(eps, retries=retries)


def test_hit_and_miss(fake: MemoryTransport) -> None:
    cache = make(fake)
    assert cache.store(NS, KEYS[:1], [b"x" * 8], 1.0) is not None
    hit = cache.lookup(NS, KEYS, 1.0)
    assert (hit.matched, hit.tiers, hit.reason) == (1, ["dram"], None)
    miss = cache.lookup(NS, KEYS[1:], 1.0)
    assert (miss.matched, miss.reason) == (0, Reason.NOT_FOUND)
    cache.close()


def test_hung_server_times_out_then_breaker_fails_fast(fake: MemoryTransport) -> None:
    cache = make(fake, failures=2)
    fake.hang.set()  # the fake ignores its timeout argument, like a SIGSTOPped peer would
    for _ in range(2):
        out = cache.lookup(NS, KEYS, 0.05)
        assert (out.matched, out.reason) == (0, Reason.TIMEOUT)
    calls = len(fake.calls)
    out = cache.lookup(NS, KEYS, 0.05)
    assert out.reason is Reason.UNAVAILABLE
    assert len(fake.calls) == calls, "an open breaker must not call the server"
    assert cache.counters.get("breaker_open.ep0") == 1
    cache.close()


def test_unavailable_is_retried_then_next_endpoint(fake: MemoryTransport) -> None:
    remote = MemoryTransport(tier="shared")
    remote.blocks[(NS, KEYS[0])] = b"p"
    fake.down = True
    cache = make(fake, remote, retries=2)
    out = cache.lookup(NS, KEYS, 1.0)
    assert (out.matched, out.tiers) == (1, ["shared"])
    assert fake.calls == ["lookup"] * 3  # one try + two retries
    assert cache.counters.get("error.ep0.unavailable") == 3
    cache.close()


def test_load_timeout_abandons_buffers(fake: MemoryTransport) -> None:
    fake.blocks[(NS, KEYS[0])] = b"z" * 4
    fake.hang.set()
    cache = make(fake)
    buf = bytearray(4)
    # Long enough that the call surely reaches the (hung) transport before the deadline.
    out = cache.load_into(NS, KEYS[:1], [buf], time.monotonic() + 0.5)
    assert (out.count, out.reason) == (0, Reason.TIMEOUT)
    # The call is still running: the outcome says so, so the caller keeps the buffer to itself.
    assert len(out.inflight) == 1
    settled_at_deadline = out.settled
    assert not settled_at_deadline
    fake.release.set()
    out.inflight[0].exception(timeout=30)
    assert out.settled
    cache.close()


def test_a_call_queued_past_its_deadline_never_reaches_the_transport(fake: MemoryTransport) -> None:
    cache = ResilientCache([Endpoint("ep0", _const(fake), CircuitBreaker(100, 60.0))], io_threads=1)
    fake.blocks[(NS, KEYS[0])] = b"z" * 4
    busy = cache._io_loads.submit(fake.release.wait)  # holds the only load thread (queued first: FIFO)
    buf = bytearray(4)
    out = cache.load_into(NS, KEYS[:1], [buf], time.monotonic() + 0.05)
    assert (out.count, out.reason, out.inflight) == (0, Reason.TIMEOUT, ())
    fake.release.set()
    busy.result(30)
    cache._io_loads.submit(lambda: None).result(30)  # everything queued before this ran or was cancelled
    assert fake.calls == [], "a load that started after its deadline reached the transport"
    assert buf == bytearray(4)
    cache.close()


def test_lookups_never_queue_behind_loads(fake: MemoryTransport) -> None:
    """Every load thread busy (asynchronous loads run while the scheduler looks up): a lookup still
    answers within its deadline, and the breaker hears of no failure."""
    breaker = CircuitBreaker(1, 60.0)
    cache = ResilientCache([Endpoint("ep0", _const(fake), breaker)], io_threads=1)
    fake.blocks[(NS, KEYS[0])] = b"z" * 4
    busy = cache._io_loads.submit(fake.release.wait)
    try:
        out = cache.lookup(NS, KEYS[:1], 5.0)
        assert (out.matched, out.reason) == (1, None)
        assert breaker.state == "closed"
    finally:
        fake.release.set()
        busy.result(30)
        cache.close()


def test_breaker_half_open_probe() -> None:
    clock = FakeClock()
    br = CircuitBreaker(2, 5.0, clock)
    br.failure()
    assert br.allow()
    br.failure()
    assert br.state == "open"
    assert not br.allow()
    clock.now += 5.0
    assert br.state == "half-open"
    assert br.allow()  # one probe
    assert not br.allow()  # and only one
    br.failure()
    assert not br.allow()
    clock.now += 5.0
    assert br.allow()
    br.success()
    assert br.state == "closed"
    assert br.allow()


def test_breaker_cooldown_doubles_per_failed_probe_and_resets_on_success() -> None:
    clock = FakeClock()
    br = CircuitBreaker(1, 1.0, clock, max_cooldown_s=4.0)
    br.failure()  # opens: 1 s
    waits = []
    for _ in range(4):
        start = clock.now
        while not br.allow():
            clock.now += 0.25
        waits.append(clock.now - start)
        br.failure()  # the probe failed
    assert waits == [1.0, 2.0, 4.0, 4.0]
    clock.now += 4.0
    assert br.allow()
    br.success()
    br.failure()  # opens again: back to the first cooldown
    clock.now += 1.0
    assert br.allow()


def test_a_refused_probe_keeps_the_first_cooldown() -> None:
    """A dead server refuses at once: probing it every cooldown is cheap, and finds it back soon."""
    clock = FakeClock()
    br = CircuitBreaker(1, 1.0, clock, max_cooldown_s=8.0)
    br.failure(slow=False)
    for _ in range(4):
        clock.now += 1.0
        assert br.allow()
        br.failure(slow=False)  # still refused
    clock.now += 1.0
    assert br.allow()  # never more than the first cooldown
    br.failure()  # a timeout (hung): now it doubles
    clock.now += 1.0
    assert not br.allow()
    clock.now += 1.0
    assert br.allow()


def test_breaker_lets_another_probe_through_when_one_never_reports() -> None:
    """A probe taken and never reported (no success, failure or abandon) is presumed lost."""
    clock = FakeClock()
    br = CircuitBreaker(1, 5.0, clock)
    br.failure()
    clock.now += 5.0
    assert br.allow()  # the probe; its caller never reports
    clock.now += 4.9
    assert not br.allow()
    clock.now += 0.1
    assert br.allow()
    br.abandon()
    assert br.allow()  # an abandoned probe frees the slot at once
    br.success()
    assert br.state == "closed"
    assert br.allow()
