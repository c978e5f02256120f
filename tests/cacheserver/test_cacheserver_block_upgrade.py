"""The upgrade promise of the block format: version-1 headers (written before generations) still read,
as generation 0 — an upgraded server keeps the blocks an older one left on its volumes, and a later
delete supersedes them, across a restart too. A block without names is still written as version 2."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
import xxhash

from kvfabric.cacheserver.engine.blockfile import (
    HEADER_SIZE,
    MAGIC,
    MAX_META_BYTES,
    BlockHeader,
    CorruptBlock,
    aligned_buffer,
    pack_header,
    payload_checksum,
    read_block_into,
    read_header,
    read_header_and_meta,
    unpack_header,
    write_block,
)
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.ttl import bucket_of
from kvfabric.client import CacheClient
from kvfabric.testing.serverproc import ServerProcess, digest, make_config, payload_for, temp_dir

NS = digest("upgrade")
# The version-1 header, as the servers before generations wrote it (blockfile.py's docstring, less
# the generation field).
V1 = struct.Struct("<8sHH32s32sQ16sdq")


def v1_header(bid: BlockId, payload: bytes, *, created_at: float, bucket: int) -> bytes:
    body = V1.pack(
        MAGIC,
        1,
        0,
        bytes.fromhex(bid.namespace),
        bytes.fromhex(bid.key),
        len(payload),
        payload_checksum(payload),
        created_at,
        bucket,
    )
    body += struct.pack("<Q", xxhash.xxh3_64_intdigest(body))
    return body.ljust(HEADER_SIZE, b"\0")


def test_a_version_1_header_reads_as_generation_0_and_a_damaged_one_is_corrupt() -> None:
    bid = BlockId(NS, digest("k"))
    payload = payload_for(bid.key, 4096)
    header = unpack_header(v1_header(bid, payload, created_at=12.5, bucket=3))
    assert header == BlockHeader(bid, len(payload), payload_checksum(payload), 12.5, 3, gen=0)
    # Any copy stored since carries a generation above 0, so it supersedes the old one.
    assert unpack_header(pack_header(BlockHeader(bid, 1, b"\0" * 16, 0.0, 3, gen=1))).gen > header.gen
    damaged = bytearray(v1_header(bid, payload, created_at=12.5, bucket=3))
    damaged[80] ^= 1  # inside the length field: the header checksum no longer matches
    with pytest.raises(CorruptBlock):
        unpack_header(bytes(damaged))


@pytest.mark.process
def test_an_upgraded_server_serves_version_1_blocks_and_a_delete_supersedes_them_for_good() -> None:
    with temp_dir() as work:
        shared = work / "shared"
        config = make_config(work, shared_dir=shared, local_disk_bytes=None)
        keys = [digest("v1", i) for i in range(3)]
        payloads = [payload_for(k, 64 * 1024) for k in keys]
        now = time.time()
        bucket = bucket_of(now, config.bucket_seconds)
        files: list[Path] = []
        for key, payload in zip(keys, payloads, strict=True):
            bid = BlockId(NS, key)
            path = shared / "buckets" / str(bucket) / bid.filename
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(v1_header(bid, payload, created_at=now, bucket=bucket) + payload)
            files.append(path)
        assert [read_header(f).gen for f in files] == [0, 0, 0]

        srv = ServerProcess(config, work)
        srv.start()
        try:
            client = CacheClient(srv.unix_target)
            assert client.lookup(NS, keys, timeout=10).matched == 3
            assert client.load(NS, keys, timeout=10) == payloads
            assert client.delete(NS, keys[:1], timeout=10) == 1
            assert client.lookup(NS, keys[:1], timeout=10).matched == 0
            assert not files[0].exists()
            client.close()
            # After a restart the old copies that were not deleted are still served, the deleted one
            # stays deleted.
            srv.stop()
            srv.start()
            client = CacheClient(srv.unix_target)
            assert client.lookup(NS, keys, timeout=10).matched == 0  # a prefix match: the first is gone
            assert client.load(NS, keys[1:], timeout=10) == payloads[1:]
            assert client.load(NS, keys[:1], timeout=10) == []
            client.close()
        finally:
            srv.stop()


V2 = struct.Struct("<8sHH32s32sQ16sdqQ")


def test_a_block_without_names_is_written_as_version_2_and_one_with_names_is_verified_apart(
    tmp_path: Path,
) -> None:
    """Blocks without names keep the version-2 bytes (a server before names reads them); names after
    the payload are bound to the header and checked on their own: damaged, they are dropped, and the
    payload still reads."""
    bid = BlockId(NS, digest("named"))
    payload = payload_for(bid.key, 10_000)
    plain = pack_header(BlockHeader(bid, len(payload), payload_checksum(payload), 1.5, 2, gen=7))
    body = V2.pack(
        MAGIC,
        2,
        0,
        bytes.fromhex(NS),
        bytes.fromhex(bid.key),
        len(payload),
        payload_checksum(payload),
        1.5,
        2,
        7,
    )
    assert plain == (body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))).ljust(HEADER_SIZE, b"\0")

    names = b"\x93names" * 100
    path = tmp_path / bid.filename
    header = write_block(tmp_path, path, bid, payload, created_at=1.5, bucket=2, gen=7, meta=names)
    assert header is not None
    assert path.stat().st_size == HEADER_SIZE + len(payload) + len(names) == header.file_size
    assert read_header(path) == header
    assert read_header_and_meta(path) == (header, names)
    buf = aligned_buffer(len(payload))
    try:
        read_block_into(path, bid, memoryview(buf), length=len(payload))
        assert buf[: len(payload)] == payload
    finally:
        buf.close()
    # The header checksum covers the names' length and checksum.
    raw = bytearray(path.read_bytes())
    raw[V2.size] ^= 1  # the first byte of meta_len
    with pytest.raises(CorruptBlock):
        unpack_header(bytes(raw[:HEADER_SIZE]))
    # Damaged names are dropped; the header and the payload still verify.
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    assert read_header_and_meta(path)[1] is None
    buf = aligned_buffer(len(payload))
    try:
        read_block_into(path, bid, memoryview(buf), length=len(payload))
        assert buf[: len(payload)] == payload
    finally:
        buf.close()
    with pytest.raises(ValueError, match="names"):
        write_block(tmp_path, path, bid, payload, created_at=1.5, bucket=2, meta=bytes(MAX_META_BYTES + 1))
