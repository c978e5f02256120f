"""The pods that wipe a deleted pool's blocks from its nodes' local disks: pure render.

A pool's local-disk tier keeps blocks (prompts at rest) under ``<hostPath>/<namespace>.<pool>`` on
every node it ran on, across restarts and rollouts, as it must. When the pool is deleted, the operator
runs one of these pods per such node (:mod:`kvfabric.operator.wipe`), in its own namespace (the pool's
may be terminating too), once the pool's cache servers are gone, so no write-back lands after it.

Least privilege: the operator's own image, the cache server's uid (the blocks are its files, so no
capability is needed to remove them), no capabilities, read-only root, no token, and only that one
directory mounted: never the disk path itself, which other pools and other data may share.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Final

from kvfabric.operator.render import names

WIPE_NAME_LABEL: Final = "kvfabric-wipe"
WIPE_MOUNT: Final = "/wipe"
# Removes everything below the mount point (the mount point itself is the pod's volume). The
# directory the server's init container chowned stays, empty, as the run directory does.
WIPE_SCRIPT: Final = f"find {WIPE_MOUNT} -mindepth 1 -delete && echo wiped"
CACHE_UID: Final = 65532


def wipe_dir(pool_body: Mapping[str, Any]) -> str | None:
    """The node directory a deleted pool's local-disk blocks live in, or None without that tier."""
    meta = pool_body.get("metadata") or {}
    local = ((pool_body.get("spec") or {}).get("tiers") or {}).get("localDisk") or {}
    path = (local.get("hostPath") or {}).get("path")
    if not path:
        return None  # no tier, or an emptyDir one: the kubelet removed it with the pod
    return f"{str(path).rstrip('/')}/{names.pool_dir_name(str(meta['namespace']), str(meta['name']))}"


def wipe_pod_name(namespace: str, pool: str, node: str) -> str:
    """A DNS-1123 name, unique per (pool, node), stable so a retry finds the pod it made."""
    digest = hashlib.sha256(f"{namespace}/{pool}/{node}".encode()).hexdigest()[:16]
    return f"kvfabric-wipe-{digest}"


def wipe_labels(namespace: str, pool: str) -> dict[str, str]:
    """Labels of a pool's wipe pods (the pool's identity as values would exceed label limits)."""
    return {
        names.NAME_LABEL: WIPE_NAME_LABEL,
        names.MANAGED_BY: names.MANAGED_BY_VALUE,
        "kvfabric.io/wipe-of": hashlib.sha256(f"{namespace}/{pool}".encode()).hexdigest()[:32],
    }


def render_wipe_pod(
    pool_body: Mapping[str, Any], node: str, operator_namespace: str
) -> dict[str, Any] | None:
    """The pod that empties the pool's local-disk directory on ``node`` (None: nothing to wipe)."""
    directory = wipe_dir(pool_body)
    if directory is None:
        return None
    meta = pool_body["metadata"]
    ns, pool = str(meta["namespace"]), str(meta["name"])
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": wipe_pod_name(ns, pool, node),
            "namespace": operator_namespace,
            "labels": wipe_labels(ns, pool),
            "annotations": {"kvfabric.io/wipe": f"{ns}/{pool} on {node}: {directory}"},
        },
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "activeDeadlineSeconds": 300,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "tolerations": [{"operator": "Exists"}],
            "securityContext": {
                "runAsUser": CACHE_UID,
                "runAsGroup": CACHE_UID,
                "runAsNonRoot": True,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": "wipe",
                    "image": names.operator_image(),
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["sh", "-c", WIPE_SCRIPT],
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                    "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
                    "volumeMounts": [{"name": "blocks", "mountPath": WIPE_MOUNT}],
                }
            ],
            # Directory, not DirectoryOrCreate: where the pool never wrote, nothing is created.
            "volumes": [{"name": "blocks", "hostPath": {"path": directory, "type": "Directory"}}],
        },
    }
