"""``kvfabric kind``: kind clusters from an offline node image, in kind's own private Docker engine.

``image`` builds (or finds) the node image for the current pins; ``up`` runs ``e2e/kind/up.sh`` with it:
kind's engine started, the pinned kind CLI, kubectl and Docker's client on PATH, the node image in
``KIND_NODE_IMAGE``, kvfabric's images copied from the images' engine and ``kind load``-ed, the e2e
tests for an existing cluster run, and then the cluster deleted and the engine stopped (``--keep``
leaves both up until Ctrl-C); ``down`` deletes a cluster left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfabric.containers.engine import DockerEngine

# Shown by `kvfabric --help`; registered under the kvfabric.commands entry points.
SUMMARY = "kind clusters from a node image built here without any registry (e2e/kind/up.sh)"
# The images `up` loads by default: the engine image (about 6 GB) is left out unless asked for.
DEFAULT_IMAGES = ("operator", "cacheserver", "connector")


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``image``, ``up`` and ``down``."""
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    sub.add_parser("image", help="build the offline node image for the current pins (skipped when built)")
    up = sub.add_parser(
        "up", help="create the cluster, load the images, install, run the e2e tests, delete it"
    )
    up.add_argument(
        "--images",
        default=" ".join(DEFAULT_IMAGES),
        help="image directories of images/images.txt to load (default: %(default)s)",
    )
    up.add_argument("--skip-tests", action="store_true", help="only create the cluster and install kvfabric")
    up.add_argument("--keep", action="store_true", help="leave the cluster and the engine up until Ctrl-C")
    up.add_argument("pytest_args", nargs=argparse.REMAINDER, help="passed on to pytest (after --)")
    sub.add_parser("down", help="delete the kind cluster up left behind (e2e/kind/down.sh)")


def tool_dir(kind_bin: Path) -> Path:
    """A directory of links that puts the pinned kind, kubectl and Docker's client first on PATH."""
    from kvfabric.containers.engine import docker_cli, run_dir
    from kvfabric.localcluster import binaries

    tools = run_dir() / "kind" / "bin"
    tools.mkdir(parents=True, exist_ok=True)
    for name, target in (
        ("kind", kind_bin),
        ("kubectl", binaries.ensure() / "kubectl"),
        ("docker", Path(docker_cli())),
    ):
        link = tools / name
        link.unlink(missing_ok=True)
        link.symlink_to(target)
    return tools


def run(args: argparse.Namespace) -> int:
    """Carry out the chosen action."""
    from kvfabric.kind import nodeimage
    from kvfabric.kind.engine import kind_engine

    def say(msg: str) -> None:
        print(f"[kind] {msg}", file=sys.stderr, flush=True)

    scripts = Path(__file__).resolve().parents[3] / "e2e" / "kind"
    with kind_engine() as eng, host_lib_modules():
        say(f"docker engine at {eng.paths.host} (data {eng.paths.data_root})")
        if args.action == "down":
            env = {**eng.env, "PATH": f"{tool_dir(nodeimage.kind_binary())}:{os.environ['PATH']}"}
            return subprocess.run(["bash", str(scripts / "down.sh")], env=env, check=False).returncode
        start = time.monotonic()
        tag = nodeimage.ensure_image(eng, say)
        say(f"node image {tag} ready after {time.monotonic() - start:.0f}s")
        if args.action == "image":
            print(tag)
            return 0
        names = args.images.split()
        load_images(eng, names, say)
        env = {
            **eng.env,
            "PATH": f"{tool_dir(nodeimage.kind_binary())}:{os.environ['PATH']}",
            "KIND_NODE_IMAGE": tag,
            "SKIP_BUILD": "1",
            "IMAGES": " ".join(names),
            "SKIP_TESTS": "1" if args.skip_tests else "0",
        }
        pytest_args = [a for a in args.pytest_args if a != "--"]
        try:
            rc = subprocess.run(["bash", str(scripts / "up.sh"), *pytest_args], env=env, check=False)
            if args.keep:
                say("--keep: the cluster runs until Ctrl-C (KUBECONFIG in the output above)")
                with contextlib.suppress(KeyboardInterrupt):
                    while True:
                        time.sleep(3600)
            return rc.returncode
        finally:
            say("deleting the cluster")
            subprocess.run(["bash", str(scripts / "down.sh")], env=env, check=False)
            after_cluster(eng, names)


def load_images(eng: DockerEngine, names: Sequence[str], say: Callable[[str], None]) -> None:
    """Copy kvfabric's images from the images' engine into kind's (``docker load`` of saved tars).

    The tars are the real-kubelet tier's (``<cache>/node-images``, saved once per image id), built
    first when their sources changed.
    """
    from kvfabric.localcluster import binaries, nodeimages

    tars = nodeimages.node_images(binaries.ensure_kubelet() / "pause", names)[1:]  # [0] is pause
    for tar in tars:
        say(f"loading {tar.name} into kind's engine")
        eng.docker("load", "-i", str(tar))


@contextlib.contextmanager
def host_lib_modules(modules: Path = Path("/lib/modules")) -> Iterator[None]:
    """Remove the empty ``/lib/modules`` Docker creates on a host without one (kind binds it into nodes)."""
    existed = modules.exists()
    try:
        yield
    finally:
        if not existed:
            with contextlib.suppress(OSError):  # not empty, or not ours to remove: leave it
                modules.rmdir()


def after_cluster(eng: DockerEngine, names: Sequence[str]) -> None:
    """Once the cluster is deleted: remove what it left in kind's engine.

    The images :func:`load_images` copied (the saved tars stay; loading them takes seconds), and
    kind's network, whose bridge interface would otherwise outlive the engine on the host.
    """
    from kvfabric.containers.build import images

    refs = [i.ref for i in images() if i.directory in names]
    eng.docker("image", "rm", *refs, check=False)
    eng.docker("network", "rm", "kind", check=False)
