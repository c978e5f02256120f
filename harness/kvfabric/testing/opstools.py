"""The operations tools the chart and monitoring tests use: Helm, the Prometheus Operator's CRDs, Prometheus.

>>> ensure_helm()                        # doctest: +SKIP
PosixPath('/root/.cache/kvfabric/opstools-…/bin/helm')

Helm and the Prometheus Operator's CRDs come from the Go module proxy, pinned below, built by
``build-opstools.sh`` into ``~/.cache/kvfabric/opstools-<digest of pins + script>/`` and reused while
the pins and the script are unchanged; ``python -m kvfabric.testing.opstools build`` does that
(``scripts/bootstrap.sh`` calls it). Prometheus and ``promtool`` are Debian's ``prometheus`` package,
which the bootstrap installs; :func:`prometheus_binaries` finds them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from kvfabric.localcluster.versions import cache_root, pins_digest

__all__ = [
    "HELM_VERSION",
    "PINS",
    "PROMETHEUS_OPERATOR_VERSION",
    "Helm",
    "OpsToolsError",
    "ensure_helm",
    "ensure_opstools",
    "helm_path",
    "opstools_dir",
    "prometheus_binaries",
    "prometheus_operator_crds",
]

HELM_VERSION: Final = "v4.3.2"
PROMETHEUS_OPERATOR_VERSION: Final = "v0.85.0"
PINS: Final[dict[str, str]] = {"helm": HELM_VERSION, "prometheus-operator": PROMETHEUS_OPERATOR_VERSION}
_SCRIPT: Final = Path(__file__).with_name("build-opstools.sh")
_PROGRESS: Final = Path(__file__).parents[1] / "localcluster" / "go-progress.sh"  # sourced by it


class OpsToolsError(RuntimeError):
    """A tool could not be built or found; the message says which and how to get it."""


def opstools_dir() -> Path:
    """Where the pinned tools live (they may not be built yet)."""
    return cache_root() / f"opstools-{pins_digest(PINS, _SCRIPT, _PROGRESS)}"


def helm_path() -> Path:
    """The pinned ``helm`` binary's path (it may not be built yet)."""
    return opstools_dir() / "bin" / "helm"


def ensure_opstools(*, quiet: bool = False) -> Path:
    """Return the tools' directory, building it first when needed (minutes on a cold Go cache)."""
    out = opstools_dir()
    if (out / "bin" / "helm").is_file():
        return out
    if shutil.which("go") is None:
        raise OpsToolsError("the Go toolchain is needed to build Helm; install Go >= 1.26")
    if not quiet:
        print(f"building Helm {HELM_VERSION} into {out}", file=sys.stderr)
    proc = subprocess.run(
        ["bash", str(_SCRIPT), str(out)],
        env={
            **os.environ,
            "HELM_VERSION": HELM_VERSION,
            "PROMETHEUS_OPERATOR_VERSION": PROMETHEUS_OPERATOR_VERSION,
        },
        stdout=subprocess.DEVNULL if quiet else sys.stderr,
        stderr=subprocess.PIPE if quiet else subprocess.STDOUT,
        text=True,
        check=False,
    )
    if proc.returncode != 0 or not (out / "bin" / "helm").is_file():
        raise OpsToolsError(f"building Helm failed (exit {proc.returncode}).\n{(proc.stderr or '')[-4000:]}")
    return out


def ensure_helm(*, quiet: bool = False) -> Path:
    """The pinned ``helm`` binary, built first when needed."""
    return ensure_opstools(quiet=quiet) / "bin" / "helm"


@dataclass(frozen=True)
class Helm:
    """Runs the pinned ``helm`` with its own state under ``home`` (nothing read from or written to ``~``)."""

    binary: Path
    home: Path
    kubeconfig: Path | None = None

    def __call__(
        self, *args: str, check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """Run ``helm ARGS``; raise with stderr when ``check`` and it fails."""
        env = {
            **os.environ,
            "HELM_CACHE_HOME": str(self.home / "cache"),
            "HELM_CONFIG_HOME": str(self.home / "config"),
            "HELM_DATA_HOME": str(self.home / "data"),
        }
        if self.kubeconfig is not None:
            env["KUBECONFIG"] = str(self.kubeconfig)
        proc = subprocess.run(
            [str(self.binary), *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc


def prometheus_operator_crds(*, quiet: bool = False) -> list[Path]:
    """The Prometheus Operator's CRD manifests (``ServiceMonitor``, ``PodMonitor``, ``PrometheusRule``, …)."""
    return sorted((ensure_opstools(quiet=quiet) / "prometheus-operator-crd").glob("*.yaml"))


def prometheus_binaries() -> tuple[Path, Path]:
    """``(prometheus, promtool)`` from Debian's ``prometheus`` package; a clear error when absent."""
    found = [shutil.which(name) for name in ("prometheus", "promtool")]
    prometheus, promtool = found
    if prometheus is None or promtool is None:
        raise OpsToolsError(
            "prometheus and promtool are needed: Debian package `prometheus` (scripts/bootstrap.sh)"
        )
    return Path(prometheus), Path(promtool)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvfabric.testing.opstools build|path``: build the tools or print their directory."""
    ap = argparse.ArgumentParser(
        prog="python -m kvfabric.testing.opstools", description=__doc__.splitlines()[0]
    )
    ap.add_argument("action", choices=["build", "path"], help="build the tools, or print their directory")
    ns = ap.parse_args(argv)
    print(ensure_opstools() if ns.action == "build" else opstools_dir())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
