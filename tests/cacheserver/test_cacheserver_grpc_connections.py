"""Connections to the gRPC listeners cannot take the server's descriptors.

Each connection holds a descriptor of the server's. Unbounded, a same-node process (or, over TCP,
anyone who reaches the port, before any authentication) that opened connections without end took
every descriptor: the DRAM tier, the staging areas and the other listeners had none, and every
tenant's stores failed. Real server process, a real descriptor limit, real connections.
"""

from __future__ import annotations

import os
import resource
import socket
import time
from pathlib import Path

import pytest

from kvfabric.client import CacheClient
from kvfabric.testing.serverproc import (
    MiB,
    cache_server,
    digest,
    nofile_site,
    payload_for,
    site_env,
    wait_until,
)

pytestmark = pytest.mark.process

NOFILE = 2000
"""The server's descriptor limit: each gRPC listener may take 64 (its floor) of it."""
NS = digest("grpc-connections")
FLOOD = 2500


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_flood_of_connections_to_the_grpc_socket_leaves_the_server_its_descriptors(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FLOOD + 500:
        pytest.skip(f"this process may open {hard} descriptors, the flood needs {FLOOD + 500}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, FLOOD + 500), hard))
    env = site_env(tmp_path / "site", nofile_site(NOFILE))
    flood: list[socket.socket] = []
    try:
        with (
            cache_server(dram_bytes=64 * MiB, local_disk_bytes=None, env=env) as srv,
            CacheClient(srv.unix_target, shared_memory=True) as engine,
        ):
            assert srv.proc is not None
            keys = [digest("before", i) for i in range(16)]
            payloads = [payload_for(k, 64 << 10) for k in keys]
            assert engine.store(NS, keys, payloads, timeout=30).accepted == 16
            assert engine.health(timeout=10)  # its gRPC connection is open before the flood
            before = _descriptors(srv.proc.pid)
            # Connections that never say a word, as fast as the kernel takes them.
            for _ in range(FLOOD):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.setblocking(False)
                try:
                    s.connect(srv.config.listen.unix_socket.as_posix())
                except BlockingIOError:
                    pass  # the backlog is full: the server takes it later
                except OSError:
                    s.close()
                    continue
                flood.append(s)
            wait_until(lambda: _descriptors(srv.proc.pid) >= before + 32, 10, what="the flood to be accepted")
            # The highest count over the next second (the listener may still be accepting).
            most, until = 0, time.monotonic() + 1.0
            while time.monotonic() < until:
                most = max(most, _descriptors(srv.proc.pid))
                time.sleep(0.01)
            print(f"server descriptors: {before} before the flood, at most {most} during it, limit {NOFILE}")
            # The listener's share (62 here) and a few of gRPC's own; unbounded, the flood took +1,613.
            # Measured before the engine's store below, whose blocks and staging areas hold
            # descriptors of their own (a run counted 37 more with them).
            assert most <= before + 64 + 16, "the flood's connections took more than the listener's share"
            # The engine connected before stores and loads meanwhile.
            keys = [digest("during", i) for i in range(16)]
            payloads = [payload_for(k, 64 << 10) for k in keys]
            assert engine.store(NS, keys, payloads, timeout=30).accepted == 16
            bufs = [memoryview(bytearray(64 << 10)) for _ in keys]
            assert engine.load_into(NS, keys, bufs, timeout=30) == 16
            assert [bytes(b) for b in bufs] == payloads
            # Silent connections are closed: at once past the bound, the others when their handshake
            # has not finished 5 s after their accept (gRPC's own default took about a minute here).
            # Then a newcomer gets in.
            wait_until(lambda: all(_closed_by_server(s) for s in flood), 30, what="the flood to be closed")
            with CacheClient(srv.unix_target) as newcomer:
                assert newcomer.health(timeout=10)
    finally:
        for s in flood:
            s.close()


def _closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (never blocks; reads what the server sent, its HTTP/2 settings)."""
    try:
        while s.recv(65536):
            pass
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset, or never connected
    return True  # the end
