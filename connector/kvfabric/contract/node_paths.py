"""Where a pool's cache-server sockets live on a node: one definition for the operator and the CSI plugin.

The operator renders the cache DaemonSet's run directory and the consumers' mounts from these; the
CSI node plugin (``kvfabric.csi``) publishes the same directory into consumer pods. Import-linter
keeps this module free of every other kvfabric module.
"""

from __future__ import annotations

from typing import Final

HOST_RUN_ROOT: Final = "/run/kvfabric"


def pool_dir_name(namespace: str, pool: str) -> str:
    """Return the one path segment naming a pool on a node or a shared volume: ``<namespace>.<pool>``.

    Injective: namespaces and pool names are DNS labels, which never contain '.', so the first '.'
    separates them (``a``/``b-x`` and ``a-b``/``x`` get different directories; with '-' they collided).
    """
    for label in (namespace, pool):
        if not label or "." in label or "/" in label:
            raise ValueError(f"{label!r} is not a DNS label")
    return f"{namespace}.{pool}"


def host_dir(namespace: str, pool: str, root: str = HOST_RUN_ROOT) -> str:
    """Return the per-pool directory on each node holding the cache server's sockets.

    Namespace and pool name are both DNS labels (no '/' or '..'), so the join cannot escape the root,
    and :func:`pool_dir_name` keeps pools apart.
    """
    return f"{root}/{pool_dir_name(namespace, pool)}"
