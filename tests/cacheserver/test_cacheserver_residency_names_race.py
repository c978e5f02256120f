"""Names described right after a store reach the chunk's local-disk copy, however DRAM evicts meanwhile.

A connector describes each chunk on the feed socket right after storing it, while its write-back is
under way and DRAM evicts to make room for the next one (1 MiB chunks, 4 MiB DRAM: every store
evicts), and a few chunks only once their copies are on local disk already. Every chunk resident
on local disk must carry exactly the names it was described with: in the live feed, in its block
file and, after a SIGKILL and a restart with no connector describing anything again, from the
disk.
"""

from __future__ import annotations

import time

import pytest

from kvfabric.cacheserver.engine.blockfile import read_header_and_meta
from kvfabric.client import CacheClient
from kvfabric.client.residency import ResidencyFeedClient
from kvfabric.connector.keys import NamespaceSpec
from kvfabric.rpc.kvledger import ChunkMeta
from kvfabric.rpc.residency import Change, decode_meta, residency_socket_for
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, payload_for

pytestmark = [pytest.mark.process, pytest.mark.slow]

SPEC = NamespaceSpec("meta-llama/Llama-3.1-8B", "0e9e39f", "bfloat16", 32, 8, 128, 16, 256)
NS = SPEC.digest()
CHUNKS = 48
LATE = 8
SIZE = 1 * MiB
ROOMY = {"tiers.local_disk.min_free_fraction": 0.0}  # write-backs land whatever else fills the disk


def _meta(i: int) -> ChunkMeta:
    return ChunkMeta((i.to_bytes(32, "big"), (i + 1000).to_bytes(32, "big")), i, tuple(range(i, i + 32)), 16)


def _on_disk(srv: ServerProcess) -> dict[str, ChunkMeta | None]:
    """A fresh subscriber's snapshot: the names of every chunk it lists on local disk."""
    client = ResidencyFeedClient(residency_socket_for(srv.config.listen.unix_socket), NS)
    out: dict[str, ChunkMeta | None] = {}
    try:
        end = time.monotonic() + 30
        while time.monotonic() < end:
            for message in client.read(0.05):
                if message == ("synced", None):
                    return out
                if isinstance(message, Change) and message.op == "stored" and message.tier == "local_disk":
                    out[message.key] = message.meta
        raise AssertionError("no snapshot within 30 s")
    finally:
        client.close()


def _in_files(srv: ServerProcess) -> dict[str, ChunkMeta | None]:
    """The names every block file under the local disk's buckets carries (verified), per key."""
    disk = srv.config.tiers.local_disk
    assert disk is not None
    out: dict[str, ChunkMeta | None] = {}
    for path in (disk.path / "buckets").glob(f"*/{NS}_*.blk"):
        try:
            header, raw = read_header_and_meta(path)
        except FileNotFoundError:  # replaced by its rewrite meanwhile: read again
            return {}
        out[header.bid.key] = None if raw is None else decode_meta(raw)
    return out


def _assert_named(srv: ServerProcess, want: dict[str, ChunkMeta], what: str) -> None:
    """Every chunk on local disk, exactly as described (waiting out write-backs still under way)."""
    end = time.monotonic() + 15
    seen = _on_disk(srv)
    while seen != want and time.monotonic() < end:
        time.sleep(0.2)
        seen = _on_disk(srv)
    wrong = [k for k in want if seen.get(k, "absent") != want[k]]
    assert seen == want, f"{what}: {len(wrong)} of {len(want)} chunks not on local disk with their names"


def test_names_described_right_after_each_store_stay_with_every_disk_copy_through_a_sigkill() -> None:
    keys = [digest("race", i) for i in range(CHUNKS)]
    late = [digest("late", i) for i in range(LATE)]  # described only once their copies are on disk
    want = {k: _meta(i) for i, k in enumerate(keys + late)}
    with cache_server(dram_bytes=4 * MiB, local_disk_bytes=256 * MiB, overrides=ROOMY) as srv:
        feed = ResidencyFeedClient(residency_socket_for(srv.config.listen.unix_socket), NS)
        try:
            with CacheClient(srv.unix_target) as client:
                client.describe(NS, SPEC.canonical().decode(), timeout=10)
                for k in late:
                    assert client.store(NS, [k], [payload_for(k, SIZE)], timeout=10).accepted == 1
                    assert client.flush(NS, [k], timeout=10).tiers == [["local_disk"]]  # without names
                for k in keys:
                    assert client.store(NS, [k], [payload_for(k, SIZE)], timeout=10).accepted == 1
                    feed.describe(k, want[k])  # right after the store: its write-back is under way
                    feed.flush()
                for k in late:
                    feed.describe(k, want[k])
                feed.read(0.2)
        finally:
            feed.close()
        _assert_named(srv, want, "live feed")
        # The copies themselves carry them (names that arrived after a write-back are written in
        # the background: a SIGKILL before that loses them, as the docs say).
        end = time.monotonic() + 15
        while (files := _in_files(srv)) != want and time.monotonic() < end:
            time.sleep(0.2)
        wrong = [k for k in want if files.get(k, "absent") != want[k]]
        assert files == want, f"block files: {len(wrong)} of {len(want)} without their names"
        srv.kill()  # SIGKILL: the server's memory is gone; only the disk copies and their names remain
        srv.start()
        _assert_named(srv, want, "after a SIGKILL and a restart")
