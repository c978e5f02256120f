"""A chunk that leaves every tier for a moment keeps its names (the in-process residency feed).

DRAM can evict a chunk before its write-back to local disk commits: for that moment no tier
indexes it. Its names must come back with the disk copy, not be dropped with the DRAM one.
"""

from __future__ import annotations

from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.transport.residencyfeed import _OVERHEAD, ResidencyFeed
from kvfabric.rpc.kvledger import ChunkMeta
from kvfabric.rpc.residency import encode_meta

NS = "ab" * 32
META = ChunkMeta((b"\x01" * 32, b"\x02" * 32), None, tuple(range(32)), 16)


def test_names_of_a_chunk_evicted_from_dram_before_its_write_back_landed_return_with_the_disk_copy() -> None:
    bid = BlockId(NS, "cd" * 32)
    tiers: dict[BlockId, list[str]] = {}
    feed = ResidencyFeed(lambda b: tiers.get(b, []))
    named: list[BlockId] = []
    feed.on_named = named.append
    tiers[bid] = ["dram"]
    feed.changed([bid])
    feed.describe(bid, META)
    assert feed.encoded(bid) == encode_meta(META)
    assert named == [bid]  # a resident chunk's new names are handed on (the disk rewrites its copy)
    tiers[bid] = []  # DRAM evicted it; the write-back has not committed yet
    feed.changed([bid])
    assert feed.encoded(bid) is None  # in no tier: nothing is announced
    tiers[bid] = ["local_disk"]
    feed.changed([bid])
    assert feed.encoded(bid) == encode_meta(META)
    stats = feed.stats()  # no subscriber, no record, nothing left pending, the names held once
    assert (stats.subscribers, stats.records, stats.pending_bytes) == (0, 0, 0)
    assert stats.names_bytes == len(encode_meta(META)) + _OVERHEAD


def test_names_restored_from_disk_are_not_handed_on_to_be_written_again() -> None:
    bid = BlockId(NS, "ef" * 32)
    feed = ResidencyFeed(lambda b: ["local_disk"])
    named: list[BlockId] = []
    feed.on_named = named.append
    feed.changed([bid])
    feed.restore(bid, encode_meta(META))
    assert feed.encoded(bid) == encode_meta(META)
    assert named == []
