"""A pool's cache servers, on whichever cluster the fabric runs: the pod runner's or an existing one.

No engine: this is the fabric test that runs wherever only the cache-server image is present (kind
here, where the engine image does not fit the nodes' disks), so ``e2e/kind/up.sh`` can select it.
"""

from __future__ import annotations

from collections import Counter

from kvfabric.demo.fabric import Fabric, wait_pool_ready
from kvfabric.demo.workloads import pool_manifest, ready_pods

POOL = "pool-nodes"
CACHE_SELECTOR = f"app.kubernetes.io/name=kvfabric-cache,app.kubernetes.io/instance={POOL}"
METRICS_PORT = 9090  # the pool default (spec.metrics.port)


def test_a_pool_runs_one_ready_cache_server_on_each_gpu_node_and_nowhere_else(fabric: Fabric) -> None:
    with fabric.cluster.namespace("pool-nodes") as ns:
        fabric.cluster.apply(pool_manifest(POOL), namespace=ns)
        wait_pool_ready(fabric.cluster, ns, POOL)
        pods = ready_pods(fabric.cluster, ns, CACHE_SELECTOR)
        assert Counter(p["spec"]["nodeName"] for p in pods) == Counter(fabric.gpu_nodes)
        for pod in pods:  # each server answers, through the pod's own network
            status, body = fabric.request(pod, METRICS_PORT, "/metrics", timeout=30)
            assert status == 200, body[:300]
            assert "kvfabric_tier_blocks" in body
