"""Read-path failures are clean misses with a reason: the entry is dropped and counted, the server
answers a miss (not UNKNOWN), and a real client's circuit breaker stays closed."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest

from kvfabric.cacheserver.engine.blockfile import write_block
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.client import CacheClient
from kvfabric.connector.resilient import CircuitBreaker, Endpoint, Reason, ResilientCache
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, payload_for, wait_until

pytestmark = [pytest.mark.process, pytest.mark.slow]


def _resilient(srv: ServerProcess, breaker: CircuitBreaker) -> ResilientCache:
    # One failure would open this breaker: any UNKNOWN from the server would show.
    return ResilientCache(
        [Endpoint("srv", lambda: CacheClient(srv.unix_target, shared_memory=True), breaker)], retries=0
    )


def _stored_on_local_disk(srv: ServerProcess, ns: str, keys: list[str], payloads: list[bytes]) -> None:
    with CacheClient(srv.unix_target, shared_memory=True) as c:
        assert c.store(ns, keys, payloads, timeout=10).accepted == len(keys)
        wait_until(lambda: c.stats(timeout=5)["writeback_pending_bytes"] == 0, what="write-back")
    srv.restart()  # DRAM is gone: loads must read the local disk
    with CacheClient(srv.unix_target, shared_memory=True) as c:
        assert c.lookup(ns, keys, timeout=5).tiers == ["local_disk"] * len(keys)


def _assert_clean_miss(srv: ServerProcess, ns: str, key: str, size: int, counter: str) -> None:
    breaker = CircuitBreaker(failures=1, cooldown_s=3600)
    cache = _resilient(srv, breaker)
    try:
        out = cache.load_into(ns, [key], [bytearray(size)], deadline=time.monotonic() + 10)
        assert out.count == 0
        assert out.reason is Reason.NOT_FOUND, "a miss, not an unavailable server"
        assert breaker.state == "closed"
        assert not [k for k in cache.counters.snapshot() if k.startswith("error.")]
    finally:
        cache.close()
    with CacheClient(srv.unix_target, shared_memory=True) as c:
        assert c.lookup(ns, [key], timeout=5).matched == 0, "the failing entry is dropped"
        assert c.stats(timeout=5)["counters"][counter]["local_disk"] == 1
        assert c.health(timeout=5)
    metrics = urllib.request.urlopen(srv.metrics_url + "/metrics", timeout=5).read().decode()
    reason = counter.removeprefix("read_misses.")
    assert any(
        line.startswith("kvfabric_cache_read_misses")
        and f'reason="{reason}"' in line
        and 'tier="local_disk"' in line
        for line in metrics.splitlines()
    ), "the miss is exported with its reason"


def test_estale_from_the_filesystem_is_a_clean_miss(ns: str) -> None:
    key = digest("estale")
    data = payload_for(key, 64 * 1024)
    with cache_server(
        dram_bytes=16 * MiB, overrides={"tiers.local_disk.faults": {"read_error": "ESTALE"}}
    ) as srv:
        _stored_on_local_disk(srv, ns, [key], [data])
        _assert_clean_miss(srv, ns, key, len(data), "read_misses.stale-handle")


def test_a_file_whose_length_is_not_the_index_s_is_a_clean_miss(ns: str) -> None:
    key = digest("length")
    data = payload_for(key, 64 * 1024)
    with cache_server(dram_bytes=16 * MiB) as srv:
        _stored_on_local_disk(srv, ns, [key], [data])
        # Another writer replaces the block with a longer one (a valid block: only the length differs
        # from what the running server's index holds).
        root = srv.config.tiers.local_disk.path  # type: ignore[union-attr]
        (path,) = list((root / "buckets").rglob("*.blk"))
        bid = BlockId(ns, key)
        other = root / "tmp" / "other-writer"
        other.mkdir(parents=True, exist_ok=True)
        longer = payload_for(key, 256 * 1024)
        write_block(other, Path(path), bid, longer, created_at=0, bucket=int(path.parent.name))
        _assert_clean_miss(srv, ns, key, len(longer), "read_misses.io-error")
