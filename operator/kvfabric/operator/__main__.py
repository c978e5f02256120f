"""``python -m kvfabric.operator``: the same as ``kvfabric operator``."""

import argparse
import sys

from kvfabric.operator import cli

parser = argparse.ArgumentParser(prog="python -m kvfabric.operator", description=cli.__doc__)
cli.configure(parser)
sys.exit(cli.run(parser.parse_args()))
