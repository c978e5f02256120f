"""Invalid pools are rejected by the API server (OpenAPI + CEL), each with a message naming the field."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from kvfabric.localcluster.testing import ClusterHandle

pytestmark = pytest.mark.cluster


def base_pool(name: str = "pool-a") -> dict[str, Any]:
    return {
        "apiVersion": "kvfabric.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name},
        "spec": {
            "image": {"tag": "v0.1.0"},
            "tiers": {
                "memory": {"size": "1Gi"},
                "localDisk": {"hostPath": {"path": "/mnt/nvme/kv"}, "capacity": "10Gi"},
            },
        },
    }


def with_(path: str, value: Any, *, delete: bool = False) -> dict[str, Any]:
    pool = base_pool()
    node: Any = pool
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    if delete:
        node.pop(keys[-1], None)
    else:
        node[keys[-1]] = copy.deepcopy(value)
    return pool


# (case id, pool, text the API server's message must contain: the field's path)
INVALID_POOLS: list[tuple[str, dict[str, Any], str]] = [
    ("latest-tag", with_("spec.image.tag", "latest"), "spec.image.tag"),
    (
        "latest-connector-image",
        with_("spec.consumers.connectorImage", "ghcr.io/kvfabric/connector:latest"),
        "spec.consumers.connectorImage",
    ),
    ("missing-tag", with_("spec.image.tag", None, delete=True), "spec.image.tag"),
    ("missing-memory-tier", with_("spec.tiers.memory", None, delete=True), "spec.tiers.memory"),
    (
        "two-disk-sources",
        with_("spec.tiers.localDisk", {"hostPath": {"path": "/mnt/kv"}, "emptyDir": {}, "capacity": "1Gi"}),
        "spec.tiers.localDisk",
    ),
    ("no-disk-source", with_("spec.tiers.localDisk", {"capacity": "10Gi"}), "spec.tiers.localDisk"),
    (
        "low-watermark-not-below-high",
        with_("spec.tiers.localDisk.watermarks", {"high": 0.7, "low": 0.8}),
        "watermarks.low",
    ),
    (
        "watermark-above-one",
        with_("spec.tiers.localDisk.watermarks", {"high": 1.5, "low": 0.5}),
        "watermarks.high",
    ),
    ("relative-host-path", with_("spec.tiers.localDisk.hostPath.path", "data/kv"), "hostPath.path"),
    ("root-host-path", with_("spec.tiers.localDisk.hostPath.path", "/"), "hostPath.path"),
    ("proc-host-path", with_("spec.tiers.localDisk.hostPath.path", "/proc/kv"), "hostPath.path"),
    (
        "kubelet-host-path",
        with_("spec.tiers.localDisk.hostPath.path", "/var/lib/kubelet/pods"),
        "hostPath.path",
    ),
    ("etc-host-path", with_("spec.tiers.localDisk.hostPath.path", "/etc"), "hostPath.path"),
    ("dotdot-host-path", with_("spec.tiers.localDisk.hostPath.path", "/mnt/../etc"), "hostPath.path"),
    ("dot-host-path", with_("spec.tiers.localDisk.hostPath.path", "/."), "hostPath.path"),
    ("dot-etc-host-path", with_("spec.tiers.localDisk.hostPath.path", "/./etc"), "hostPath.path"),
    ("kubelet-parent-host-path", with_("spec.tiers.localDisk.hostPath.path", "/var"), "hostPath.path"),
    (
        "kubelet-parent-slash-host-path",
        with_("spec.tiers.localDisk.hostPath.path", "/var/lib/"),
        "hostPath.path",
    ),
    (
        "empty-dir-capacity-above-limit",
        with_("spec.tiers.localDisk", {"emptyDir": {"sizeLimit": "1Gi"}, "capacity": "2Gi"}),
        "spec.tiers.localDisk.capacity",
    ),
    (
        "two-shared-sources",
        with_(
            "spec.tiers.shared", {"existingClaim": "kv", "claimTemplate": {"size": "1Ti"}, "capacity": "1Gi"}
        ),
        "spec.tiers.shared",
    ),
    (
        "shared-capacity-above-claim",
        with_("spec.tiers.shared", {"claimTemplate": {"size": "10Gi"}, "capacity": "20Gi"}),
        "spec.tiers.shared.capacity",
    ),
    ("bad-memory-quantity", with_("spec.tiers.memory.size", "lots"), "spec.tiers.memory.size"),
    ("zero-memory", with_("spec.tiers.memory.size", "0"), "spec.tiers.memory.size"),
    ("chunk-not-multiple-of-16", with_("spec.chunkTokens", 100), "spec.chunkTokens"),
    ("ttl-too-short", with_("spec.ttlSeconds", 5), "spec.ttlSeconds"),
    ("bad-max-unavailable", with_("spec.updateStrategy", {"maxUnavailable": "150%"}), "maxUnavailable"),
    ("zero-max-unavailable", with_("spec.updateStrategy", {"maxUnavailable": 0}), "maxUnavailable"),
    (
        "bad-failure-policy",
        with_("spec.consumers", {"failurePolicy": "Maybe"}),
        "spec.consumers.failurePolicy",
    ),
    (
        "memory-limit-below-tier",
        with_("spec.resources", {"limits": {"memory": "512Mi"}}),
        "spec.resources.limits.memory",
    ),
    ("metrics-port-privileged", with_("spec.metrics", {"port": 80}), "spec.metrics.port"),
    (
        "exists-toleration-with-value",
        with_("spec.placement", {"tolerations": [{"key": "a", "operator": "Exists", "value": "b"}]}),
        "spec.placement.tolerations",
    ),
    ("unknown-pull-policy", with_("spec.image.pullPolicy", "Sometimes"), "spec.image.pullPolicy"),
    ("name-not-dns-label", {**base_pool(), "metadata": {"name": "pool.dotted"}}, "metadata.name"),
]


@pytest.mark.parametrize(("case", "pool", "field"), INVALID_POOLS, ids=[c[0] for c in INVALID_POOLS])
def test_invalid_pool_is_rejected_with_a_message_naming_the_field(
    cluster: ClusterHandle, crd: None, namespace: str, case: str, pool: dict[str, Any], field: str
) -> None:
    result = cluster.kubectl(
        "create", "-n", namespace, "--dry-run=server", "-f", "-", input=json.dumps(pool), check=False
    )
    assert result.returncode != 0, f"{case} was accepted"
    assert field in result.stderr, result.stderr


def test_there_are_at_least_twelve_cases() -> None:
    assert len(INVALID_POOLS) >= 12


IMMUTABLE_CHANGES: list[tuple[str, str, Any, str]] = [
    ("chunk-tokens", "spec.chunkTokens", 512, "spec.chunkTokens is immutable"),
    ("host-path", "spec.tiers.localDisk.hostPath.path", "/mnt/other", "hostPath.path is immutable"),
    (
        "disk-source",
        "spec.tiers.localDisk",
        {"emptyDir": {}, "capacity": "10Gi"},
        "the disk source (hostPath or emptyDir) is immutable",
    ),
]


@pytest.mark.parametrize(
    ("case", "path", "value", "message"), IMMUTABLE_CHANGES, ids=[c[0] for c in IMMUTABLE_CHANGES]
)
def test_immutable_fields(
    cluster: ClusterHandle, crd: None, namespace: str, case: str, path: str, value: Any, message: str
) -> None:
    cluster.kubectl(
        "apply",
        "--server-side",
        "--field-manager=kvfabric-tests",
        "-n",
        namespace,
        "-f",
        "-",
        input=json.dumps(base_pool()),
    )
    changed = with_(path, value)
    result = cluster.kubectl(
        "apply",
        "--server-side",
        "--field-manager=kvfabric-tests",
        "-n",
        namespace,
        "--dry-run=server",
        "-f",
        "-",
        input=json.dumps(changed),
        check=False,
    )
    assert result.returncode != 0, f"{case}: change accepted"
    assert message in result.stderr, result.stderr
    # Mutable fields still change.
    ok = with_("spec.tiers.memory.size", "2Gi")
    cluster.kubectl(
        "apply",
        "--server-side",
        "--field-manager=kvfabric-tests",
        "-n",
        namespace,
        "--dry-run=server",
        "-f",
        "-",
        input=json.dumps(ok),
    )
