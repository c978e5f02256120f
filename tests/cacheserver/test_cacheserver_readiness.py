"""Readiness follows the data path: a listener that stops accepting makes ``/readyz`` fail, naming it.

The fault is real and injected from outside the real server process: the test takes a duplicate of
the listener's socket out of the server (``pidfd_getfd``; the test is the server's parent) and shuts
it down. From then on the server's own accept fails (EINVAL) and every client's connect is refused,
exactly as when an accept loop has died; nothing in the server is told.
"""

from __future__ import annotations

import ctypes
import os
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfabric.rpc.blockproto import block_socket_for
from kvfabric.rpc.indextable import index_socket_for
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, wait_until

pytestmark = [pytest.mark.process, pytest.mark.slow]

_SYS_PIDFD_GETFD = 438  # the same number on every architecture (the unified syscall table)


def readyz(srv: ServerProcess) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(srv.metrics_url + "/readyz", timeout=5) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def listener_up(srv: ServerProcess) -> dict[str, float]:
    with urllib.request.urlopen(srv.metrics_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        s.labels["listener"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "kvfabric_listener_up"
    }


def shut_down_listener(pid: int, published: Path) -> None:
    """Shut down the server's listening socket published at ``published`` (bound as ``<path>.<hex>``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        for name in os.listdir(f"/proc/{pid}/fd"):
            try:
                if not os.readlink(f"/proc/{pid}/fd/{name}").startswith("socket:"):
                    continue
            except FileNotFoundError:
                continue
            fd = libc.syscall(_SYS_PIDFD_GETFD, pidfd, int(name), 0)
            if fd < 0:
                continue
            s = socket.socket(fileno=fd)
            try:
                bound = s.getsockname() if s.family == socket.AF_UNIX else ""
                listening = s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                if (
                    listening
                    and isinstance(bound, str)
                    and os.path.normpath(bound).rsplit(".", 1)[0] == str(published)
                ):
                    s.shutdown(socket.SHUT_RDWR)
                    return
            finally:
                s.close()
    finally:
        os.close(pidfd)
    raise AssertionError(f"no listening socket bound for {published} in process {pid}")


@pytest.mark.parametrize("listener", ["blocks", "index", "grpc"])
def test_readyz_fails_naming_the_listener_that_stopped_serving(listener: str) -> None:
    with cache_server(server_id="ready", dram_bytes=16 * MiB, local_disk_bytes=None, tcp=False) as srv:
        assert srv.proc is not None
        sock = srv.config.listen.unix_socket.absolute()
        path = {"blocks": block_socket_for(sock), "index": index_socket_for(sock), "grpc": sock}[listener]
        wait_until(lambda: readyz(srv)[0] == 200, 10, what="ready")
        _, body = readyz(srv)
        assert body.splitlines() == ["ready", "listener grpc up", "listener blocks up", "listener index up"]
        assert listener_up(srv) == {"grpc": 1, "blocks": 1, "index": 1}

        shut_down_listener(srv.proc.pid, path)
        start = time.monotonic()
        wait_until(lambda: readyz(srv)[0] == 503, 15, 0.02, what="/readyz to fail")
        elapsed = time.monotonic() - start
        print(f"{listener}: /readyz failed {elapsed:.2f} s after its listener stopped accepting")
        _, body = readyz(srv)
        lines = body.splitlines()
        assert lines[0] == "not ready"
        why = {"grpc": "health check failed: UNAVAILABLE"}.get(
            listener, "connection refused (nothing accepts on the socket)"
        )
        assert f"listener {listener} down: {why}" in lines
        assert [ln for ln in lines if ln.endswith(" up")] == [
            f"listener {other} up" for other in ("grpc", "blocks", "index") if other != listener
        ]
        assert listener_up(srv) == {name: float(name != listener) for name in ("grpc", "blocks", "index")}
        assert elapsed < 5  # one probe interval plus one deadline, with room for a loaded machine


def test_a_removed_socket_file_is_not_ready_either() -> None:
    with cache_server(server_id="gone", dram_bytes=16 * MiB, local_disk_bytes=None, tcp=False) as srv:
        wait_until(lambda: readyz(srv)[0] == 200, 10, what="ready")
        block_socket_for(srv.config.listen.unix_socket.absolute()).unlink()
        wait_until(lambda: readyz(srv)[0] == 503, 15, 0.02, what="/readyz to fail")
        assert "listener blocks down: socket file" in readyz(srv)[1]
