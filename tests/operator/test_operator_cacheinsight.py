"""Cache insight: real cache servers' metrics scraped and folded into status.cache."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvfabric.cacheserver.metrics import namespace_label
from kvfabric.client import CacheClient
from kvfabric.client.residency import ResidencyFeedClient
from kvfabric.operator.cacheinsight import NodeCache, Scraper, parse_metrics, scrape_targets, summarize
from kvfabric.operator.status import compute_status
from kvfabric.rpc.residency import residency_socket_for
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
        with CacheClient(one.unix_target, shared_memory=True) as c:
            c.store(ns, keys[:3], [payload_for(k, 200_000) for k in keys[:3]], timeout=10)
            assert c.lookup(ns, keys, timeout=5).matched == 3  # 3 hits, then 1 miss
        with CacheClient(two.unix_target, shared_memory=True) as c:
            assert c.lookup(ns, keys, timeout=5).matched == 0  # 4 misses: a silent 0 % node
        # One engine follows server one's residency feed (its KV events announce that node's tiers).
        feed = ResidencyFeedClient(residency_socket_for(one.config.listen.unix_socket), ns)
        for _ in range(100):
            if ("synced", None) in feed.read(0.1):
                break
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
        assert (insight.routing_subscribers, insight.routing_nodes) == (1, 1)
        feed.close()
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


A, B = "a" * 16, "b" * 16

INFO = (
    'kvfabric_namespace_info{{namespace_label="{}",model="llama",revision="{}",'
    'dtype="bf16",tp_rank="0",tenant_label=""}} 1'
)
NAMESPACE_EXPOSITION = f"""# TYPE kvfabric_namespace_info gauge
{INFO.format(A, "r1")}
{INFO.format(B, "r2")}
# TYPE kvfabric_namespace_lookup_keys_total counter
kvfabric_namespace_lookup_keys_total{{namespace_label="{A}",result="hit"}} 6.0
kvfabric_namespace_lookup_keys_total{{namespace_label="{A}",result="miss"}} 2.0
kvfabric_namespace_lookup_keys_total{{namespace_label="{B}",result="hit"}} 0.0
kvfabric_namespace_lookup_keys_total{{namespace_label="{B}",result="miss"}} 4.0
kvfabric_namespace_lookup_keys_total{{namespace_label="not-a-label",result="miss"}} 4.0
kvfabric_namespace_lookup_keys_total{{namespace="{"c" * 64}",result="miss"}} 4.0
# TYPE kvfabric_namespace_stores_total counter
kvfabric_namespace_stores_total{{namespace_label="{A}"}} 3.0
"""


def test_namespaces_are_merged_across_nodes_and_splits_are_named() -> None:
    one = parse_metrics(NAMESPACE_EXPOSITION)
    assert set(one.namespaces) == {A, B}  # a malformed label, or a full digest (older servers), is ignored
    assert one.namespaces[A].fields == {"dtype": "bf16", "model": "llama", "revision": "r1", "tp_rank": "0"}
    info_only = NAMESPACE_EXPOSITION.split("# TYPE kvfabric_namespace_lookup", maxsplit=1)[0]
    two = parse_metrics(info_only)
    insight = summarize({"gpu-2": two, "gpu-1": one}, "t")
    assert insight.namespaces_in_use == 2
    first, second = insight.namespaces
    assert (first.digest, first.nodes, first.node_count) == (A, ["gpu-1", "gpu-2"], 2)
    assert (first.lookup_hits, first.lookup_misses, first.hit_rate, first.stores) == (6, 2, "75.0%", 3)
    assert (second.digest, second.hit_rate) == (B, "0.0%")
    (split,) = insight.namespace_splits
    assert "model llama" in split
    assert "2 namespaces" in split
    assert "revision: r1, r2" in split
    assert "dtype" not in split  # only what differs


def test_tensor_parallel_ranks_and_tenants_are_not_splits() -> None:
    def node(*entries: tuple[str, dict[str, str]]) -> NodeCache:
        from kvfabric.operator.cacheinsight import NodeNamespace

        return NodeCache(namespaces={d: NodeNamespace(fields=f) for d, f in entries})

    ranks = node((A, {"model": "m", "tp_rank": "0"}), (B, {"model": "m", "tp_rank": "1"}))
    assert summarize({"n": ranks}, "t").namespace_splits == []
    tenants = node((A, {"model": "m", "tenant_label": "x"}), (B, {"model": "m", "tenant_label": "y"}))
    assert summarize({"n": tenants}, "t").namespace_splits == []
    undescribed = node((A, {}))  # counters of a namespace the server no longer describes
    assert summarize({"n": undescribed}, "t").namespaces == []


def test_the_namespace_list_is_bounded() -> None:
    from kvfabric.operator.cacheinsight import MAX_NAMESPACES_PER_NODE

    lines = [
        f'kvfabric_namespace_info{{namespace_label="{i:016x}",model="m{i}"}} 1.0'
        for i in range(MAX_NAMESPACES_PER_NODE + 50)
    ]
    node = parse_metrics("# TYPE kvfabric_namespace_info gauge\n" + "\n".join(lines) + "\n")
    assert len(node.namespaces) == MAX_NAMESPACES_PER_NODE
    insight = summarize({"n": node}, "t")
    assert insight.namespaces_in_use == MAX_NAMESPACES_PER_NODE
    assert len(insight.namespaces) == 16
    # The status written to the API stays within the CRD's bounds.
    from kvfabric.operator.api.v1alpha1 import CacheInsight

    CacheInsight.model_validate(insight.model_dump())


def test_a_new_split_is_an_event_once() -> None:
    from tests.operator.test_operator_status import NOW, observe

    insight = summarize({"n1": parse_metrics(NAMESPACE_EXPOSITION)}, NOW)
    status, events = compute_status(observe(cache=insight), NOW)
    assert status["cache"]["namespacesInUse"] == 2
    assert status["cache"]["namespaces"][0]["fields"]["revision"] == "r1"
    diverge = [e for e in events if e.reason == "NamespacesDiverge"]
    assert len(diverge) == 1
    assert diverge[0].type == "Warning"
    assert "revision" in diverge[0].message
    _, again = compute_status(observe(cache=insight, previous_status=status), NOW)
    assert not [e for e in again if e.reason == "NamespacesDiverge"]


@pytest.mark.process
@pytest.mark.asyncio
async def test_a_pool_whose_last_pass_reached_no_server_is_due_when_its_servers_change() -> None:
    scraper = Scraper(interval=3600, retry_gap=0, timeout=5)
    key = ("ns", "p")
    dead = {"gpu-1": f"http://127.0.0.1:{free_port()}/metrics"}
    assert scraper.due(key, {})
    await scraper.scrape(key, {}, "t")  # no ready server yet
    assert not scraper.due(key, {})
    assert scraper.due(key, dead)  # one became ready
    await scraper.scrape(key, dead, "t")  # ... and did not answer
    assert not scraper.due(key, dead)
    with cache_server(dram_bytes=16 * MiB) as srv:
        live = {"gpu-1": srv.metrics_url + "/metrics"}
        assert scraper.due(key, live)  # it moved (a new pod IP)
        insight = await scraper.scrape(key, live, "t")
        assert insight is not None
        assert insight.nodes_scraped == 1
        # Once a pass reached a server, changes wait for the interval (a 1,000-node rollout
        # changes the ready set at every step).
        assert not scraper.due(key, {**live, "gpu-2": "http://127.0.0.1:1/metrics"})
    await scraper.close()


@pytest.mark.asyncio
async def test_a_pass_in_flight_is_never_doubled() -> None:
    scraper = Scraper(interval=0, retry_gap=0)
    key = ("ns", "p")
    scraper.schedule(key, {}, "t")
    assert not scraper.due(key, {})  # the scheduled pass has not run yet
    await asyncio.sleep(0)
    await asyncio.gather(*list(scraper._tasks))
    assert scraper.due(key, {})
    await scraper.close()


@pytest.mark.process
@pytest.mark.asyncio
async def test_namespaces_described_to_real_servers_reach_the_insight() -> None:
    from kvfabric.connector.keys import NamespaceSpec

    r1 = NamespaceSpec("tiny", "r1", "float32", 2, 1, 4, 16, 32)
    r2 = NamespaceSpec("tiny", "r2", "float32", 2, 1, 4, 16, 32)
    keys = [digest("k", i) for i in range(2)]
    with cache_server(dram_bytes=16 * MiB) as one, cache_server(dram_bytes=16 * MiB, server_id="two") as two:
        for srv, spec in ((one, r1), (two, r1), (two, r2)):
            with CacheClient(srv.unix_target, shared_memory=True) as c:
                c.announce(spec.digest(), spec.canonical().decode())
                c.store(spec.digest(), keys[:1], [payload_for(keys[0], 1000)], timeout=10)
                c.lookup(spec.digest(), keys, timeout=5)
        scraper = Scraper(interval=3600, timeout=5)
        targets = {"gpu-1": one.metrics_url + "/metrics", "gpu-2": two.metrics_url + "/metrics"}
        insight = await scraper.scrape(("ns", "p"), targets, "t")
        await scraper.close()
    assert insight is not None
    by_label = {n.digest: n for n in insight.namespaces}
    one_, two_ = namespace_label(r1.digest()), namespace_label(r2.digest())
    assert set(by_label) == {one_, two_}
    assert by_label[one_].nodes == ["gpu-1", "gpu-2"]
    assert (by_label[one_].lookup_hits, by_label[one_].lookup_misses) == (2, 2)
    assert by_label[two_].nodes == ["gpu-2"]
    assert by_label[two_].fields["revision"] == "r2"
    assert by_label[two_].fields["chunk_tokens"] == "32"
    # What reaches the pool's status never holds a digest (a capability) nor recomputes one.
    assert not any("payload_key_id" in n.fields or "tenant" in n.fields for n in insight.namespaces)
    assert all(len(n.digest) == 16 for n in insight.namespaces)
    (split,) = insight.namespace_splits
    assert "revision: r1, r2" in split
