"""The private Docker engine kind runs in: the harness's dockerd setup with its own paths.

Separate from the images' engine (:func:`kvfabric.containers.engine.engine`) so that a kind cluster
never depends on whichever process happens to own that one: the image tests start and stop it
freely. Like it, no bridge and no iptables rules of its own (host iptables untouched); kind's
user-defined ``kind`` network needs neither, and the API server's published port goes through
Docker's userland proxy.
"""

from __future__ import annotations

from kvfabric.containers.engine import DockerEngine, EnginePaths, run_dir
from kvfabric.localcluster.versions import cache_root


def kind_engine_paths() -> EnginePaths:
    """Data in ``<cache>/kind/docker`` (the node image survives), socket under ``<run>/kind``."""
    run = run_dir() / "kind"
    return EnginePaths(
        data_root=cache_root() / "kind" / "docker",
        exec_root=run / "exec",
        socket=run / "docker.sock",
        pidfile=run / "docker.pid",
        log=run / "dockerd.log",
        lock=run / "dockerd.lock",
    )


def kind_engine() -> DockerEngine:
    """A context that starts (or joins) kind's engine, and stops it on exit if it started it."""
    return DockerEngine(kind_engine_paths())
