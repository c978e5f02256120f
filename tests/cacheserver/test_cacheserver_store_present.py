"""A store is skipped as "already here" only if the copy is: a stale shared-volume entry is not one.

Two real servers share a volume. Server B knows a block from A's journal; the file then goes from
the volume without B hearing of it (its ``D`` record lost: a journal that started over, an admin).
A client storing that block through B must not be told it is already there: it would skip a block
the tier no longer has, and the next load would miss.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfabric.client import CacheClient
from kvfabric.testing.serverproc import MiB, cache_server, digest, payload_for, wait_until

pytestmark = [pytest.mark.process, pytest.mark.slow]


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "grpc"])
def test_a_store_over_a_stale_shared_volume_entry_is_stored(
    ns: str, tmp_path: Path, shared_memory: bool
) -> None:
    shared = tmp_path / "shared"
    key = digest("stale-present", shared_memory)
    data = payload_for(key, 256 * 1024)
    with (
        cache_server(server_id="node-a", shared_dir=shared, local_disk_bytes=None) as a,
        cache_server(server_id="node-b", shared_dir=shared, local_disk_bytes=None) as b,
        CacheClient(a.unix_target, shared_memory=True) as ca,
        CacheClient(b.unix_target, shared_memory=shared_memory) as cb,
    ):
        assert ca.store(ns, [key], [data], timeout=10).accepted == 1
        wait_until(lambda: cb.lookup(ns, [key], timeout=5).tiers == ["shared"], what="B to learn A's block")
        (path,) = list((shared / "buckets").rglob("*.blk"))
        path.unlink()  # gone from the volume; B's index still lists it
        assert cb.store(ns, [key], [data], timeout=10).accepted == 1
        assert cb.lookup(ns, [key], timeout=5).tiers == ["dram"], "the store was skipped as already present"
        assert cb.load(ns, [key], timeout=10) == [data]
        assert cb.stats(timeout=5)["counters"]["stale_index"]["shared"] == 1


def test_a_store_of_a_block_that_is_on_the_volume_is_still_skipped(ns: str, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    key = digest("really-present")
    data = payload_for(key, 256 * 1024)
    with (
        cache_server(server_id="node-a", shared_dir=shared, local_disk_bytes=None, dram_bytes=64 * MiB) as a,
        cache_server(server_id="node-b", shared_dir=shared, local_disk_bytes=None, dram_bytes=64 * MiB) as b,
        CacheClient(a.unix_target, shared_memory=True) as ca,
        CacheClient(b.unix_target, shared_memory=True) as cb,
    ):
        assert ca.store(ns, [key], [data], timeout=10).accepted == 1
        wait_until(lambda: cb.lookup(ns, [key], timeout=5).tiers == ["shared"], what="B to learn A's block")
        assert cb.store(ns, [key], [data], timeout=10).accepted == 1
        # Skipped (the copy on the volume is there): nothing landed in B's DRAM.
        assert cb.lookup(ns, [key], timeout=5).tiers == ["shared"]
