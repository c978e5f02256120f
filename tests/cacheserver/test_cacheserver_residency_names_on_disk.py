"""A chunk's names (the residency metadata a connector attaches) are kept with its local-disk copy.

After a SIGKILL and a restart, a fresh subscriber's snapshot names the chunks the disk kept exactly
as the connector sent them, with no connector describing them again; names that fail their checksum
are dropped while the block still serves; another namespace on the server, and another pool's server
(its own directories), never see them. The names of resident chunks take at most
``limits.max_resident_names_bytes``, restored ones included; what is dropped is counted.
"""

from __future__ import annotations

import dataclasses
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from kvfabric.cacheserver.engine.blockfile import HEADER_SIZE, pack_header, unpack_header
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.transport.residencyfeed import ResidencyFeed
from kvfabric.client import CacheClient
from kvfabric.connector.keys import NamespaceSpec
from kvfabric.rpc.kvledger import ChunkMeta
from kvfabric.rpc.residency import encode_meta
from kvfabric.testing import feedfollower
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, payload_for, wait_until

pytestmark = [pytest.mark.process, pytest.mark.slow]

SPEC = NamespaceSpec("meta-llama/Llama-3.1-8B", "0e9e39f", "bfloat16", 32, 8, 128, 16, 256)
NS = SPEC.digest()
OTHER = NamespaceSpec("meta-llama/Llama-3.1-8B", "0e9e39f", "float16", 32, 8, 128, 16, 256).digest()
SIZE = 256 << 10
# Write-backs must land whatever else fills this machine's disk (the tier refuses below 5 % free).
ROOMY = {"tiers.local_disk.min_free_fraction": 0.0}
# What connectors send: bytes and integer hashes, a parent, extra keys (salt, multimodal), LoRA.
METAS = [
    ChunkMeta((b"\x01" * 32, b"\x02" * 32), None, tuple(range(8)), 4),
    ChunkMeta((7, 8), 6, tuple(range(100, 108)), 4, extra_keys=(("salt",), None), lora_name="a", lora_id=3),
    ChunkMeta((b"h",), b"\x02" * 32, (5, 6, 7, 2**32 - 1), 4, extra_keys=((("mm", 0),),)),
]


class Follower(feedfollower.Follower):
    """A follower that records a name dropped (a stored record without names) as None."""

    def __init__(self, srv: ServerProcess, namespace: str = NS) -> None:
        super().__init__(srv, namespace, keep_unnamed=True)


@pytest.fixture
def srv() -> Iterator[ServerProcess]:
    with cache_server(dram_bytes=8 * MiB, local_disk_bytes=64 * MiB, overrides=ROOMY) as s:
        yield s


def _store_named(srv: ServerProcess, keys: list[str], metas: list[ChunkMeta]) -> None:
    """Describe, then store, as a connector does (its names reach the server before the payload)."""
    f = Follower(srv)
    try:
        with CacheClient(srv.unix_target) as client:
            client.describe(
                NS, SPEC.canonical().decode(), timeout=10
            )  # a namespace the server knows keeps early names
            for key, meta in zip(keys, metas, strict=True):
                f.client.describe(key, meta)
            f.client.read(0.2)  # flushes what describe queued
            result = client.store(NS, keys, [payload_for(k, SIZE) for k in keys], timeout=10)
            assert result.accepted == len(keys)
        f.until(lambda: all(f.tiers.get(k) == {"dram", "local_disk"} for k in keys), "store and write-back")
        assert f.metas == dict(zip(keys, metas, strict=True))
    finally:
        f.close()


def _block_file(srv: ServerProcess, key: str) -> Path:
    disk = srv.config.tiers.local_disk
    assert disk is not None
    (path,) = (disk.path / "buckets").glob(f"*/{NS}_{key}.blk")
    return path


def test_names_kept_with_disk_copies_survive_a_sigkill_and_stay_in_their_namespace_and_pool(
    srv: ServerProcess,
) -> None:
    keys = [digest("named", i) for i in range(len(METAS))]
    _store_named(srv, keys, METAS)
    srv.kill()  # SIGKILL: nothing is flushed or handed over; DRAM and the server's memory are gone
    srv.start()
    g = Follower(srv)
    try:
        # No connector described anything to the new process: the names come from the disk.
        assert g.tiers == {k: {"local_disk"} for k in keys}
        assert g.metas == dict(zip(keys, METAS, strict=True))
    finally:
        g.close()
    # Another namespace on the same server sees none of them.
    other = Follower(srv, OTHER)
    try:
        assert other.tiers == {}
    finally:
        other.close()
    # Another pool's server (its own directories, as the operator renders them) has none of them.
    with cache_server(
        server_id="other", dram_bytes=8 * MiB, local_disk_bytes=64 * MiB, overrides=ROOMY
    ) as pool_b:
        h = Follower(pool_b)
        try:
            assert h.tiers == {}
            assert h.metas == {}
        finally:
            h.close()


def test_names_that_fail_their_checksum_are_dropped_and_the_block_still_serves(srv: ServerProcess) -> None:
    keys = [digest("damaged", 0), digest("intact", 0)]
    _store_named(srv, keys, METAS[:2])
    srv.stop()
    path = _block_file(srv, keys[0])
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # inside the names after the payload
    path.write_bytes(bytes(data))
    srv.start()
    g = Follower(srv)
    try:
        assert g.tiers == {k: {"local_disk"} for k in keys}
        # Dropped, never served wrongly; the other block's names are intact.
        assert g.metas == {keys[0]: None, keys[1]: METAS[1]}
    finally:
        g.close()
    with CacheClient(srv.unix_target) as client:
        # The payload has its own checksum: the block serves, byte for byte.
        assert client.load(NS, keys, timeout=10) == [payload_for(k, SIZE) for k in keys]


def _metric(srv: ServerProcess, name: str, label: str) -> float:
    with urllib.request.urlopen(f"{srv.metrics_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(value)
        for sample, _, value in (line.rpartition(" ") for line in text.splitlines())
        if sample.split("{")[0] == name and label in sample
    )


def test_names_with_a_valid_checksum_that_do_not_decode_are_dropped_counted_and_the_block_serves(
    srv: ServerProcess,
) -> None:
    keys = [digest("undecodable", 0), digest("intact", 1)]
    _store_named(srv, keys, METAS[:2])
    srv.stop()
    path = _block_file(srv, keys[0])
    data = bytearray(path.read_bytes())
    header = unpack_header(bytes(data[:HEADER_SIZE]))
    # Names of the same length that are no msgpack at all (0xc1 is never used), checksummed anew:
    # the scan reads them back as intact, the feed cannot decode them.
    junk = b"\xc1" * header.meta_length
    data[HEADER_SIZE + header.length :] = junk
    data[:HEADER_SIZE] = pack_header(dataclasses.replace(header, meta_sum=xxhash.xxh3_64_intdigest(junk)))
    path.write_bytes(bytes(data))
    srv.start()
    g = Follower(srv)
    try:
        assert g.tiers == {k: {"local_disk"} for k in keys}
        assert g.metas == {keys[0]: None, keys[1]: METAS[1]}
    finally:
        g.close()
    dropped = "kvfabric_residency_names_dropped_total"
    wait_until(lambda: _metric(srv, dropped, 'reason="undecodable"') == 1, what="the drop counted")
    assert _metric(srv, "kvfabric_cache_names_dropped_total", "") == 0  # their checksum held
    with CacheClient(srv.unix_target) as client:
        assert client.load(NS, keys, timeout=10) == [payload_for(k, SIZE) for k in keys]


def test_names_restored_from_disk_are_bounded_and_what_is_dropped_is_counted(srv: ServerProcess) -> None:
    """Names of resident chunks persist across restarts: restoring them honours the same bound."""
    keys = [digest("bounded", i) for i in range(len(METAS))]
    _store_named(srv, keys, METAS)
    srv.stop()
    sizes = sorted(len(encode_meta(m)) + 96 for m in METAS)  # each entry's bytes and its overhead
    bound = sizes[-1]  # room for any one of them, never for two
    assert sizes[0] + sizes[1] > bound
    srv.config.limits.max_resident_names_bytes = bound
    srv.start()
    g = Follower(srv)
    try:
        assert g.tiers == {k: {"local_disk"} for k in keys}  # every chunk still resident
        named = {k: m for k, m in g.metas.items() if m is not None}
        assert len(named) == 1
        ((key, meta),) = named.items()
        assert meta == METAS[keys.index(key)]
    finally:
        g.close()
    # (The feed's metrics are registered once every listener answers: wait for them.)
    dropped = "kvfabric_residency_names_dropped_total"
    wait_until(lambda: _metric(srv, dropped, "memory_bound") == 2, what="the drops counted")
    assert _metric(srv, "kvfabric_residency_names_bytes", "") <= bound
    with CacheClient(srv.unix_target) as client:  # unannounced, still served
        assert client.load(NS, keys, timeout=10) == [payload_for(k, SIZE) for k in keys]


def test_the_names_of_resident_chunks_take_at_most_their_bound_the_oldest_dropped_first() -> None:
    """Model of the bound: whatever is described, resident names stay within it; drops are counted."""
    resident: set[BlockId] = set()
    feed = ResidencyFeed(
        lambda bid: ["dram"] if bid in resident else [], known=lambda ns: True, max_names_bytes=4096
    )
    bids = [BlockId(NS, digest("n", i)) for i in range(40)]
    for i, bid in enumerate(bids):
        resident.add(bid)
        feed.changed([bid])
        feed.describe(bid, ChunkMeta((i,), None, tuple(range(i, i + 4)), 4))
        assert feed.names_bytes <= 4096
    kept = [bid for bid in bids if feed.encoded(bid) is not None]
    assert kept == bids[len(bids) - len(kept) :], "the newest are kept, the oldest dropped"
    assert feed.stats().names_dropped == {"undecodable": 0, "memory_bound": len(bids) - len(kept)}
    assert 0 < len(kept) < len(bids)
    # A chunk that leaves frees its names' bytes.
    before = feed.names_bytes
    resident.discard(kept[-1])
    feed.changed([kept[-1]])
    assert feed.names_bytes < before
    assert all(feed.encoded(b) is None for b in bids[: len(bids) - len(kept)])
