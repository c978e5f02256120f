"""Invalid pools are rejected by the API server (OpenAPI + CEL), each with a message naming the field."""

from __future__ import annotations

import copy
import json
from typing import Any

import pydantic
import pytest

from kvfabric.localcluster.testing import ClusterHandle
from kvfabric.operator.api.v1alpha1 import KVCachePool


def base_pool(name: str = "pool-a") -> dict[str, Any]:
    return {
        "apiVersion": "kvfabric.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name},
        "spec": {
            "image": {"tag": "v0.2.0"},
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
        "bad-load-mode",
        with_("spec.consumers", {"loadMode": "Sometimes"}),
        "spec.consumers.loadMode",
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

_DISK = "spec.tiers.localDisk"
_PATH = "spec.tiers.localDisk.hostPath.path"
_HEX = "a" * 64

# Nonsense specs: each is also rejected by the models (the reconciler's and the webhook's
# parse), see test_nonsense_pool_is_rejected_by_the_models.
NONSENSE_POOLS: list[tuple[str, dict[str, Any], str]] = [
    (
        "routing-events-one-port-twice",
        with_("spec.consumers", {"routingEvents": {"port": 6000, "replayPort": 6000}}),
        "spec.consumers.routingEvents.replayPort",
    ),
    (
        "routing-events-model-with-at",
        with_("spec.consumers", {"routingEvents": {"modelName": "a@b"}}),
        "spec.consumers.routingEvents.modelName",
    ),
    # Whole-byte quantities with bounds.
    ("memory-milli", with_("spec.tiers.memory.size", "100m"), "spec.tiers.memory.size"),
    ("memory-half-byte", with_("spec.tiers.memory.size", "0.5"), "spec.tiers.memory.size"),
    ("memory-1e400", with_("spec.tiers.memory.size", "1e400"), "spec.tiers.memory.size"),
    ("memory-below-minimum", with_("spec.tiers.memory.size", "1Mi"), "spec.tiers.memory.size"),
    ("memory-above-maximum", with_("spec.tiers.memory.size", "100Ti"), "spec.tiers.memory.size"),
    ("memory-negative", with_("spec.tiers.memory.size", "-1Gi"), "spec.tiers.memory.size"),
    ("memory-exponent-fraction", with_("spec.tiers.memory.size", "1e-3"), "spec.tiers.memory.size"),
    ("disk-capacity-milli", with_(f"{_DISK}.capacity", "10m"), f"{_DISK}.capacity"),
    ("disk-capacity-fraction", with_(f"{_DISK}.capacity", "1.5"), f"{_DISK}.capacity"),
    ("disk-capacity-above-maximum", with_(f"{_DISK}.capacity", "2Pi"), f"{_DISK}.capacity"),
    (
        "empty-dir-size-limit-fraction",
        with_(_DISK, {"emptyDir": {"sizeLimit": "0.5"}, "capacity": "1Gi"}),
        f"{_DISK}.emptyDir.sizeLimit",
    ),
    (
        "shared-capacity-1e400",
        with_("spec.tiers.shared", {"claimTemplate": {"size": "1Ti"}, "capacity": "1e400"}),
        "spec.tiers.shared.capacity",
    ),
    (
        "claim-size-milli",
        with_("spec.tiers.shared", {"claimTemplate": {"size": "500m"}, "capacity": "1Mi"}),
        "spec.tiers.shared.claimTemplate.size",
    ),
    (
        "resources-memory-milli",
        with_("spec.resources", {"requests": {"memory": "100m"}}),
        "spec.resources.requests",
    ),
    (
        "resources-memory-limit-1e400",
        with_("spec.resources", {"limits": {"memory": "1e400"}}),
        "spec.resources.limits",
    ),
    (
        "resources-unknown-resource",
        with_("spec.resources", {"requests": {"nvidia.com/gpu": "1"}}),
        "spec.resources.requests",
    ),
    (
        "resources-request-above-limit",
        with_("spec.resources", {"requests": {"memory": "4Gi"}, "limits": {"memory": "2Gi"}}),
        "spec.resources.requests",
    ),
    ("resources-zero-cpu", with_("spec.resources", {"requests": {"cpu": "0"}}), "spec.resources.requests"),
    # Ports.
    ("server-port-equals-default-metrics-port", with_("spec.server", {"port": 9090}), "spec.metrics.port"),
    (
        "server-and-metrics-port-equal",
        {
            **with_("spec.server", {"port": 8000}),
            "spec": {**with_("spec.server", {"port": 8000})["spec"], "metrics": {"port": 8000}},
        },
        "spec.metrics.port",
    ),
    ("server-port-above-65535", with_("spec.server", {"port": 70000}), "spec.server.port"),
    # Image references.
    ("repository-with-space", with_("spec.image.repository", "ghcr.io/kv fabric"), "spec.image.repository"),
    (
        "repository-with-capitals",
        with_("spec.image.repository", "ghcr.io/KVFabric/kvfabric"),
        "spec.image.repository",
    ),
    (
        "repository-with-tag",
        with_("spec.image.repository", "ghcr.io/kvfabric/kvfabric:v1"),
        "spec.image.repository",
    ),
    (
        "repository-trailing-slash",
        with_("spec.image.repository", "ghcr.io/kvfabric/"),
        "spec.image.repository",
    ),
    ("repository-double-dot", with_("spec.image.repository", "ghcr.io/kv..fabric"), "spec.image.repository"),
    ("tag-with-space", with_("spec.image.tag", "v 1"), "spec.image.tag"),
    ("tag-too-long", with_("spec.image.tag", "v" * 129), "spec.image.tag"),
    ("tag-short-digest", with_("spec.image.tag", "v1@sha256:abc"), "spec.image.tag"),
    ("tag-leading-dot", with_("spec.image.tag", ".v1"), "spec.image.tag"),
    (
        "connector-image-capitals",
        with_("spec.consumers.connectorImage", "ghcr.io/KV/connector:v1"),
        "spec.consumers.connectorImage",
    ),
    (
        "connector-image-space",
        with_("spec.consumers.connectorImage", "ghcr.io/kv/connector :v1"),
        "spec.consumers.connectorImage",
    ),
    (
        "connector-image-bad-digest",
        with_("spec.consumers.connectorImage", f"ghcr.io/kv/connector@sha256:{_HEX[:10]}"),
        "spec.consumers.connectorImage",
    ),
    # Bounded deadlines.
    ("lookup-deadline-a-minute", with_("spec.consumers.deadlines", {"lookupMs": 60000}), "lookupMs"),
    ("lookup-deadline-above-2s", with_("spec.consumers.deadlines", {"lookupMs": 2001}), "lookupMs"),
    ("lookup-deadline-zero", with_("spec.consumers.deadlines", {"lookupMs": 0}), "lookupMs"),
    ("load-deadline-ten-minutes", with_("spec.consumers.deadlines", {"loadMs": 600000}), "loadMs"),
    ("store-deadline-an-hour", with_("spec.consumers.deadlines", {"storeMs": 3600000}), "storeMs"),
    # Label keys and values in every selector.
    (
        "node-selector-key-with-space",
        with_("spec.placement.nodeSelector", {"bad key": "true"}),
        "spec.placement.nodeSelector",
    ),
    (
        "node-selector-value-with-space",
        with_("spec.placement.nodeSelector", {"gpu": "a b"}),
        "spec.placement.nodeSelector",
    ),
    (
        "node-selector-key-name-too-long",
        with_("spec.placement.nodeSelector", {"x" * 64: "true"}),
        "spec.placement.nodeSelector",
    ),
    (
        "node-selector-key-two-slashes",
        with_("spec.placement.nodeSelector", {"a.io/b/c": "true"}),
        "spec.placement.nodeSelector",
    ),
    (
        "pod-selector-label-key-leading-dash",
        with_("spec.consumers.podSelector", {"matchLabels": {"-x": "y"}}),
        "spec.consumers.podSelector.matchLabels",
    ),
    (
        "pod-selector-expression-key-with-space",
        with_("spec.consumers.podSelector", {"matchExpressions": [{"key": "a b", "operator": "Exists"}]}),
        "spec.consumers.podSelector.matchExpressions[0].key",
    ),
    (
        "namespace-selector-expression-bad-value",
        with_(
            "spec.consumers.namespaceSelector",
            {"matchExpressions": [{"key": "team", "operator": "In", "values": ["not valid!"]}]},
        ),
        "spec.consumers.namespaceSelector.matchExpressions[0].values[0]",
    ),
    (
        "namespace-selector-label-value-too-long",
        with_("spec.consumers.namespaceSelector", {"matchLabels": {"team": "v" * 64}}),
        "spec.consumers.namespaceSelector.matchLabels",
    ),
    (
        "toleration-key-two-slashes",
        with_("spec.placement", {"tolerations": [{"key": "nvidia.com/gpu/x", "operator": "Exists"}]}),
        "spec.placement.tolerations[0].key",
    ),
    (
        "toleration-value-with-space",
        with_("spec.placement", {"tolerations": [{"key": "gpu", "value": "a b"}]}),
        "spec.placement.tolerations[0].value",
    ),
    (
        "opt-out-label-upper-case-prefix",
        with_("spec.placement", {"optOutNodeLabel": "KVFabric.io/deploy"}),
        "spec.placement.optOutNodeLabel",
    ),
    (
        "priority-class-with-space",
        with_("spec.placement", {"priorityClassName": "high prio"}),
        "spec.placement.priorityClassName",
    ),
    # Normalised host paths.
    ("host-path-trailing-newline", with_(_PATH, "/mnt/nvme/kv\n"), _PATH),
    ("host-path-tab", with_(_PATH, "/mnt/\tkv"), _PATH),
    ("host-path-nul", with_(_PATH, "/mnt/kv\u0000"), _PATH),
    ("host-path-etcd", with_(_PATH, "/var/lib/etcd"), _PATH),
    ("host-path-under-etcd", with_(_PATH, "/var/lib/etcd/kv"), _PATH),
    ("host-path-under-var-log", with_(_PATH, "/var/log/kv"), _PATH),
    ("host-path-trailing-slash", with_(_PATH, "/mnt/nvme/kv/"), _PATH),
    ("host-path-trailing-space", with_(_PATH, "/mnt/nvme/kv "), _PATH),
    # Object names.
    (
        "existing-claim-not-a-name",
        with_("spec.tiers.shared", {"existingClaim": "My Claim", "capacity": "1Gi"}),
        "spec.tiers.shared.existingClaim",
    ),
    (
        "storage-class-not-a-name",
        with_(
            "spec.tiers.shared",
            {"claimTemplate": {"size": "1Gi", "storageClassName": "Fast_SSD"}, "capacity": "1Gi"},
        ),
        "spec.tiers.shared.claimTemplate.storageClassName",
    ),
    # Rollout deadline.
    (
        "progress-deadline-too-short",
        with_("spec.updateStrategy", {"progressDeadlineSeconds": 5}),
        "spec.updateStrategy.progressDeadlineSeconds",
    ),
    (
        "progress-deadline-too-long",
        with_("spec.updateStrategy", {"progressDeadlineSeconds": 10**6}),
        "spec.updateStrategy.progressDeadlineSeconds",
    ),
]
INVALID_POOLS += NONSENSE_POOLS


@pytest.mark.cluster
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
    assert len(NONSENSE_POOLS) >= 40
    assert len({c[0] for c in INVALID_POOLS}) == len(INVALID_POOLS)


def test_the_base_pool_is_valid() -> None:
    KVCachePool.model_validate({**base_pool(), "metadata": {"name": "pool-a", "namespace": "ns"}})


@pytest.mark.parametrize(("case", "pool", "field"), NONSENSE_POOLS, ids=[c[0] for c in NONSENSE_POOLS])
def test_nonsense_pool_is_rejected_by_the_models(case: str, pool: dict[str, Any], field: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        KVCachePool.model_validate(pool)
    # The model's error names the same field (pydantic writes the location with dots and indexes).
    leaf = field.rsplit(".", 1)[-1].split("[", maxsplit=1)[0]
    assert leaf in str(info.value), f"{case}: {info.value}"


def server_side_apply(cluster: ClusterHandle, namespace: str, pool: dict[str, Any], *, dry_run: bool) -> Any:
    args = ["apply", "--server-side", "--field-manager=kvfabric-tests", "-n", namespace, "-f", "-"]
    return cluster.kubectl(
        *args, *(["--dry-run=server"] if dry_run else []), input=json.dumps(pool), check=False
    )


TEMPLATE = {"storageClassName": "fast", "size": "20Gi"}
# (case id, shared tier before, shared tier after, the API server's message): the shared tier's
# transition rules (oldSelf), which only an update exercises.
SHARED_CHANGES: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    (
        "storage-class",
        {"claimTemplate": TEMPLATE, "capacity": "10Gi"},
        {"claimTemplate": {**TEMPLATE, "storageClassName": "slow"}, "capacity": "10Gi"},
        "spec.tiers.shared.claimTemplate.storageClassName is immutable",
    ),
    (
        "existing-claim",
        {"existingClaim": "kv-a", "capacity": "10Gi"},
        {"existingClaim": "kv-b", "capacity": "10Gi"},
        "spec.tiers.shared.existingClaim is immutable",
    ),
    (
        "claim-to-template",
        {"existingClaim": "kv-a", "capacity": "10Gi"},
        {"claimTemplate": TEMPLATE, "capacity": "10Gi"},
        "the volume source (existingClaim or claimTemplate) is immutable",
    ),
    (
        "template-to-claim",
        {"claimTemplate": TEMPLATE, "capacity": "10Gi"},
        {"existingClaim": "kv-a", "capacity": "10Gi"},
        "the volume source (existingClaim or claimTemplate) is immutable",
    ),
]


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("case", "before", "after", "message"), SHARED_CHANGES, ids=[c[0] for c in SHARED_CHANGES]
)
def test_the_shared_tiers_volume_is_immutable(
    cluster: ClusterHandle,
    crd: None,
    namespace: str,
    case: str,
    before: dict[str, Any],
    after: dict[str, Any],
    message: str,
) -> None:
    created = server_side_apply(cluster, namespace, with_("spec.tiers.shared", before), dry_run=False)
    assert created.returncode == 0, created.stderr
    changed = server_side_apply(cluster, namespace, with_("spec.tiers.shared", after), dry_run=True)
    assert changed.returncode != 0, f"{case}: change accepted"
    assert message in changed.stderr, changed.stderr
    # The rest of the shared tier still changes: its capacity, its watermarks.
    grown = {**before, "capacity": "15Gi", "watermarks": {"high": 0.8, "low": 0.6}}
    ok = server_side_apply(cluster, namespace, with_("spec.tiers.shared", grown), dry_run=True)
    assert ok.returncode == 0, ok.stderr


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


@pytest.mark.cluster
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
