"""``kvfabric images``: build and smoke-test kvfabric's container images without any registry.

``base`` makes the local base images (Debian by debootstrap, the Python and busybox stand-ins),
``build`` builds the four images from ``images/*/Dockerfile`` (base first), ``smoke`` runs each image's
default command in a container, ``sizes`` prints their sizes. Everything runs in a private dockerd
the command starts and stops (socket under /run/kvfabric-<uid>/docker, images kept in the kvfabric
cache); each step is skipped when its inputs' digest is already built.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfabric.containers.build import Image
    from kvfabric.containers.engine import DockerEngine

# Shown by `kvfabric --help`; registered under the kvfabric.commands entry points.
SUMMARY = "build and smoke-test the container images in a private Docker engine (no registry)"


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``base``, ``build``, ``smoke`` and ``sizes``."""
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    sub.add_parser("base", help="make the local base images (debootstrap, Python and busybox stand-ins)")
    build = sub.add_parser("build", help="build the images whose inputs changed (base images first)")
    build.add_argument("names", nargs="*", help="image directories (default: all of images/images.txt)")
    build.add_argument("--force", action="store_true", help="build even when the inputs' digest is built")
    build.add_argument(
        "--torch-index-url",
        default="lock",
        help="where the engine image gets torch: 'lock' (PyPI's CUDA build as uv.lock pins it, "
        "several GB; the default, as the CPU index is unreachable here) or an index URL such as "
        "https://download.pytorch.org/whl/cpu",
    )
    smoke = sub.add_parser("smoke", help="run each image's default command in a container")
    smoke.add_argument("names", nargs="*", help="image directories (default: all)")
    sizes = sub.add_parser("sizes", help="print each built image's size")
    sizes.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    """Carry out the chosen action."""
    from kvfabric.containers import base, build, smoke
    from kvfabric.containers.engine import EngineError, engine

    def say(msg: str) -> None:
        print(f"[images] {msg}", file=sys.stderr, flush=True)

    chosen = [i for i in build.images() if not getattr(args, "names", None) or i.directory in args.names]
    try:
        with engine() as eng:
            if args.action == "base":
                base.ensure_all(eng, say)
            elif args.action == "build":
                base.ensure_all(eng, say)
                built = [
                    build.build(eng, image, torch_source=args.torch_index_url, force=args.force, say=say)
                    for image in chosen
                ]
                # Only after a build, and only when every image was considered (each has tagged its
                # builder stage), so that no image's cached layers are taken.
                if any(built) and not args.names:
                    build.prune(eng)
            elif args.action == "smoke":
                for image in chosen:
                    say(f"smoke {image.ref}: {_smoke_one(eng, image)}")
            else:
                sizes = {i.ref: build.image_size(eng, i.ref) for i in chosen}
                if args.json:
                    print(json.dumps(sizes, indent=2))
                else:
                    for ref, size in sizes.items():
                        print(f"{ref:45s} {size / 1e6:8.0f} MB")
    except (EngineError, base.BaseImageError, smoke.SmokeError, subprocess.CalledProcessError) as exc:
        print(f"kvfabric images {args.action}: {exc}", file=sys.stderr)
        return 1
    return 0


def _smoke_one(eng: DockerEngine, image: Image) -> str:
    from kvfabric.containers import smoke as s

    if image.directory == "operator":
        s.help_of(eng, image, "operator")
        return "operator --help ok"
    if image.directory == "engine":
        s.help_of(eng, image, "engine", "serve")
        return "engine serve --help ok"
    if image.directory == "cacheserver":
        facts = s.cacheserver_round_trip(eng, image)
        return f"stored and loaded a chunk through the Unix socket; server process {facts}"
    if image.directory == "connector":
        return f"payload copied and imported: {', '.join(s.connector_payload(eng, image)[:6])}, ..."
    return "no smoke check"
