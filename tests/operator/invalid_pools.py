"""Invalid KVCachePool specs, each with the field its rejection message must name.

Shared by the admission test (tests/operator/test_operator_cluster_admission.py) and the report.
"""

from __future__ import annotations

import copy
from typing import Any


def base_pool(name: str = "pool-a") -> dict[str, Any]:
    """A valid pool to derive invalid ones from."""
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


def _with(path: str, value: Any, *, delete: bool = False) -> dict[str, Any]:
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


# (case id, pool body, substring the API server's message must contain)
INVALID_POOLS: list[tuple[str, dict[str, Any], str]] = [
    ("latest-tag", _with("spec.image.tag", "latest"), "spec.image.tag"),
    ("missing-tag", _with("spec.image.tag", None, delete=True), "spec.image.tag"),
    (
        "two-disk-sources",
        _with(
            "spec.tiers.localDisk",
            {"hostPath": {"path": "/mnt/nvme/kv"}, "emptyDir": {}, "capacity": "10Gi"},
        ),
        "spec.tiers.localDisk",
    ),
    ("no-disk-source", _with("spec.tiers.localDisk", {"capacity": "10Gi"}), "spec.tiers.localDisk"),
    (
        "low-watermark-not-below-high",
        _with("spec.tiers.localDisk.watermarks", {"high": 0.7, "low": 0.8}),
        "watermarks.low",
    ),
    (
        "watermark-above-one",
        _with("spec.tiers.localDisk.watermarks", {"high": 1.5, "low": 0.5}),
        "watermarks.high",
    ),
    ("relative-host-path", _with("spec.tiers.localDisk.hostPath.path", "data/kv"), "hostPath.path"),
    ("root-host-path", _with("spec.tiers.localDisk.hostPath.path", "/"), "hostPath.path"),
    ("proc-host-path", _with("spec.tiers.localDisk.hostPath.path", "/proc/kv"), "hostPath.path"),
    (
        "kubelet-host-path",
        _with("spec.tiers.localDisk.hostPath.path", "/var/lib/kubelet/pods"),
        "hostPath.path",
    ),
    ("dotdot-host-path", _with("spec.tiers.localDisk.hostPath.path", "/mnt/../etc"), "hostPath.path"),
    (
        "two-shared-sources",
        _with(
            "spec.tiers.shared",
            {"existingClaim": "kv", "claimTemplate": {"size": "1Ti"}, "capacity": "100Gi"},
        ),
        "spec.tiers.shared",
    ),
    (
        "shared-capacity-above-claim",
        _with("spec.tiers.shared", {"claimTemplate": {"size": "10Gi"}, "capacity": "20Gi"}),
        "spec.tiers.shared.capacity",
    ),
    ("bad-memory-quantity", _with("spec.tiers.memory.size", "lots"), "spec.tiers.memory.size"),
    ("zero-memory", _with("spec.tiers.memory.size", "0"), "spec.tiers.memory.size"),
    ("chunk-not-multiple-of-16", _with("spec.chunkTokens", 100), "spec.chunkTokens"),
    ("ttl-too-short", _with("spec.ttlSeconds", 5), "spec.ttlSeconds"),
    ("bad-max-unavailable", _with("spec.updateStrategy", {"maxUnavailable": "150%"}), "maxUnavailable"),
    (
        "bad-failure-policy",
        _with("spec.consumers", {"failurePolicy": "Maybe"}),
        "spec.consumers.failurePolicy",
    ),
    (
        "memory-limit-below-tier",
        _with("spec.resources", {"limits": {"memory": "512Mi"}}),
        "spec.resources.limits.memory",
    ),
    ("metrics-port-privileged", _with("spec.metrics", {"port": 80}), "spec.metrics.port"),
    (
        "exists-toleration-with-value",
        _with("spec.placement", {"tolerations": [{"key": "a", "operator": "Exists", "value": "b"}]}),
        "spec.placement.tolerations",
    ),
    ("name-not-dns-label", {**base_pool("1-Pool"), "metadata": {"name": "pool.dotted"}}, "metadata.name"),
]

# (case id, field path to change, new value, substring of the message) for immutable fields
IMMUTABLE_CHANGES: list[tuple[str, str, Any, str]] = [
    ("chunk-tokens-immutable", "spec.chunkTokens", 512, "spec.chunkTokens is immutable"),
    ("host-path-immutable", "spec.tiers.localDisk.hostPath.path", "/mnt/other", "hostPath.path is immutable"),
]
