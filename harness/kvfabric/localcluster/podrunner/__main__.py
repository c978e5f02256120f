"""``python -m kvfabric.localcluster.podrunner``: run the pods bound to some fake nodes.

Stops cleanly (every pod's processes, network namespaces, the nodes) on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from types import FrameType

from kvfabric.localcluster.podrunner.runner import NodeSpec, PodRunner


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and serve until signalled."""
    parser = argparse.ArgumentParser(prog="python -m kvfabric.localcluster.podrunner", description=__doc__)
    parser.add_argument("--kubeconfig", type=Path, required=True, help="admin kubeconfig of the cluster")
    parser.add_argument(
        "--base",
        type=Path,
        required=True,
        help="directory for per-node hostPath dirs, the shared PVC dir, pod logs",
    )
    parser.add_argument(
        "--node",
        action="append",
        required=True,
        metavar="NAME[:GPUS]",
        help="a node to register and serve (repeatable); GPUS defaults to 8, 0 = CPU node",
    )
    parser.add_argument(
        "--run-as-pod-user",
        action="store_true",
        help="run containers with their securityContext's runAsUser/runAsGroup/fsGroup (needs an "
        "interpreter other users can execute: a Python under a 0700 /root is not)",
    )
    parser.add_argument(
        "--relay-port",
        action="append",
        type=int,
        default=[],
        metavar="PORT",
        help="a port of the host's 127.0.0.1 that every pod reaches at 127.0.0.1:PORT too (repeatable; "
        "a cluster service such as the object tier's S3 server)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    specs = []
    for item in args.node:
        name, _, gpus = item.partition(":")
        specs.append(NodeSpec(name, int(gpus) if gpus else 8))
    runner = PodRunner(
        args.kubeconfig,
        args.base,
        specs,
        run_as_pod_user=args.run_as_pod_user,
        relay_ports=tuple(args.relay_port),
    )

    def on_signal(_sig: int, _frame: FrameType | None) -> None:
        runner.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    runner.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
