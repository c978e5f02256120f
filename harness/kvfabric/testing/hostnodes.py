"""Against an existing cluster, the test run starts no node of its own on this host.

``KVFABRIC_TEST_KUBECONFIG`` points the e2e suite at a cluster someone else runs (kind, a real
cluster). Tests that bring their own nodes (the real-kubelet tier, the pod runner, the local
control plane) would then start kubelets, container runtimes and control planes on the user's own
machine: ``e2e/conftest.py`` installs :func:`install`'s audit hook for such a run, which refuses to
start any of them, naming the process and the test level that runs it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import PurePath
from typing import Any

# Programs that make this host a Kubernetes node or control plane.
NODE_PROGRAMS = frozenset(
    {
        "kubelet",
        "containerd",
        "dockerd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kube-proxy",
        "etcd",
        "kwok",
    }
)
# Python modules that run pods on this host (``python -m …``).
NODE_MODULES = frozenset({"kvfabric.localcluster.podrunner"})
SPAWN_EVENTS = frozenset({"subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn"})
ENV = "KVFABRIC_TEST_KUBECONFIG"


class HostNodeError(RuntimeError):
    """A run against an existing cluster tried to start a node process on this host."""


def node_process(argv: Sequence[str]) -> str | None:
    """The node program or module ``argv`` would start, or None (pure)."""
    if not argv:
        return None
    name = PurePath(str(argv[0])).name
    if name in NODE_PROGRAMS:
        return name
    args = [str(a) for a in argv]
    for i, arg in enumerate(args[:-1]):
        if arg == "-m" and args[i + 1] in NODE_MODULES:
            return args[i + 1]
    return None


def _argv(event: str, args: tuple[Any, ...]) -> Sequence[str]:
    """The argument vector of a spawn audit event (each event lays its arguments out differently)."""
    if event == "subprocess.Popen":  # (executable, args, cwd, env)
        executable, argv = args[0], args[1]
        if isinstance(argv, (str, bytes, os.PathLike)):
            argv = [argv]
        argv = [os.fsdecode(a) for a in argv]
        if executable is not None and argv:
            argv[0] = os.fsdecode(executable)
        return argv
    argv = args[1]  # os.exec / os.posix_spawn: (path, argv, env); os.spawn: (mode, path, args, env)
    if event == "os.spawn":
        argv = args[2]
    return [os.fsdecode(a) for a in argv]


class _Guard:
    def __init__(self, cluster: str) -> None:
        self.cluster = cluster
        sys.addaudithook(self.hook)

    def hook(self, event: str, args: tuple[Any, ...]) -> None:
        if event not in SPAWN_EVENTS:
            return
        try:
            found = node_process(_argv(event, args))
        except (IndexError, TypeError):
            return
        if found is not None:
            raise HostNodeError(
                f"this run uses the existing cluster {ENV}={self.cluster} but would start {found} on this "
                "host: tests that bring their own nodes (levels kubelet, vllm, and fabric without "
                f"{ENV}) do not run against an existing cluster; select them with -m fabric"
            )


_guard: _Guard | None = None


def install() -> str | None:
    """Install the guard when ``$KVFABRIC_TEST_KUBECONFIG`` is set (once); the cluster, or None."""
    global _guard  # noqa: PLW0603  (audit hooks cannot be removed: one per interpreter)
    cluster = os.environ.get(ENV)
    if not cluster:
        return None
    if _guard is None:
        _guard = _Guard(cluster)
    return cluster
