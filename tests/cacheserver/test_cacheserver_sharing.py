"""Several real servers sharing one directory: journals, concurrent writers, TTL ownership, skewed clocks."""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfabric.cacheserver.engine.blockfile import aligned_buffer, read_block_into
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.journal import parse_lines
from kvfabric.client import CacheClient
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, payload_for, wait_until

pytestmark = [pytest.mark.process, pytest.mark.slow]


@contextlib.contextmanager
def servers(
    shared: Path, *ids: str, env: dict[str, dict[str, str]] | None = None, **kw: Any
) -> Iterator[list[ServerProcess]]:
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                cache_server(server_id=sid, shared_dir=shared, env=(env or {}).get(sid), **kw)
            )
            for sid in ids
        ]


def _blocks(shared: Path) -> list[Path]:
    return list((shared / "buckets").rglob("*.blk"))


def test_chunk_stored_through_a_is_a_hit_through_b(ns: str, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    keys = [digest("ab", i) for i in range(3)]
    payloads = [payload_for(k, 2 * MiB + i) for i, k in enumerate(keys)]
    with (
        servers(shared, "node-a", "node-b", local_disk_bytes=None) as (a, b),
        CacheClient(a.unix_target, shared_memory=True) as ca,
        CacheClient(b.unix_target, shared_memory=True) as cb,
    ):
        assert cb.lookup(ns, keys, timeout=5).matched == 0
        assert ca.store(ns, keys, payloads, timeout=10).accepted == 3
        # B learns from A's journal (no filesystem probe per lookup); poll, do not time it.
        res = wait_until(
            lambda: (r := cb.lookup(ns, keys, timeout=5)).matched == 3 and r, what="B to see A's blocks"
        )
        assert res.tiers == ["shared"] * 3
        assert cb.load(ns, keys, timeout=10) == payloads
        # Promoted into B's DRAM by the load.
        assert cb.lookup(ns, keys, timeout=5).tiers == ["dram"] * 3
        # A delete through A reaches B's shared index too.
        assert ca.delete(ns, keys[2:], timeout=5) == 1
        wait_until(lambda: cb.stats(timeout=5)["tiers"]["shared"]["blocks"] == 2, what="B to see the delete")


def test_concurrent_stores_of_one_key_leave_one_whole_block(ns: str, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    size = 4 * MiB
    keys = [digest("race", i) for i in range(8)]
    with servers(shared, "node-a", "node-b", local_disk_bytes=None) as (a, b):
        clients = [CacheClient(a.tcp_target), CacheClient(b.tcp_target)]
        versions = {k: [payload_for(k, size, salt=b"A"), payload_for(k, size, salt=b"B")] for k in keys}
        barrier = threading.Barrier(2)

        def writer(i: int) -> None:
            barrier.wait()
            for k in keys:
                clients[i].store(ns, [k], [versions[k][i]], timeout=30)

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for c in clients:
            wait_until(lambda c=c: c.stats(timeout=5)["writeback_pending_bytes"] == 0, what="write-backs")
            c.close()
        files = _blocks(shared)
        by_key = Counter(p.name for p in files)
        assert set(by_key) == {BlockId(ns, k).filename for k in keys}
        assert all(n == 1 for n in by_key.values()), "one block file per key"
        buf = aligned_buffer(size)
        for p in files:
            bid = BlockId.from_filename(p.name)
            assert bid is not None
            header = read_block_into(p, bid, memoryview(buf))  # verifies both checksums
            assert bytes(buf[: header.length]) in versions[bid.key], "a block is one writer's bytes, whole"
        buf.close()
        assert not [p for p in (shared / "tmp").rglob("*") if p.is_file()]
        # A third server starting on the directory indexes exactly these blocks and serves them.
        with (
            cache_server(server_id="node-c", shared_dir=shared, local_disk_bytes=None) as c3,
            CacheClient(c3.unix_target, shared_memory=True) as cc,
        ):
            loaded = cc.load(ns, keys, timeout=30)
            assert len(loaded) == len(keys)
            assert all(data in versions[k] for k, data in zip(keys, loaded, strict=True))


def _expiry_events(shared: Path) -> Counter[int]:
    out: Counter[int] = Counter()
    for j in (shared / "journals").glob("*.log"):
        for ev in parse_lines(j.read_bytes()):
            if ev.op == "X":
                out[ev.bucket] += 1
    return out


def test_ttl_buckets_expire_once_by_one_server(ns: str, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    fast_ttl = {"ttl_seconds": 1, "bucket_seconds": 1, "janitor_interval_seconds": 0.1, "lease_seconds": 5}
    keys = [digest("ttl", i) for i in range(6)]
    with servers(shared, "node-a", "node-b", "node-c", local_disk_bytes=None, overrides=fast_ttl) as procs:
        with CacheClient(procs[0].unix_target, shared_memory=True) as c:
            for k in keys:  # spread over a few buckets
                c.store(ns, [k], [payload_for(k, 64 * 1024)], timeout=10)
        wait_until(lambda: _blocks(shared), what="write-back")
        wait_until(lambda: not _blocks(shared) and _expiry_events(shared), timeout=60, what="expiry")
        # Wait until every server has processed the journals, then look at who expired what.
        for p in procs:
            with CacheClient(p.unix_target) as cp:
                wait_until(
                    lambda cp=cp: cp.stats(timeout=5)["tiers"]["shared"]["blocks"] == 0, what="index update"
                )
        events = _expiry_events(shared)
        assert events, "buckets expired"
        assert all(n == 1 for n in events.values()), f"a bucket expired more than once: {events}"
        total = 0
        for p in procs:
            with CacheClient(p.unix_target) as cp:
                total += cp.stats(timeout=5)["counters"].get("expired_buckets", {}).get("shared", 0)
        assert total == len(events), "each expiry was done by exactly one server"
        assert not [d for d in (shared / "buckets").iterdir() if d.name.startswith(".expired")]


def test_server_with_skewed_clock_never_expires_early(ns: str, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    # One hour TTL; this server's own clock is ten hours ahead. Expiry must follow the volume's clock.
    cfg = {"ttl_seconds": 3600, "bucket_seconds": 60, "janitor_interval_seconds": 0.05}
    skew = {"node-skewed": {"KVFABRIC_TEST_CLOCK_SKEW_SECONDS": str(10 * 3600)}}
    keys = [digest("skew", i) for i in range(4)]
    with (
        servers(shared, "node-skewed", env=skew, local_disk_bytes=None, overrides=cfg) as (s,),
        CacheClient(s.unix_target, shared_memory=True) as c,
    ):
        c.store(ns, keys, [payload_for(k, 64 * 1024) for k in keys], timeout=10)
        wait_until(lambda: len(_blocks(shared)) == 4, what="write-back")
        # Let the janitor run many times (each tick logs nothing; count its lease renewals instead).
        lease = shared / "leases" / "node-skewed"
        first = lease.stat().st_mtime_ns
        wait_until(lambda: lease.stat().st_mtime_ns > first, what="janitor ticks")
        for _ in range(20):
            prev = lease.stat().st_mtime_ns
            wait_until(lambda prev=prev: lease.stat().st_mtime_ns > prev, what="janitor tick")
        assert len(_blocks(shared)) == 4
        stats = c.stats(timeout=5)
        assert "expired_buckets" not in stats["counters"]
        volume = (shared / "clocks" / "node-skewed").stat().st_mtime
        assert abs(stats["clock"] - volume) < 3600, "volume time, not local time"
        assert c.lookup(ns, keys, timeout=5).matched == 4


def test_a_hit_refreshes_the_block_into_the_current_bucket(ns: str, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    cfg = {"ttl_seconds": 3600, "bucket_seconds": 1}
    key = digest("refresh")
    with (
        servers(shared, "node-a", "node-b", local_disk_bytes=None, overrides=cfg) as (a, b),
        CacheClient(a.unix_target, shared_memory=True) as ca,
    ):
        ca.store(ns, [key], [payload_for(key, 8192)], timeout=10)
        (first,) = wait_until(lambda: _blocks(shared), what="write-back")
        stored_bucket = int(first.parent.name)

        def moved() -> list[Path]:
            ca.load(ns, [key], timeout=10)  # a DRAM hit on A
            return [p for p in _blocks(shared) if int(p.parent.name) > stored_bucket]

        (newer,) = wait_until(moved, what="the block to move into a newer bucket")
        assert len(_blocks(shared)) == 1
        # B learns the move from A's journal and loads the block from its new place.
        with CacheClient(b.unix_target, shared_memory=True) as cb:
            wait_until(lambda: cb.load(ns, [key], timeout=10), what="B to load the refreshed block")
            assert cb.load(ns, [key], timeout=10) == [payload_for(key, 8192)]
        assert newer.exists()
