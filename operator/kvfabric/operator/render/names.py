"""Names, labels and node-local paths derived from a pool: one place, so render and status agree."""

from __future__ import annotations

from typing import Final

FIELD_MANAGER: Final = "kvfabric-operator"
MANAGED_BY: Final = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE: Final = "kvfabric-operator"
NAME_LABEL: Final = "app.kubernetes.io/name"
NAME_VALUE: Final = "kvfabric-cache"
INSTANCE_LABEL: Final = "app.kubernetes.io/instance"
COMPONENT_LABEL: Final = "app.kubernetes.io/component"
# Names the owning pool on every child. Deliberately not kvfabric.io/pool: that is the consumers'
# opt-in label, and the injection webhook must never select the cache servers themselves.
OWNER_POOL_LABEL: Final = "kvfabric.io/owner-pool"

CONFIG_HASH_ANNOTATION: Final = "kvfabric.io/config-hash"
INJECTED_ANNOTATION: Final = "kvfabric.io/injected"
SKIP_REASON_ANNOTATION: Final = "kvfabric.io/skip-reason"
POOL_NAMESPACE_ANNOTATION: Final = "kvfabric.io/pool-namespace"
TARGET_CONTAINERS_ANNOTATION: Final = "kvfabric.io/target-containers"

CONFIG_KEY: Final = "config.yaml"
CONFIG_MOUNT_DIR: Final = "/etc/kvfabric"
CONFIG_PATH: Final = f"{CONFIG_MOUNT_DIR}/{CONFIG_KEY}"
HOST_RUN_ROOT: Final = "/run/kvfabric"
LOCAL_DISK_MOUNT: Final = "/var/lib/kvfabric/local"
SHARED_MOUNT: Final = "/var/lib/kvfabric/shared"
# The object-store tier's credentials (a Secret) and CA bundle (a ConfigMap), mounted read-only.
OBJECT_STORE_SECRET_MOUNT: Final = "/etc/kvfabric/object-store"  # noqa: S105 - a mount path
OBJECT_STORE_CA_MOUNT: Final = "/etc/kvfabric/object-store-ca"
SOCKET_NAME: Final = "cache.sock"
SHM_NAME: Final = "shm"
CACHE_CONTAINER: Final = "cache"
PAYLOAD_VOLUME: Final = "kvfabric-connector"
PAYLOAD_MOUNT: Final = "/opt/kvfabric"
PAYLOAD_PYTHONPATH: Final = f"{PAYLOAD_MOUNT}/site-packages"
PAYLOAD_ANNOTATION: Final = "kvfabric.io/inject-payload"
RUN_VOLUME: Final = "kvfabric-run"


def local_disk_dir(namespace: str, pool: str) -> str:
    """Return the pool's directory below the local-disk mount (so pools may share one disk path)."""
    return f"{LOCAL_DISK_MOUNT}/{namespace}-{pool}"


def configmap_name(pool: str) -> str:
    """Return the ConfigMap holding the server configuration."""
    return f"{pool}-config"


def daemonset_name(pool: str) -> str:
    """Return the DaemonSet running one cache server per selected node."""
    return f"{pool}-cache"


def service_name(pool: str) -> str:
    """Return the node-local Service (``internalTrafficPolicy: Local``)."""
    return pool


def metrics_service_name(pool: str) -> str:
    """Return the headless metrics Service."""
    return f"{pool}-metrics"


def shared_claim_name(pool: str) -> str:
    """Return the PersistentVolumeClaim a pool with a claim template owns."""
    return f"{pool}-shared"


def host_dir(namespace: str, pool: str) -> str:
    """Return the per-pool directory on each node holding the socket and the shm directory.

    Namespace and pool name are both DNS labels (no '/' or '..'), so the join cannot escape the root.
    """
    return f"{HOST_RUN_ROOT}/{namespace}-{pool}"


def selector_labels(pool: str) -> dict[str, str]:
    """Return the DaemonSet's immutable selector (and the Services' selector)."""
    return {NAME_LABEL: NAME_VALUE, INSTANCE_LABEL: pool}


def child_labels(pool: str, component: str) -> dict[str, str]:
    """Return the labels on every child: selector labels plus ownership for the child watches."""
    return {
        **selector_labels(pool),
        COMPONENT_LABEL: component,
        MANAGED_BY: MANAGED_BY_VALUE,
        OWNER_POOL_LABEL: pool,
    }
