"""Queued write-backs cannot take the server's last file descriptors.

Each write-back queued for a disk tier holds a descriptor of its block until it is written. The
queue's byte bound (``limits.store_queue_bytes``) never fills with tiny blocks, so a tenant storing
4 KiB blocks faster than the disk takes them once queued a descriptor per block until the server
had none: every client's stores then failed (``EMFILE``). Real server process, a real descriptor
limit, a real disk tier.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvfabric.client import CacheClient
from kvfabric.testing.serverproc import MiB, cache_server, digest, nofile_site, payload_for, site_env

pytestmark = pytest.mark.process

NOFILE = 2000
"""The server's descriptor limit: 1,000 DRAM blocks, 500 staging areas, 250 queued write-backs."""
NS = digest("writeback-descriptors")


def test_a_flood_of_tiny_stores_leaves_the_server_descriptors_for_everyone(tmp_path: Path) -> None:
    env = site_env(tmp_path / "site", nofile_site(NOFILE))
    with (
        cache_server(dram_bytes=256 * MiB, local_disk_bytes=512 * MiB, env=env) as srv,
        CacheClient(srv.unix_target, shared_memory=True) as flood,
        CacheClient(srv.unix_target, shared_memory=True) as other,
    ):
        assert srv.proc is not None
        fd_dir = Path(f"/proc/{srv.proc.pid}/fd")
        most = 0
        for r in range(80):  # 5,120 blocks of 4 KiB, as fast as one client stores them
            keys = [digest("flood", r, i) for i in range(64)]
            flood.store(NS, keys, [b"x" * 4096] * 64, timeout=30)
            most = max(most, len(os.listdir(fd_dir)))
        # Another tenant's store and load right after: served, not refused for want of descriptors.
        keys = [digest("other", i) for i in range(16)]
        payloads = [payload_for(k, 64 << 10) for k in keys]
        assert other.store(NS, keys, payloads, timeout=30).accepted == 16
        bufs = [memoryview(bytearray(64 << 10)) for _ in keys]
        assert other.load_into(NS, keys, bufs, timeout=30) == 16
        assert [bytes(b) for b in bufs] == payloads
        print(f"server descriptors at most {most} of {NOFILE}")
        assert most < NOFILE - 100, "the server came within 100 descriptors of its limit"
