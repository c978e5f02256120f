"""``kvfabric demo``: the whole fabric on the local cluster, replaying a multi-round chat workload.

Brings up a real control plane whose GPU nodes are served by the pod runner, installs the CRDs and
runs the operator, applies the sample pool (plus a shared tier on the demo's RWX volume) and a
reference-engine Deployment with one replica per GPU node, then replays conversations: a shared
system prompt plus per-user histories, several users, several rounds, each round sent to the other
node than the last. It prints the hit rate per round, TTFT cold vs warm, bytes per tier and
``kubectl get kvp``, and cleans up unless ``--keep`` is given.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Shown by `kvfabric --help`; this module is registered under the kvfabric.commands entry points.
SUMMARY = "run the whole fabric on the local cluster and replay a chat workload"


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options."""
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="working directory (cluster state, node dirs, logs); default: a fresh temp dir",
    )
    parser.add_argument(
        "--keep", action="store_true", help="leave everything running afterwards (stop it with Ctrl-C)"
    )
    parser.add_argument("--users", type=int, default=4, help="concurrent conversations (default 4)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per conversation (default 4)")
    parser.add_argument("--system-tokens", type=int, default=4096, help="shared system prompt length")
    parser.add_argument("--turn-tokens", type=int, default=128, help="tokens a user adds per round")
    parser.add_argument("--answer-tokens", type=int, default=16, help="tokens the engine answers per round")
    parser.add_argument("--preset", default="bench", help="reference-engine model size (tiny or bench)")
    parser.add_argument(
        "--install",
        choices=("kustomize", "helm"),
        default=os.environ.get("KVFABRIC_INSTALL") or "kustomize",
        help="install kvfabric from the CRDs in crds/ (kustomize) or with the Helm chart charts/kvfabric "
        "(helm: its CRD, RBAC, admission policy, the operator running as the chart's ServiceAccount) "
        "(default: $KVFABRIC_INSTALL, else kustomize)",
    )
    parser.add_argument(
        "--object-store",
        action="store_true",
        help="share chunks across nodes through a real S3 server (SeaweedFS, run on loopback) instead "
        "of the shared volume; builds SeaweedFS from the Go module proxy on first use (minutes)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns 0 when every request succeeded."""
    import shutil
    import tempfile

    from kvfabric.demo import replay

    base = args.dir or Path(tempfile.mkdtemp(prefix="kvfabric-demo-"))
    try:
        return replay.main(base, args, progress=lambda m: print(f"[demo] {m}", file=sys.stderr, flush=True))
    finally:
        if args.dir is None:
            # The node directories hold the cache's blocks: a demo leaves nothing behind.
            shutil.rmtree(base, ignore_errors=True)
