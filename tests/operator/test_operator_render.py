"""Pure renderers: a pool in, complete server-side-apply bodies out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvfabric.cacheserver.config import ServerConfig
from kvfabric.operator.api.v1alpha1 import KVCachePool
from kvfabric.operator.render import connection_settings, names, render_children
from kvfabric.operator.render.children import build_server_config, render_daemonset


def pool(**spec_overrides: Any) -> KVCachePool:
    spec: dict[str, Any] = {
        "image": {"repository": "example.com/kvfabric", "tag": "v1.2.3"},
        "tiers": {
            "memory": {"size": "8Gi"},
            "localDisk": {"hostPath": {"path": "/mnt/nvme/kv"}, "capacity": "100Gi"},
        },
    }
    spec.update(spec_overrides)
    return KVCachePool.model_validate(
        {"metadata": {"name": "pool-a", "namespace": "llm", "uid": "uid-1"}, "spec": spec}
    )


def kinds(p: KVCachePool) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in render_children(p).objects}


def test_children_and_owner_references() -> None:
    objs = kinds(pool())
    assert set(objs) == {
        ("ConfigMap", "pool-a-config"),
        ("DaemonSet", "pool-a-cache"),
        ("Service", "pool-a"),
        ("Service", "pool-a-metrics"),
        ("NetworkPolicy", "pool-a-cache"),
    }
    for obj in objs.values():
        meta = obj["metadata"]
        assert meta["namespace"] == "llm"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "kvfabric.io/v1alpha1",
                "kind": "KVCachePool",
                "name": "pool-a",
                "uid": "uid-1",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"][names.OWNER_POOL_LABEL] == "pool-a"
        # The consumers' opt-in label must never be on the operator's own objects.
        assert "kvfabric.io/pool" not in meta["labels"]


def test_configmap_is_the_cache_servers_own_model(tmp_path: Path) -> None:
    cm = kinds(pool())[("ConfigMap", "pool-a-config")]
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    config = ServerConfig.from_yaml(path)
    assert config.tiers.dram.capacity_bytes == 8 * 2**30
    assert config.tiers.local_disk is not None
    assert config.tiers.local_disk.capacity_bytes == 100 * 2**30
    assert str(config.tiers.local_disk.path).startswith(names.LOCAL_DISK_MOUNT + "/")
    assert str(config.listen.unix_socket) == "/run/kvfabric/llm.pool-a/cache.sock"
    assert config.shm.dir is None  # blocks live in the server's memfds, in no shared directory
    assert config.server_id is None  # the server uses $NODE_NAME
    assert config.metrics.port == 9090


def test_daemonset_fields() -> None:
    ds = kinds(pool())[("DaemonSet", "pool-a-cache")]
    template = ds["spec"]["template"]
    pod = template["spec"]
    container = pod["containers"][0]
    assert container["image"] == "example.com/kvfabric:v1.2.3"
    assert container["command"] == ["kvfabric", "cacheserver", "--config", "/etc/kvfabric/config.yaml"]
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in container[
        "env"
    ]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    opt_out = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert opt_out["nodeSelectorTerms"][0]["matchExpressions"] == [
        {"key": "kvfabric.io/deploy", "operator": "NotIn", "values": ["false"]}
    ]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["kvfabric-run"]["hostPath"]["path"] == "/run/kvfabric/llm.pool-a"
    assert volumes["local-disk"]["hostPath"]["path"] == "/mnt/nvme/kv"
    assert volumes["config"]["configMap"]["name"] == "pool-a-config"
    assert (
        template["metadata"]["annotations"][names.CONFIG_HASH_ANNOTATION]
        == render_children(pool()).config_hash
    )
    # Rolled with hand-over: the new server starts beside the old one and takes its DRAM.
    assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    assert build_server_config(pool()).handover.enabled
    off = pool(updateStrategy={"handOver": False})
    assert render_daemonset(off, "r")["spec"]["updateStrategy"]["rollingUpdate"] == {
        "maxUnavailable": 1,
        "maxSurge": 0,
    }
    assert not build_server_config(off).handover.enabled
    # Nothing of the hand-over is rendered: the server would try to create a directory never mounted.
    assert build_server_config(off).handover.socket_dir is None
    off_volumes = render_daemonset(off, "r")["spec"]["template"]["spec"]["volumes"]
    assert names.HANDOVER_VOLUME not in {v["name"] for v in off_volumes}
    assert ds["spec"]["selector"]["matchLabels"] == names.selector_labels("pool-a")
    # Default resources follow the memory tier.
    assert container["resources"]["requests"]["memory"] == "8704Mi"


def test_memory_change_changes_config_and_revision_but_not_the_consumer_hash() -> None:
    small, big = pool(), pool(tiers={"memory": {"size": "16Gi"}})
    a, b = render_children(small), render_children(big)
    assert a.config_hash != b.config_hash
    assert connection_settings(small).config_hash == connection_settings(big).config_hash
    # A consumer-visible change does change the consumer hash.
    tenant = pool(consumers={"tenant": "team-a"})
    assert connection_settings(tenant).config_hash != connection_settings(small).config_hash


def test_render_is_deterministic() -> None:
    assert render_children(pool()).objects == render_children(pool()).objects


def test_node_local_service() -> None:
    svc = kinds(pool())[("Service", "pool-a")]
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    assert svc["spec"]["ports"][0]["port"] == 7070
    metrics = kinds(pool())[("Service", "pool-a-metrics")]
    assert metrics["spec"]["clusterIP"] == "None"


def test_metrics_disabled_drops_the_metrics_service() -> None:
    assert ("Service", "pool-a-metrics") not in kinds(pool(metrics={"enabled": False}))


def test_shared_claim_template_renders_an_owned_pvc() -> None:
    p = pool(
        tiers={
            "memory": {"size": "1Gi"},
            "shared": {"claimTemplate": {"size": "1Ti", "storageClassName": "nfs"}, "capacity": "900Gi"},
        }
    )
    objs = kinds(p)
    pvc = objs[("PersistentVolumeClaim", "pool-a-shared")]
    assert pvc["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "1Ti"}},
        "storageClassName": "nfs",
    }
    volumes = {
        v["name"]: v for v in objs[("DaemonSet", "pool-a-cache")]["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes["shared"]["persistentVolumeClaim"]["claimName"] == "pool-a-shared"
    config = build_server_config(p)
    assert config.tiers.shared is not None
    assert config.tiers.shared.capacity_bytes == 900 * 2**30


def test_existing_claim_is_mounted_not_owned() -> None:
    p = pool(tiers={"memory": {"size": "1Gi"}, "shared": {"existingClaim": "rwx", "capacity": "1Ti"}})
    objs = kinds(p)
    assert not [k for k in objs if k[0] == "PersistentVolumeClaim"]
    volumes = {
        v["name"]: v for v in objs[("DaemonSet", "pool-a-cache")]["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes["shared"]["persistentVolumeClaim"]["claimName"] == "rwx"


def test_empty_dir_disk_and_small_memory_render_a_valid_config() -> None:
    p = pool(
        tiers={
            "memory": {"size": "64Mi"},
            "localDisk": {"emptyDir": {"sizeLimit": "10Gi"}, "capacity": "10Gi"},
        }
    )
    config = build_server_config(p)
    assert config.limits.max_payload_bytes <= config.tiers.dram.capacity_bytes
    volumes = {
        v["name"]: v for v in kinds(p)[("DaemonSet", "pool-a-cache")]["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes["local-disk"] == {"name": "local-disk", "emptyDir": {"sizeLimit": "10Gi"}}


def test_user_resources_win() -> None:
    p = pool(resources={"requests": {"cpu": "2", "memory": "10Gi"}, "limits": {"memory": "12Gi"}})
    container = kinds(p)[("DaemonSet", "pool-a-cache")]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"] == {
        "requests": {"cpu": "2", "memory": "10Gi"},
        "limits": {"memory": "12Gi"},
    }


def test_rendered_yaml_is_plain_data() -> None:
    for obj in render_children(pool()).objects:
        assert yaml.safe_load(yaml.safe_dump(obj)) == obj


def test_the_hand_over_socket_lies_in_a_directory_only_cache_servers_mount() -> None:
    # An engine running as the server's uid could otherwise ask for a hand-over: every tenant's blocks.
    p = pool()
    spec = render_daemonset(p, "r")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    handover = volumes[names.HANDOVER_VOLUME]["hostPath"]["path"]
    run = names.host_dir(p.namespace, p.name)
    assert not handover.startswith(run.rstrip("/") + "/")
    assert not run.startswith(handover.rstrip("/") + "/")
    assert handover != run
    assert build_server_config(p).handover.socket_dir == Path(handover)
    # Prepared (owned by the server's uid) like the run directory, and injected into no consumer.
    assert handover in " ".join(spec["initContainers"][0]["command"])
    assert connection_settings(p).host_dir == run  # the one directory injection mounts (read-only)


def _existing(
    *, max_surge: int, annotated: bool, desired: int = 3, updated: int = 3, observed: int = 2
) -> dict[str, Any]:
    annotations = {names.HANDOVER_ANNOTATION: "v1"} if annotated else {}
    return {
        "metadata": {"generation": 2},
        "spec": {
            "updateStrategy": {"rollingUpdate": {"maxSurge": max_surge, "maxUnavailable": 1}},
            "template": {"metadata": {"annotations": annotations}},
        },
        "status": {
            "observedGeneration": observed,
            "desiredNumberScheduled": desired,
            "currentNumberScheduled": desired,
            "updatedNumberScheduled": updated,
        },
    }


def test_the_first_rollout_onto_hand_over_stops_first_and_later_ones_surge() -> None:
    from kvfabric.operator.render.children import surge_is_safe, without_surge

    # A new pool, or one already surging: its pods can all hand over.
    assert surge_is_safe(None)
    assert surge_is_safe(_existing(max_surge=1, annotated=True, updated=1))
    # Pods of a version without hand-over run: a surge would put a new server beside one that goes on
    # writing the node's disks, so this rollout stops first.
    assert not surge_is_safe(_existing(max_surge=0, annotated=False))
    # The stop-first rollout onto hand-over is still going (or not observed yet): keep stopping first.
    assert not surge_is_safe(_existing(max_surge=0, annotated=True, updated=1))
    assert not surge_is_safe(_existing(max_surge=0, annotated=True, observed=1))
    # Done: every pod offers hand-overs, the next rollout surges.
    assert surge_is_safe(_existing(max_surge=0, annotated=True))
    p = pool()
    ds = render_daemonset(p, "r")
    assert ds["spec"]["template"]["metadata"]["annotations"][names.HANDOVER_ANNOTATION] == "v1"
    stop_first = without_surge(ds, p)
    assert stop_first["spec"]["updateStrategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
    assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    assert stop_first["spec"]["template"] == ds["spec"]["template"]  # no extra rollout
