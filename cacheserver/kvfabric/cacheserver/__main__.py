"""``python -m kvfabric.cacheserver --config FILE``: same as ``kvfabric cacheserver``."""

from __future__ import annotations

import argparse
import sys

from kvfabric.cacheserver import cli


def main() -> int:
    """Parse arguments and run the server."""
    parser = argparse.ArgumentParser(prog="python -m kvfabric.cacheserver")
    cli.configure(parser)
    return cli.run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
