"""The storage engine's pieces on temp dirs, without a server: block format, tiers, journal, TTL."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfabric.cacheserver.config import ServerConfig
from kvfabric.cacheserver.engine import blockfile
from kvfabric.cacheserver.engine.base import MissReason, Tier, read_miss_counter
from kvfabric.cacheserver.engine.blockfile import (
    HEADER_SIZE,
    BlockHeader,
    CorruptBlock,
    aligned_buffer,
    pack_header,
    read_block_into,
    read_block_to_fd,
    read_header,
    unpack_header,
    write_block,
)
from kvfabric.cacheserver.engine.disk import DiskTier
from kvfabric.cacheserver.engine.dram import DramTier
from kvfabric.cacheserver.engine.ids import BlockId, InvalidId, parse_ids
from kvfabric.cacheserver.engine.journal import Event, JournalReader, JournalWriter, parse_lines
from kvfabric.cacheserver.engine.tiered import TieredStore
from kvfabric.cacheserver.engine.ttl import SharedClock, bucket_of, expired_buckets, owner_of
from kvfabric.testing.serverproc import digest, open_descriptors, payload_for

NS = digest("engine")


def bid(i: object) -> BlockId:
    return BlockId.parse(NS, digest(i))


@given(
    length=st.integers(0, 2**40),
    created=st.floats(0, 2e9, allow_nan=False),
    bucket=st.integers(-(2**40), 2**40),
    checksum=st.binary(min_size=16, max_size=16),
)
def test_header_round_trip(length: int, created: float, bucket: int, checksum: bytes) -> None:
    h = BlockHeader(bid("h"), length, checksum, created, bucket)
    raw = pack_header(h)
    assert len(raw) == HEADER_SIZE
    assert unpack_header(raw) == h


def test_any_flipped_header_byte_is_detected() -> None:
    raw = bytearray(pack_header(BlockHeader(bid("x"), 10, b"\1" * 16, 1.0, 2)))
    for i in range(0, 8 + 2 + 2 + 32 + 32 + 8 + 16 + 8 + 8 + 8):
        bad = bytearray(raw)
        bad[i] ^= 0x01
        with pytest.raises(CorruptBlock):
            unpack_header(bytes(bad))


def test_block_write_read_and_payload_corruption(tmp_path: Path) -> None:
    (tmp_path / "tmp").mkdir()
    b = bid("rw")
    data = payload_for(b.key, 3 * 4096 + 17)
    path = tmp_path / "b" / b.filename
    h = write_block(tmp_path / "tmp", path, b, data, created_at=5.0, bucket=7)
    assert not list((tmp_path / "tmp").iterdir()), "temp file renamed away"
    assert read_header(path) == h
    buf = aligned_buffer(len(data))
    for direct in (True, False):
        assert read_block_into(path, b, memoryview(buf), direct=direct).length == len(data)
        assert bytes(buf[: len(data)]) == data
    with pytest.raises(CorruptBlock, match="holds"):
        read_block_into(path, bid("other"), memoryview(buf))
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + len(data) - 1)
        f.write(b"\0" if data[-1] else b"\1")
    with pytest.raises(CorruptBlock, match="checksum"):
        read_block_into(path, b, memoryview(buf))
    os.truncate(path, HEADER_SIZE + 10)
    with pytest.raises(CorruptBlock):
        read_header(path)
    buf.close()


PIECE = blockfile._PIPE_PIECE


@pytest.mark.parametrize(
    "size", [0, 1, 4095, 4096, 4097, PIECE - 1, PIECE, PIECE + 1, 3 * PIECE + 17], ids=lambda n: f"{n}B"
)
def test_the_overlapped_read_into_a_memfd_gives_the_verified_bytes_of_every_size(
    tmp_path: Path, size: int
) -> None:
    (tmp_path / "tmp").mkdir()
    b = bid(("fd", size))
    data = payload_for(b.key, size)
    path = tmp_path / "b" / b.filename
    write_block(tmp_path / "tmp", path, b, data, created_at=5.0, bucket=7)
    for direct in (True, False):
        fd = os.memfd_create("t", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            assert read_block_to_fd(path, b, fd, direct=direct).length == size
            assert os.pread(fd, size + 1, 0) == data
        finally:
            os.close(fd)


def test_the_overlapped_read_refuses_corrupt_truncated_and_foreign_blocks(tmp_path: Path) -> None:
    (tmp_path / "tmp").mkdir()
    b = bid("fd-bad")
    data = payload_for(b.key, 2 * PIECE + 4096 * 3 + 5)
    path = tmp_path / "b" / b.filename
    write_block(tmp_path / "tmp", path, b, data, created_at=5.0, bucket=7)
    threads = set(threading.enumerate())

    def read() -> None:
        fd = os.memfd_create("t", os.MFD_CLOEXEC)
        try:
            read_block_to_fd(path, b, fd)
        finally:
            os.close(fd)

    with pytest.raises(CorruptBlock, match="holds"):
        read_block_to_fd(path, bid("other"), 0)
    # A header whose length is not the index's: refused before a byte is written (the destination
    # never grows past what its caller sized).
    fd = os.memfd_create("t", os.MFD_CLOEXEC)
    try:
        with pytest.raises(ValueError, match="index says"):
            read_block_to_fd(path, b, fd, length=len(data) - 1)
        assert os.fstat(fd).st_size == 0
    finally:
        os.close(fd)
    with open(path, "r+b") as f:  # one byte of the middle piece
        f.seek(HEADER_SIZE + PIECE + 7)
        f.write(b"\0" if data[PIECE + 7] else b"\1")
    with pytest.raises(CorruptBlock, match="checksum"):
        read()
    os.truncate(path, HEADER_SIZE + PIECE + 5)
    with pytest.raises(CorruptBlock, match="truncated"):
        read()
    # A write that fails (here: a read-only descriptor) raises, and stops the reading thread.
    with open(path, "r+b") as f:
        f.truncate(0)
    write_block(tmp_path / "tmp", path, b, data, created_at=5.0, bucket=7)
    ro = os.open(path, os.O_RDONLY)
    try:
        # Not an OSError: a tier must never take the destination's failure for its own copy's.
        with pytest.raises(blockfile.DestinationFailed, match="Bad file descriptor"):
            read_block_to_fd(path, b, ro)
    finally:
        os.close(ro)
    assert [t.name for t in threading.enumerate() if t not in threads] == []  # every reader stopped


def _dram_and_disk(tmp_path: Path, *, dram: int, disk: int, max_payload: int, **more: object) -> ServerConfig:
    """A server configuration with a DRAM and a local-disk tier under ``tmp_path``."""
    return ServerConfig.model_validate(
        {
            "server_id": "unit",
            "listen": {"unix_socket": str(tmp_path / "s.sock")},
            "tiers": {
                "dram": {"capacity_bytes": dram},
                "local_disk": {"path": str(tmp_path / "local"), "capacity_bytes": disk},
            },
            "limits": {"max_payload_bytes": max_payload},
            **more,
        }
    )


@contextmanager
def _on_disk_only(tmp_path: Path, name: str, size: int) -> Iterator[tuple[TieredStore, BlockId, bytes]]:
    """A started DRAM-and-disk store holding one block of ``size`` bytes on its disk only."""
    store = TieredStore(_dram_and_disk(tmp_path, dram=64 << 20, disk=64 << 20, max_payload=16 << 20))
    store.start()
    try:
        b = bid(name)
        data = payload_for(b.key, size)
        assert store.put(b, data)
        assert store.flush()
        assert store.tier("dram").delete(b)
        yield store, b, data
    finally:
        store.close()


def test_a_promotion_whose_dram_side_fails_keeps_the_disk_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    with _on_disk_only(tmp_path, "dram-full", 2 * PIECE + 5) as (store, b, data):  # overlapped path
        real = os.pwrite

        def full(*_a: object) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")  # memory for the memfd ran out

        monkeypatch.setattr(os, "pwrite", full)
        assert store.ensure_dram(b) is None  # a miss for DRAM...
        monkeypatch.setattr(os, "pwrite", real)
        assert store.tier("local_disk").contains(b)  # ...and the disk copy is still there
        handle = store.open_block(b)
        assert handle is not None
        assert handle.read() == data
        handle.close()


def test_a_read_error_half_way_through_a_promotion_is_a_miss_and_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The disk fails (EIO) on the second piece of the overlapped read, while the first is being
    # checksummed and written: the promotion is a miss counted as an I/O error, no DRAM block and no
    # memfd is left, the reading thread has stopped and its piece buffers went back to the spares.
    import errno

    with _on_disk_only(tmp_path, "eio", 3 * PIECE + 5) as (store, b, _):  # overlapped, four pieces
        real = os.preadv
        reads: list[int] = []

        def failing(fd: int, buffers: list[memoryview], offset: int) -> int:
            if threading.current_thread().name == "kvfabric-block-read":
                reads.append(offset)
                if offset >= HEADER_SIZE + PIECE:
                    raise OSError(errno.EIO, "Input/output error")
            return real(fd, buffers, offset)

        threads = set(threading.enumerate())
        fds = open_descriptors()
        spares = blockfile._spare_pieces.qsize()
        monkeypatch.setattr(os, "preadv", failing)
        assert store.ensure_dram(b) is None
        monkeypatch.setattr(os, "preadv", real)
        assert reads == [HEADER_SIZE, HEADER_SIZE + PIECE]  # it failed half-way, and read no further
        assert store.dram.slot(b) is None
        assert store.tier("dram").usage().used_bytes == 0
        assert store.counters.get(read_miss_counter(MissReason.IO_ERROR), "local_disk") == 1
        assert [t.name for t in threading.enumerate() if t not in threads] == []  # none started and left
        # No descriptor opened meanwhile is still open (one this process closed meanwhile, on another
        # thread, is no leak: a count that came out one lower failed this once).
        assert {fd: what for fd, what in open_descriptors().items() if fds.get(fd) != what} == {}
        # Every piece buffer the read took (spares first) is a spare again, none lost.
        kept = min(max(spares, blockfile._PIPE_DEPTH), blockfile._SPARE_MAX)
        assert blockfile._spare_pieces.qsize() == kept


def test_ids_reject_everything_but_hex_digests() -> None:
    for bad in ("", "a" * 63, "A" * 64, "../" * 21 + "a", "a" * 62 + " a", "\u0660" * 64):
        with pytest.raises(InvalidId):
            parse_ids(NS, [digest(1), bad])
        with pytest.raises(InvalidId):
            BlockId.parse(bad, digest(1))
    ids = parse_ids(NS, [digest(1), digest(2)])
    assert ids == [BlockId(NS, digest(1)), BlockId(NS, digest(2))]
    assert BlockId.from_filename(ids[0].filename) == ids[0]
    assert BlockId.from_filename("../" + ids[0].filename[3:]) is None


def test_dram_tier_lru_and_budget(tmp_path: Path) -> None:
    tier: DramTier = DramTier(5 * 4096, high_watermark=1.0, low_watermark=0.6)
    as_tier: Tier = tier  # both tiers satisfy the one small interface (checked by mypy)
    assert as_tier.name == "dram"
    for i in range(5):
        assert tier.put(bid(i), payload_for(str(i), 4096))
    assert tier.slot(bid(0)) is not None  # touch 0: now most recently used
    assert tier.put(bid(5), payload_for("5", 4096))  # evicts down to 60 % first: 1, 2 go
    assert tier.usage().used_bytes <= 5 * 4096
    assert tier.contains(bid(0))
    assert not tier.contains(bid(1))
    assert not tier.contains(bid(2))
    assert tier.get(bid(5)) == payload_for("5", 4096)
    assert not tier.put(bid(9), b"x" * (6 * 4096)), "larger than the whole budget"
    # An evicted block's memfd is closed; a reader that opened it first keeps its bytes.
    handle = tier.open(bid(5))
    assert handle is not None
    assert tier.delete(bid(5))
    assert handle.read() == payload_for("5", 4096)
    handle.close()


def test_disk_tier_scan_refresh_evict_expire(tmp_path: Path) -> None:
    def tier() -> DiskTier:
        return DiskTier(
            "local_disk", tmp_path / "d", 6 * (HEADER_SIZE + 4096), server_id="me",
            high_watermark=1.0, low_watermark=0.5,
        )  # fmt: skip

    t = tier()
    as_tier: Tier = t
    assert as_tier.usage().capacity_bytes == t.capacity
    for i in range(4):
        assert t.put(bid(i), payload_for(str(i), 4096), bucket=10 + i // 2)
    (t.tmp_dir / "leftover.tmp").write_bytes(b"half a block")
    (tmp_path / "d" / "buckets" / "11" / "garbage.blk").write_bytes(b"not a block")
    t2 = tier()
    assert t2.scan() == 4
    assert not list(t2.tmp_dir.iterdir()), "leftover temp files are cleaned at start-up"
    assert t2.buckets() == [10, 11]
    assert t2.get(bid(3)) == payload_for("3", 4096)
    # A hit refreshes a block into the current bucket.
    assert t2.refresh(bid(0), 12)
    entry = t2.entry(bid(0))
    assert entry is not None
    assert entry.bucket == 12
    assert (tmp_path / "d" / "buckets" / "12" / bid(0).filename).exists()
    assert t2.get(bid(0)) == payload_for("0", 4096)
    # Filling past the budget evicts LRU down to the low watermark and never exceeds the high one.
    for i in range(4, 10):
        t2.put(bid(i), payload_for(str(i), 4096), bucket=12)
        assert t2.usage().used_bytes <= t2.usage().high_bytes
    # Whole-bucket expiry, claimed once.
    gone = t2.expire_bucket(12)
    assert gone is not None
    assert t2.expire_bucket(12) is None
    assert 12 not in t2.bucket_dirs()


def test_journal_tailing_partial_lines_and_truncation(tmp_path: Path) -> None:
    jdir = tmp_path / "journals"
    a = JournalWriter(jdir, "a")
    reader = JournalReader(jdir, "b")
    reader.skip_to_end()
    a.append([Event("P", bid(1), 5, 100), Event("D", bid(2))])
    with open(a.path, "ab") as f:
        f.write(b"X 7\nP 9 " + NS.encode())  # a torn, partial last line
    events = reader.poll()
    assert events == [Event("P", bid(1), 5, 100), Event("D", bid(2)), Event("X", bucket=7)]
    with open(a.path, "ab") as f:
        f.write(f" {bid(3).key} 42\n".encode())
    assert reader.poll() == [Event("P", bid(3), 9, 42)]
    # The owner restarts: its journal starts empty; the reader starts over.
    a.close()
    a = JournalWriter(jdir, "a")
    a.append([Event("D", bid(3))])
    assert reader.poll() == [Event("D", bid(3))]
    a.close()
    assert list(parse_lines(b"garbage\nP x y z w\nD " + NS.encode() + b" ../../etc\n")) == []


def test_bucket_ownership_is_rendezvous() -> None:
    servers = [f"node-{i}" for i in range(5)]
    owners = [owner_of(b, servers) for b in range(1000)]
    assert set(owners) == set(servers), "every server owns some buckets"
    # Losing a server moves only its buckets.
    survivors = servers[1:]
    for b, o in enumerate(owners):
        if o != servers[0]:
            assert owner_of(b, survivors) == o
    assert owner_of(1, []) is None


def test_expiry_arithmetic_and_clock(tmp_path: Path) -> None:
    assert bucket_of(7199.9, 3600) == 1
    # Bucket 1 covers [3600, 7200): expired when its end is a TTL ago.
    assert expired_buckets([0, 1, 2], 7200 + 3600, ttl_seconds=3600, bucket_seconds=3600) == [0, 1]
    assert expired_buckets([1], 7200 + 3599, ttl_seconds=3600, bucket_seconds=3600) == []
    clock = SharedClock(tmp_path / "clock")
    now = clock.now()
    assert now is not None
    assert abs(now - (tmp_path / "clock").stat().st_mtime) < 5
    # An unreachable clock file means "unknown": nothing may expire.
    (tmp_path / "not-a-dir").write_text("a file where a directory should be")
    broken = SharedClock(tmp_path / "not-a-dir" / "clock")
    assert not broken.sync()
    assert broken.now() is None


def test_journal_rotation_keeps_tailers_consistent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfabric.cacheserver.engine import journal

    monkeypatch.setattr(journal, "MAX_JOURNAL_BYTES", 600)
    jdir = tmp_path / "journals"
    w = JournalWriter(jdir, "a")
    r = JournalReader(jdir, "b")
    seen: list[Event] = []
    for i in range(12):  # ~140 bytes each: the journal is truncated several times
        w.append([Event("P", bid(i), 1, i)])
        seen.extend(r.poll())
    assert w.path.stat().st_size <= 600
    assert seen == [Event("P", bid(i), 1, i) for i in range(12)], "a tailer polling often misses nothing"
    w.close()


def test_tiered_store_writes_back_promotes_and_expires_local_buckets(tmp_path: Path) -> None:
    import time

    from kvfabric.cacheserver.engine.tiered import TieredStore

    cfg = _dram_and_disk(
        tmp_path,
        dram=1 << 20,
        disk=1 << 22,
        max_payload=1 << 20,
        ttl_seconds=1,
        bucket_seconds=1,
        janitor_interval_seconds=3600,  # ticks are driven by the test
    )
    store = TieredStore(cfg)
    store.start()
    try:
        b = bid("tiered")
        data = payload_for(b.key, 10_000)
        assert store.put(b, data)
        assert store.flush()
        assert store.lookup([b]) == ["dram"]
        local = store.tier("local_disk")
        assert local.contains(b)
        # Out of DRAM: the next load promotes from local disk, verified.
        assert store.tier("dram").delete(b)
        assert store.lookup([b]) == ["local_disk"]
        handle = store.open_block(b)
        assert handle is not None
        assert not isinstance(handle, bytes)
        assert handle.read() == data
        handle.close()
        assert store.lookup([b]) == ["dram"]
        # Once its bucket is more than a TTL old, the janitor deletes it from disk (DRAM keeps its copy).
        deadline = time.monotonic() + 30
        while local.contains(b) and time.monotonic() < deadline:
            time.sleep(0.2)
            store.janitor_tick()
        assert not local.contains(b)
        assert store.counters.get("expirations", "local_disk") == 1
        assert store.lookup([b]) == ["dram"]
    finally:
        store.close()


def test_put_sealed_owns_the_memfd_takes_only_a_sealed_one_and_writes_it_back(tmp_path: Path) -> None:
    """A staging memfd becomes the block itself; refused or dropped, its descriptor is closed all the same."""
    from kvfabric.cacheserver.engine.dram import OpenBlock, new_memfd, seal
    from kvfabric.cacheserver.engine.tiered import TieredStore

    def memfd(data: bytes, *, sealed: bool = True) -> int:
        fd = new_memfd("test", len(data))
        assert fd is not None
        os.pwrite(fd, data, 0)
        if sealed:
            seal(fd)
        return fd

    def closed(fd: int) -> bool:
        try:
            os.fstat(fd)
        except OSError:
            return True
        return False

    cfg = _dram_and_disk(
        tmp_path, dram=1 << 20, disk=1 << 22, max_payload=1 << 20, janitor_interval_seconds=3600
    )
    store = TieredStore(cfg)
    store.start()
    try:
        good, unsealed, short, frozen = (bid(f"sealed-{i}") for i in range(4))
        data = payload_for(good.key, 10_000)
        fd = memfd(data)
        ino = os.fstat(fd).st_ino
        assert store.put_sealed(good, fd, len(data))
        handle = store.open_block(good)
        assert handle is not None
        with handle:
            assert isinstance(handle, OpenBlock)
            assert handle.read() == data
            assert os.fstat(handle.fd).st_ino == ino  # the memfd itself, not a copy
        assert store.flush()
        assert store.tier("local_disk").contains(good)  # written back like any put
        # An unsealed memfd (it could still change) or one of another length is refused, and closed.
        for b, fd, n in (
            (unsealed, memfd(data, sealed=False), len(data)),
            (short, memfd(data), len(data) + 1),
        ):
            assert not store.put_sealed(b, fd, n)
            assert closed(fd)
            assert store.lookup([b]) == []
        # Frozen for a hand-over: dropped, and closed.
        assert store.freeze(5)
        fd = memfd(data)
        assert not store.put_sealed(frozen, fd, len(data))
        assert closed(fd)
        store.thaw(reclaim=False)
    finally:
        store.close()


def test_a_store_whose_write_back_finds_no_descriptor_is_stored_and_only_the_write_back_dropped(
    tmp_path: Path,
) -> None:
    """Out of descriptors when its write-back is queued (a real ``EMFILE``), a store still succeeds."""
    import resource

    from kvfabric.cacheserver.engine.dram import new_memfd, seal
    from kvfabric.cacheserver.engine.tiered import TieredStore

    cfg = _dram_and_disk(
        tmp_path, dram=1 << 20, disk=1 << 22, max_payload=1 << 20, janitor_interval_seconds=3600
    )
    store = TieredStore(cfg)
    store.start()
    try:
        b = bid("no-descriptor")
        data = payload_for(b.key, 10_000)
        fd = new_memfd("test", len(data))
        assert fd is not None
        os.pwrite(fd, data, 0)
        seal(fd)
        dropped = store.counters.get("dropped_writebacks")
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        lowest = os.dup(0)
        os.close(lowest)
        # No descriptor numbered from the lowest free one on: the write-back's duplicate fails.
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))
        try:
            stored = store.put_sealed(b, fd, len(data))  # before: OSError(EMFILE) out of the store
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert stored
        assert store.counters.get("dropped_writebacks") == dropped + 1
        handle = store.open_block(b)
        assert handle is not None
        with handle:
            assert handle.read() == data
    finally:
        store.close()


def test_staging_pages_the_server_cannot_allocate_drop_the_key_and_committed_ones_leave_the_arena(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of memory at ``ShmStoreBegin`` (the server allocates staging pages there) is a dropped key."""
    import errno

    from kvfabric.cacheserver.engine.stats import Counters
    from kvfabric.cacheserver.engine.tiered import TieredStore
    from kvfabric.cacheserver.transport.arena import StagingArena
    from kvfabric.client.blocks import write_all

    counters = Counters()
    arena = StagingArena(1 << 20, 30.0, counters)
    keys = [bid(f"staged-{i}") for i in range(2)]
    real = os.posix_fallocate

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "no space")

    monkeypatch.setattr(os, "posix_fallocate", full)
    res = arena.begin(keys, [8192, 8192], [False, False])
    assert (res.names, res.dropped, arena.used_bytes) == (["", ""], 2, 0)
    monkeypatch.setattr(os, "posix_fallocate", real)
    store = TieredStore(_dram_and_disk(tmp_path, dram=1 << 20, disk=1 << 22, max_payload=1 << 20))
    store.start()
    try:
        res = arena.begin(keys, [8192, 8192], [False, False])
        assert res.dropped == 0
        assert arena.used_bytes == 2 * 8192
        for name, b in zip(res.names, keys, strict=True):
            got = arena.dup_by_name(name)
            assert got is not None
            assert os.fstat(got[0]).st_blocks * 512 >= 8192  # allocated before the client writes
            write_all(got[0], memoryview(payload_for(b.key, 8192)))
        assert arena.commit(res.lease_id, store) == (2, 0, 2 * 8192)
        assert arena.used_bytes == 0  # the blocks are the DRAM tier's now, not staging
        for b in keys:
            handle = store.open_block(b)
            assert handle is not None
            with handle:
                assert handle.read() == payload_for(b.key, 8192)
    finally:
        store.close()
        arena.close()


def _resident_pages(path: Path) -> list[bool]:
    """Which pages of ``path`` are in the page cache now (``mincore`` of a mapping nobody touches)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            vec = ctypes.create_string_buffer(pages)
            assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
            return [bool(b & 1) for b in vec.raw[:pages]]
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def test_a_write_back_from_dram_puts_no_copy_of_the_payload_into_the_page_cache(tmp_path: Path) -> None:
    """The write-back writes a block's whole pages with O_DIRECT: no copy into the page cache.

    Reads of a tier are O_DIRECT, so a cached copy would only cost a pass over the bytes and push
    other files out of the cache. Only the header page and the last, partial page go through it.
    """
    from kvfabric.cacheserver.engine.tiered import TieredStore

    probe = tmp_path / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        pytest.skip(f"{tmp_path} has no O_DIRECT (tmpfs?): the write is buffered there by design")
    size = 2 * (1 << 20) + 100
    cfg = _dram_and_disk(tmp_path, dram=8 << 20, disk=16 << 20, max_payload=4 << 20)
    store = TieredStore(cfg)
    store.start()
    try:
        b = bid("direct")
        data = payload_for(b.key, size)
        assert store.put(b, data)
        assert store.flush()
        (path,) = (tmp_path / "local").rglob("*.blk")
        resident = _resident_pages(path)
        whole = size // blockfile.ALIGN
        assert not any(resident[1 : 1 + whole]), (
            f"{sum(resident[1 : 1 + whole])} of {whole} payload pages cached"
        )
        # And it reads back verified, from the disk (DRAM emptied).
        assert store.tier("dram").delete(b)
        handle = store.open_block(b)
        assert handle is not None
        with handle:
            assert handle.read() == data
    finally:
        store.close()
