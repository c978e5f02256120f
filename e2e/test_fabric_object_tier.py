"""A pool whose cross-node sharing goes through the object tier only: no shared volume, no local disk.

The cache servers run as pods (pod runner), each in its own network namespace, and reach the real S3
server (SeaweedFS) the harness runs on the host, relayed into every pod at the same address, as a
cluster Service would be. Node a's engine computes a prompt; its server writes the chunks back to
the bucket; node b's server learns of them from node a's journal objects; node b's engine then
loads them from the object tier instead of recomputing, with the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvfabric.demo.fabric import Fabric, wait_pool_ready
from kvfabric.demo.workloads import (
    engine_deployment,
    generate,
    object_store_secret,
    pool_manifest,
    prompt,
    ready_pods,
    with_object_tier,
)
from kvfabric.localcluster.testing import wait_for

POOL = "pool-s3"
CHUNK = 64
METRICS_PORT = 9090  # the pool default (spec.metrics.port)


@pytest.fixture(scope="module")
def deployed(fabric: Fabric) -> Iterator[tuple[Fabric, str]]:
    if fabric.runner_base is None:
        pytest.skip("an existing cluster (KVFABRIC_TEST_KUBECONFIG): no S3 server of the harness there")
    s3 = fabric.object_store
    assert s3 is not None
    with fabric.cluster.namespace("e2e-s3") as ns:
        fabric.cluster.apply(object_store_secret(s3, "s3-keys"), namespace=ns)
        pool = with_object_tier(pool_manifest(POOL, chunk_tokens=CHUNK), s3, "s3-keys")
        fabric.cluster.apply(pool, namespace=ns)
        wait_pool_ready(fabric.cluster, ns, POOL)
        fabric.cluster.apply(engine_deployment("engine-s3", POOL), namespace=ns)
        wait_for(
            lambda: len(ready_pods(fabric.cluster, ns, "app=engine-s3")) == 2,
            timeout=180,
            message="two ready engines",
        )
        yield fabric, ns


def test_object_store_is_reported_ready(deployed: tuple[Fabric, str]) -> None:
    fabric, ns = deployed
    pool = fabric.cluster.get_json("kvcachepool", POOL, "-n", ns)
    conds = {c["type"]: c for c in pool["status"]["conditions"]}
    assert conds["StorageReady"]["status"] == "True", conds["StorageReady"]
    assert conds["StorageReady"]["reason"] == "ObjectStoreWritable"


def test_a_prefix_stored_on_node_a_is_an_object_tier_hit_on_node_b(deployed: tuple[Fabric, str]) -> None:
    fabric, ns = deployed
    by_node = {p["spec"]["nodeName"]: p for p in ready_pods(fabric.cluster, ns, "app=engine-s3")}
    a, b = (by_node[n] for n in fabric.gpu_nodes[:2])
    p = prompt(11, 5 * CHUNK + 7)
    cold = generate(fabric, a, p)
    assert cold["hit_tokens"] == 0
    # A's store and its server's write-back to the bucket are asynchronous, and B's server learns of
    # the objects from A's journal objects: wait until B's server indexes them (asking B's engine
    # earlier would make it compute and store the prompt itself, a DRAM hit afterwards).
    b_server = cache_pods(fabric, ns)[b["spec"]["nodeName"]]
    wait_for(
        lambda: object_blocks(fabric, b_server) >= 5, timeout=60, message="node b's server to index 5 objects"
    )
    warm = generate(fabric, b, p)
    assert warm["output_token_ids"] == cold["output_token_ids"]  # cached KV gives the same tokens
    assert warm["hit_tokens"] == 5 * CHUNK, warm
    assert warm["tier"] == "object", warm


def cache_pods(fabric: Fabric, ns: str) -> dict[str, dict[str, Any]]:
    selector = f"app.kubernetes.io/name=kvfabric-cache,app.kubernetes.io/instance={POOL}"
    return {p["spec"]["nodeName"]: p for p in ready_pods(fabric.cluster, ns, selector)}


def object_blocks(fabric: Fabric, server_pod: dict[str, Any]) -> int:
    """Blocks the server's object tier indexes, from its Prometheus metrics."""
    status, body = fabric.request(server_pod, METRICS_PORT, "/metrics", timeout=10)
    assert status == 200, body[:300]
    for line in body.splitlines():
        if line.startswith("kvfabric_tier_blocks") and 'tier="object"' in line:
            return int(float(line.rsplit(" ", 1)[1]))
    return 0
