"""``kvfabric csi-node``: run the CSI node plugin on one node (the ``manifests/csi`` DaemonSet)."""

from __future__ import annotations

import argparse
import os
import signal
import threading

from kvfabric.contract.node_paths import HOST_RUN_ROOT


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the node plugin's options."""
    parser.description = (
        "Serve the csi.kvfabric.io node plugin: publish a pool's node-local cache socket directory, "
        "read-only, into pods of the pool's namespace as a CSI ephemeral inline volume, so engines "
        "in namespaces that enforce Pod Security baseline or restricted need no hostPath; and, as a "
        "second volume (content: payload-key), the payload key of the pod's own namespace. Runs as "
        "root with CAP_SYS_ADMIN (it bind-mounts) and registers itself with the kubelet."
    )
    parser.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME"),
        help="this node's name, reported as the CSI node id (default: $NODE_NAME, from the downward API)",
    )
    parser.add_argument(
        "--kubelet-root",
        default=os.environ.get("KVFABRIC_KUBELET_ROOT", "/var/lib/kubelet"),
        help="the kubelet's --root-dir, mounted at the same path with Bidirectional propagation "
        "(default /var/lib/kubelet)",
    )
    parser.add_argument(
        "--run-root",
        default=HOST_RUN_ROOT,
        help=f"the node directory holding every pool's run directory (default {HOST_RUN_ROOT})",
    )
    parser.add_argument(
        "--no-cross-namespace",
        action="store_true",
        help="never read the API server: publish only pools of the pod's own namespace (default: pods of "
        "other namespaces get a pool when its spec.consumers.namespaceSelector selects their namespace)",
    )
    parser.add_argument(
        "--kubeconfig", default=None, help="kubeconfig (default: the in-cluster ServiceAccount token)"
    )
    parser.add_argument(
        "--staging-dir",
        default="/run/kvfabric-csi",
        help="a writable directory private to the plugin's mount namespace (an emptyDir), where each "
        "bind is made read-only before it is attached and each key volume's directory is made, in "
        "keys/ (default /run/kvfabric-csi)",
    )
    parser.add_argument("--log-level", default="INFO", help="log level (JSON logs on stderr)")


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; deregister on the way out."""
    from kvfabric.cacheserver.logs import setup_logging
    from kvfabric.cli.version import __version__
    from kvfabric.csi.plugin import NodePlugin, start

    if not args.node_name:
        raise SystemExit("--node-name (or $NODE_NAME) is required")
    setup_logging(args.log_level)
    authorizer = None
    if not args.no_cross_namespace:
        from kvfabric.csi.access import ApiAuthorizer

        authorizer = ApiAuthorizer.from_environment(args.kubeconfig)
    plugin = NodePlugin(
        node_name=args.node_name,
        kubelet_root=args.kubelet_root,
        run_root=args.run_root,
        version=__version__,
        staging_root=args.staging_dir,
        key_root=os.path.join(args.staging_dir, "keys"),
        authorizer=authorizer,
    )
    running = start(plugin)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    running.stop()
    return 0
