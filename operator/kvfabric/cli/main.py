"""Entry point of the ``kvfabric`` command.

Each subcommand lives beside the component it drives, in a module that exposes ``configure(parser)``
and ``run(args) -> int``. Those modules import only the standard library at import time, so that
``kvfabric --help`` works in every image (the operator image has no torch, the cache-server image no
kopf) and heavy imports happen only when a subcommand runs.

The product's own subcommands are listed in :data:`SUBCOMMANDS`. The development harness
(``kvfabric-dev``: ``cluster``, ``engine``, ``bench``, ``demo``) adds its subcommands through the
``kvfabric.commands`` entry-point group, with a module-level ``SUMMARY``; the product never imports
the harness, and where the harness is not installed those subcommands simply do not exist.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Protocol, cast

# The product's subcommands: name -> (module, one-line summary). Order is the order shown by --help.
PRODUCT_SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "version": ("kvfabric.cli.version_cmd", "print kvfabric's version and the pinned component versions"),
    "cacheserver": ("kvfabric.cacheserver.cli", "run the per-node KV-chunk cache server"),
    "operator": ("kvfabric.operator.cli", "run the KVCachePool operator (reconciler + injection webhook)"),
    "csi-node": ("kvfabric.csi.cli", "run the CSI node plugin that publishes a pool's socket to pods"),
}

PLUGIN_GROUP = "kvfabric.commands"


def plugin_subcommands() -> dict[str, tuple[str, str]]:
    """Subcommands other distributions (the development harness) register under :data:`PLUGIN_GROUP`."""
    found: dict[str, tuple[str, str]] = {}
    for ep in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        if ep.name in PRODUCT_SUBCOMMANDS:
            continue  # a plug-in never replaces a product command
        found[ep.name] = (ep.value, "")
    return found


def all_subcommands() -> dict[str, tuple[str, str]]:
    """Every subcommand available in this installation, product ones first."""
    return {**PRODUCT_SUBCOMMANDS, **plugin_subcommands()}


SUBCOMMANDS = all_subcommands()


class _Subcommand(Protocol):
    def configure(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _load(name: str) -> _Subcommand | None:
    module_name, _ = SUBCOMMANDS[name]
    try:
        return cast(_Subcommand, importlib.import_module(module_name))
    except ModuleNotFoundError as exc:
        # A subcommand whose component is not installed in this image is listed but unavailable.
        if exc.name is not None and module_name.startswith(exc.name):
            return None
        raise


def build_parser() -> argparse.ArgumentParser:
    """Build the top-level parser with every available subcommand."""
    parser = argparse.ArgumentParser(
        prog="kvfabric",
        description="kvfabric: a KV-cache fabric for LLM inference on Kubernetes.",
        epilog="Run 'kvfabric COMMAND --help' for the options of one command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, listed) in SUBCOMMANDS.items():
        module = _load(name)
        if module is None:
            continue
        summary = listed or str(getattr(module, "SUMMARY", name))
        child = sub.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".")
        module.configure(child)
        child.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; returns the process exit code."""
    args = build_parser().parse_args(argv)
    module = cast(_Subcommand, args._module)
    try:
        return module.run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
