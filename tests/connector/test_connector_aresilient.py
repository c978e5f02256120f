"""The async facade of the resilience layer against a real cache-server process: hits, a frozen and a
dead server (the same core as the blocking layer, so the same contract)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfabric.connector.resilient import (
    AsyncResilientCache,
    CircuitBreaker,
    Endpoint,
    Reason,
    ResilientCache,
    transport_factory,
)
from kvfabric.testing.memtransport import CacheServerProcess

pytestmark = pytest.mark.process  # real cache-server processes (test level, see kvfabric.testing.levels)

NS = "a" * 64
KEYS = ["b" * 64, "c" * 64, "d" * 64]


def make(srv: CacheServerProcess, *, tcp: bool = False) -> AsyncResilientCache:
    target = srv.tcp_target if tcp else srv.unix_target
    ep = Endpoint("ep", transport_factory(target, shared_memory=not tcp), CircuitBreaker(2, 60.0))
    return AsyncResilientCache(ResilientCache([ep], retries=1))


@pytest.mark.asyncio
@pytest.mark.parametrize("tcp", [False, True], ids=["unix+shm", "tcp"])
async def test_store_lookup_load(tmp_path: Path, tcp: bool) -> None:
    with CacheServerProcess(tmp_path, name="s") as srv:
        cache = make(srv, tcp=tcp)
        payloads = [bytes([i]) * 1000 for i in range(2)]
        stored = await cache.store(NS, KEYS[:2], payloads, 5.0)
        assert stored is not None
        assert stored.accepted == 2
        hit = await cache.lookup(NS, KEYS, 5.0)
        assert (hit.matched, hit.tiers, hit.reason) == (2, ["dram", "dram"], None)
        bufs = [bytearray(1000) for _ in range(3)]
        out = await cache.load_into(NS, KEYS, bufs, 5.0)
        assert (out.count, out.reason) == (2, Reason.NOT_FOUND)
        assert [bytes(b) for b in bufs[:2]] == payloads
        await cache.close()


@pytest.mark.asyncio
async def test_frozen_then_dead_server(tmp_path: Path) -> None:
    with CacheServerProcess(tmp_path, name="f") as srv:
        cache = make(srv)
        assert (await cache.lookup(NS, KEYS, 5.0)).reason is Reason.NOT_FOUND
        srv.freeze()
        try:
            out = await cache.lookup(NS, KEYS, 0.2)
            assert (out.matched, out.reason) == (0, Reason.TIMEOUT)
        finally:
            srv.thaw()
        srv.kill()
        out = await cache.lookup(NS, KEYS, 2.0)
        assert (out.matched, out.reason) == (0, Reason.UNAVAILABLE)
        # Two consecutive failures opened the breaker: the next call does not reach the transport.
        out = await cache.lookup(NS, KEYS, 2.0)
        assert out.reason is Reason.UNAVAILABLE
        assert cache.counters.get("breaker_open.ep") >= 1
        await cache.close()
