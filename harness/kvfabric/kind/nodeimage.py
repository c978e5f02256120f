"""Find or build the offline kind node image (cached outside the repository, keyed by its pins).

Two caches, each keyed by a digest of the pins and of the scripts and files that build it:

- ``<cache>/kind-node-<k8s>-<digest>/``: kubeadm, kube-proxy, CoreDNS and the kind CLI built from the
  Go module proxy, and kind's ``images/base/files`` (build-node-binaries.sh);
- ``kvfabric.local/kind-node:<k8s>-<digest>`` in kind's engine (build-node-image.sh), from those,
  the local control plane's and kubelet's binaries and the local Debian image.

A changed pin, script or Debian root file system changes the digest, so the next call rebuilds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Final

from kvfabric.containers import base
from kvfabric.containers.engine import DockerEngine
from kvfabric.localcluster import binaries, versions

KIND_VERSION: Final = "v0.33.0"
# The CoreDNS that kubeadm v1.36.3 deploys (`kubeadm config images list`).
COREDNS_VERSION: Final = "v1.14.2"
PINS: Final[dict[str, str]] = {
    "kubernetes": versions.KUBERNETES_VERSION,
    "kind": KIND_VERSION,
    "coredns": COREDNS_VERSION,
}
NODE_BINARIES: Final = ("kubeadm", "kube-proxy", "coredns", "kind")
IMAGE_REPOSITORY: Final = "kvfabric.local/kind-node"
HERE: Final = Path(__file__).parent


class NodeImageError(RuntimeError):
    """A step of the node image's build failed; the message names it."""


def _inputs(*paths: Path) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        files.extend(sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p])
    return files


def binaries_key() -> str:
    """The cache key of the node binaries: the pins and build-node-binaries.sh (with its helper)."""
    scripts = _inputs(HERE / "build-node-binaries.sh", HERE.parent / "localcluster" / "go-progress.sh")
    return f"kind-node-{versions.KUBERNETES_VERSION}-{versions.pins_digest(PINS, *scripts)}"


def binaries_dir() -> Path:
    """Where build-node-binaries.sh puts its output for the current pins."""
    return versions.cache_root() / binaries_key()


def image_digest() -> str:
    """What the node image depends on: every pin and script above, plus the binaries' own keys."""
    pins = {
        **PINS,
        "binaries": binaries_key(),
        "control-plane": versions.pin_key(),
        "kubelet": versions.kubelet_pin_key(),
        "debian": base.rootfs_digest(),
    }
    return versions.pins_digest(pins, *_inputs(HERE / "build-node-image.sh", HERE / "images"))


def image_tag() -> str:
    """The node image's name for the current inputs, e.g. ``kvfabric.local/kind-node:v1.36.3-ab12…``."""
    return f"{IMAGE_REPOSITORY}:{versions.KUBERNETES_VERSION}-{image_digest()}"


def built_marker() -> Path:
    """Written after a successful build: lets a test level know, without an engine, that it is cheap."""
    return versions.cache_root() / "kind" / f"node-image-{image_digest()}.built"


def ensure_binaries(*, quiet: bool = False) -> Path:
    """The node binaries for the current pins, built first when missing (progress on stderr)."""
    out = binaries_dir()
    if all((out / "bin" / b).is_file() for b in NODE_BINARIES) and (out / "kind-base-files").is_dir():
        return out
    if shutil.which("go") is None:
        raise NodeImageError("the Go toolchain is needed to build kubeadm, kube-proxy, CoreDNS and kind")
    if not quiet:
        print(f"building kind's node binaries {PINS} into {out}", file=sys.stderr)
    proc = subprocess.run(
        ["nice", "-n", "15", "bash", str(HERE / "build-node-binaries.sh"), str(out)],
        env={
            **os.environ,
            "KUBERNETES_VERSION": versions.KUBERNETES_VERSION,
            "KIND_VERSION": KIND_VERSION,
            "COREDNS_VERSION": COREDNS_VERSION,
        },
        stdout=subprocess.DEVNULL if quiet else sys.stderr,
        stderr=subprocess.STDOUT,
        check=False,
    )
    if proc.returncode != 0:
        raise NodeImageError(f"build-node-binaries.sh failed (exit {proc.returncode}); its output is above")
    return out


def kind_binary() -> Path:
    """The pinned kind CLI (built with the node binaries)."""
    return ensure_binaries() / "bin" / "kind"


def ensure_image(eng: DockerEngine, say: Callable[[str], None]) -> str:
    """The node image's tag in ``eng``, built first when missing (about 10 min cold; see the docs)."""
    tag = image_tag()
    if base.image_digest(eng, tag) == image_digest():
        say(f"{tag} is current")
        built_marker().parent.mkdir(parents=True, exist_ok=True)
        built_marker().touch()
        return tag
    k8s_bin = binaries.ensure()
    kubelet_bin = binaries.ensure_kubelet()
    node_bin = ensure_binaries()
    base.ensure_debian(eng, say)
    say(f"building {tag}")
    proc = subprocess.run(
        ["nice", "-n", "15", "bash", str(HERE / "build-node-image.sh")],
        env={
            **eng.env,
            "DOCKER": eng.docker_path,
            "DEBIAN_IMAGE": base.DEBIAN_IMAGE,
            "K8S_BIN": str(k8s_bin),
            "KUBELET_BIN": str(kubelet_bin),
            "NODE_BIN": str(node_bin),
            "NODE_IMAGE": tag,
            "KUBERNETES_VERSION": versions.KUBERNETES_VERSION,
            "INPUTS_DIGEST": image_digest(),
        },
        stdout=sys.stderr,
        stderr=subprocess.STDOUT,
        check=False,
    )
    if proc.returncode != 0:
        raise NodeImageError(f"build-node-image.sh failed (exit {proc.returncode}); its output is above")
    prune(eng, tag, say)
    built_marker().parent.mkdir(parents=True, exist_ok=True)
    built_marker().touch()
    return tag


def prune(eng: DockerEngine, keep: str, say: Callable[[str], None]) -> None:
    """Remove node images of other inputs and the layers nothing names any more (about 1.2 GB each)."""
    listed = eng.docker("image", "ls", "--format", "{{.Repository}}:{{.Tag}}", IMAGE_REPOSITORY)
    for old in listed.stdout.split():
        if old != keep:
            say(f"removing the outdated node image {old}")
            eng.docker("image", "rm", old, check=False)
    eng.docker("image", "prune", "--force", check=False)
