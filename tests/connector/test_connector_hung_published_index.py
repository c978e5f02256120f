"""A hung same-node server costs the connector's lookups no call and no deadline (published index).

With the published index, a lookup reads the server's table in shared memory; once the table's
heartbeat is older than its bound, the reader says "unavailable" in microseconds. What this proves
end to end, with a real cache-server process frozen by SIGSTOP and the connector's resilience layer
(a breaker on an injected clock, the namespace described as the connector does): every lookup after
the heartbeat went stale, the breaker's half-open probe included, is a miss answered from the table,
with no RPC (which would wait its deadline on a frozen server) and no timeout counted; after SIGCONT
the next probe finds the hits again, still without a call.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from kvfabric.client import CacheClient
from kvfabric.connector.keys import NamespaceSpec
from kvfabric.connector.resilient import CircuitBreaker, Endpoint, Reason, ResilientCache, transport_factory
from kvfabric.testing.serverproc import MiB, cache_server, digest, payload_for, wait_until

pytestmark = pytest.mark.process

SPEC = NamespaceSpec("m", "r", "float32", 2, 1, 4, 16, 32)
DEADLINE_S = 5.0  # a lookup that made an RPC to the frozen server would wait this long
STALE_S = 0.5  # the published index's staleness bound (LocalIndex's default)


def test_a_hung_server_costs_lookups_no_call_and_no_deadline() -> None:
    ns = SPEC.digest()
    keys = [digest("hung", i) for i in range(4)]
    now = [0.0]
    with cache_server(dram_bytes=64 * MiB, metrics=False) as srv:
        breaker = CircuitBreaker(3, 1.0, clock=lambda: now[0], max_cooldown_s=8.0)
        target = f"unix://{srv.config.listen.unix_socket}"
        ep = Endpoint("local", transport_factory(target, shared_memory=True, local_index=True), breaker)
        cache = ResilientCache([ep])
        cache.describe(ns, SPEC.canonical().decode())  # as the connector's scheduler half does
        try:
            assert cache.store(ns, keys, [payload_for(k, 4096) for k in keys], 30) is not None
            assert cache.lookup(ns, keys, DEADLINE_S).matched == 4  # describes, maps the table

            # The table is mapped on an I/O thread: on a loaded machine the next lookup may come
            # first (and go over RPC). From the first one answered from the table on, all are.
            def from_table() -> bool:
                hit = cache.lookup(ns, keys, DEADLINE_S).matched == 4
                return hit and cache.counters.get("lookup_local") > 0

            wait_until(from_table, 30, 0.02, "a lookup answered from the published table")
            local = cache.counters.get("lookup_local")
            client = ep.client()
            assert isinstance(client, CacheClient)
            index = client.local_index
            assert index is not None
            calls: list[Any] = []
            real_call = client._call

            def spy(fn: Any) -> Any:
                calls.append(fn)
                return real_call(fn)

            client._call = spy  # type: ignore[method-assign]
            assert srv.proc is not None
            srv.proc.send_signal(signal.SIGSTOP)
            try:
                wait_until(lambda: index.alive(ns) is False, 30, 0.02, "a stale heartbeat")
                # Three failures open the breaker; the lookups while it is open fail fast.
                for _ in range(5):
                    out = cache.lookup(ns, keys, DEADLINE_S)
                    assert (out.matched, out.reason) == (0, Reason.UNAVAILABLE)
                assert breaker.state == "open"
                now[0] += 1.5  # past the cooldown: the next lookup is the half-open probe
                assert breaker.state == "half-open"
                probe = cache.lookup(ns, keys, DEADLINE_S)
                assert (probe.matched, probe.reason) == (0, Reason.UNAVAILABLE)
                assert breaker.state == "open"  # the probe failed, from the table
                assert calls == [], "a lookup made an RPC to the frozen server"
                assert cache.counters.get("error.local.timeout") == 0
                assert cache.counters.get("error.local.unavailable") == 4  # three, then the probe
            finally:
                srv.proc.send_signal(signal.SIGCONT)
            wait_until(lambda: index.alive(ns) is True, 30, 0.02, "the thawed server's heartbeat")
            now[0] += 1.5  # a probe that fails fast keeps the first cooldown (it cost nothing)
            back = cache.lookup(ns, keys, DEADLINE_S)
            assert (back.matched, back.reason) == (4, None)
            assert breaker.state == "closed"
            assert calls == []  # answered from the table
            assert cache.counters.get("lookup_local") == local + 1
        finally:
            cache.close()


def test_the_first_load_after_a_hang_falls_back_in_milliseconds_and_opens_no_breaker() -> None:
    """The load a lookup found a hit for, just before the hang, gives up at its reply bound.

    Without it the load waited until the heartbeat went stale (0.5 s). The suspicion costs the
    breaker nothing (the server may only be slow), and the lookups meanwhile make no call.
    """
    ns = SPEC.digest()
    keys = [digest("first", i) for i in range(4)]
    payloads = [payload_for(k, 4096) for k in keys]
    with cache_server(dram_bytes=64 * MiB, metrics=False) as srv:
        breaker = CircuitBreaker(3, 1.0, max_cooldown_s=8.0)
        target = f"unix://{srv.config.listen.unix_socket}"
        ep = Endpoint("local", transport_factory(target, shared_memory=True, local_index=True), breaker)
        cache = ResilientCache([ep])
        cache.describe(ns, SPEC.canonical().decode())
        try:
            assert cache.store(ns, keys, payloads, 30) is not None
            assert cache.lookup(ns, keys, DEADLINE_S).matched == 4
            bufs = [bytearray(4096) for _ in keys]
            while cache.load_into(ns, keys, bufs, time.monotonic() + DEADLINE_S).count != 4:
                time.sleep(0.05)  # a false suspicion on a loaded machine: cleared by the next beat
            client = ep.client()
            assert isinstance(client, CacheClient)
            base = cache.counters.get("suspect.local")
            assert srv.proc is not None
            srv.proc.send_signal(signal.SIGSTOP)
            try:
                assert cache.lookup(ns, keys, DEADLINE_S).matched == 4  # the heartbeat is fresh
                t0 = time.monotonic()
                out = cache.load_into(ns, keys, bufs, t0 + DEADLINE_S)
                took = time.monotonic() - t0
                assert (out.count, out.reason) == (0, Reason.UNAVAILABLE)
                # Slack for a loaded machine; before the reply bound the load waited for the
                # heartbeat to go stale (at least 0.45 s after the SIGSTOP).
                assert took < STALE_S * 0.7, f"the first load after the hang took {took * 1e3:.0f} ms"
                assert cache.counters.get("suspect.local") == base + 1
                miss = cache.lookup(ns, keys, DEADLINE_S)  # suspect: at once, from no table
                assert (miss.matched, miss.reason) == (0, Reason.UNAVAILABLE)
                assert cache.counters.get("suspect.local") == base + 2
                assert breaker.state == "closed"
                assert cache.counters.get("error.local.timeout") == 0
            finally:
                srv.proc.send_signal(signal.SIGCONT)
            wait_until(lambda: cache.lookup(ns, keys, DEADLINE_S).matched == 4, 30, 0.02, "hits again")
            while cache.load_into(ns, keys, bufs, time.monotonic() + DEADLINE_S).count != 4:
                time.sleep(0.05)  # a false suspicion on a loaded machine: cleared by the next beat
            assert [bytes(b) for b in bufs] == payloads
        finally:
            cache.close()
