"""The ordering invariant: a load of K returns the latest acknowledged store of K no later delete
superseded, or a miss — through deletes racing write-backs, across servers and across restarts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfabric.cacheserver.engine.blockfile import payload_checksum, read_header, write_block
from kvfabric.cacheserver.engine.disk import DiskTier
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.ordering import Generations
from kvfabric.client import CacheClient
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, payload_for, wait_until

NS = digest("ordering")


def _disk(root: Path, gens: Generations) -> DiskTier:
    return DiskTier("local_disk", root, 1 << 24, server_id="me", generations=gens)


def test_a_write_never_replaces_a_newer_copy_nor_lands_after_a_delete(tmp_path: Path) -> None:
    gens = Generations(lambda: 1.0)
    t = _disk(tmp_path / "d", gens)
    b = BlockId(NS, digest("k"))
    new, old = payload_for(b.key, 8192, salt=b"new"), payload_for(b.key, 8192, salt=b"old")
    g_old, g_new = gens.next(), gens.next()

    def write(data: bytes, gen: int, bucket: int = 1) -> bool:
        view = memoryview(data)
        return t.write(b, view, gen=gen, bucket=bucket, created_at=0, checksum=payload_checksum(view))

    assert write(new, g_new)
    assert not write(old, g_old), "an older generation never replaces a newer copy"
    assert t.get(b) == new
    g_del = gens.next()
    gens.tombstone(b, g_del)
    assert t.delete(b, g_del)
    assert not write(new, g_new), "a copy the delete superseded is never admitted"
    assert t.get(b) is None
    assert write(old, gens.next(), bucket=2), "a store after the delete is"


def test_a_store_right_after_a_delete_never_outlives_a_later_delete_on_another_server() -> None:
    # Two servers whose volume clocks read the same (they agree only to within the timestamp
    # granularity). Server a deletes a key and stores it again at once; server b then deletes it.
    # A store clock that jumps past a's tombstone would give the store a generation a margin ahead of
    # volume time, newer than b's later delete: the deleted bytes would survive it. (The two-server
    # model test in test_cacheserver_ordering_model.py found this once DRAM puts became fast.)
    a, b = Generations(lambda: 100.0), Generations(lambda: 100.0)
    key = BlockId(NS, digest("delete-store-delete"))
    first = a.for_delete(5.0)
    a.tombstone(key, first)
    store = a.next()
    later = b.for_delete(5.0)
    assert not (a.admits(key, store) and store >= later), "a store survived a later delete"
    assert not a.admits(key, store), "within the margin a deleted key is not stored again"
    # Once volume time passes the tombstone, stores are admitted again.
    c = Generations(lambda: 106.0)
    c.tombstone(key, first)
    assert c.admits(key, c.next())


def test_a_delete_never_shares_its_generation_with_a_store_when_the_clock_ran_ahead() -> None:
    # The store clock observed a peer's generation beyond the delete margin: the delete's
    # generation comes from the store clock, and a store issued right after gets a greater one.
    g = Generations(lambda: 1.0)
    g.observe(int(1e12))
    delete = g.for_delete(5.0)
    assert g.next() > delete


def test_a_delete_removes_copies_in_every_bucket_and_scans_honour_it(tmp_path: Path) -> None:
    gens = Generations(lambda: 1.0)
    root = tmp_path / "d"
    t = _disk(root, gens)
    b = BlockId(NS, digest("two-buckets"))
    data = payload_for(b.key, 4096)
    assert t.put(b, data, bucket=5)
    # Another server wrote the key into another bucket, unseen by this index.
    (root / "tmp" / "other").mkdir(parents=True)
    write_block(
        root / "tmp" / "other", root / "buckets" / "7" / b.filename, b, data, created_at=0, bucket=7, gen=1
    )
    g = gens.next()
    gens.tombstone(b, g)
    assert t.delete(b, g)
    assert not list((root / "buckets").rglob("*.blk")), "no stale copy left to come back at a scan"
    # A copy older than a known tombstone is dropped by the start-up scan too.
    write_block(
        root / "tmp" / "other", root / "buckets" / "8" / b.filename, b, data, created_at=0, bucket=8, gen=2
    )
    assert read_header(root / "buckets" / "8" / b.filename).gen < g
    again = _disk(root, gens)
    assert again.scan() == 0
    assert not list((root / "buckets").rglob("*.blk"))


@pytest.mark.process
@pytest.mark.slow
def test_delete_racing_a_slow_write_back_never_resurrects_old_bytes(ns: str) -> None:
    # Every local-disk write sleeps 4 s before its rename (a configured I/O-delay hook, the code that
    # ships): store A, delete, store B, and the load must be B (or a miss) — never A.
    slow = {"tiers.local_disk.faults": {"write_delay_seconds": 4.0}}
    key = digest("race")
    a, b = payload_for(key, 256 * 1024, salt=b"A"), payload_for(key, 256 * 1024, salt=b"B")
    with cache_server(dram_bytes=16 * MiB, overrides=slow) as srv:
        with CacheClient(srv.unix_target, shared_memory=True) as c:
            assert c.store(ns, [key], [a], timeout=10).accepted == 1
            assert c.delete(ns, [key], timeout=5) == 1
            assert c.stats(timeout=5)["writeback_pending_bytes"] > 0, "the delete raced A's write-back"
            # A's write-back finishes (or gives up) after the delete.
            wait_until(lambda: c.stats(timeout=5)["writeback_pending_bytes"] == 0, what="A's write-back")
            assert c.load(ns, [key], timeout=10) == [], "deleted means a miss"
            assert c.store(ns, [key], [b], timeout=10).accepted == 1
            assert c.load(ns, [key], timeout=10) == [b]
            wait_until(lambda: c.stats(timeout=5)["writeback_pending_bytes"] == 0, what="B's write-back")
            assert c.stats(timeout=5)["counters"]["writes_superseded"]["local_disk"] == 1
        srv.restart()  # DRAM is gone: the load comes from local disk
        with CacheClient(srv.unix_target, shared_memory=True) as c:
            assert c.lookup(ns, [key], timeout=5).tiers == ["local_disk"]
            assert c.load(ns, [key], timeout=10) == [b]


@contextlib.contextmanager
def _pair(shared: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    with (
        cache_server(server_id="node-a", shared_dir=shared) as a,
        cache_server(server_id="node-b", shared_dir=shared) as b,
    ):
        yield a, b


@pytest.mark.process
@pytest.mark.slow
def test_a_delete_on_one_server_is_honoured_by_another_sharing_the_volume(ns: str, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    k1, k2 = digest("xdel", 1), digest("xdel", 2)
    p1, p2 = payload_for(k1, 128 * 1024), payload_for(k2, 128 * 1024)
    with _pair(shared) as (a, b):
        ca = CacheClient(a.unix_target, shared_memory=True)
        cb = CacheClient(b.unix_target, shared_memory=True)
        # B stores both keys: in its DRAM, its local disk and the shared volume.
        assert cb.store(ns, [k1, k2], [p1, p2], timeout=10).accepted == 2
        wait_until(lambda: cb.stats(timeout=5)["writeback_pending_bytes"] == 0, what="B's write-backs")
        wait_until(lambda: ca.lookup(ns, [k1, k2], timeout=5).matched == 2, what="A to see B's blocks")
        # Deleted through A while B runs: B drops its DRAM and local-disk copies too.
        assert ca.delete(ns, [k1], timeout=5) == 1
        wait_until(lambda: cb.lookup(ns, [k1], timeout=5).matched == 0, what="B to honour the delete")
        assert cb.load(ns, [k1], timeout=10) == []
        assert cb.stats(timeout=5)["tiers"]["local_disk"]["blocks"] == 1
        # Deleted through A while B is down: B's restarted index honours the tombstone.
        cb.close()
        b.stop()
        assert ca.delete(ns, [k2], timeout=5) == 1
        b.start()
        cb = CacheClient(b.unix_target, shared_memory=True)
        assert cb.lookup(ns, [k1, k2], timeout=5).matched == 0
        assert cb.load(ns, [k2], timeout=10) == []
        assert cb.load(ns, [k1], timeout=10) == []
        assert cb.stats(timeout=5)["tiers"]["local_disk"]["blocks"] == 0
        # A key stored again after the delete is served again, everywhere, once the delete margin
        # has passed (within it the key stays deleted: engine/ordering.py).
        wait_until(lambda: ca.store(ns, [k2], [p1], timeout=10).accepted == 1, what="the margin to pass")
        wait_until(lambda: cb.load(ns, [k2], timeout=10) == [p1], what="B to see the new store")
        ca.close()
        cb.close()
