"""Cache insight: real cache servers' metrics scraped and folded into status.cache (issue #14.3)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvfabric.client import CacheClient
from kvfabric.operator.cacheinsight import NodeCache, Scraper, parse_metrics, scrape_targets, summarize
from kvfabric.operator.status import compute_status
from kvfabric.testing.serverproc import MiB, cache_server, digest, free_port, payload_for

EXPOSITION = """# TYPE kvfabric_cache_lookup_keys_total counter
kvfabric_cache_lookup_keys_total{result="hit"} 30.0
kvfabric_cache_lookup_keys_total{result="miss"} 10.0
# TYPE kvfabric_cache_misses_total counter
kvfabric_cache_misses_total 4.0
# TYPE kvfabric_cache_read_misses_total counter
kvfabric_cache_read_misses_total{reason="corrupt",tier="local_disk"} 2.0
# TYPE kvfabric_tier_used_bytes gauge
kvfabric_tier_used_bytes{tier="dram"} 900.0
# TYPE kvfabric_tier_capacity_bytes gauge
kvfabric_tier_capacity_bytes{tier="dram"} 1000.0
"""


def test_parse_and_summarize() -> None:
    a = parse_metrics(EXPOSITION)
    assert (a.lookup_hits, a.lookup_misses) == (30, 10)
    assert a.load_misses == {"absent": 4, "corrupt": 2}
    b = NodeCache(lookup_hits=10, lookup_misses=50, used={"dram": 100}, capacity={"dram": 1000})
    insight = summarize({"gpu-1": a, "gpu-2": b}, "2026-11-30T12:00:00Z", unreachable=1)
    assert (insight.lookup_hits, insight.lookup_misses, insight.hit_rate) == (40, 60, "40.0%")
    assert insight.load_misses_by_reason == {"absent": 4, "corrupt": 2}
    (dram,) = insight.tiers
    assert (dram.tier, dram.used_bytes, dram.capacity_bytes) == ("dram", 1000, 2000)
    assert (dram.worst_node, dram.worst_node_used) == ("gpu-1", "90.0%")
    assert (insight.nodes_scraped, insight.nodes_unreachable) == (2, 1)
    assert summarize({}, "t").hit_rate == "n/a"


def test_only_ready_pods_with_an_ip_are_scraped() -> None:
    def pod(node: str, ip: str | None, ready: bool) -> dict[str, Any]:
        status: dict[str, Any] = {"conditions": [{"type": "Ready", "status": str(ready)}]}
        if ip:
            status["podIP"] = ip
        return {"spec": {"nodeName": node}, "status": status}

    pods = [
        pod("n1", "10.0.0.1", True),
        pod("n2", "10.0.0.2", False),
        pod("n3", None, True),
        pod("n4", "fd00::1", True),
    ]
    assert scrape_targets(pods, 9090) == {
        "n1": "http://10.0.0.1:9090/metrics",
        "n4": "http://[fd00::1]:9090/metrics",
    }


def test_status_carries_the_insight_and_keeps_it_between_scrapes() -> None:
    from tests.operator.test_operator_status import NOW, observe

    insight = summarize({"n1": parse_metrics(EXPOSITION)}, NOW)
    status, _ = compute_status(observe(cache=insight), NOW)
    assert status["cache"]["hitRate"] == "75.0%"
    assert status["cache"]["tiers"][0]["worstNode"] == "n1"
    again, _ = compute_status(observe(previous_status=status), NOW)
    assert again["cache"] == status["cache"]


@pytest.mark.process
@pytest.mark.asyncio
async def test_scraping_real_cache_servers_at_a_bounded_rate() -> None:
    ns = digest("insight")
    keys = [digest("k", i) for i in range(4)]
    with cache_server(dram_bytes=16 * MiB) as one, cache_server(dram_bytes=16 * MiB, server_id="two") as two:
        with CacheClient(one.unix_target, shm_dir=one.shm_dir) as c:
            c.store(ns, keys[:3], [payload_for(k, 200_000) for k in keys[:3]], timeout=10)
            assert c.lookup(ns, keys, timeout=5).matched == 3  # 3 hits, then 1 miss
        with CacheClient(two.unix_target, shm_dir=two.shm_dir) as c:
            assert c.lookup(ns, keys, timeout=5).matched == 0  # 4 misses: a silent 0 % node
        dead = f"http://127.0.0.1:{free_port()}/metrics"
        targets = {
            "gpu-1": one.metrics_url + "/metrics",
            "gpu-2": two.metrics_url + "/metrics",
            "gpu-3": dead,
        }
        updates: list[tuple[str, str]] = []
        scraper = Scraper(interval=3600, concurrency=2, timeout=5, on_update=updates.append)
        scraper.schedule(("ns", "p"), targets, "2026-11-30T12:00:00Z")
        for _ in range(200):
            if updates:
                break
            await asyncio.sleep(0.05)
        insight = scraper.insights[("ns", "p")]
        assert (insight.lookup_hits, insight.lookup_misses, insight.hit_rate) == (3, 5, "37.5%")
        assert (insight.nodes_scraped, insight.nodes_unreachable) == (2, 1)
        dram = next(t for t in insight.tiers if t.tier == "dram")
        assert dram.worst_node == "gpu-1"
        assert dram.used_bytes >= 3 * 200_000
        # Within the interval a pool is not scraped again, however often it is reconciled.
        requests = scraper.requests
        for _ in range(5):
            scraper.schedule(("ns", "p"), targets, "2026-11-30T12:00:01Z")
        await asyncio.sleep(0.2)
        assert scraper.requests == requests
        await scraper.close()
