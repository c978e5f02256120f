"""``kvfabric demo``: bring up the local cluster and show it.

Later stages install the operator and cache servers, run reference-engine "inference" pods and replay
a multi-round chat workload.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options."""
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="cluster state directory (default: a fresh temporary directory)",
    )
    parser.add_argument("--keep", action="store_true", help="leave the cluster running afterwards")


def run(args: argparse.Namespace) -> int:
    """Run the demo."""
    import tempfile

    from kvfabric.localcluster.cluster import ClusterStartError, LocalCluster

    directory = args.dir or Path(tempfile.mkdtemp(prefix="kvfabric-demo-"))
    cluster = LocalCluster(directory)

    def say(msg: str) -> None:
        print(f"[demo] {msg}", file=sys.stderr, flush=True)

    try:
        cluster.up(progress=say)
    except ClusterStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        print(cluster.kubectl("get", "nodes", "-L", "nvidia.com/gpu.present").stdout)
    finally:
        if args.keep:
            say(f"cluster left running; export KUBECONFIG={cluster.kubeconfig}")
        else:
            cluster.down(progress=say)
    return 0
