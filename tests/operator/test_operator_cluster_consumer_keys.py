"""Payload keys per consumer namespace, against the real API server.

The operator keeps the consumer-keys Secret (in its own namespace) current for the CSI node plugin,
and the webhook gives a consumer in another namespace its key as a CSI volume, which the API server's
PodSecurity admission (restricted) admits.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from tests.operator.conftest import OperatorProcess
from tests.operator.test_operator_cluster_injection import env_of, pool, restricted_pod, wait_pool_known

from kvfabric.contract.consumer_keys import consumer_root, encode_key
from kvfabric.localcluster.testing import ClusterHandle, wait_for
from kvfabric.operator.render import names

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CSI = "csi.kvfabric.io"


def _entries(cluster: ClusterHandle, operator_namespace: str) -> dict[str, str]:
    got = cluster.kubectl(
        "get", "secret", names.CONSUMER_KEYS_SECRET, "-n", operator_namespace, "-o", "json", check=False
    )
    if got.returncode:
        return {}
    data = json.loads(got.stdout).get("data") or {}
    return {k: base64.b64decode(v).decode() for k, v in data.items()}


def _payload_secret(cluster: ClusterHandle, namespace: str, pool_name: str) -> str | None:
    got = cluster.kubectl(
        "get", "secret", names.credentials_secret_name(pool_name), "-n", namespace, "-o", "json", check=False
    )
    if got.returncode:
        return None
    raw = (json.loads(got.stdout).get("data") or {}).get(names.PAYLOAD_KEY)
    return base64.b64decode(raw).decode() if raw else None


def test_a_pool_has_its_consumer_key_root_in_the_operators_namespace_until_it_is_deleted(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    # The session's operator runs without leader election: its namespace is $POD_NAMESPACE's default.
    operator_ns = names.operator_namespace()
    if cluster.kubectl("get", "namespace", operator_ns, check=False).returncode:
        cluster.kubectl("create", "namespace", operator_ns)
    cluster.apply(pool("pool-k"), pool("pool-l"), namespace=namespace)
    entry, other = f"{namespace}.pool-k", f"{namespace}.pool-l"

    def published() -> bool:
        secret = _payload_secret(cluster, namespace, "pool-k")
        entries = _entries(cluster, operator_ns)
        return (
            secret is not None
            and entries.get(entry) == encode_key(consumer_root(secret))
            and other in entries
        )

    wait_for(published, timeout=60, message="the pool's consumer-key root in the consumer-keys Secret")
    secret = _payload_secret(cluster, namespace, "pool-k")
    assert secret is not None
    # The root, never the pool's secret, is what leaves the pool's namespace.
    assert secret not in json.dumps(_entries(cluster, operator_ns))

    cluster.kubectl("delete", "kvp", "pool-k", "-n", namespace)
    wait_for(
        lambda: entry not in _entries(cluster, operator_ns),
        timeout=60,
        message="the deleted pool's entry removed",
    )
    assert other in _entries(cluster, operator_ns), "only the deleted pool's entry goes"

    # An entry left by a pool deleted while no operator ran is removed by the resync.
    operator.stop()
    cluster.kubectl("delete", "kvp", "pool-l", "-n", namespace)
    operator.start()
    wait_for(
        lambda: other not in _entries(cluster, operator_ns),
        timeout=60,
        message="the resync removes the entry of a pool deleted while the operator was down",
    )


def test_a_restricted_namespace_consuming_another_namespaces_pool_gets_its_key_volume_and_is_admitted(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    """Through the CSI plugin: the socket volume and a second, read-only key volume; no Secret of the
    pool's namespace; the API server's own PodSecurity (restricted) admits the mutated pod."""
    selected = {"kvfabric-test/consumers": "yes"}
    cluster.apply(pool("pool-x", namespaceSelector={"matchLabels": selected}), namespace=namespace)
    wait_pool_known(cluster, namespace, "pool-x")
    operator.stop()
    operator.extra_args.append(f"--csi-driver={CSI}")
    operator.start()
    try:
        with cluster.namespace("consumer") as consumer_ns:
            cluster.kubectl(
                "label",
                "namespace",
                consumer_ns,
                "pod-security.kubernetes.io/enforce=restricted",
                "kvfabric-test/consumers=yes",
            )

            def injected() -> dict[str, Any] | None:
                # The webhook learns namespace labels from a watch: until it saw these, it skips the
                # pod (namespace-not-selected); delete and retry.
                body = restricted_pod("cross-consumer", "pool-x")
                body["metadata"]["annotations"] = {names.POOL_NAMESPACE_ANNOTATION: namespace}
                cluster.apply(body, namespace=consumer_ns)
                created = cluster.get_json("pod", "cross-consumer", "-n", consumer_ns)
                if names.INJECTED_ANNOTATION in created["metadata"].get("annotations", {}):
                    return created
                cluster.kubectl("delete", "pod", "cross-consumer", "-n", consumer_ns, "--wait=true")
                return None

            admitted = wait_for(injected, timeout=60, interval=1.0, message="the cross-namespace consumer")
            volumes = {v["name"]: v for v in admitted["spec"]["volumes"]}
            assert volumes["kvfabric-run"]["csi"]["volumeAttributes"] == {
                "pool": "pool-x",
                "namespace": namespace,
            }
            assert volumes["kvfabric-key"] == {
                "name": "kvfabric-key",
                "csi": {
                    "driver": CSI,
                    "readOnly": True,
                    "volumeAttributes": {"pool": "pool-x", "namespace": namespace, "content": "payload-key"},
                },
            }
            mounts = admitted["spec"]["containers"][0]["volumeMounts"]
            assert {"name": "kvfabric-key", "mountPath": "/var/run/kvfabric/key", "readOnly": True} in mounts
            env = env_of(admitted)
            assert env["KVFABRIC_PAYLOAD_KEY_FILE"] == "/var/run/kvfabric/key/payload.key"
            assert "KVFABRIC_PAYLOAD_KEY" not in env
            assert env["KVFABRIC_KEY_SCOPE"] == consumer_ns  # named in its namespace digest
            assert "secretKeyRef" not in json.dumps(admitted["spec"])
    finally:
        operator.stop()
        operator.extra_args.remove(f"--csi-driver={CSI}")
        operator.start()
