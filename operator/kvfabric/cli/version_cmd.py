"""``kvfabric version``: the package version and the pinned control-plane component versions."""

from __future__ import annotations

import argparse
import json
from importlib.metadata import entry_points


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``kvfabric version``."""
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    """Print the versions."""
    from kvfabric.cli.version import __version__

    info: dict[str, str] = {"kvfabric": __version__}
    # Pinned component versions come from installed distributions (the development harness pins the
    # Kubernetes binaries of its local cluster), so the product never imports the harness.
    for ep in sorted(entry_points(group="kvfabric.versions"), key=lambda e: e.name):
        info.update(ep.load())
    if args.json:
        print(json.dumps(info))
    else:
        for key, value in info.items():
            print(f"{key:<24} {value}")
    return 0
