"""The one list of pinned control-plane component versions.

Changing a pin changes the cache key, so the next ``kvfabric cluster up`` rebuilds the binaries.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Final

KUBERNETES_VERSION: Final = "v1.36.3"
# The etcd release that k8s.io/kubernetes v1.36.3 itself requires (go.etcd.io/etcd/client/v3 v3.6.8).
ETCD_VERSION: Final = "v3.6.8"
KWOK_VERSION: Final = "v0.8.0"

PINS: Final[dict[str, str]] = {
    "kubernetes": KUBERNETES_VERSION,
    "etcd": ETCD_VERSION,
    "kwok": KWOK_VERSION,
}

BINARIES: Final = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
    "kwok-stages.yaml",
)


# The real-node tier (``kvfabric cluster up --kubelets N``), built by build-kubelet.sh.
KUBELET_BINARIES: Final = ("kubelet", "pause")


def cache_root() -> Path:
    """Where built binaries are kept: ``$KVFABRIC_CACHE_DIR`` or ``~/.cache/kvfabric``."""
    env = os.environ.get("KVFABRIC_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvfabric"


def pins_digest(pins: dict[str, str], *scripts: Path) -> str:
    """A short digest of ``pins`` and the build scripts that use them: a built tool's cache key."""
    built_by = b"".join(s.read_bytes() for s in scripts)
    return hashlib.sha256(json.dumps(pins, sort_keys=True).encode() + built_by).hexdigest()[:10]


def pin_key() -> str:
    """A short digest of the pins and the build script, part of the cache directory's name."""
    here = Path(__file__).parent
    digest = pins_digest(PINS, here / "build-binaries.sh", here / "go-progress.sh")
    return f"k8s-{KUBERNETES_VERSION}-{digest}"


def bin_dir() -> Path:
    """The bin directory for the current pins."""
    return cache_root() / pin_key() / "bin"


def kubelet_pin_key() -> str:
    """The cache key of the real-node binaries: the Kubernetes pin and the build scripts."""
    here = Path(__file__).parent
    script = (here / "build-kubelet.sh").read_bytes() + (here / "go-progress.sh").read_bytes()
    digest = hashlib.sha256(KUBERNETES_VERSION.encode() + script).hexdigest()[:10]
    return f"kubelet-{KUBERNETES_VERSION}-{digest}"


def kubelet_bin_dir() -> Path:
    """The bin directory of the real-node binaries for the current pins."""
    return cache_root() / kubelet_pin_key() / "bin"
