"""Render a pool's children: ConfigMaps, DaemonSet, node-local Service, metrics Service, shared PVC.

Each function returns a complete server-side-apply body: every field the operator owns is present,
fields it does not care about are absent (so other managers, e.g. an autoscaler, may own them).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import Any, Final

import pydantic
import yaml

from kvfabric.cacheserver import config as server_config
from kvfabric.operator.api.v1alpha1 import POOL_LABEL, KVCachePool, LabelSelector
from kvfabric.operator.quantity import QuantityError, format_bytes, to_bytes
from kvfabric.operator.render import names
from kvfabric.operator.render.router import router_data

_GiB: Final = 1 << 30
_MiB: Final = 1 << 20


class ConfigError(ValueError):
    """The pool passed the CRD's validation but yields no valid server configuration."""


@dataclass(frozen=True)
class RenderedChildren:
    """The desired children of one pool, plus the server configuration's hash (the revision)."""

    config_hash: str
    objects: list[dict[str, Any]]

    def by_kind(self, kind: str) -> list[dict[str, Any]]:
        """Return the rendered objects of one kind."""
        return [obj for obj in self.objects if obj["kind"] == kind]


# The uid/gid the cache-server image runs as (images/cacheserver/Dockerfile: USER 65532:65532).
CACHE_UID = 65532


def owner_reference(pool: KVCachePool) -> dict[str, Any]:
    """Return the controller owner reference pointing at ``pool`` (GC deletes children with it)."""
    return {
        "apiVersion": pool.api_version,
        "kind": pool.kind,
        "name": pool.name,
        "uid": str(pool.metadata.get("uid", "")),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(pool: KVCachePool, name: str, component: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": pool.namespace,
        "labels": names.child_labels(pool.name, component),
        "ownerReferences": [owner_reference(pool)],
    }


def build_server_config(pool: KVCachePool) -> server_config.ServerConfig:
    """Return the cache server's configuration for ``pool``; raise :class:`ConfigError` if invalid."""
    spec = pool.spec
    base = names.host_dir(pool.namespace, pool.name)
    try:
        dram_bytes = to_bytes(spec.tiers.memory.size)
        tiers: dict[str, Any] = {"dram": {"capacity_bytes": dram_bytes}}
        disk = spec.tiers.local_disk
        if disk is not None:
            tiers["local_disk"] = {
                "path": names.local_disk_dir(pool.namespace, pool.name),
                "capacity_bytes": to_bytes(disk.capacity),
                "high_watermark": disk.watermarks.high,
                "low_watermark": disk.watermarks.low,
            }
        shared = spec.tiers.shared
        if shared is not None:
            tiers["shared"] = {
                "path": names.SHARED_MOUNT,
                "capacity_bytes": to_bytes(shared.capacity),
                "high_watermark": shared.watermarks.high,
                "low_watermark": shared.watermarks.low,
            }
        obj = spec.tiers.object_store
        if obj is not None:
            tiers["object_store"] = object_store_config(pool)
        return server_config.ServerConfig.model_validate(
            {
                "listen": _listen(pool, f"{base}/{names.SOCKET_NAME}"),
                # Store staging is a slice of the DRAM budget, never more than 1 GiB.
                "shm": {"arena_bytes": max(1, min(_GiB, dram_bytes // 4))},
                "metrics": {"host": "0.0.0.0", "port": spec.metrics.port},
                "tiers": tiers,
                "ttl_seconds": spec.ttl_seconds,
                "bucket_seconds": min(3600, spec.ttl_seconds),
                # A payload larger than the DRAM tier could never be stored; cap it so a small pool is valid.
                "limits": {"max_payload_bytes": min(128 * _MiB, dram_bytes)},
                "log_level": spec.server.log_level.upper(),
                "handover": (
                    {"enabled": True, "socket_dir": names.handover_dir(pool.namespace, pool.name)}
                    if spec.update_strategy.hand_over
                    else {"enabled": False}
                ),
            }
        )
    except (QuantityError, pydantic.ValidationError) as exc:
        raise ConfigError(str(exc)) from exc


def object_store_config(pool: KVCachePool) -> dict[str, Any]:
    """The server's ``tiers.object_store`` section for ``spec.tiers.objectStore`` (which must be set).

    Credentials and the CA are files in read-only volumes (see :func:`render_daemonset`): the key
    pair never appears in the ConfigMap.
    """
    obj = pool.spec.tiers.object_store
    assert obj is not None
    out: dict[str, Any] = {
        "endpoint": obj.endpoint,
        "bucket": obj.bucket,
        "prefix": obj.prefix or f"kvfabric/{pool.namespace}/{pool.name}",
        "region": obj.region,
        "path_style": obj.path_style,
        "capacity_bytes": to_bytes(obj.capacity),
        "high_watermark": obj.watermarks.high,
        "low_watermark": obj.watermarks.low,
    }
    if obj.credentials is not None:
        out["access_key_id_file"] = f"{names.OBJECT_STORE_SECRET_MOUNT}/{obj.credentials.access_key_id_key}"
        out["secret_access_key_file"] = (
            f"{names.OBJECT_STORE_SECRET_MOUNT}/{obj.credentials.secret_access_key_key}"
        )
    if obj.ca is not None:
        out["ca_file"] = f"{names.OBJECT_STORE_CA_MOUNT}/{obj.ca.key}"
    return out


def _listen(pool: KVCachePool, socket: str) -> dict[str, Any]:
    """The listeners: the Unix socket always; TCP only when asked, then mutual TLS plus the token."""
    if not pool.spec.server.tcp.enabled:
        return {"unix_socket": socket, "tcp_port": None}
    tls = names.SERVER_TLS_MOUNT
    return {
        "unix_socket": socket,
        "tcp_host": "0.0.0.0",
        "tcp_port": pool.spec.server.port,
        "tls": {
            "cert_file": f"{tls}/tls.crt",
            "key_file": f"{tls}/tls.key",
            "client_ca_file": f"{tls}/{names.CA_KEY}",
        },
        "token_file": f"{names.CREDENTIALS_MOUNT}/{names.TOKEN_KEY}",
    }


def config_yaml(config: server_config.ServerConfig) -> str:
    """Return the ConfigMap payload: the fields that differ from their defaults, as YAML.

    Defaults are left to the server, so a pool whose image is a release behind the operator still
    starts (its configuration model forbids fields it does not know) unless the pool sets a newer one.
    """
    return yaml.safe_dump(config.model_dump(mode="json", exclude_defaults=True), sort_keys=True)


def config_hash(text: str) -> str:
    """Return the revision: a short digest of the rendered configuration."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def render_configmap(pool: KVCachePool, text: str) -> dict[str, Any]:
    """Return the ConfigMap holding ``config.yaml``."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(pool, names.configmap_name(pool.name), "config"),
        "data": {names.CONFIG_KEY: text},
    }


def _resources(pool: KVCachePool) -> dict[str, Any]:
    spec = pool.spec
    if spec.resources is not None and (spec.resources.requests or spec.resources.limits):
        out: dict[str, Any] = {}
        if spec.resources.requests:
            out["requests"] = dict(spec.resources.requests)
        if spec.resources.limits:
            out["limits"] = dict(spec.resources.limits)
        return out
    # Default: the DRAM tier plus headroom for the process itself (cf. LMCache's size + 5Gi, 1.5x limit).
    # DRAM blocks are memfds (shmem), charged to this container's memory cgroup like any page of the
    # process, so the limit covers the tier itself; the quarter and the GiB are the process, staging
    # arenas and the page cache of disk-tier I/O. The limit also bounds what the server can write to
    # its run directory on the node's /run tmpfs (tmpfs pages are charged to the writer's cgroup;
    # docs/security.md, "Paths and pods").
    dram = to_bytes(spec.tiers.memory.size)
    return {
        "requests": {"cpu": "500m", "memory": format_bytes(dram + 512 * _MiB)},
        "limits": {"memory": format_bytes(dram + dram // 4 + _GiB)},
    }


@dataclass(frozen=True)
class _Volumes:
    """The pod's volumes, the cache server's mounts and the directory-preparing init container's."""

    volumes: list[dict[str, Any]]
    server: list[dict[str, Any]]
    prepare: list[dict[str, Any]]


def _volumes(pool: KVCachePool) -> _Volumes:
    """Return the pod's volumes and both containers' mounts: config, run dir, disk, shared tier.

    Every hostPath the cache server mounts is its own pool's directory and nothing above it: the
    run and hand-over directories are volumes of their own, and the local-disk tier is the user's
    disk path mounted with ``subPath: <namespace>.<pool>``. The disk path itself (where every pool
    sharing it has its directory) is mounted only into the init container, which runs the
    operator's image and a fixed script (:func:`_prepare_dirs_container`).
    """
    spec = pool.spec
    base = names.host_dir(pool.namespace, pool.name)
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": names.configmap_name(pool.name)}},
        {"name": names.RUN_VOLUME, "hostPath": {"path": base, "type": "DirectoryOrCreate"}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": names.CONFIG_MOUNT_DIR, "readOnly": True},
        {"name": names.RUN_VOLUME, "mountPath": base},
    ]
    prepare: list[dict[str, Any]] = [{"name": names.RUN_VOLUME, "mountPath": base}]
    if spec.update_strategy.hand_over:
        handover = names.handover_dir(pool.namespace, pool.name)
        volumes.append(
            {"name": names.HANDOVER_VOLUME, "hostPath": {"path": handover, "type": "DirectoryOrCreate"}}
        )
        mounts.append({"name": names.HANDOVER_VOLUME, "mountPath": handover})
        prepare.append({"name": names.HANDOVER_VOLUME, "mountPath": handover})
    tcp = spec.server.tcp.enabled
    if tcp:
        # Secret volumes (not env): the kubelet swaps rotated files in place and the server re-reads
        # them at the next handshake / call. Mode 0440 with the pod's fsGroup: readable by the server only.
        volumes += [
            {
                "name": "server-tls",
                "secret": {"secretName": names.server_tls_secret_name(pool.name), "defaultMode": 0o440},
            },
            {
                "name": "credentials",
                "secret": {
                    "secretName": names.credentials_secret_name(pool.name),
                    "items": [{"key": names.TOKEN_KEY, "path": names.TOKEN_KEY}],
                    "defaultMode": 0o440,
                },
            },
        ]
        mounts += [
            {"name": "server-tls", "mountPath": names.SERVER_TLS_MOUNT, "readOnly": True},
            {"name": "credentials", "mountPath": names.CREDENTIALS_MOUNT, "readOnly": True},
        ]
    disk = spec.tiers.local_disk
    if disk is not None:
        if disk.host_path is not None:
            volumes.append(
                {"name": "local-disk", "hostPath": {"path": disk.host_path.path, "type": "DirectoryOrCreate"}}
            )
        else:
            empty: dict[str, Any] = {}
            if disk.empty_dir is not None and disk.empty_dir.size_limit is not None:
                empty["sizeLimit"] = disk.empty_dir.size_limit
            volumes.append({"name": "local-disk", "emptyDir": empty})
        # The server sees its own directory only, where its configuration says (tiers.local_disk.path
        # is names.local_disk_dir): never the disk path, where every pool sharing it has one. The
        # init container creates that directory and refuses a symlink there before this mount is
        # made (the kubelet resolves the subPath when it starts the server's container, after the
        # init container has succeeded, and never lets it leave the volume).
        mounts.append(
            {
                "name": "local-disk",
                "mountPath": names.local_disk_dir(pool.namespace, pool.name),
                "subPath": names.pool_dir_name(pool.namespace, pool.name),
            }
        )
        prepare.append({"name": "local-disk", "mountPath": names.LOCAL_DISK_MOUNT})
    shared = spec.tiers.shared
    if shared is not None:
        claim = shared.existing_claim or names.shared_claim_name(pool.name)
        volumes.append({"name": "shared", "persistentVolumeClaim": {"claimName": claim}})
        # One sub-directory per pool, so several pools can share one existing claim; neither
        # container ever mounts the claim's root.
        shared_mount = {
            "name": "shared",
            "mountPath": names.SHARED_MOUNT,
            "subPath": names.pool_dir_name(pool.namespace, pool.name),
        }
        mounts.append(shared_mount)
        prepare.append(dict(shared_mount))
    obj = spec.tiers.object_store
    if obj is not None and obj.credentials is not None:
        creds = obj.credentials
        volumes.append(
            {
                "name": "object-store-credentials",
                "secret": {
                    "secretName": creds.secret_name,
                    "items": [
                        {"key": creds.access_key_id_key, "path": creds.access_key_id_key},
                        {"key": creds.secret_access_key_key, "path": creds.secret_access_key_key},
                    ],
                    # Read-only; the volume is visible only inside this pod, whose processes all run as
                    # the server's uid (no fsGroup: it would make the kubelet chown the shared volume).
                    "defaultMode": 0o444,
                },
            }
        )
        mounts.append(
            {
                "name": "object-store-credentials",
                "mountPath": names.OBJECT_STORE_SECRET_MOUNT,
                "readOnly": True,
            }
        )
    if obj is not None and obj.ca is not None:
        volumes.append(
            {
                "name": "object-store-ca",
                "configMap": {
                    "name": obj.ca.config_map_name,
                    "items": [{"key": obj.ca.key, "path": obj.ca.key}],
                },
            }
        )
        mounts.append({"name": "object-store-ca", "mountPath": names.OBJECT_STORE_CA_MOUNT, "readOnly": True})
    return _Volumes(volumes, mounts, prepare)


def _opt_out_affinity(pool: KVCachePool) -> dict[str, Any]:
    """Nodes labelled ``<optOutNodeLabel>=false`` never run this pool's cache server."""
    requirement = {"key": pool.spec.placement.opt_out_node_label, "operator": "NotIn", "values": ["false"]}
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [requirement]}]
            }
        }
    }


def _cache_container(pool: KVCachePool, mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """Return the cache-server container: non-root, read-only root FS, probes on the metrics port."""
    spec = pool.spec
    return {
        "name": names.CACHE_CONTAINER,
        "image": f"{spec.image.repository}:{spec.image.tag}",
        "imagePullPolicy": spec.image.pull_policy.value,
        "command": ["kvfabric", "cacheserver", "--config", names.CONFIG_PATH],
        "env": [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
        "ports": [
            *(
                [{"name": "cache", "containerPort": spec.server.port, "protocol": "TCP"}]
                if spec.server.tcp.enabled
                else []
            ),
            {"name": "metrics", "containerPort": spec.metrics.port, "protocol": "TCP"},
        ],
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "metrics"},
            "periodSeconds": 5,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "metrics"},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        "resources": _resources(pool),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": CACHE_UID,
            "runAsGroup": CACHE_UID,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": mounts,
    }


def prepare_dirs_script(owned: list[str], *, shared: bool) -> str:
    """The init container's script: create ``owned``, refuse any that is a symlink or no directory, chown.

    The check comes after ``mkdir -p`` (which succeeds silently on a symlink to a directory) and
    before the cache server's container exists: the kubelet mounts the server's pool directory only
    once this script has exited 0. ``chown -h`` never follows a symlink either. Paths are the
    operator's own (DNS labels and a dot below fixed roots): nothing a shell would interpret.
    """
    dirs = " ".join(owned)
    script = (
        f"mkdir -p {dirs} && for d in {dirs}; do "
        'if [ -L "$d" ] || [ ! -d "$d" ]; then echo "refused: $d is a symlink or not a directory" >&2; '
        "exit 3; fi; done && "
        f"chown -h {CACHE_UID}:{CACHE_UID} {dirs}"
    )
    if shared:
        script += f" && (chown {CACHE_UID}:{CACHE_UID} {names.SHARED_MOUNT} || true)"
    return script


def _prepare_dirs_container(pool: KVCachePool, mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """Return the root init container that hands the pool's directories to the non-root server.

    It runs the operator's own image (:func:`names.operator_image`), never the pool's: a pool author
    chooses the cache-server image, and root with that path mounted would be root on the node.

    The kubelet creates missing hostPath directories as root (mode 0755), where the non-root cache
    server could not create its socket or blocks. A short root init container with nothing but
    CAP_CHOWN hands them over; the shared volume is best effort (NFS with root_squash refuses
    chown, and there the volume's own permissions must already let the server write).
    Only directories kvfabric owns are chowned: the run directory, the hand-over directory and a
    per-pool directory below the user's disk path, never the path itself (it may be shared with
    other data, and with other pools).

    It is the only container that mounts the disk path itself: it creates the pool's directory
    there and refuses one that is a symlink (:func:`prepare_dirs_script`), so that the cache
    server's ``subPath`` mount of that directory is a real directory below the disk path. No pool's
    server can plant a symlink in the disk path meanwhile: none of them mounts it.
    """
    owned = [names.host_dir(pool.namespace, pool.name)]
    if pool.spec.update_strategy.hand_over:
        owned.append(names.handover_dir(pool.namespace, pool.name))
    if pool.spec.tiers.local_disk is not None:
        owned.append(names.local_disk_dir(pool.namespace, pool.name))
    return {
        "name": "prepare-dirs",
        "image": names.operator_image(),
        "imagePullPolicy": "IfNotPresent",
        "command": ["sh", "-c", prepare_dirs_script(owned, shared=pool.spec.tiers.shared is not None)],
        "securityContext": {
            "runAsUser": 0,
            "runAsNonRoot": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
        },
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
        # Only the directories it prepares: never the config, the server's TLS, the token or the
        # object store's credentials.
        "volumeMounts": mounts,
    }


def _pod_spec(pool: KVCachePool) -> dict[str, Any]:
    """Return the cache-server pod spec: placement, the init container, the server, volumes."""
    placement = pool.spec.placement
    vols = _volumes(pool)
    cache = _cache_container(pool, vols.server)
    pod_spec: dict[str, Any] = {
        "nodeSelector": dict(placement.node_selector),
        "tolerations": [
            t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in placement.tolerations
        ],
        "affinity": _opt_out_affinity(pool),
        "initContainers": [_prepare_dirs_container(pool, vols.prepare)],
        "containers": [cache],
        "volumes": vols.volumes,
        "terminationGracePeriodSeconds": 30,
        "enableServiceLinks": False,
        # The server never talks to the API server: no token to steal.
        "automountServiceAccountToken": False,
        # Secret volumes are group-readable by the server's gid only.
        "securityContext": {"fsGroup": CACHE_UID, "seccompProfile": {"type": "RuntimeDefault"}},
    }
    if placement.priority_class_name:
        pod_spec["priorityClassName"] = placement.priority_class_name
    return pod_spec


def _rolling_update(pool: KVCachePool, *, surge: bool) -> dict[str, Any]:
    """Surge (the new server takes the old one's DRAM, then the old goes), else stop first."""
    nodes = pool.spec.update_strategy.max_unavailable
    return {"maxUnavailable": 0, "maxSurge": nodes} if surge else {"maxUnavailable": nodes, "maxSurge": 0}


def surge_is_safe(existing: dict[str, Any] | None) -> bool:
    """Whether a hand-over rollout may surge beside the DaemonSet's pods as they are now.

    A surge starts the new server beside the old one; an old one that cannot hand over (a version
    from before hand-over) would go on writing the node's disks while the new one scans them. So the
    first rollout onto hand-over stops first; later ones surge. Safe: no DaemonSet yet, one already
    surging (it surges only once all its pods can hand over), or one whose every pod runs a template
    that offers hand-overs.
    """
    if existing is None:
        return True
    spec = existing.get("spec") or {}
    rolling = (spec.get("updateStrategy") or {}).get("rollingUpdate") or {}
    if rolling.get("maxSurge") not in (None, 0, "0", "0%"):
        return True
    annotations = ((spec.get("template") or {}).get("metadata") or {}).get("annotations") or {}
    status = existing.get("status") or {}
    meta = existing.get("metadata") or {}
    desired = int(status.get("desiredNumberScheduled") or 0)
    return (
        names.HANDOVER_ANNOTATION in annotations
        and status.get("observedGeneration") == meta.get("generation")
        and int(status.get("updatedNumberScheduled") or 0) == desired
        and int(status.get("currentNumberScheduled") or 0) == desired
    )


def without_surge(daemonset: dict[str, Any], pool: KVCachePool) -> dict[str, Any]:
    """``daemonset`` rolled by stopping first (this rollout only: see :func:`surge_is_safe`)."""
    out = copy.deepcopy(daemonset)
    out["spec"]["updateStrategy"]["rollingUpdate"] = _rolling_update(pool, surge=False)
    return out


def render_daemonset(pool: KVCachePool, revision: str) -> dict[str, Any]:
    """Return the DaemonSet; ``revision`` (the config hash) in the template rolls it on change."""
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _metadata(pool, names.daemonset_name(pool.name), "cache-server"),
        "spec": {
            "selector": {"matchLabels": names.selector_labels(pool.name)},
            "updateStrategy": {
                "type": "RollingUpdate",
                "rollingUpdate": _rolling_update(pool, surge=pool.spec.update_strategy.hand_over),
            },
            "template": {
                "metadata": {
                    "labels": names.child_labels(pool.name, "cache-server"),
                    "annotations": {
                        names.CONFIG_HASH_ANNOTATION: revision,
                        **({names.HANDOVER_ANNOTATION: "v1"} if pool.spec.update_strategy.hand_over else {}),
                    },
                },
                "spec": _pod_spec(pool),
            },
        },
    }


def render_service(pool: KVCachePool) -> dict[str, Any]:
    """Return the node-local Service: traffic stays on the client's node (no hostNetwork needed)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(pool, names.service_name(pool.name), "cache-server"),
        "spec": {
            "type": "ClusterIP",
            "internalTrafficPolicy": "Local",
            "selector": names.selector_labels(pool.name),
            "ports": [
                {"name": "cache", "port": pool.spec.server.port, "targetPort": "cache", "protocol": "TCP"}
            ],
        },
    }


def render_metrics_service(pool: KVCachePool) -> dict[str, Any]:
    """Return the headless metrics Service (one endpoint per cache server, for Prometheus)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(pool, names.metrics_service_name(pool.name), "metrics"),
        "spec": {
            "clusterIP": "None",
            "selector": names.selector_labels(pool.name),
            "ports": [
                {
                    "name": "metrics",
                    "port": pool.spec.metrics.port,
                    "targetPort": "metrics",
                    "protocol": "TCP",
                }
            ],
        },
    }


def _selector(selector: LabelSelector, extra: dict[str, str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"matchLabels": {**selector.match_labels, **(extra or {})}}
    if selector.match_expressions:
        out["matchExpressions"] = [
            {"key": r.key, "operator": r.operator.value, **({"values": list(r.values)} if r.values else {})}
            for r in selector.match_expressions
        ]
    return out


def render_network_policy(pool: KVCachePool) -> dict[str, Any]:
    """Return the NetworkPolicy of the cache servers: consumers to the cache port, scrapers to metrics.

    Everything else is denied, including the cache port when the TCP listener is off. Consumers are
    the pods carrying the opt-in label (and matching ``consumers.podSelector``) in the pool's
    namespace or in a namespace ``consumers.namespaceSelector`` selects. Probes from the kubelet come
    from the node, which NetworkPolicy always admits.
    """
    spec = pool.spec
    ingress: list[dict[str, Any]] = []
    if spec.server.tcp.enabled:
        consumers = spec.consumers
        pods = _selector(consumers.pod_selector or LabelSelector(), {POOL_LABEL: pool.name})
        peers: list[dict[str, Any]] = [{"podSelector": pods}]
        if consumers.namespace_selector is not None:
            peers.append({"namespaceSelector": _selector(consumers.namespace_selector), "podSelector": pods})
        ingress.append({"from": peers, "ports": [{"protocol": "TCP", "port": spec.server.port}]})
    if spec.metrics.enabled:
        scrapers = spec.metrics.scrapers
        # The operator reads the servers' metrics too (status.cache): its own pods, in its namespace.
        operator = {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": names.operator_namespace()}},
            "podSelector": {"matchLabels": dict(names.OPERATOR_POD_LABELS)},
        }
        ingress.append(
            {
                "from": [
                    {
                        "namespaceSelector": _selector(scrapers.namespace_selector),
                        "podSelector": _selector(scrapers.pod_selector),
                    },
                    operator,
                ],
                "ports": [{"protocol": "TCP", "port": spec.metrics.port}],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(pool, names.network_policy_name(pool.name), "cache-server"),
        "spec": {
            "podSelector": {"matchLabels": names.selector_labels(pool.name)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def render_shared_claim(pool: KVCachePool) -> dict[str, Any] | None:
    """Return the PVC the pool owns, or None when the shared tier is absent or uses an existing claim."""
    shared = pool.spec.tiers.shared
    if shared is None or shared.claim_template is None:
        return None
    template = shared.claim_template
    spec: dict[str, Any] = {
        "accessModes": [mode.value for mode in template.access_modes],
        "resources": {"requests": {"storage": template.size}},
    }
    if template.storage_class_name is not None:
        spec["storageClassName"] = template.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(pool, names.shared_claim_name(pool.name), "shared-storage"),
        "spec": spec,
    }


def render_router_configmap(pool: KVCachePool) -> dict[str, Any] | None:
    """The ConfigMap ``<pool>-router`` (llm-d's and Dynamo's router settings); None without routing events."""
    data = router_data(pool)
    if data is None:
        return None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(pool, names.router_configmap_name(pool.name), "router-config"),
        "data": data,
    }


def render_children(pool: KVCachePool) -> RenderedChildren:
    """Return every child ``pool`` should have; raise :class:`ConfigError` for an unusable spec."""
    text = config_yaml(build_server_config(pool))
    revision = config_hash(text)
    objects = [
        render_configmap(pool, text),
        render_daemonset(pool, revision),
        render_service(pool),
        render_network_policy(pool),
    ]
    if pool.spec.metrics.enabled:
        objects.append(render_metrics_service(pool))
    claim = render_shared_claim(pool)
    if claim is not None:
        objects.append(claim)
    router = render_router_configmap(pool)
    if router is not None:
        objects.append(router)
    return RenderedChildren(config_hash=revision, objects=objects)
