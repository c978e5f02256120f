"""A block in a new bucket directory is durable when the write returns: ``buckets/`` is fsynced too.

The fsync of the bucket directory after a block's rename makes the block's entry durable, not the
bucket directory's own entry in ``buckets/``: after a power loss the whole new bucket (every block
``Flush`` reported durable in it) could be gone. The syscalls are recorded (``os.fsync``, ``os.rename``
and ``os.mkdir`` wrapped), so the test sees what reached the kernel, and in which order.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvfabric.cacheserver.engine.disk import DiskTier
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.testing.serverproc import digest, payload_for

Calls = list[tuple[str, str]]


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    """``(syscall, path)`` of every fsync, rename and mkdir from now on (an fsync names its fd's file)."""
    out: Calls = []

    def wrap(name: str, real: Callable[..., Any], path_of: Callable[..., str]) -> Callable[..., Any]:
        def call(*args: Any, **kw: Any) -> Any:
            path = path_of(*args)  # before the call: an fsync'd fd may be closed right after
            res = real(*args, **kw)
            out.append((name, path))
            return res

        return call

    monkeypatch.setattr(os, "fsync", wrap("fsync", os.fsync, lambda fd: os.readlink(f"/proc/self/fd/{fd}")))
    monkeypatch.setattr(os, "rename", wrap("rename", os.rename, lambda src, dst, *a: str(dst)))
    monkeypatch.setattr(os, "mkdir", wrap("mkdir", os.mkdir, lambda p, *a: str(p)))
    return out


def _tier(root: Path) -> DiskTier:
    return DiskTier("local_disk", root, 1 << 24, server_id="s", direct_io=False)


def _durable_before_return(calls: Calls, bucket_dir: Path) -> None:
    made = [i for i, (op, p) in enumerate(calls) if op == "mkdir" and p == str(bucket_dir)]
    assert made, f"{bucket_dir} was not created"
    parent = [i for i, (op, p) in enumerate(calls) if op == "fsync" and p == str(bucket_dir.parent)]
    assert parent, f"{bucket_dir.parent} never fsynced"
    assert parent[0] > made[0], f"{bucket_dir.parent} not fsynced after {bucket_dir.name} was made"
    moved_in = [i for i, (op, p) in enumerate(calls) if op == "rename" and Path(p).parent == bucket_dir]
    assert moved_in, f"no block renamed into {bucket_dir}"
    assert parent[0] < moved_in[0], "the new bucket's entry is durable before a block moves in"


def test_a_write_into_a_new_bucket_fsyncs_the_buckets_directory(tmp_path: Path, calls: Calls) -> None:
    tier = _tier(tmp_path)
    bid = BlockId(digest("ns"), digest("k"))
    calls.clear()
    assert tier.put(bid, payload_for("k", 8192), bucket=41)
    _durable_before_return(calls, tmp_path / "buckets" / "41")
    # Once made durable, a bucket costs no further fsync of buckets/ per block.
    calls.clear()
    assert tier.put(BlockId(digest("ns"), digest("k2")), payload_for("k2", 8192), bucket=41)
    assert ("fsync", str(tmp_path / "buckets")) not in calls


def test_a_refresh_into_a_new_bucket_fsyncs_the_buckets_directory(tmp_path: Path, calls: Calls) -> None:
    tier = _tier(tmp_path)
    bid = BlockId(digest("ns"), digest("hot"))
    assert tier.put(bid, payload_for("hot", 8192), bucket=7)
    calls.clear()
    assert tier.refresh(bid, 8)
    _durable_before_return(calls, tmp_path / "buckets" / "8")
