"""Against an existing cluster, the test run starts no node of its own on this host.

``KVFABRIC_TEST_KUBECONFIG`` points the e2e suite at a cluster someone else runs (kind, a real
cluster). Tests that bring their own nodes (the real-kubelet tier, the pod runner, the local
control plane) would then start kubelets, container runtimes and control planes on the user's own
machine: ``e2e/conftest.py`` installs :func:`install`'s audit hook for such a run, which refuses to
start any of them, naming the process and the test level that runs it.
"""

from __future__ import annotations

import os
import re
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
        "kind",
    }
)
# Programs that run another program given later on their command line, with each one's options that
# take a separate value (so that value is not mistaken for the program) and how many positional
# arguments come before the program (timeout's duration, chroot's root).
WRAPPERS: dict[str, tuple[frozenset[str], int]] = {
    "sudo": (frozenset({"-u", "-g", "-C", "-D", "-h", "-p", "-r", "-t", "-U", "-T", "--user", "--group"}), 0),
    "doas": (frozenset({"-u", "-C"}), 0),
    "env": (frozenset({"-u", "--unset", "-C", "--chdir", "-S", "--split-string"}), 0),
    "nsenter": (frozenset({"-t", "--target", "-S", "--setuid", "-G", "--setgid"}), 0),
    "unshare": (
        frozenset({"--propagation", "-S", "--setuid", "-G", "--setgid", "-R", "--root", "-w", "--wd"}),
        0,
    ),
    "setsid": (frozenset(), 0),
    "nohup": (frozenset(), 0),
    "nice": (frozenset({"-n", "--adjustment"}), 0),
    "timeout": (frozenset({"-s", "--signal", "-k", "--kill-after"}), 1),
    "chroot": (frozenset({"--userspec", "--groups"}), 1),
}
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "ash"})
# What separates the words of a shell script, for the purpose of spotting a program's name in it.
_SCRIPT_SEPARATORS = re.compile(r"[\s;&|()<>\"'`{}]+")
_SCRIPT_COMMENT = re.compile(r"(?:^|(?<=\s))#[^\n]*", re.MULTILINE)
# Python modules that run pods on this host (``python -m …``).
NODE_MODULES = frozenset({"kvfabric.localcluster.podrunner"})
SPAWN_EVENTS = frozenset({"subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn"})
ENV = "KVFABRIC_TEST_KUBECONFIG"


class HostNodeError(RuntimeError):
    """A run against an existing cluster tried to start a node process on this host."""


def node_process(argv: Sequence[str]) -> str | None:
    """The node program or module ``argv`` would start, or None (pure).

    Looks through wrappers (``sudo``, ``env A=1``, ``nsenter … --``, ``unshare``, ``timeout 5`` …) to
    the program they run, and into a shell's ``-c`` script, where any word naming a node program
    counts (``bash -c 'containerd & exec kubelet'``): a guard errs on the side of refusing.
    """
    args = [str(a) for a in argv]
    if not args:
        return None
    name = PurePath(args[0]).name
    if name in NODE_PROGRAMS:
        return name
    if name in WRAPPERS:
        return node_process(_wrapped(name, args[1:]))
    if name in SHELLS:
        return _in_script(args[1:])
    for i, arg in enumerate(args[:-1]):
        if arg == "-m" and args[i + 1] in NODE_MODULES:
            return args[i + 1]
    return None


def _wrapped(wrapper: str, args: list[str]) -> list[str]:
    """The command line a wrapper runs: after its options, assignments and leading positionals."""
    takes_value, positionals = WRAPPERS[wrapper]
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            if positionals == 0:
                return args[i + 1 :]
        elif arg.startswith("-") and arg != "-":
            i += 2 if arg in takes_value else 1
            continue
        elif wrapper in ("env", "sudo") and "=" in arg:
            pass  # NAME=value
        elif positionals > 0:
            positionals -= 1
        else:
            return args[i:]
        i += 1
    return []


def _in_script(args: list[str]) -> str | None:
    """The first node program named by a word of a shell's ``-c`` script, or None."""
    command = False
    i = 0
    while i < len(args) and args[i].startswith(("-", "+")) and args[i] != "--":
        arg = args[i]
        if arg in ("-o", "+o", "-O", "+O"):
            i += 1  # the option's name
        elif not arg.startswith("--") and "c" in arg[1:]:
            command = True
        i += 1
    if i < len(args) and args[i] == "--":
        i += 1
    if not command or i >= len(args):
        return None
    for word in _SCRIPT_SEPARATORS.split(_SCRIPT_COMMENT.sub(" ", args[i])):
        if word and PurePath(word).name in NODE_PROGRAMS:
            return PurePath(word).name
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
