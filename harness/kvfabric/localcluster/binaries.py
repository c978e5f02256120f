"""Find or build the pinned control-plane binaries (cached outside the repository)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from kvfabric.localcluster import versions


class BuildError(RuntimeError):
    """The binaries could not be built; the message names the failing step."""


def missing(bin_dir: Path) -> list[str]:
    """Binaries of the pinned set that are not in ``bin_dir``."""
    return [b for b in versions.BINARIES if not (bin_dir / b).is_file()]


def ensure(*, quiet: bool = False) -> Path:
    """Return the bin directory for the current pins, building it first when needed.

    The build takes minutes on a cold Go cache (progress goes to stderr) and seconds when the Go
    build and module caches are warm. The directory is keyed by the pins, so a changed pin rebuilds.
    """
    bin_dir = versions.bin_dir()
    if not missing(bin_dir):
        return bin_dir
    if shutil.which("go") is None:
        raise BuildError("the Go toolchain is needed to build the control plane; install Go >= 1.26")
    script = Path(__file__).with_name("build-binaries.sh")
    env = {
        **os.environ,
        "KUBERNETES_VERSION": versions.KUBERNETES_VERSION,
        "ETCD_VERSION": versions.ETCD_VERSION,
        "KWOK_VERSION": versions.KWOK_VERSION,
    }
    if not quiet:
        print(f"building control-plane binaries {versions.PINS} into {bin_dir}", file=sys.stderr)
    proc = subprocess.run(
        ["bash", str(script), str(bin_dir)],
        env=env,
        stdout=subprocess.DEVNULL if quiet else sys.stderr,
        stderr=subprocess.STDOUT if not quiet else subprocess.PIPE,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stderr or "")[-4000:]
        raise BuildError(f"building the control plane failed (exit {proc.returncode}).\n{tail}")
    still = missing(bin_dir)
    if still:
        raise BuildError(f"the build finished but these binaries are missing: {', '.join(still)}")
    return bin_dir


def ensure_kubelet(*, quiet: bool = False) -> Path:
    """The real-node binaries (kubelet, pause) for the current pins, built first when needed.

    About 6.5 minutes on a cold Go cache, under a minute when the control plane's build left it warm;
    build-kubelet.sh prints how many packages it has compiled and roughly how long is left.
    """
    bin_dir = versions.kubelet_bin_dir()
    if all((bin_dir / b).is_file() for b in versions.KUBELET_BINARIES):
        return bin_dir
    if shutil.which("go") is None:
        raise BuildError("the Go toolchain is needed to build the kubelet; install Go >= 1.26")
    script = Path(__file__).with_name("build-kubelet.sh")
    if not quiet:
        print(f"building kubelet {versions.KUBERNETES_VERSION} into {bin_dir}", file=sys.stderr)
    proc = subprocess.run(
        ["bash", str(script), str(bin_dir)],
        env={**os.environ, "KUBERNETES_VERSION": versions.KUBERNETES_VERSION},
        stdout=subprocess.DEVNULL if quiet else sys.stderr,
        stderr=subprocess.STDOUT if not quiet else subprocess.PIPE,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise BuildError(
            f"building the kubelet failed (exit {proc.returncode}).\n{(proc.stderr or '')[-4000:]}"
        )
    return bin_dir
