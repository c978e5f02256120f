"""``kvfabric version``: the package version and the pinned control-plane component versions."""

from __future__ import annotations

import argparse
import json


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``kvfabric version``."""
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    """Print the versions."""
    from kvfabric.cli.version import __version__
    from kvfabric.localcluster import versions

    info = {"kvfabric": __version__, **versions.PINS}
    if args.json:
        print(json.dumps(info))
    else:
        for key, value in info.items():
            print(f"{key:<24} {value}")
    return 0
