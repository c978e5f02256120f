"""Metrics, probes, logs and backpressure of a real server process."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from kvfabric.cacheserver.testing import MiB, cache_server, digest, payload_for
from kvfabric.client import CacheClient

pytestmark = pytest.mark.slow


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_metrics_probes_and_json_logs() -> None:
    ns = digest("metrics")
    keys = [digest("m", i) for i in range(3)]
    with cache_server(dram_bytes=16 * MiB) as srv:
        with CacheClient(srv.unix_target, shm_dir=srv.shm_dir) as c:
            c.store(ns, keys[:2], [payload_for(k, 100_000) for k in keys[:2]], timeout=10)
            c.lookup(ns, keys, timeout=5)
            c.load(ns, keys, timeout=10)
        assert _get(srv.metrics_url + "/healthz")[0] == 200
        assert _get(srv.metrics_url + "/readyz")[0] == 200
        code, text = _get(srv.metrics_url + "/metrics")
        assert code == 200
        for name in (
            "kvfabric_cache_lookups",
            "kvfabric_cache_hits",
            "kvfabric_cache_misses",
            "kvfabric_cache_bytes_out",
            "kvfabric_load_duration",
            "kvfabric_store_duration",
            "kvfabric_tier_used",
            "kvfabric_cache_stores",
        ):
            assert name in text, name
        assert 'tier="dram"' in text
        records = srv.log_records()
        assert any(r.get("message") == "serving" and r.get("server_id") == "srv" for r in records)
        # After a graceful stop (SIGTERM) the log says so, and every line was JSON.
        srv.stop()
        assert srv.proc is not None
        assert srv.proc.returncode == 0
        assert any(r.get("message") == "stopped" for r in srv.log_records())
        assert len(srv.log_records()) == len([ln for ln in srv.logs().splitlines() if ln.strip()])


def test_stores_beyond_the_arena_are_dropped_and_counted_not_failed() -> None:
    ns = digest("pressure")
    keys = [digest("p", i) for i in range(4)]
    # The arena holds two 512 KiB payloads at a time: the other two stores of the batch are dropped.
    with (
        cache_server(dram_bytes=16 * MiB, overrides={"shm.arena_bytes": 1 * MiB}) as srv,
        CacheClient(srv.unix_target, shm_dir=srv.shm_dir) as c,
    ):
        res = c.store(ns, keys, [payload_for(k, 512 * 1024) for k in keys], timeout=10)
        assert (res.accepted, res.dropped) == (2, 2)
        stats = c.stats(timeout=5)
        assert stats["counters"]["dropped_stores"]["arena"] == 2
        assert c.lookup(ns, keys, timeout=5).matched == 2
        # Loads are unaffected, and the arena is free again for the next store.
        assert c.load(ns, keys, timeout=10) == [payload_for(k, 512 * 1024) for k in keys[:2]]
        assert c.store(ns, keys[2:], [payload_for(k, 512 * 1024) for k in keys[2:]], timeout=10).accepted == 2
