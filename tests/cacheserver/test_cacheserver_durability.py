"""Crash safety and integrity, with real server processes on real files."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kvfabric.cacheserver.engine.blockfile import HEADER_SIZE
from kvfabric.client import CacheClient
from kvfabric.client.blocks import BlockChannel, close_all
from kvfabric.client.errors import CacheError
from kvfabric.rpc.blockproto import block_socket_for
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, payload_for, wait_until

pytestmark = [pytest.mark.process, pytest.mark.slow]


def _tmp_files(root: Path) -> list[Path]:
    return [p for p in (root / "tmp").rglob("*") if p.is_file()]


def _block_files(root: Path) -> list[Path]:
    return [p for p in (root / "buckets").rglob("*.blk")]


def _flush(srv: ServerProcess, ns: str, keys: list[str], timeout: float) -> tuple[list[list[str]], bool]:
    """The Flush RPC through the client: durable tiers per key, and whether every write-back finished."""
    with CacheClient(srv.unix_target) as c:
        res = c.flush(ns, keys, timeout=timeout)
    return res.tiers, res.complete


def test_flush_says_which_tiers_hold_a_store_durably(ns: str, tmp_path: Path) -> None:
    keys = [digest("flush", i) for i in range(3)]
    payloads = [payload_for(k, 64 * 1024) for k in keys]
    with (
        cache_server(shared_dir=tmp_path / "shared", dram_bytes=16 * MiB) as srv,
        CacheClient(srv.unix_target, shared_memory=True) as c,
    ):
        assert c.store(ns, keys, payloads, timeout=10).accepted == 3
        tiers, complete = _flush(srv, ns, [*keys, digest("never stored")], timeout=30)
        assert complete
        assert tiers == [["local_disk", "shared"]] * 3 + [[]]
    # DRAM only: acknowledged, not durable — and Flush says so.
    with (
        cache_server(dram_bytes=16 * MiB, overrides={"tiers.write_back": "none"}) as srv,
        CacheClient(srv.unix_target, shared_memory=True) as c,
    ):
        assert c.store(ns, keys, payloads, timeout=10).accepted == 3
        assert _flush(srv, ns, keys, timeout=10) == ([[]] * 3, True)
    # A write-back still running at the deadline: not durable yet, and the answer says incomplete.
    slow = {"tiers.local_disk.faults": {"write_delay_seconds": 5.0}}
    with (
        cache_server(dram_bytes=16 * MiB, overrides=slow) as srv,
        CacheClient(srv.unix_target, shared_memory=True) as c,
    ):
        assert c.store(ns, keys[:1], payloads[:1], timeout=10).accepted == 1
        assert _flush(srv, ns, keys[:1], timeout=1) == ([[]], False)
        assert _flush(srv, ns, keys[:1], timeout=30) == ([["local_disk"]], True)


def test_kill_9_during_store_storm_then_restart(ns: str, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    size = 1 * MiB + 123  # not page-aligned on purpose
    with cache_server(shared_dir=shared, dram_bytes=64 * MiB, local_disk_bytes=256 * MiB) as srv:
        client = CacheClient(srv.unix_target, shared_memory=True)
        remote = CacheClient(srv.tcp_target)
        stored: list[str] = []
        stop = threading.Event()

        def storm(c: CacheClient, tag: str) -> None:
            i = 0
            while not stop.is_set():
                keys = [digest(tag, i, j) for j in range(4)]
                i += 1
                try:
                    res = c.store(ns, keys, [payload_for(k, size) for k in keys], timeout=10)
                except CacheError:
                    return  # the server died under us
                if res.accepted:
                    stored.extend(keys)

        durable: set[str] = set()

        def flusher() -> None:
            # Ask, again and again, which stored keys are durable yet; keep those the server says are.
            while not stop.is_set():
                todo = [k for k in list(stored) if k not in durable][:64]
                if not todo:
                    stop.wait(0.05)
                    continue
                try:
                    tiers, _ = _flush(srv, ns, todo, timeout=2)
                except CacheError:
                    return  # the server died under us
                durable.update(k for k, held in zip(todo, tiers, strict=True) if held)

        workers = [threading.Thread(target=storm, args=(c, t)) for c, t in ((client, "shm"), (remote, "tcp"))]
        workers.append(threading.Thread(target=flusher))
        for w in workers:
            w.start()
        local_root = srv.config.tiers.local_disk.path  # type: ignore[union-attr]
        # Kill once blocks are landing on disk, i.e. in the middle of write-backs, and the flusher has
        # been told of some durable ones (fast write-backs can land 20 files before its first answer).
        wait_until(
            lambda: len(_block_files(local_root)) >= 20 and bool(durable),
            what="write-backs to reach disk and a flush to report some",
        )
        srv.kill()
        stop.set()
        for w in workers:
            w.join()
        client.close()
        remote.close()
        assert len(stored) >= 20

        srv.start()
        client = CacheClient(srv.unix_target, shared_memory=True)
        # The index is rebuilt from headers: blocks on disk are found without any load.
        on_disk = {p.name for p in _block_files(local_root)} | {p.name for p in _block_files(shared)}
        assert on_disk
        assert durable, "precondition: some stores were acknowledged durable before the kill"
        found = 0
        lost: list[str] = []
        for key in stored:
            res = client.lookup(ns, [key], timeout=5)
            loaded = client.load(ns, [key], timeout=30)
            if res.matched:
                assert res.tiers[0] in ("local_disk", "shared")
            if loaded:
                assert loaded[0] == payload_for(key, size), "a block that loads must be byte-identical"
                found += 1
            else:
                lost.append(key)
        # Every store acknowledged durable survived kill -9; every other one loads or is lost.
        assert not set(lost) & durable, "a store acknowledged durable was lost"
        assert found + len(lost) == len(stored)
        print(f"kill -9: {len(stored)} stored, {len(durable)} durable, {found} loaded, {len(lost)} lost")
        # Every block file that survived is whole: the right size and a valid checksum (loaded above).
        for p in _block_files(local_root) + _block_files(shared):
            assert p.stat().st_size == HEADER_SIZE + size
        assert not _tmp_files(local_root), "leftover temporary files were not cleaned"
        assert not _tmp_files(shared), "leftover temporary files were not cleaned"
        stats = client.stats(timeout=5)
        assert stats["tiers"]["local_disk"]["blocks"] + stats["tiers"]["shared"]["blocks"] >= found
        client.close()


def test_corrupted_block_is_detected_removed_and_reported_as_miss(ns: str) -> None:
    keys = [digest("corrupt", i) for i in range(3)]
    payloads = [payload_for(k, 256 * 1024 + i) for i, k in enumerate(keys)]
    with cache_server(dram_bytes=64 * MiB) as srv:
        with CacheClient(srv.unix_target, shared_memory=True) as c:
            assert c.store(ns, keys, payloads, timeout=10).accepted == 3
            root = srv.config.tiers.local_disk.path  # type: ignore[union-attr]
            wait_until(lambda: len(_block_files(root)) == 3, what="write-back")
        srv.stop()  # DRAM is gone after the restart, so loads must come from disk
        files = {p.name.split("_")[1][:64]: p for p in _block_files(root)}
        # Flip one payload byte of the second block, and one header byte of the third.
        for key, offset in ((keys[1], HEADER_SIZE + 1000), (keys[2], 100)):
            with open(files[key], "r+b") as f:
                f.seek(offset)
                b = f.read(1)
                f.seek(offset)
                f.write(bytes([b[0] ^ 0xFF]))
        srv.start()
        with CacheClient(srv.unix_target, shared_memory=True) as c:
            # The header-corrupt block is dropped by the start-up scan; the payload-corrupt one is
            # still indexed (headers only are read at start-up) until a load verifies it.
            assert c.lookup(ns, keys, timeout=5).matched == 2
            loaded = c.load(ns, keys, timeout=10)
            assert loaded == [payloads[0]], "a corrupt block must never be served"
            assert c.lookup(ns, keys, timeout=5).matched == 1
            assert not files[keys[1]].exists()
            assert not files[keys[2]].exists()
            stats = c.stats(timeout=5)
            assert stats["counters"]["checksum_failures"]["local_disk"] == 2
            assert c.health(timeout=5)


def test_filling_past_every_budget_stays_under_high_watermarks(ns: str, tmp_path: Path) -> None:
    size = 512 * 1024
    overrides = {
        "tiers.dram.high_watermark": 0.9,
        "tiers.dram.low_watermark": 0.5,
    }
    with (
        cache_server(
            shared_dir=tmp_path / "shared",
            dram_bytes=4 * MiB,
            local_disk_bytes=6 * MiB,
            shared_bytes=8 * MiB,
            overrides=overrides,
        ) as srv,
        CacheClient(srv.unix_target, shared_memory=True) as c,
        CacheClient(srv.tcp_target) as r,
    ):
        for i in range(40):
            keys = [digest("fill", i)]
            client = c if i % 2 else r
            res = client.store(ns, keys, [payload_for(keys[0], size)], timeout=10)
            assert res.accepted + res.dropped == 1
            stats = c.stats(timeout=5)
            for name, tier in stats["tiers"].items():
                assert tier["used_bytes"] <= tier["high_bytes"], f"{name} above its high watermark"
        wait_until(lambda: c.stats(timeout=5)["writeback_pending_bytes"] == 0, what="write-backs")
        stats = c.stats(timeout=5)
        for name, tier in stats["tiers"].items():
            assert tier["used_bytes"] <= tier["high_bytes"], f"{name} above its high watermark"
            assert tier["blocks"] > 0
        assert stats["counters"]["evictions"]["dram"] > 0
        assert stats["counters"]["evictions"]["local_disk"] > 0
        assert stats["counters"]["evictions"]["shared"] > 0
        # Disk usage on the filesystem agrees with the index.
        for name in ("local_disk", "shared"):
            root = getattr(srv.config.tiers, name).path
            on_disk = sum(p.stat().st_size for p in _block_files(root))
            assert on_disk <= stats["tiers"][name]["high_bytes"]
        # The most recent block is still loadable.
        last = digest("fill", 39)
        assert c.load(ns, [last], timeout=10) == [payload_for(last, size)]


def test_nearly_full_disk_refuses_writes_without_failing_stores(ns: str) -> None:
    # min_free_fraction 0.9999: the filesystem looks full, so every disk write is refused.
    with (
        cache_server(dram_bytes=8 * MiB, overrides={"tiers.local_disk.min_free_fraction": 0.9999}) as srv,
        CacheClient(srv.unix_target, shared_memory=True) as c,
    ):
        for i in range(10):
            key = digest("full", i)
            res = c.store(ns, [key], [payload_for(key, 1 * MiB)], timeout=10)
            assert res.accepted + res.dropped == 1
        wait_until(lambda: c.stats(timeout=5)["writeback_pending_bytes"] == 0, what="write-backs")
        stats = c.stats(timeout=5)
        assert stats["counters"]["writes_refused"]["local_disk"] >= 1
        assert stats["tiers"]["local_disk"]["blocks"] == 0
        root = srv.config.tiers.local_disk.path  # type: ignore[union-attr]
        assert not _block_files(root)
        assert not _tmp_files(root)
        assert c.health(timeout=5)
        key = digest("full", 9)
        assert c.load(ns, [key], timeout=10) == [payload_for(key, 1 * MiB)]


def test_client_that_dies_between_begin_and_commit_leaks_nothing(ns: str) -> None:
    import grpc

    from kvfabric.rpc.v1 import cache_pb2 as pb
    from kvfabric.rpc.v1 import cache_pb2_grpc as pb_grpc

    with cache_server(dram_bytes=16 * MiB, overrides={"shm.slot_lease_seconds": 0.5}) as srv:
        with grpc.insecure_channel(srv.unix_target) as ch:
            stub = pb_grpc.CacheStub(ch)  # type: ignore[no-untyped-call]
            keys = [digest("lease", i) for i in range(3)]
            resp = stub.ShmStoreBegin(
                pb.ShmStoreBeginRequest(namespace=ns, keys=keys, lengths=[4096] * 3), timeout=5
            )
            assert all(s.name for s in resp.slots)
            blocks = BlockChannel(block_socket_for(srv.config.listen.unix_socket))
            names = [slot.name for slot in resp.slots]

            def staged() -> list[bool]:
                fds = blocks.fetch(names, deadline=time.monotonic() + 5)
                close_all(fds)
                return [fd is not None for fd in fds]

            assert staged() == [True] * 3
            # Never commit: the lease expires and its staging memfds go away.
            wait_until(lambda: staged() == [False] * 3, what="lease reaping")
            blocks.close()
            with pytest.raises(grpc.RpcError) as err:
                stub.ShmStoreCommit(pb.ShmStoreCommitRequest(lease_id=resp.lease_id), timeout=5)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with CacheClient(srv.unix_target, shared_memory=True) as c:
            assert c.stats(timeout=5)["arena_used_bytes"] == 0
