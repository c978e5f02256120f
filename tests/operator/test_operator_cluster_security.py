"""A TCP pool on the real API server: per-pool credentials, NetworkPolicy, and a server that uses them.

The operator issues the Secrets; a real cache-server process is then started with exactly the
rendered listener configuration, reading the Secrets' files, and a client holding the consumer
Secret gets in while one without the token or without the certificate does not.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
from tests.operator.conftest import OperatorProcess

from kvfabric.client import CacheClient
from kvfabric.client.errors import CacheUnavailable, PermissionDenied
from kvfabric.localcluster.testing import ClusterHandle, wait_for
from kvfabric.testing.serverproc import MiB, cache_server, digest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def tcp_pool(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "kvfabric.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name},
        "spec": {
            "image": {"tag": "v0.2.0"},
            "tiers": {"memory": {"size": "1Gi"}},
            "server": {"tcp": {"enabled": True}},
        },
    }


def _files(cluster: ClusterHandle, ns: str, secret: str, into: Path) -> Path:
    data = cluster.get_json("secret", secret, "-n", ns)["data"]
    into.mkdir(parents=True, exist_ok=True)
    for key, value in data.items():
        (into / key).write_bytes(base64.b64decode(value))
    return into


def test_tcp_pool_gets_credentials_and_a_network_policy(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    cluster.apply(tcp_pool("sec"), namespace=namespace)
    secrets = wait_for(
        lambda: (
            {s["metadata"]["name"] for s in cluster.get_json("secrets", "-n", namespace)["items"]}
            >= {"sec-credentials", "sec-ca", "sec-server-tls", "sec-client-tls"}
        ),
        timeout=60,
        message="the pool's Secrets",
    )
    assert secrets
    policy = cluster.get_json("networkpolicy", "sec-cache", "-n", namespace)["spec"]
    assert [r["ports"][0]["port"] for r in policy["ingress"]] == [7070, 9090]
    # Consumer pods in the pool's namespace get the token as a projected Secret file (checked by the API
    # server's own validation of the mutated pod).
    server_tls = _files(cluster, namespace, "sec-server-tls", tmp_path / "server")
    creds = _files(cluster, namespace, "sec-credentials", tmp_path / "creds")
    client_tls = _files(cluster, namespace, "sec-client-tls", tmp_path / "client")
    token = (creds / "token").read_text()
    overrides = {
        "listen.token_file": str(creds / "token"),
        "listen.tls": {
            "cert_file": str(server_tls / "tls.crt"),
            "key_file": str(server_tls / "tls.key"),
            "client_ca_file": str(server_tls / "ca.crt"),
        },
    }
    k = digest("cluster-tcp")
    with cache_server(dram_bytes=16 * MiB, overrides=overrides) as srv:
        # The certificate names the node-local Service; connect to loopback under that name.
        target = f"127.0.0.1:{srv.config.listen.tcp_port}"
        tls = {
            "tls_ca": client_tls / "ca.crt",
            "tls_cert": client_tls / "tls.crt",
            "tls_key": client_tls / "tls.key",
        }
        with _client(target, f"sec.{namespace}.svc", token=token, **tls) as ok:
            assert ok.store(digest("ns"), [k], [b"x"], timeout=10).accepted == 1
        with _client(target, f"sec.{namespace}.svc", **tls) as anon, pytest.raises(PermissionDenied):
            anon.lookup(digest("ns"), [k], timeout=10)
        with (
            _client(target, f"sec.{namespace}.svc", token=token, tls_ca=client_tls / "ca.crt") as no_cert,
            pytest.raises(CacheUnavailable),
        ):
            no_cert.lookup(digest("ns"), [k], timeout=10)


def _client(target: str, server_name: str, **kwargs: Any) -> CacheClient:
    # Dial loopback but verify the certificate against the Service's DNS name.
    return CacheClient(target, tls_server_name=server_name, **kwargs)


def test_pool_in_a_namespace_whose_pod_security_rejects_its_pods_is_degraded(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    # The cache DaemonSet needs hostPath (node-local NVMe, the socket): Pod Security baseline forbids
    # it. The API server's own PodSecurity admission rejects the pods; the pool must say so.
    assert cluster.gpu_nodes, "the session cluster has GPU nodes"
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=baseline")
    cluster.apply(
        {
            "apiVersion": "kvfabric.io/v1alpha1",
            "kind": "KVCachePool",
            "metadata": {"name": "psa"},
            "spec": {"image": {"tag": "v0.2.0"}, "tiers": {"memory": {"size": "1Gi"}}},
        },
        namespace=namespace,
    )

    def degraded() -> dict[str, Any] | None:
        pool = cluster.get_json("kvcachepool", "psa", "-n", namespace)
        conds: list[dict[str, Any]] = (pool.get("status") or {}).get("conditions") or []
        cond = next((c for c in conds if c["type"] == "Degraded"), {})
        return cond if cond.get("status") == "True" and cond.get("reason") == "PodSecurityRejected" else None

    cond = wait_for(degraded, timeout=120, message="Degraded=PodSecurityRejected")
    assert "hostPath" in cond["message"]
    assert "baseline" in cond["message"]
