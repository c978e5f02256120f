"""The pods that wipe a deleted pool's blocks from its nodes' local disks: pure render.

A pool's local-disk tier keeps blocks (prompts at rest) under ``<hostPath>/<namespace>.<pool>`` on
every node it ran on, across restarts and rollouts, as it must. When the pool is deleted, the operator
runs one of these pods per such node (:mod:`kvfabric.operator.wipe`), in its own namespace (the pool's
may be terminating too), once the pool's cache servers are gone, so no write-back lands after it.

Least privilege: the operator's own image, the cache server's uid (the blocks are its files, so no
capability is needed to remove them), no capabilities, read-only root, no token. It mounts the
pool's disk path (the parent of the pool's directory, not the directory itself: the kubelet would
resolve a symlink there, which a server sharing that parent could have planted) and removes only
what lies inside ``<namespace>.<pool>``, refusing that name if it is a symlink.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Final

from kvfabric.operator.render import names

WIPE_NAME_LABEL: Final = "kvfabric-wipe"
WIPE_MOUNT: Final = "/wipe"
CACHE_UID: Final = 65532


def wipe_script(pool_dir_name: str) -> str:
    """Empty ``/wipe/<pool_dir_name>``: refuse a symlink, succeed when it does not exist.

    ``find -P`` (the default) never follows a symlink inside; the directory itself stays (the run
    directory does too), empty. ``pool_dir_name`` is ``<namespace>.<pool>``: DNS labels and a dot,
    nothing a shell would interpret.
    """
    d = f"{WIPE_MOUNT}/{pool_dir_name}"
    return (
        f'd={d}; if [ -L "$d" ]; then echo "refused: $d is a symlink" >&2; exit 3; fi; '
        f'if [ ! -d "$d" ]; then echo "nothing to wipe"; exit 0; fi; '
        f'find "$d" -mindepth 1 -delete && echo wiped'
    )


def disk_path(pool_body: Mapping[str, Any]) -> str | None:
    """The pool's local-disk hostPath, or None without one (no tier, or an emptyDir the kubelet removes)."""
    local = ((pool_body.get("spec") or {}).get("tiers") or {}).get("localDisk") or {}
    path = (local.get("hostPath") or {}).get("path")
    return str(path).rstrip("/") or "/" if path else None


def wipe_dir(pool_body: Mapping[str, Any]) -> str | None:
    """The node directory a deleted pool's local-disk blocks live in, or None without that tier."""
    path = disk_path(pool_body)
    if path is None:
        return None
    meta = pool_body.get("metadata") or {}
    return f"{path.rstrip('/')}/{names.pool_dir_name(str(meta['namespace']), str(meta['name']))}"


def _identity(pool_body: Mapping[str, Any]) -> str:
    meta = pool_body.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}/{meta.get('uid', '')}"


def wipe_pod_name(pool_body: Mapping[str, Any], node: str) -> str:
    """A DNS-1123 name, unique per (pool incarnation, node): a re-created pool never meets old pods."""
    digest = hashlib.sha256(f"{_identity(pool_body)}/{node}".encode()).hexdigest()[:16]
    return f"kvfabric-wipe-{digest}"


def wipe_labels(pool_body: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Labels of wipe pods (of one pool incarnation when given; its identity as a hash fits a label)."""
    labels = {names.NAME_LABEL: WIPE_NAME_LABEL, names.MANAGED_BY: names.MANAGED_BY_VALUE}
    if pool_body is not None:
        labels["kvfabric.io/wipe-of"] = hashlib.sha256(_identity(pool_body).encode()).hexdigest()[:32]
    return labels


def render_wipe_pod(
    pool_body: Mapping[str, Any], node: str, operator_namespace: str
) -> dict[str, Any] | None:
    """The pod that empties the pool's local-disk directory on ``node`` (None: nothing to wipe)."""
    path, directory = disk_path(pool_body), wipe_dir(pool_body)
    if path is None or directory is None:
        return None
    meta = pool_body["metadata"]
    ns, pool = str(meta["namespace"]), str(meta["name"])
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": wipe_pod_name(pool_body, node),
            "namespace": operator_namespace,
            "labels": wipe_labels(pool_body),
            "annotations": {"kvfabric.io/wipe": f"{ns}/{pool} on {node}: {directory}"},
        },
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "activeDeadlineSeconds": 600,
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
                    "command": ["sh", "-c", wipe_script(names.pool_dir_name(ns, pool))],
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]},
                    },
                    "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
                    "volumeMounts": [{"name": "disk", "mountPath": WIPE_MOUNT}],
                }
            ],
            # Directory, not DirectoryOrCreate: where the pool never wrote, nothing is created.
            "volumes": [{"name": "disk", "hostPath": {"path": path, "type": "Directory"}}],
        },
    }
