"""A same-node server that sends no first reply within the reply bound is given up in milliseconds.

Real cache-server processes, frozen by SIGSTOP. Without the reply bound, the first load after a
hang waits until the published heartbeat reads as stale (0.5 s); with it, the load fails as
:class:`CacheSuspect` within milliseconds, lookups fail at once while the server is suspect, and the
heartbeat then decides: a server that beats again was only slow (the suspicion is cleared and its
hits come back), one that does not is hung (the published index says so, as before). A late reply
to a given-up load is never read as anything: the bytes loaded afterwards are the right ones.
"""

from __future__ import annotations

import signal
import time

import pytest

from kvfabric.client import CacheClient
from kvfabric.client.errors import CacheSuspect, CacheUnavailable
from kvfabric.testing.serverproc import MiB, cache_server, digest, payload_for, wait_until

pytestmark = pytest.mark.process

NS = digest("suspect")
STALE_S = 0.5  # the published index's staleness bound (LocalIndex's default)


def _since(c: CacheClient, base: tuple[int, int, int]) -> tuple[int, int, int]:
    s = c.suspicion
    return (s.suspected - base[0], s.cleared - base[1], s.confirmed - base[2])


def _answers(c: CacheClient, keys: list[str]) -> bool:
    try:
        return c.lookup_local(NS, keys) is not None
    except CacheSuspect:
        return False


def _ready(c: CacheClient, keys: list[str], payloads: list[bytes]) -> list[memoryview]:
    assert c.store(NS, keys, payloads, timeout=30).accepted == len(keys)
    assert c.lookup(NS, keys, timeout=10).matched == len(keys)  # maps the published table
    bufs = [memoryview(bytearray(len(p))) for p in payloads]
    done = 0
    while done < 5:  # a few replies in time for the clock
        try:
            assert c.load_into(NS, keys, bufs, timeout=30) == len(keys)
            done += 1
        except CacheSuspect:  # a loaded machine delayed a live server past the floor: it clears
            wait_until(lambda: _answers(c, keys), 30, 0.005, "a false suspicion cleared")
    return bufs


def _load(c: CacheClient, keys: list[str], bufs: list[memoryview]) -> int:
    """``load_into``, again after a false suspicion (a loaded machine delayed the live server)."""
    while True:
        try:
            return c.load_into(NS, keys, bufs, timeout=30)
        except CacheSuspect:
            wait_until(lambda: _answers(c, keys), 30, 0.005, "a false suspicion cleared")


def test_the_first_load_after_a_hang_gives_up_long_before_the_staleness_bound() -> None:
    keys = [digest("sus", i) for i in range(2)]
    payloads = [payload_for(k, MiB) for k in keys]
    with (
        cache_server(dram_bytes=64 * MiB) as srv,
        CacheClient(srv.unix_target, shared_memory=True, local_index=True) as c,
    ):
        bufs = _ready(c, keys, payloads)
        base = (c.suspicion.suspected, c.suspicion.cleared, c.suspicion.confirmed)
        index = c.local_index
        assert index is not None
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(CacheSuspect, match="no first reply"):
                c.load_into(NS, keys, bufs, timeout=60)
            took = time.monotonic() - t0
            # The bound is a few ms; a loaded 2-core machine adds scheduling delays (hence the
            # slack), never the staleness bound: before the reply bound existed the load waited
            # for the heartbeat to go stale, at least 0.45 s after the SIGSTOP.
            assert took < STALE_S * 0.7, f"the first load after the hang took {took * 1e3:.0f} ms"
            # Suspect: lookups (from the table or over RPC) and loads fail at once, no call made.
            t1 = time.monotonic()
            with pytest.raises(CacheSuspect):
                c.lookup_local(NS, keys)
            with pytest.raises(CacheSuspect):
                c.lookup(NS, keys, timeout=60)
            with pytest.raises(CacheSuspect):
                c.load_into(NS, keys, bufs, timeout=60)
            assert time.monotonic() - t1 < STALE_S * 0.7
            assert _since(c, base) == (1, 0, 0)
            # No beat for the staleness bound: hung, as the published index says from now on.
            wait_until(lambda: index.alive(NS) is False, 30, 0.02, "a stale heartbeat")
            with pytest.raises(CacheUnavailable) as err:
                c.lookup_local(NS, keys)
            assert not isinstance(err.value, CacheSuspect)
            assert _since(c, base) == (1, 0, 1)
        finally:
            srv.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: index.alive(NS) is True, 30, 0.02, "the thawed server's heartbeat")
        assert _load(c, keys, bufs) == 2
        assert [bytes(b) for b in bufs] == payloads


def test_a_delayed_server_is_suspected_then_cleared_and_its_late_reply_is_never_read() -> None:
    first = [digest("late-a", i) for i in range(2)]
    second = [digest("late-b", i) for i in range(2)]
    pa = [payload_for(k, MiB) for k in first]
    pb = [payload_for(k, MiB) for k in second]
    with (
        cache_server(dram_bytes=64 * MiB) as srv,
        CacheClient(srv.unix_target, shared_memory=True, local_index=True) as c,
    ):
        assert c.store(NS, second, pb, timeout=30).accepted == 2
        bufs = _ready(c, first, pa)
        base = (c.suspicion.suspected, c.suspicion.cleared, c.suspicion.confirmed)
        for b in bufs:
            b[:] = b"\0" * len(b)
        index = c.local_index
        assert index is not None
        assert srv.proc is not None
        # Delayed, not hung: stopped for a moment past the reply bound, well within the staleness
        # bound. The load is given up; the server then answers the cancelled stream (too late).
        srv.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(CacheSuspect):
                c.load_into(NS, first, bufs, timeout=60)
        finally:
            srv.proc.send_signal(signal.SIGCONT)
        # The given-up load placed no bytes, or the right ones: never another key's.
        for b, p in zip(bufs, pa, strict=True):
            assert bytes(b) in (b"\0" * len(p), p)
        # Its heartbeat advances past the suspicion: cleared, a false suspicion counted as such.
        wait_until(lambda: _answers(c, first), 30, 0.005, "the suspicion cleared")
        assert _since(c, base) == (1, 1, 0)
        hit = c.lookup_local(NS, first)
        assert hit is not None
        assert hit.matched == 2
        # The next loads read their own replies (the late one went nowhere).
        other = [memoryview(bytearray(MiB)) for _ in second]
        assert _load(c, second, other) == 2
        assert [bytes(b) for b in other] == pb
        assert _load(c, first, bufs) == 2
        assert [bytes(b) for b in bufs] == pa
