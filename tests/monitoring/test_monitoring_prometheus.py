"""The dashboard and the alerts against a real Prometheus scraping real cache-server processes.

Two servers stand for two nodes of a pool, labelled as the PodMonitor labels them. Each alert is made
to fire by the fault it is for (a corrupt block, a disk tier too small for a block, a staging arena
too small for a batch, a listener whose socket is gone, a killed server), none fires while all is well,
and every dashboard query that reads the cache servers returns data. The engine's queries
(``vllm:…``) and the operator's are checked to be valid PromQL here; their data needs vLLM
(e2e/test_fabric_vllm.py), and the operator (test_operator_cluster_metrics.py).

The live rules are the shipped ones with every ``for`` cut to 1 s (a test cannot wait 15 minutes);
the ``for`` durations and thresholds themselves are unit-tested by ``promtool test rules``
(test_monitoring_rules.py).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvfabric.client import CacheClient
from kvfabric.connector.keys import NamespaceSpec
from kvfabric.rpc.blockproto import block_socket_for
from kvfabric.testing.opstools import prometheus_binaries
from kvfabric.testing.prometheus import (
    PrometheusServer,
    Target,
    dashboard_queries,
    grafana_expr,
    has_data,
    prometheus_server,
    rules_without_delay,
)
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, payload_for, wait_until

pytestmark = [pytest.mark.process, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "charts" / "kvfabric" / "files" / "monitoring"
SPEC = NamespaceSpec("meta-llama/Llama-3.1-8B", "0e9e39f", "bfloat16", 32, 8, 128, 16, 256)
NS = SPEC.digest()
# Queries on metrics that are not the cache servers': the engines' and the operator's.
OTHER_JOBS = ("vllm:", "kvfabric_operator_")


def _labels(node: str, pod: str) -> dict[str, str]:
    """The labels the PodMonitor's relabelling gives a cache-server pod's target (besides job)."""
    return {"namespace": "team-a", "pool": "pool-a", "node": node, "pod": pod}


def _target(srv: ServerProcess, node: str, pod: str) -> Target:
    return Target(srv.metrics_url.removeprefix("http://"), _labels(node, pod))


@pytest.fixture
def live_rules(tmp_path: Path) -> Path:
    """The shipped alert rules with every ``for`` cut to 1 s (see the module docstring)."""
    return rules_without_delay(MONITORING / "alerts.yaml", tmp_path / "alerts.yaml")


@pytest.fixture
def prom(live_rules: Path) -> Iterator[PrometheusServer]:
    try:
        prometheus_binaries()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    with prometheus_server(rule_files=[live_rules]) as server:
        yield server


def _traffic(srv: ServerProcess, tag: str) -> None:
    """A described namespace's stores, lookups and loads over both transports (hits and misses)."""
    keys = [digest(tag, i) for i in range(4)]
    with CacheClient(srv.unix_target, shared_memory=True) as c:
        c.describe(NS, SPEC.canonical().decode(), timeout=5)
        assert c.store(NS, keys[:3], [payload_for(k, 64 * 1024) for k in keys[:3]], timeout=10).accepted == 3
        assert c.lookup(NS, keys, timeout=5).matched == 3
        assert len(c.load(NS, keys, timeout=10)) == 3
    with CacheClient(srv.tcp_target) as c:
        assert c.lookup(NS, keys, timeout=5).matched == 3
        assert len(c.load(NS, keys[:3], timeout=10)) == 3


def _corrupt_a_block_on_disk(srv: ServerProcess) -> None:
    """A block evicted from DRAM to its local disk, a byte of it flipped, then loaded: a checksum failure."""
    victim = digest("victim")
    root = srv.config.tiers.local_disk.path  # type: ignore[union-attr]
    with CacheClient(srv.unix_target, shared_memory=True) as c:
        assert c.store(NS, [victim], [payload_for(victim, 256 * 1024)], timeout=10).accepted == 1
        path = wait_until(
            lambda: next((p for p in (root / "buckets").rglob("*.blk") if victim in p.name), None),
            30,
            what="the victim's write-back",
        )
        # 6 MiB more than the 4 MiB DRAM holds: the victim is evicted and must be read from disk.
        filler = [digest("filler", i) for i in range(24)]
        for key in filler:
            c.store(NS, [key], [payload_for(key, 256 * 1024)], timeout=10)
        wait_until(
            lambda: c.stats(timeout=5)["counters"]["evictions"].get("dram", 0) > 0, 30, what="evictions"
        )
        with path.open("r+b") as f:
            f.seek(-1000, 2)
            byte = f.read(1)
            f.seek(-1000, 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        assert c.load(NS, [victim], timeout=10) == [], "a corrupt block must never be served"
        assert c.stats(timeout=5)["counters"]["checksum_failures"]["local_disk"] == 1


def _refuse_and_drop(srv: ServerProcess) -> None:
    """On a server with a 1 MiB disk tier and a 1 MiB staging arena: a refused write-back, dropped stores."""
    big = digest("big")
    with CacheClient(srv.tcp_target) as c:  # over gRPC: not through the 1 MiB arena
        assert c.store(NS, [big], [payload_for(big, 2 * MiB)], timeout=10).accepted == 1
        wait_until(
            lambda: c.stats(timeout=5)["counters"].get("writes_refused", {}).get("local_disk", 0) >= 1,
            30,
            what="the 2 MiB write-back to the 1 MiB disk tier to be refused",
        )
    keys = [digest("batch", i) for i in range(4)]
    with CacheClient(srv.unix_target, shared_memory=True) as c:
        result = c.store(NS, keys, [payload_for(k, 512 * 1024) for k in keys], timeout=10)
        assert (result.accepted, result.dropped) == (2, 2)


def _empty_panels(prom: PrometheusServer) -> list[tuple[str, str]]:
    """(title, query) of every dashboard query on the cache servers' metrics that returns no number.

    Every query runs (a PromQL error raises); the engine's (``vllm:``) and the operator's need not
    return data here (test_operator_cluster_metrics.py scrapes the operator).
    """
    empty = []
    for title, expr in dashboard_queries(MONITORING / "dashboard.json"):
        got = prom.query(grafana_expr(expr))
        if not any(other in expr for other in OTHER_JOBS) and not has_data(got):
            empty.append((title, expr))
    return empty


def test_every_panel_returns_data_and_every_alert_fires_under_its_fault(prom: PrometheusServer) -> None:
    with (
        cache_server(server_id="a", dram_bytes=4 * MiB, local_disk_bytes=64 * MiB) as a,
        cache_server(
            server_id="b",
            dram_bytes=16 * MiB,
            local_disk_bytes=1 * MiB,
            overrides={"shm.arena_bytes": 1 * MiB},
        ) as b,
    ):
        prom.set_targets([_target(a, "node-a", "pool-a-aaaaa"), _target(b, "node-b", "pool-a-bbbbb")])
        wait_until(
            lambda: sorted(prom.targets_up().values()) == ["up", "up"],
            60,
            interval=0.5,
            what="both targets up",
        )
        _traffic(a, "healthy")
        _traffic(b, "healthy")
        # All is well: a few evaluations with data, and nothing fires.
        wait_until(
            lambda: prom.value('count(kvfabric_cache_lookup_keys_total{job="kvfabric-cache"})') == 4,
            60,
            interval=0.5,
            what="the traffic to be scraped",
        )
        wait_until(lambda: prom.value("count(count_over_time(up[1m]) > 3)") == 2, 60, what="a few scrapes")
        assert prom.firing() == {}

        _corrupt_a_block_on_disk(a)
        prom.wait_firing("KVFabricChecksumFailures", node="node-a", tier="local_disk", pool="pool-a")
        _refuse_and_drop(b)
        prom.wait_firing("KVFabricTierRefusingWrites", node="node-b", tier="local_disk")
        prom.wait_firing("KVFabricStoresDropped", node="node-b")
        # The blocks listener's socket is gone: the server still answers scrapes, engines cannot
        # reach that path.
        sock = block_socket_for(b.config.listen.unix_socket)
        sock.rename(sock.with_name(sock.name + ".gone"))
        prom.wait_firing("KVFabricCacheServerNotServing", node="node-b", listener="blocks")
        assert not prom.is_firing("KVFabricCacheServerNotServing", node="node-a")
        b.kill()
        prom.wait_firing("KVFabricCacheServerDown", node="node-b", pod="pool-a-bbbbb")
        assert not prom.is_firing("KVFabricCacheServerDown", node="node-a")
        assert not prom.is_firing("KVFabricStoresDropped", node="node-a")
        # Nothing fires that no fault was made for. (A dead server's listener series go stale, so
        # "not serving" gives way to "down".)
        wait_until(
            lambda: "KVFabricCacheServerNotServing" not in prom.firing(), 60, what="not serving resolved"
        )
        assert set(prom.firing()) == {
            "KVFabricChecksumFailures",
            "KVFabricTierRefusingWrites",
            "KVFabricStoresDropped",
            "KVFabricCacheServerDown",
        }

        # A rolling update of node-a: its successor takes the DRAM blocks over, and replaces it as
        # the node's target (as a pod watch would).
        successor = a.successor()
        try:
            successor.start_beside()
            prom.set_targets(
                [_target(successor, "node-a", "pool-a-ccccc"), _target(b, "node-b", "pool-a-bbbbb")]
            )
            _traffic(successor, "after")
            wait_until(
                lambda: prom.query('kvfabric_handover_adopted_blocks_total{node="node-a"}'),
                60,
                interval=0.5,
                what="the hand-over to be scraped",
            )
            wait_until(
                lambda: has_data(prom.query('rate(kvfabric_cache_bytes_out_bytes_total{node="node-a"}[1m])')),
                60,
                interval=0.5,
                what="the successor's traffic to be scraped",
            )
            # Counters first seen after the successor's first scrape need a second round to have a rate.
            _traffic(successor, "again")
            with contextlib.suppress(TimeoutError):  # the assertion below names the empty ones
                wait_until(lambda: not _empty_panels(prom), 60, interval=1, what="every panel to have data")
            assert _empty_panels(prom) == []
            # Every alert expression is valid PromQL too (the engine's, which no fault here triggers).
            for group in yaml.safe_load((MONITORING / "alerts.yaml").read_text())["groups"]:
                for rule in group["rules"]:
                    prom.query(rule["expr"])
        finally:
            successor.stop()


def test_dashboard_variables_find_their_labels(prom: PrometheusServer) -> None:
    with cache_server(server_id="a", dram_bytes=4 * MiB) as a:
        prom.set_targets([_target(a, "node-a", "pool-a-aaaaa")])
        dash = json.loads((MONITORING / "dashboard.json").read_text())
        variables = [v for v in dash["templating"]["list"] if v["type"] == "query"]
        assert [v["name"] for v in variables] == ["namespace", "pool", "node"]
        for var in variables:
            match = re.fullmatch(r"label_values\((.*), (\w+)\)", var["query"]["query"])
            assert match is not None, var
            selector, label = match.groups()
            expected = _labels("node-a", "pool-a-aaaaa")[label]
            wait_until(
                lambda s=selector, lab=label, e=expected: (
                    {r["metric"].get(lab) for r in prom.query(grafana_expr(s))} == {e}
                ),
                60,
                interval=0.5,
                what=f"variable {var['name']}",
            )
