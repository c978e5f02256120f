"""Kept mappings: a repeated same-node load copies from a kept mapping, and never a wrong byte.

What is promised (kvfabric.client.mappings, docs/performance.md "Kept mappings"):

- a repeated load of resident blocks sends nothing on the block socket (no fetch, no mapping);
- a kept mapping is used only for the block the server just named: an overwritten key loads the
  new bytes, a deleted one misses, a restarted server's blocks are new mappings;
- the client keeps at most its budget, and the server holds exactly what the client keeps plus the
  releases it has yet to send, under concurrent loads that evict each other's mappings.
"""

from __future__ import annotations

import mmap
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfabric.client import CacheClient
from kvfabric.client import blocks as blocks_mod
from kvfabric.client.mappings import MappingCache
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, payload_for, wait_until

NS = digest("mappings")


def _mapping(data: bytes) -> mmap.mmap:
    fd = os.memfd_create("kept", os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        return mmap.mmap(fd, len(data), prot=mmap.PROT_READ)
    finally:
        os.close(fd)


@pytest.mark.unit
def test_the_cache_keeps_its_budget_least_recently_used_first_and_queues_releases() -> None:
    cache = MappingCache(3 * 4096)
    for i in range(3):
        assert cache.keep(f"n{i}", _mapping(bytes([i]) * 4096), 4096, key=f"k{i}", epoch=0)
    out = memoryview(bytearray(4096))
    assert cache.copy("n0", 4096, out)  # n0 is now the most recently used
    assert bytes(out) == b"\0" * 4096
    assert cache.keep("n3", _mapping(b"\3" * 4096), 4096, key="k3", epoch=0)
    assert cache.kept_bytes == 3 * 4096
    assert not cache.copy("n1", 4096, out)  # the least recently used went
    assert cache.take_releases(10) == ["n1"]
    # A key's block under a new name: the old name is never named again, so it goes at once.
    assert cache.keep("n0b", _mapping(b"\7" * 4096), 4096, key="k0", epoch=0)
    assert not cache.copy("n0", 4096, out)
    assert cache.take_releases(10) == ["n0"]
    # Too large for the budget, or held on a connection that closed since: refused.
    assert not cache.keep("big", _mapping(b"b" * 4 * 4096), 4 * 4096, epoch=0)
    cache.clear()
    assert cache.take_releases(10) == []  # the closed connection released them all
    assert not cache.keep("late", _mapping(b"l" * 4096), 4096, epoch=0)
    assert len(cache) == 0


@pytest.mark.unit
def test_a_mapping_evicted_while_a_copy_reads_it_is_unmapped_when_the_copy_ends() -> None:
    cache = MappingCache(4096)
    assert cache.keep("a", _mapping(b"a" * 4096), 4096, epoch=0)
    kept = cache._kept["a"]
    reading, evicted = threading.Event(), threading.Event()

    class Target:
        """A copy destination that waits, mid-copy, until "a" was evicted."""

        def __setitem__(self, _index: slice, view: memoryview) -> None:
            reading.set()
            assert evicted.wait(10)
            assert not kept.mapping.closed  # still mapped while the copy reads it
            self.got = bytes(view[:4])

    target = Target()
    copier = threading.Thread(target=cache.copy, args=("a", 4096, target))
    copier.start()
    assert reading.wait(10)
    assert cache.keep("b", _mapping(b"b" * 4096), 4096, epoch=0)  # evicts "a" while it is read
    assert kept.doomed
    assert cache.take_releases(10) == []  # not released while still mapped
    evicted.set()
    copier.join(10)
    assert target.got == b"aaaa"
    assert kept.mapping.closed
    assert cache.take_releases(10) == ["a"]


@pytest.mark.unit
def test_releases_belong_to_their_connection_and_a_key_named_anew_drops_its_old_mapping() -> None:
    cache = MappingCache(4 * 4096)
    assert cache.keep("a", _mapping(b"a" * 4096), 4096, key="k", epoch=0)
    cache.named("k", "a")  # the same block named again: kept
    assert len(cache) == 1
    cache.named("k", "a2")  # the key's block has a new name: the old one can only pin memory
    assert len(cache) == 0
    assert cache.take_releases(10) == ["a"]
    # A mapping still being copied when its connection closes: its release, queued when the copy
    # ends, belongs to the closed connection and is never sent on the next one (where the same
    # block may be held again, by another load).
    assert cache.keep("b", _mapping(b"b" * 4096), 4096, epoch=0)
    kept = cache._kept["b"]
    with cache._lock:
        kept.users += 1
    cache.clear()
    with cache._lock:
        kept.users -= 1
    cache._close("b", kept)
    cache.release_later("c", epoch=0)  # a refused keep of the old connection: not sent either
    assert cache.take_releases(10) == []
    assert cache.pending_releases() == 0
    # Room is made before a hold is asked for, in page-rounded sizes like the server's.
    assert cache.keep("d", _mapping(b"d" * 4097), 4097, epoch=1)  # charged two pages
    assert cache.kept_bytes == 2 * 4096
    assert cache.keep("e", _mapping(b"e" * 4096), 4096, epoch=1)
    assert cache.make_room(4096)  # 3 pages kept + 1 fits the 4
    assert len(cache) == 2
    assert cache.make_room(2 * 4096)  # does not: the least recently used goes first
    assert cache.take_releases(10) == ["d"]
    assert not cache.make_room(5 * 4096)


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProcess]:
    with cache_server(dram_bytes=256 * MiB) as s:
        yield s


def _bufs(n: int, size: int) -> list[memoryview]:
    return [memoryview(bytearray(size)) for _ in range(n)]


@pytest.mark.process
def test_a_repeated_load_sends_nothing_on_the_block_socket(
    srv: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [digest("rep", i) for i in range(4)]
    payloads = [payload_for(k, 2 * MiB + 17) for k in keys]
    with CacheClient(srv.unix_target, shared_memory=True) as c:
        assert c.store(NS, keys, payloads, timeout=30).accepted == 4
        bufs = _bufs(4, 3 * MiB)
        assert c.load_into(NS, keys, bufs, timeout=30) == 4

        def no_requests(*_a: object, **_k: object) -> None:
            raise AssertionError("a repeated load fetched from the block socket")

        monkeypatch.setattr(blocks_mod.BlockChannel, "_exchange", no_requests)
        for b in bufs:
            b[:] = b"\0" * len(b)
        assert c.load_into(NS, keys, bufs, timeout=30) == 4
        assert [bytes(b[: len(p)]) for b, p in zip(bufs, payloads, strict=True)] == payloads


@pytest.mark.process
def test_kept_mappings_never_serve_an_overwritten_deleted_or_restarted_block() -> None:
    keys = [digest("ow", i) for i in range(3)]
    old = [payload_for(k, 1 * MiB) for k in keys]
    new = [payload_for(k, 1 * MiB, salt=b"new") for k in keys]
    with (
        cache_server(dram_bytes=64 * MiB) as srv,
        CacheClient(srv.unix_target, shared_memory=True) as c,
        CacheClient(srv.unix_target, shared_memory=True) as writer,
    ):
        assert writer.store(NS, keys, old, timeout=30).accepted == 3
        bufs = _bufs(3, MiB)
        assert c.load_into(NS, keys, bufs, timeout=30) == 3
        kept = c._blocks.maps  # type: ignore[union-attr]
        assert kept is not None
        assert len(kept) == 3
        # Replaced by another client (a delete, then a store of other bytes): the new block.
        assert writer.delete(NS, keys[:1], timeout=10) == 1
        # A store in the same clock tick as the delete is ordered before it (dropped): retry.
        wait_until(lambda: writer.store(NS, keys[:1], new[:1], timeout=30).accepted == 1, 10)
        assert c.load_into(NS, keys, bufs, timeout=30) == 3
        assert bytes(bufs[0]) == new[0]
        assert [bytes(b) for b in bufs[1:]] == old[1:]
        assert len(kept) == 3  # the old block's mapping went when its key named a new one
        # Deleted: a miss, though its mapping is still kept here.
        assert writer.delete(NS, keys[1:2], timeout=10) == 1
        assert c.load_into(NS, keys, bufs, timeout=30) == 1
        # Restarted: the old mappings go at the reconnect; the blocks come back from disk under new
        # names (key 1 stored anew), and each load returns what the server now has.
        expect = [new[0], new[1], old[2]]
        wait_until(lambda: writer.stats(timeout=10)["writeback_pending_bytes"] == 0, 30)
        srv.restart()
        wait_until(lambda: writer.store(NS, keys[1:2], new[1:2], timeout=30).accepted == 1, 10)
        epoch = kept.epoch
        for b in bufs:
            b[:] = bytes(len(b))
        assert c.load_into(NS, keys, bufs, timeout=30) == 3
        assert kept.epoch > epoch
        assert [bytes(b) for b in bufs] == expect


@pytest.mark.process
def test_concurrent_loads_with_a_small_budget_keep_the_server_and_client_books_equal() -> None:
    keys = [digest("cc", i) for i in range(12)]
    payloads = [payload_for(k, 256 * 1024 + 4096 * (i % 3)) for i, k in enumerate(keys)]
    with (
        cache_server(dram_bytes=64 * MiB) as srv,
        CacheClient(srv.unix_target, shared_memory=True, mapping_cache_bytes=5 * 256 * 1024) as c,
    ):
        assert c.store(NS, keys, payloads, timeout=30).accepted == 12
        errors: list[BaseException] = []

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            bufs = _bufs(4, 300 * 1024)
            try:
                for _ in range(60):
                    start = rng.randrange(0, 9)
                    got = c.load_into(NS, keys[start : start + 4], bufs, timeout=30)
                    assert got == 4
                    for b, p in zip(bufs, payloads[start : start + 4], strict=True):
                        assert bytes(b[: len(p)]) == p
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        maps = c._blocks.maps  # type: ignore[union-attr]
        assert maps is not None
        assert maps.kept_bytes <= maps.budget
        # Every release the client owes, sent: then the server holds exactly what the client keeps.
        c._blocks.flush_releases(deadline=time.monotonic() + 10)  # type: ignore[union-attr]
        held = c.stats(timeout=10)["tiers"]["dram"]["held_bytes"]
        page = 4096
        assert held == sum(-(-k.length // page) * page for k in maps._kept.values())
        assert held > 0


@pytest.mark.process
def test_with_the_budgets_equal_kept_mappings_keep_turning_over() -> None:
    # A client budget equal to the server's per-client hold budget: the client makes room before
    # it asks, so the server never refuses it, and blocks loaded late are kept too (not only the
    # first ones ever loaded).
    size = 256 * 1024
    keys = [digest("turn", i) for i in range(16)]
    payloads = [payload_for(k, size) for k in keys]
    with (
        cache_server(dram_bytes=64 * MiB, overrides={"shm.hold_bytes_per_client": 4 * size}) as srv,
        CacheClient(srv.unix_target, shared_memory=True, mapping_cache_bytes=4 * size) as c,
    ):
        assert c.store(NS, keys, payloads, timeout=30).accepted == 16
        maps = c._blocks.maps  # type: ignore[union-attr]
        assert maps is not None
        bufs = _bufs(1, size)
        for k, p in zip(keys, payloads, strict=True):
            assert c.load_into(NS, [k], bufs, timeout=30) == 1
            assert bytes(bufs[0]) == p
            assert maps._kept
            assert next(reversed(maps._kept.values())).key == f"{NS}/{k}"  # this one was kept
        assert len(maps) == 4
        c._blocks.flush_releases(deadline=time.monotonic() + 10)  # type: ignore[union-attr]
        assert c.stats(timeout=10)["tiers"]["dram"]["held_bytes"] == maps.kept_bytes == 4 * size


@pytest.mark.process
def test_an_older_client_gets_one_block_per_message() -> None:
    # Slots batched into one message would be read by a client that ignores ShmSlot.more as the
    # next key's block: only a request that asks for batching gets it.
    import grpc

    from kvfabric.rpc.v1 import cache_pb2 as pb
    from kvfabric.rpc.v1 import cache_pb2_grpc as pb_grpc

    keys = [digest("old", i) for i in range(3)]
    many = [digest("many", i) for i in range(257)]  # past one message's 256 slots
    with cache_server(dram_bytes=64 * MiB) as srv, CacheClient(srv.unix_target, shared_memory=True) as c:
        assert c.store(NS, keys, [payload_for(k, 8192) for k in keys], timeout=30).accepted == 3
        assert c.store(NS, many, [b"m"] * len(many), timeout=30).accepted == len(many)
        with grpc.insecure_channel(srv.unix_target) as ch:
            stub = pb_grpc.CacheStub(ch)  # type: ignore[no-untyped-call]
            old = list(stub.ShmLoad(pb.LoadRequest(namespace=NS, keys=keys), timeout=10))
            new = list(stub.ShmLoad(pb.LoadRequest(namespace=NS, keys=keys, batch_slots=True), timeout=10))
            split = list(stub.ShmLoad(pb.LoadRequest(namespace=NS, keys=many, batch_slots=True), timeout=10))
            one_by_one = list(stub.ShmLoad(pb.LoadRequest(namespace=NS, keys=many), timeout=10))
        assert [len(m.more) for m in old] == [0, 0, 0]
        assert [len(m.more) for m in new] == [2]
        assert [m.name for m in old] == [new[0].name, *(m.name for m in new[0].more)]
        assert [1 + len(m.more) for m in split] == [256, 1]
        assert [s.name for m in split for s in (m, *m.more)] == [m.name for m in one_by_one]  # key order


@pytest.mark.unit
def test_a_server_that_knows_no_holds_is_served_the_plain_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvfabric.cacheserver.transport import blocksock
    from kvfabric.rpc import blockproto as bp

    data = b"block" * 1000
    block = os.memfd_create("old-server", os.MFD_CLOEXEC)
    os.write(block, data)
    real_parse = bp.parse_request

    def older(raw: bytes) -> bp.Request | None:  # what a server before KVBH1 answered: bad request
        return None if raw.startswith(bp.HOLD_PREFIX) else real_parse(raw)

    monkeypatch.setattr(bp, "parse_request", older)  # the module the socket calls it in
    sock = blocksock.BlockSocket(tmp_path / "b.sock", lambda name: (os.dup(block), len(data)))
    sock.start()
    try:
        chan = blocks_mod.BlockChannel(sock.path, mapping_budget=1 << 20)
        target = memoryview(bytearray(len(data)))
        name = "d_" + "cd" * 16
        assert chan.copy_block(name, len(data), target, deadline=time.monotonic() + 10)
        assert bytes(target) == data
        assert chan.maps is None  # no more hold requests to this server
        assert chan.copy_block(name, len(data), target, deadline=time.monotonic() + 10)
        # The server upgraded (restarted): after the reconnect, holds are asked for again.
        monkeypatch.undo()
        chan.close()
        assert chan.copy_block(name, len(data), target, deadline=time.monotonic() + 10)
        assert _kept_by(chan) is not None
        chan.close()
    finally:
        sock.close()
        os.close(block)


@pytest.mark.process
def test_when_the_server_lends_the_client_gives_holds_back_and_they_keep_turning_over() -> None:
    # DRAM of 4 MiB: clients together may hold 2 MiB (16 blocks of 128 KiB), this client could keep
    # 64 MiB. Past 16 blocks the server lends; the client gives its oldest hold back each time, so
    # later blocks are held and kept too, and the books stay equal.
    size = 128 * 1024
    keys = [digest("lent", i) for i in range(24)]
    payloads = [payload_for(k, size) for k in keys]
    with (
        cache_server(dram_bytes=4 * MiB) as srv,
        CacheClient(srv.unix_target, shared_memory=True, mapping_cache_bytes=64 * MiB) as c,
    ):
        assert c.store(NS, keys, payloads, timeout=30).accepted == 24
        maps = c._blocks.maps  # type: ignore[union-attr]
        assert maps is not None
        bufs = _bufs(1, size)
        for k, p in zip(keys, payloads, strict=True):
            assert c.load_into(NS, [k], bufs, timeout=30) == 1
            assert bytes(bufs[0]) == p
        late = {kept.key for kept in maps._kept.values()} & {f"{NS}/{k}" for k in keys[16:]}
        assert late, "blocks loaded after the share filled were never kept"
        c._blocks.flush_releases(deadline=time.monotonic() + 10)  # type: ignore[union-attr]
        dram = c.stats(timeout=10)["tiers"]["dram"]
        assert dram["held_bytes"] == maps.kept_bytes <= 2 * MiB


def _kept_by(chan: blocks_mod.BlockChannel) -> MappingCache | None:
    """``chan.maps`` read afresh (a property that a reconnect changes; mypy keeps it narrowed)."""
    return chan.maps


@pytest.mark.unit
def test_a_release_queued_before_a_reconnect_is_not_sent_on_the_next_connection(tmp_path: Path) -> None:
    import socket

    from kvfabric.rpc import blockproto as bp

    path = tmp_path / "b.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(4)
    seen: list[bytes] = []

    def serve() -> None:
        first, _ = listener.accept()
        seen.append(first.recv(bp.MAX_MESSAGE))
        first.close()  # the connection breaks before any answer: the client reconnects
        second, _ = listener.accept()
        seen.append(second.recv(bp.MAX_MESSAGE))
        second.send(bytes([bp.GONE]))
        second.close()

    server = threading.Thread(target=serve)
    server.start()
    chan = blocks_mod.BlockChannel(path, mapping_budget=1 << 20)
    maps = chan.maps
    assert maps is not None
    stale = "d_" + "ee" * 16
    maps.release_later(stale, maps.epoch)
    wanted = "d_" + "ab" * 16
    assert not chan.copy_block(wanted, 4096, memoryview(bytearray(4096)), deadline=time.monotonic() + 10)
    server.join(10)
    chan.close()
    listener.close()
    assert stale.encode() in seen[0]  # it rode on the request to the connection that held it...
    assert stale.encode() not in seen[1]  # ...and not on the retry to the next one
    assert wanted.encode() in seen[1]


# --- lent loads: the caller reads the kept mapping itself (no copy) -----------------------------------


@pytest.mark.unit
def test_a_lent_mapping_is_never_unmapped_while_lent_and_its_release_is_queued_once() -> None:
    cache = MappingCache(2 * 4096)
    lease = cache.keep_lent("n0", _mapping(b"\1" * 4096), 4096, key="k0", epoch=0)
    assert lease is not None
    again = cache.borrow("n0", 4096)
    assert again is not None
    # Evicted while lent (two more blocks in a budget of two): the bytes stay readable.
    assert cache.keep("n1", _mapping(b"\2" * 4096), 4096, key="k1", epoch=0)
    assert cache.keep("n2", _mapping(b"\3" * 4096), 4096, key="k2", epoch=0, sealed=True)
    assert cache.borrow("n0", 4096) is None, "an evicted block is lent no more"
    assert bytes(lease.view) == b"\1" * 4096
    lease.release()
    lease.release()  # idempotent: a second release must not unmap under the other lease
    assert bytes(again.view) == b"\1" * 4096
    assert cache.take_releases(10) == [], "released to the server only once nobody reads it"
    again.release()
    assert cache.take_releases(10) == ["n0"]
    # Lent at once on keep: the same block kept twice lends the mapping already kept.
    dup = cache.keep_lent("n2", _mapping(b"\x09" * 4096), 4096, key="k2", epoch=0)
    assert dup is not None
    assert bytes(dup.view) == b"\3" * 4096
    dup.release()
    # A connection that closed since the hold: refused, nothing lent.
    assert cache.keep_lent("n4", _mapping(b"\4" * 4096), 4096, epoch=-1) is None


@pytest.mark.process
def test_concurrent_lent_loads_read_exactly_the_stored_bytes_and_leave_nothing_pinned() -> None:
    keys = [digest("lent", i) for i in range(12)]
    payloads = [payload_for(k, 256 * 1024 + 4096 * (i % 3)) for i, k in enumerate(keys)]
    with (
        cache_server(dram_bytes=64 * MiB) as srv,
        CacheClient(srv.unix_target, shared_memory=True, mapping_cache_bytes=5 * 256 * 1024) as c,
    ):
        assert c.lends
        assert c.store(NS, keys, payloads, timeout=30).accepted == 12
        errors: list[BaseException] = []

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(60):
                    start = rng.randrange(0, 9)
                    leases = c.load_views(NS, keys[start : start + 4], timeout=30)
                    try:
                        assert len(leases) == 4
                        for lease, p in zip(leases, payloads[start : start + 4], strict=True):
                            assert bytes(lease.view) == p
                    finally:
                        for lease in leases:
                            lease.release()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        maps = c._blocks.maps  # type: ignore[union-attr]
        assert maps is not None
        assert all(k.users == 0 for k in maps._kept.values()), "a released lease left a mapping pinned"
        assert maps.kept_bytes <= maps.budget
        c._blocks.flush_releases(deadline=time.monotonic() + 10)  # type: ignore[union-attr]
        held = c.stats(timeout=10)["tiers"]["dram"]["held_bytes"]
        assert held == sum(-(-k.length // 4096) * 4096 for k in maps._kept.values())
        assert held > 0
        # A missing key ends the lent prefix; nothing after it is lent.
        got = c.load_views(NS, [keys[0], digest("absent"), keys[1]], timeout=30)
        assert [bytes(x.view) for x in got] == [payloads[0]]
        got[0].release()


@pytest.mark.unit
def test_a_tensor_over_a_lease_outlives_the_release_and_eviction_without_reading_unmapped_memory() -> None:
    # torch.frombuffer holds a reference to the view, not a buffer export: unmapping the block when
    # its lease is released would leave the tensor pointing at unmapped memory (a segfault here).
    import torch

    cache = MappingCache(4096)
    lease = cache.keep_lent("n0", _mapping(b"\1" * 4096), 4096, epoch=0)
    assert lease is not None
    t = torch.frombuffer(lease.view, dtype=torch.uint8)
    assert cache.keep("n1", _mapping(b"\2" * 4096), 4096, epoch=0)  # evicts n0 while lent
    lease.release()
    assert cache.take_releases(10) == ["n0"], "the server's hold is released all the same"
    assert int(t.sum()) == 4096, "the tensor still reads the block's bytes"


@pytest.mark.unit
def test_an_unsealed_block_is_never_read_in_place(tmp_path: Path) -> None:
    # Lent bytes are verified first and scattered later: a block that could still be written in
    # between (a server that did not seal it) is copied privately instead.
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, b"\1" * 4096)
    channel = blocks_mod.BlockChannel(tmp_path / "none.sock", mapping_budget=1 << 20)
    maps = channel.maps
    assert maps is not None
    writer = os.dup(fd)
    try:
        lease = channel._lend_held(maps, "n0", 4096, key=None, fetched=(fd, True, maps.epoch))
        assert lease is not None
        os.pwrite(writer, b"\2" * 4096, 0)
        assert bytes(lease.view) == b"\1" * 4096, "the lent bytes changed after they were read"
        assert len(maps) == 0, "an unsealed block is not kept"
        lease.release()
        # Nor is one kept unsealed by a copying load (load_into) ever lent later.
        assert maps.keep("n1", _mapping(b"\3" * 4096), 4096, epoch=maps.epoch)
        assert maps.borrow("n1", 4096) is None
        assert maps.keep_lent("n1", _mapping(b"\3" * 4096), 4096, epoch=maps.epoch) is None
    finally:
        os.close(writer)
