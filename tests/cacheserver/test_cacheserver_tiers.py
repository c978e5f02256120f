"""The tier seam: tier names defined once, every tier behind the protocol, a new tier by configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvfabric.cacheserver.config import ServerConfig
from kvfabric.cacheserver.engine.base import BackingTier, TierName
from kvfabric.cacheserver.engine.disk import DiskTier
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.shared import SharedTier
from kvfabric.cacheserver.engine.tiered import TieredStore
from kvfabric.client import CacheClient
from kvfabric.rpc.v1 import cache_pb2 as pb
from kvfabric.testing import objecttier
from kvfabric.testing.serverproc import MiB, cache_server, digest, payload_for, wait_until

NS = digest("tiers")
OBJECT_TIER = "kvfabric.testing.objecttier:build"


def bid(i: object) -> BlockId:
    return BlockId.parse(NS, digest(i))


def test_tier_names_are_the_proto_enum() -> None:
    from kvfabric.cacheserver.service import _TIER_ENUM

    assert {f"TIER_{n.name}" for n in TierName} == set(pb.Tier.keys()) - {"TIER_UNSPECIFIED"}
    for name in TierName:
        assert pb.Tier.Name(_TIER_ENUM[name]) == f"TIER_{name.name}"


def test_every_backing_tier_satisfies_the_protocol() -> None:
    # Checked by mypy: the store composes these through BackingTier and nothing else.
    kinds: list[type[BackingTier]] = [DiskTier, SharedTier, objecttier.ObjectTier]
    assert len(kinds) == 3


def _config(tmp_path: Path, **tiers: Any) -> ServerConfig:
    return ServerConfig.model_validate(
        {
            "server_id": "unit",
            "listen": {"unix_socket": str(tmp_path / "s.sock")},
            "tiers": {"dram": {"capacity_bytes": 1 << 20}, **tiers},
            "janitor_interval_seconds": 3600,
            "limits": {"max_payload_bytes": 1 << 20},
        }
    )


def test_an_object_tier_is_one_module_plus_configuration(tmp_path: Path) -> None:
    bucket = f"seam-{tmp_path.name}"
    extra = [{"kind": OBJECT_TIER, "capacity_bytes": 1 << 22, "options": {"bucket": bucket}}]
    store = TieredStore(_config(tmp_path, extra=extra))
    store.start()
    try:
        b = bid("object")
        data = payload_for(b.key, 10_000)
        assert store.put(b, data)
        assert store.flush()
        assert store.tier(TierName.OBJECT).contains(b), "written back like any backing tier"
        assert store.stats()["tiers"]["object"]["blocks"] == 1
        # Out of DRAM: the lookup names the object tier, a load promotes from it.
        assert store.tier(TierName.DRAM).delete(b)
        assert store.lookup([b]) == [TierName.OBJECT]
        handle = store.open_block(b)
        assert handle is not None
        with handle:
            assert handle.read() == data
        assert store.lookup([b]) == [TierName.DRAM]
        assert store.counters.get("hits", "object") == 1
        # A delete reaches it, and nothing in flight brings the key back.
        assert store.delete(b)
        assert store.lookup([b]) == []
        assert not objecttier.buckets()[bucket].objects
    finally:
        store.close()


@pytest.mark.process
@pytest.mark.slow
def test_a_server_process_runs_a_configured_object_tier(ns: str) -> None:
    extra = [{"kind": OBJECT_TIER, "capacity_bytes": 64 * MiB}]
    keys = [digest("obj", i) for i in range(3)]
    payloads = [payload_for(k, 64 * 1024 + i) for i, k in enumerate(keys)]
    with (
        cache_server(local_disk_bytes=None, overrides={"tiers.extra": extra}) as srv,
        CacheClient(srv.unix_target, shared_memory=True) as c,
    ):
        assert c.store(ns, keys, payloads, timeout=10).accepted == 3
        wait_until(lambda: c.stats(timeout=5)["tiers"]["object"]["blocks"] == 3, what="write-back")
        assert c.stats(timeout=5)["counters"]["bytes_written"]["object"] == sum(map(len, payloads))
        assert c.load(ns, keys, timeout=10) == payloads
