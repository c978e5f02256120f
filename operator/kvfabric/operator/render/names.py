"""Names, labels and node-local paths derived from a pool: one place, so render and status agree."""

from __future__ import annotations

import os
from typing import Final

from kvfabric.contract import consumer_env, node_paths

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
# On the cache pods' template: its servers offer and take hand-overs (a rollout may surge).
HANDOVER_ANNOTATION: Final = "kvfabric.io/hand-over"
INJECTED_ANNOTATION: Final = "kvfabric.io/injected"
SKIP_REASON_ANNOTATION: Final = "kvfabric.io/skip-reason"
POOL_NAMESPACE_ANNOTATION: Final = "kvfabric.io/pool-namespace"
TARGET_CONTAINERS_ANNOTATION: Final = "kvfabric.io/target-containers"

CONFIG_KEY: Final = "config.yaml"
CONFIG_MOUNT_DIR: Final = "/etc/kvfabric"
CONFIG_PATH: Final = f"{CONFIG_MOUNT_DIR}/{CONFIG_KEY}"
# The node paths are shared with the CSI node plugin (kvfabric.contract.node_paths); render, status
# and the tests name them through this module.
HOST_RUN_ROOT: Final = node_paths.HOST_RUN_ROOT
pool_dir_name = node_paths.pool_dir_name
host_dir = node_paths.host_dir
# The hand-over socket (old server -> new server during a rollout) lives apart from the run directory
# consumers mount: an engine running as the server's own uid must never reach it. A sibling of the
# pools' run directories (a namespace never starts with a dot, so no pool directory is called that),
# on the node's own /run/kvfabric like them.
HOST_HANDOVER_ROOT: Final = f"{HOST_RUN_ROOT}/.handover"
HANDOVER_VOLUME: Final = "kvfabric-handover"
LOCAL_DISK_MOUNT: Final = "/var/lib/kvfabric/local"
SHARED_MOUNT: Final = "/var/lib/kvfabric/shared"
# Volumes mounted beside the configuration, never inside CONFIG_MOUNT_DIR: that is a read-only
# ConfigMap volume, and the runtime cannot create a nested mount point in it ("mkdir ...: read-only
# file system", the container never starts).
SECRETS_MOUNT_ROOT: Final = "/var/run/secrets/kvfabric.io"
# The object-store tier's credentials (a Secret) and CA bundle (a ConfigMap), mounted read-only.
OBJECT_STORE_SECRET_MOUNT: Final = f"{SECRETS_MOUNT_ROOT}/object-store"
OBJECT_STORE_CA_MOUNT: Final = f"{SECRETS_MOUNT_ROOT}/object-store-ca"
SOCKET_NAME: Final = "cache.sock"
CACHE_CONTAINER: Final = "cache"
PAYLOAD_VOLUME: Final = "kvfabric-connector"
PAYLOAD_MOUNT: Final = "/opt/kvfabric"
PAYLOAD_PYTHONPATH: Final = f"{PAYLOAD_MOUNT}/site-packages"
PAYLOAD_ANNOTATION: Final = "kvfabric.io/inject-payload"
RUN_VOLUME: Final = "kvfabric-run"
# Per-pool credentials, mounted read-only into the cache servers (and the client side into consumers).
SERVER_TLS_MOUNT: Final = f"{SECRETS_MOUNT_ROOT}/server-tls"
CREDENTIALS_MOUNT: Final = f"{SECRETS_MOUNT_ROOT}/credentials"
CLIENT_TLS_VOLUME: Final = "kvfabric-client-tls"
CLIENT_TLS_MOUNT: Final = "/var/run/secrets/kvfabric.io/tls"
PAYLOAD_KEY: Final = "payload-key"
# Consumers outside the pool's namespace get their namespace's payload key as a file, published by the
# CSI node plugin into a second read-only inline volume (content=payload-key), never a Secret they
# could read; the CSI plugin derives it from one Secret in the operator's namespace. The names are the
# consumer contract's (the plugin and the connector read the same ones).
KEY_VOLUME: Final = "kvfabric-key"
KEY_MOUNT: Final = consumer_env.KEY_MOUNT_PATH
KEY_CONTENT_ATTRIBUTE: Final = "content"
KEY_CONTENT: Final = consumer_env.KEY_VOLUME_CONTENT
CONSUMER_KEYS_SECRET: Final = consumer_env.CONSUMER_KEYS_SECRET
TOKEN_KEY: Final = "token"  # noqa: S105 - the key name inside the Secret, not a secret
CA_KEY: Final = "ca.crt"


consumer_keys_entry = consumer_env.consumer_keys_entry


def credentials_secret_name(pool: str) -> str:
    """Return the Secret holding the pool's bearer token (and payload key)."""
    return f"{pool}-credentials"


def ca_secret_name(pool: str) -> str:
    """Return the Secret holding the pool's own CA (certificate and key; never mounted anywhere)."""
    return f"{pool}-ca"


def server_tls_secret_name(pool: str) -> str:
    """Return the Secret with the cache servers' certificate, key and the CA bundle."""
    return f"{pool}-server-tls"


def client_tls_secret_name(pool: str) -> str:
    """Return the Secret with the consumers' client certificate, key and the CA bundle."""
    return f"{pool}-client-tls"


def pool_secret_names(pool: str) -> tuple[str, str, str, str]:
    """Return every Secret name a pool's credentials may use (credentials, CA, server and client TLS)."""
    return (
        credentials_secret_name(pool),
        ca_secret_name(pool),
        server_tls_secret_name(pool),
        client_tls_secret_name(pool),
    )


def network_policy_name(pool: str) -> str:
    """Return the NetworkPolicy guarding the cache servers' ports."""
    return f"{pool}-cache"


OPERATOR_IMAGE_ENV: Final = "KVFABRIC_OPERATOR_IMAGE"
DEFAULT_OPERATOR_IMAGE: Final = "ghcr.io/kvfabric/operator:v0.2.0"


def operator_image() -> str:
    """Return the operator's own image (``$KVFABRIC_OPERATOR_IMAGE``, set by its Deployment).

    The cache servers' directory-preparing init container runs this image, which the cluster admin
    chose, never the pool's image: whoever may create a pool must not get to run code as root.
    """
    return os.environ.get(OPERATOR_IMAGE_ENV) or DEFAULT_OPERATOR_IMAGE


OPERATOR_POD_LABELS: Final = {"app.kubernetes.io/name": "kvfabric-operator"}


def operator_namespace() -> str:
    """Return the operator's own namespace (``$POD_NAMESPACE``, set by its Deployment)."""
    return os.environ.get("POD_NAMESPACE") or "kvfabric-system"


def local_disk_dir(namespace: str, pool: str) -> str:
    """Return the pool's directory below the local-disk mount (so pools may share one disk path)."""
    return f"{LOCAL_DISK_MOUNT}/{pool_dir_name(namespace, pool)}"


def configmap_name(pool: str) -> str:
    """Return the ConfigMap holding the server configuration."""
    return f"{pool}-config"


def router_configmap_name(pool: str) -> str:
    """Return the ConfigMap holding the router configuration (a pool with routing events)."""
    return f"{pool}-router"


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


def handover_dir(namespace: str, pool: str) -> str:
    """Return the per-pool directory on each node holding the hand-over socket (cache servers only)."""
    return f"{HOST_HANDOVER_ROOT}/{pool_dir_name(namespace, pool)}"


def selector_labels(pool: str) -> dict[str, str]:
    """Return the DaemonSet's immutable selector (and the Services' selector)."""
    return {NAME_LABEL: NAME_VALUE, INSTANCE_LABEL: pool}


def owned_pod_selector(pool: str) -> str:
    """The label selector of a pool's cache-server pods: its selector labels and ownership labels.

    The ownership labels are what the operator's informer of owned pods indexes, so a read with this
    selector is served from its cache (the selector labels alone cannot be).
    """
    owned = {**selector_labels(pool), MANAGED_BY: MANAGED_BY_VALUE, OWNER_POOL_LABEL: pool}
    return ",".join(f"{k}={v}" for k, v in owned.items())


def child_labels(pool: str, component: str) -> dict[str, str]:
    """Return the labels on every child: selector labels plus ownership for the child watches."""
    return {
        **selector_labels(pool),
        COMPONENT_LABEL: component,
        MANAGED_BY: MANAGED_BY_VALUE,
        OWNER_POOL_LABEL: pool,
    }
