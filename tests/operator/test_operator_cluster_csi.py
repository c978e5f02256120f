"""The CSI node plugin's cross-namespace check against the real API server, with its shipped RBAC.

A pod of another namespace than the pool's gets the pool's socket only when the pool's
``spec.consumers.namespaceSelector`` selects the pod's namespace; the plugin reads both objects as
its own ServiceAccount, which may do that, and get the consumer-keys Secret of its own namespace,
and nothing else (``manifests/csi/rbac.yaml``).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.operator.conftest import OperatorProcess

from kvfabric.contract.consumer_env import CONSUMER_KEYS_SECRET, consumer_keys_entry
from kvfabric.contract.consumer_keys import consumer_root, encode_key
from kvfabric.csi.access import ApiAuthorizer
from kvfabric.csi.publish import Code, Publication, Refused
from kvfabric.localcluster.testing import ClusterHandle, token_kubeconfig

pytestmark = [pytest.mark.cluster]

ROOT = Path(__file__).resolve().parents[2]
SA = "system:serviceaccount:kvfabric-system:kvfabric-csi-node"


@pytest.fixture
def plugin_kubeconfig(cluster: ClusterHandle, crd: None, tmp_path: Path) -> Path:
    if cluster.kubectl("get", "namespace", "kvfabric-system", check=False).returncode:
        cluster.kubectl("create", "namespace", "kvfabric-system")
    docs = [d for d in yaml.safe_load_all((ROOT / "manifests" / "csi" / "rbac.yaml").read_text()) if d]
    for d in docs:
        if d["kind"] in ("ServiceAccount", "Role", "RoleBinding"):
            d["metadata"]["namespace"] = "kvfabric-system"
    cluster.apply(*docs)
    return token_kubeconfig(
        cluster, "kvfabric-system", tmp_path / "csi.kubeconfig", account="kvfabric-csi-node"
    )


def _publication(pool_ns: str, pod_ns: str, pool: str = "pool-a") -> Publication:
    return Publication(
        source=f"/run/kvfabric/{pool_ns}.{pool}",
        target="/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/v/mount",
        namespace=pool_ns,
        pool=pool,
        pod_namespace=pod_ns,
        pod="engine",
    )


def test_only_namespaces_the_pools_selector_selects_are_granted(
    cluster: ClusterHandle, namespace: str, plugin_kubeconfig: Path
) -> None:
    pool = {
        "apiVersion": "kvfabric.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": "pool-a"},
        "spec": {
            "image": {"tag": "v0.2.0"},
            "tiers": {"memory": {"size": "1Gi"}},
            "consumers": {"namespaceSelector": {"matchLabels": {"kvfabric-test/consumer": "yes"}}},
        },
    }
    cluster.apply(pool, namespace=namespace)
    authorize = ApiAuthorizer.from_environment(str(plugin_kubeconfig))
    with cluster.namespace("sel") as selected, cluster.namespace("other") as other:
        cluster.kubectl("label", "namespace", selected, "kvfabric-test/consumer=yes")
        assert authorize(_publication(namespace, selected)) is None
        refusal = authorize(_publication(namespace, other))
        assert refusal is not None
        assert f"does not select namespace {other}" in refusal
        assert authorize(_publication(namespace, selected, pool="absent")) == "no such KVCachePool"
        # Relabelled: the next publication sees it (each is decided on the live objects).
        cluster.kubectl("label", "namespace", selected, "kvfabric-test/consumer-")
        assert authorize(_publication(namespace, selected)) is not None


def _pool(consumers: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "kvfabric.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": "pool-a"},
        "spec": {"image": {"tag": "v0.2.0"}, "tiers": {"memory": {"size": "1Gi"}}, "consumers": consumers},
    }


def test_the_plugin_reads_the_consumer_root_from_its_own_namespaces_secret_and_nothing_else(
    cluster: ClusterHandle, namespace: str, plugin_kubeconfig: Path, operator: OperatorProcess
) -> None:
    # The operator keeps this Secret (it publishes every pool's root): stopped, so that the test
    # decides what the Secret holds; started again after, and it publishes again.
    operator.stop()
    cluster.apply(_pool({}), namespace=namespace)
    authorize = ApiAuthorizer.from_environment(str(plugin_kubeconfig), namespace="kvfabric-system")
    forget = ("delete", "secret", CONSUMER_KEYS_SECRET, "-n", "kvfabric-system", "--ignore-not-found")
    cluster.kubectl(*forget)
    with pytest.raises(Refused) as missing:
        authorize.consumer_key(namespace, "pool-a")
    assert missing.value.code is Code.UNAVAILABLE
    assert f"Secret {CONSUMER_KEYS_SECRET}" in missing.value.message
    root = consumer_root("the pool's payload secret")
    entry = consumer_keys_entry(namespace, "pool-a")

    def keys_secret(data: dict[str, str]) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": CONSUMER_KEYS_SECRET},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
        }

    try:
        cluster.apply(keys_secret({"other.pool": encode_key(bytes(32))}), namespace="kvfabric-system")
        with pytest.raises(Refused) as no_entry:
            authorize.consumer_key(namespace, "pool-a")
        assert (no_entry.value.code, entry in no_entry.value.message) == (Code.UNAVAILABLE, True)
        cluster.apply(keys_secret({entry: encode_key(root)}), namespace="kvfabric-system")
        key = authorize.consumer_key(namespace, "pool-a")
        assert (key.root, key.shared) == (root, False)  # no keySpace: a key space per namespace
        with pytest.raises(Refused) as absent:
            authorize.consumer_key(namespace, "absent")
        assert absent.value.code is Code.FAILED_PRECONDITION
    finally:
        cluster.kubectl(*forget)
        operator.start()


@pytest.mark.parametrize(
    ("verb", "resource", "allowed"),
    [
        ("get", "kvcachepools.kvfabric.io", True),
        ("get", "namespaces", True),
        ("list", "kvcachepools.kvfabric.io", False),
        ("update", "kvcachepools.kvfabric.io", False),
        ("get", "secrets", False),
        ("list", "pods", False),
        ("create", "pods", False),
        ("patch", "namespaces", False),
    ],
)
def test_the_plugins_service_account_may_read_pools_and_namespaces_and_nothing_else(
    cluster: ClusterHandle, plugin_kubeconfig: Path, verb: str, resource: str, allowed: bool
) -> None:
    out = cluster.kubectl("auth", "can-i", verb, resource, "-A", f"--as={SA}", check=False)
    assert out.stdout.strip() == ("yes" if allowed else "no"), (verb, resource, out.stdout, out.stderr)


@pytest.mark.parametrize(
    ("verb", "resource", "namespace", "allowed"),
    [
        ("get", f"secrets/{CONSUMER_KEYS_SECRET}", "kvfabric-system", True),
        ("get", "secrets/kvfabric-ca", "kvfabric-system", False),
        ("list", "secrets", "kvfabric-system", False),
        ("watch", "secrets", "kvfabric-system", False),
        ("update", f"secrets/{CONSUMER_KEYS_SECRET}", "kvfabric-system", False),
        ("get", f"secrets/{CONSUMER_KEYS_SECRET}", "default", False),
    ],
)
def test_the_plugins_one_secret_is_the_consumer_keys_of_its_own_namespace(
    cluster: ClusterHandle, plugin_kubeconfig: Path, verb: str, resource: str, namespace: str, allowed: bool
) -> None:
    out = cluster.kubectl("auth", "can-i", verb, resource, "-n", namespace, f"--as={SA}", check=False)
    assert out.stdout.strip() == ("yes" if allowed else "no"), (verb, resource, out.stdout, out.stderr)
