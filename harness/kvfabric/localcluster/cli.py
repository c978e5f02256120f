"""``kvfabric cluster``: a real local Kubernetes control plane with fake GPU nodes.

``up`` builds the pinned binaries on first use (cached outside the repository), starts etcd,
kube-apiserver, kube-controller-manager, kube-scheduler and kwok on loopback, and registers fake
nodes. ``down`` stops every process it started. ``status`` shows what runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Shown by `kvfabric --help`; this module is registered under the kvfabric.commands entry points.
SUMMARY = "run a real local Kubernetes control plane with fake GPU nodes"


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``up``, ``down``, ``status`` and ``build``."""
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="state directory of the cluster (certificates, etcd data, logs, kubeconfig); "
        "default: $KVFABRIC_CLUSTER_DIR or ~/.local/state/kvfabric/cluster",
    )
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = sub.add_parser("up", help="start the control plane and the fake nodes (idempotent)")
    up.add_argument(
        "--gpu-nodes",
        type=int,
        default=3,
        help="fake GPU nodes (label nvidia.com/gpu.present=true, 8 nvidia.com/gpu, GPU taint)",
    )
    up.add_argument("--cpu-nodes", type=int, default=1, help="fake CPU-only nodes")
    up.add_argument(
        "--kubelets",
        type=int,
        default=0,
        help="real GPU nodes: a kubelet and containerd each, in their own network and mount "
        "namespaces, running kvfabric's images (needs root, Debian's containerd, and "
        "`kvfabric images build`; same GPU label, capacity and taint as the fake ones)",
    )
    up.add_argument(
        "--no-merge-kubeconfig",
        action="store_true",
        help="do not add the 'kvfabric-local' context to ~/.kube/config (or $KUBECONFIG)",
    )
    sub.add_parser("down", help="stop every process 'up' started and free its ports")
    status = sub.add_parser("status", help="show the components, their health and the nodes")
    status.add_argument("--json", action="store_true", help="print JSON")
    build = sub.add_parser("build", help="only build (or find) the pinned control-plane binaries")
    build.add_argument("--kubelet", action="store_true", help="also the real-node binaries (kubelet, pause)")
    sub.add_parser("kubeconfig", help="print the path of the cluster's kubeconfig")


def run(args: argparse.Namespace) -> int:
    """Carry out the chosen action."""
    from kvfabric.localcluster import binaries
    from kvfabric.localcluster.cluster import ClusterStartError, LocalCluster

    cluster = LocalCluster(args.dir)

    def say(msg: str) -> None:
        print(f"[cluster] {msg}", file=sys.stderr, flush=True)

    try:
        if args.action == "build":
            print(binaries.ensure())
            if args.kubelet:
                print(binaries.ensure_kubelet())
        elif args.action == "up":
            cluster.up(
                gpu_nodes=args.gpu_nodes, cpu_nodes=args.cpu_nodes, kubelets=args.kubelets, progress=say
            )
            if not args.no_merge_kubeconfig:
                from kvfabric.localcluster.kubeconfig import merge_into_user_config

                say(
                    f"context 'kvfabric-local' is now current in {merge_into_user_config(cluster.kubeconfig)}"
                )
            print(f"export KUBECONFIG={cluster.kubeconfig}")
        elif args.action == "down":
            cluster.down(progress=say)
        elif args.action == "kubeconfig":
            print(cluster.kubeconfig)
        else:
            status = cluster.status()
            if args.json:
                print(json.dumps(status, indent=2))
            else:
                _print_status(status)
            return 0 if status["running"] else 1
    except (ClusterStartError, binaries.BuildError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _print_status(status: dict[str, object]) -> None:
    if not status["running"] and "components" not in status:
        print(f"no cluster running (state directory {status['dir']})")
        return
    print(f"api server: {status.get('api_server')}\nkubeconfig: {status.get('kubeconfig')}")
    comps = status.get("components", {})
    assert isinstance(comps, dict)
    for name, info in comps.items():
        print(f"  {name:<24} pid {info['pid']:<8} {'running' if info['alive'] else 'DEAD'}")
    node_list = status.get("nodes", [])
    assert isinstance(node_list, list)
    for node in node_list:
        print(f"  node {node['name']:<19} {'Ready' if node['ready'] else 'NotReady':<9} gpus={node['gpus']}")
