"""The pool's status lists the compatibility namespaces its consumers use, on the real
control plane: the operator scrapes real cache-server processes standing in for the kwok pods.

kwok runs no containers, so the test gives each cache-server pod the address of a real cache-server
process (a loopback address of its own, written into the pod's status as a kubelet would report the
pod IP); the operator finds the pods, scrapes ``http://<podIP>:<spec.metrics.port>/metrics`` and
folds the namespaces the connectors described into ``status.cache.namespaces``.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from tests.operator.conftest import OperatorProcess, condition, get_pool, patch_pod_status
from tests.operator.test_operator_cluster_reconcile import cache_pods, sample

from kvfabric.cacheserver.metrics import namespace_label
from kvfabric.client import CacheClient
from kvfabric.connector.keys import NamespaceSpec
from kvfabric.localcluster.testing import ClusterHandle, wait_for
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, payload_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# Two engines of one model whose revisions differ: they never share a chunk.
R1 = NamespaceSpec("tiny-llama", "rev-1", "float32", 2, 1, 4, 16, 32)
R2 = NamespaceSpec("tiny-llama", "rev-2", "float32", 2, 1, 4, 16, 32)
ADDRESSES = ("127.42.14.1", "127.42.14.2")


def _port_free_on(addresses: tuple[str, ...]) -> int:
    """A port free on every address (the pool has one metrics port for all its servers)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((addresses[0], 0))
            port = int(s.getsockname()[1])
        try:
            for address in addresses:
                with socket.socket() as s:
                    s.bind((address, port))
        except OSError:
            continue
        return port
    raise AssertionError("no port free on every test address")


@contextlib.contextmanager
def servers(port: int) -> Iterator[list[ServerProcess]]:
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                cache_server(
                    server_id=f"srv{i}",
                    dram_bytes=16 * MiB,
                    tcp=False,
                    overrides={"metrics.host": address, "metrics.port": port},
                )
            )
            for i, address in enumerate(ADDRESSES)
        ]


def _set_pod_ip(cluster: ClusterHandle, ns: str, pod: dict[str, Any], ip: str) -> None:
    patch_pod_status(cluster, ns, pod["metadata"]["name"], {"podIP": ip, "podIPs": [{"ip": ip}]})


def _namespaces(cluster: ClusterHandle, ns: str) -> list[dict[str, Any]]:
    cache = (get_pool(cluster, ns, "pool-a").get("status") or {}).get("cache") or {}
    return list(cache.get("namespaces") or [])


def test_status_lists_the_namespaces_in_use_from_the_scraped_servers(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    port = _port_free_on(ADDRESSES)
    keys = [digest("k", i) for i in range(3)]
    with servers(port) as (one, two):
        # Node one's engine uses rev-1 and finds 2 of 3 chunks; node two runs both revisions.
        for srv, spec, stored in ((one, R1, 2), (two, R1, 0), (two, R2, 0)):
            with CacheClient(srv.unix_target, shared_memory=True) as c:
                c.announce(spec.digest(), spec.canonical().decode())
                if stored:
                    c.store(
                        spec.digest(),
                        keys[:stored],
                        [payload_for(k, 1000) for k in keys[:stored]],
                        timeout=10,
                    )
                c.lookup(spec.digest(), keys, timeout=5)

        doc = sample("pool-a")
        doc["spec"]["metrics"] = {"port": port}
        cluster.apply(doc, namespace=namespace)
        wait_for(
            lambda: condition(get_pool(cluster, namespace, "pool-a"), "Ready").get("status") == "True",
            timeout=90,
            message="Ready",
        )
        pods = sorted(cache_pods(cluster, namespace, "pool-a"), key=lambda p: p["spec"]["nodeName"])
        assert len(pods) >= 2
        nodes = [p["spec"]["nodeName"] for p in pods[:2]]
        for pod, address in zip(pods, ADDRESSES, strict=False):
            _set_pod_ip(cluster, namespace, pod, address)

        def listed() -> list[dict[str, Any]] | None:
            found = _namespaces(cluster, namespace)
            return (
                found
                if {n["digest"] for n in found}
                == {namespace_label(R1.digest()), namespace_label(R2.digest())}
                else None
            )

        try:
            found = wait_for(listed, timeout=90, message="status.cache.namespaces")
        except AssertionError as exc:
            status = get_pool(cluster, namespace, "pool-a").get("status")
            raise AssertionError(f"{exc}\nstatus: {json.dumps(status)}\n{operator.tail()}") from None

    by_digest = {n["digest"]: n for n in found}
    r1, r2 = by_digest[namespace_label(R1.digest())], by_digest[namespace_label(R2.digest())]
    assert sorted(r1["nodes"]) == sorted(nodes)
    assert r1["nodeCount"] == 2
    assert (r1["lookupHits"], r1["lookupMisses"], r1["hitRate"]) == (2, 4, "33.3%")
    assert r2["nodes"] == [nodes[1]]
    assert (r2["lookupHits"], r2["lookupMisses"], r2["hitRate"]) == (0, 3, "0.0%")
    assert r1["fields"]["model"] == "tiny-llama"
    assert (r1["fields"]["revision"], r2["fields"]["revision"]) == ("rev-1", "rev-2")
    assert r1["fields"]["chunk_tokens"] == "32"
    assert r1["fields"]["dtype"] == "float32"
    cache = get_pool(cluster, namespace, "pool-a")["status"]["cache"]
    assert cache["namespacesInUse"] == 2
    (split,) = cache["namespaceSplits"]
    assert "tiny-llama" in split
    assert "revision: rev-1, rev-2" in split
    # Visible to kubectl users: -o wide prints the count, describe prints the list.
    wide = cluster.kubectl("get", "kvp", "pool-a", "-n", namespace, "-o", "wide").stdout
    header, row = wide.splitlines()[:2]
    assert header.split()[-3:] == ["NAMESPACES", "ROUTING", "AGE"]
    # Read by the header's offsets: ROUTING has no value while routing events are off.
    assert row[header.index("NAMESPACES") : header.index("ROUTING")].strip() == "2"
    described = cluster.kubectl("describe", "kvp", "pool-a", "-n", namespace).stdout
    assert namespace_label(R2.digest()) in described
    assert R2.digest() not in described  # the digest is a capability: never in the status
    assert "rev-2" in described
    events = cluster.get_json(
        "events",
        "-n",
        namespace,
        "--field-selector",
        "involvedObject.kind=KVCachePool,involvedObject.name=pool-a",
    )["items"]
    assert "NamespacesDiverge" in {e.get("reason") for e in events}
