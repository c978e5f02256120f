"""``spec.tiers.objectStore``: admission messages name the field; the operator renders the server's
object tier, mounts the credentials Secret and never writes the key pair into the ConfigMap."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml

from kvfabric.cacheserver.config import ServerConfig
from kvfabric.localcluster.testing import ClusterHandle
from kvfabric.operator.api.v1alpha1 import KVCachePool
from kvfabric.operator.render import names, render_children

OBJECT_STORE: dict[str, Any] = {
    "endpoint": "https://s3.example.com",
    "bucket": "kv-cache",
    "capacity": "10Ti",
    "credentials": {"secretName": "s3-keys"},
    "ca": {"configMapName": "s3-ca"},
}


def pool_doc(object_store: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "kvfabric.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": "pool-a", "namespace": "llm", "uid": "uid-1"},
        "spec": {
            "image": {"repository": "example.com/kvfabric", "tag": "v0.2.0"},
            "tiers": {"memory": {"size": "1Gi"}, "objectStore": copy.deepcopy(object_store or OBJECT_STORE)},
        },
    }


def test_the_object_tier_is_rendered_with_credentials_as_mounted_files() -> None:
    rendered = render_children(KVCachePool.model_validate(pool_doc()))
    (cm,) = rendered.by_kind("ConfigMap")
    text = cm["data"][names.CONFIG_KEY]
    cfg = ServerConfig.model_validate(yaml.safe_load(text)).tiers.object_store
    assert cfg is not None
    assert (cfg.endpoint, cfg.bucket, cfg.prefix) == (
        "https://s3.example.com",
        "kv-cache",
        "kvfabric/llm/pool-a",
    )
    assert cfg.capacity_bytes == 10 << 40
    assert str(cfg.access_key_id_file) == f"{names.OBJECT_STORE_SECRET_MOUNT}/AWS_ACCESS_KEY_ID"
    assert str(cfg.secret_access_key_file) == f"{names.OBJECT_STORE_SECRET_MOUNT}/AWS_SECRET_ACCESS_KEY"
    assert str(cfg.ca_file) == f"{names.OBJECT_STORE_CA_MOUNT}/ca.crt"
    (ds,) = rendered.by_kind("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["object-store-credentials"]["secret"]["secretName"] == "s3-keys"
    assert vols["object-store-ca"]["configMap"]["name"] == "s3-ca"
    (server,) = [c for c in pod["containers"] if c["name"] == names.CACHE_CONTAINER]
    mounts = {m["name"]: m for m in server["volumeMounts"]}
    assert mounts["object-store-credentials"]["readOnly"] is True
    assert mounts["object-store-credentials"]["mountPath"] == names.OBJECT_STORE_SECRET_MOUNT
    # The init container that chowns directories never sees the credentials.
    (prep,) = pod["initContainers"]
    assert "object-store-credentials" not in {m["name"] for m in prep["volumeMounts"]}


def test_a_changed_object_store_rolls_the_daemonset() -> None:
    a = render_children(KVCachePool.model_validate(pool_doc())).config_hash
    b = render_children(KVCachePool.model_validate(pool_doc({**OBJECT_STORE, "bucket": "other"}))).config_hash
    assert a != b


def _with(**change: Any) -> dict[str, Any]:
    doc = pool_doc({**OBJECT_STORE, **change})
    doc["metadata"] = {"name": "pool-a"}
    return doc


INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("endpoint-no-scheme", _with(endpoint="s3.example.com"), "spec.tiers.objectStore.endpoint"),
    (
        "endpoint-with-path",
        _with(endpoint="https://s3.example.com/bucket"),
        "spec.tiers.objectStore.endpoint",
    ),
    ("bucket-upper-case", _with(bucket="Kv_Cache"), "spec.tiers.objectStore.bucket"),
    ("prefix-dotdot", _with(prefix="a/../b"), "spec.tiers.objectStore.prefix"),
    ("ca-on-http", _with(endpoint="http://minio:9000"), "spec.tiers.objectStore.ca"),
    ("bad-capacity", _with(capacity="lots"), "spec.tiers.objectStore.capacity"),
    ("no-secret-name", _with(credentials={}), "spec.tiers.objectStore.credentials.secretName"),
]


@pytest.mark.cluster
@pytest.mark.parametrize(("case", "pool", "field"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_object_store_is_rejected_naming_the_field(
    cluster: ClusterHandle, crd: None, namespace: str, case: str, pool: dict[str, Any], field: str
) -> None:
    result = cluster.kubectl(
        "create", "-n", namespace, "--dry-run=server", "-f", "-", input=json.dumps(pool), check=False
    )
    assert result.returncode != 0, f"{case} was accepted"
    assert field in result.stderr, result.stderr


@pytest.mark.cluster
def test_a_valid_object_store_is_accepted(cluster: ClusterHandle, crd: None, namespace: str) -> None:
    doc = pool_doc()
    doc["metadata"] = {"name": "pool-a"}
    cluster.kubectl("create", "-n", namespace, "--dry-run=server", "-f", "-", input=json.dumps(doc))


def test_no_mount_of_a_cache_server_lies_inside_a_read_only_volume() -> None:
    """Every feature on (TCP, object tier with CA, local disk, shared): no nested read-only mount.

    A runtime creates a volume's mount point inside the container's view of its parent directory; in
    a read-only ConfigMap or Secret volume that fails ("mkdir: read-only file system") and the cache
    server never starts. Found by the whole-fabric object-tier test (its credentials were mounted
    under the configuration's volume, /etc/kvfabric).
    """
    doc = pool_doc()
    doc["spec"]["server"] = {"tcp": {"enabled": True}}
    doc["spec"]["tiers"]["localDisk"] = {"hostPath": {"path": "/mnt/nvme/kv"}, "capacity": "1Ti"}
    doc["spec"]["tiers"]["shared"] = {"existingClaim": "kv-shared", "capacity": "1Ti"}
    (ds,) = render_children(KVCachePool.model_validate(doc)).by_kind("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        mounts = container.get("volumeMounts") or []
        read_only = [m["mountPath"].rstrip("/") for m in mounts if m.get("readOnly")]
        nested = [
            (m["mountPath"], parent)
            for m in mounts
            for parent in read_only
            if m["mountPath"].rstrip("/") != parent and m["mountPath"].startswith(parent + "/")
        ]
        assert not nested, (container["name"], nested)
    assert {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]} >= {
        names.OBJECT_STORE_SECRET_MOUNT,
        names.OBJECT_STORE_CA_MOUNT,
        names.SERVER_TLS_MOUNT,
        names.CREDENTIALS_MOUNT,
    }
