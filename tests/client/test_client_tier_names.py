"""The client names every tier the proto defines, spelled as the server spells it."""

from __future__ import annotations

from kvfabric.cacheserver.engine.base import TierName
from kvfabric.client._common import TIER_NAMES, lookup_result, tier_name
from kvfabric.rpc.v1 import cache_pb2 as pb


def test_every_proto_tier_has_the_servers_name() -> None:
    proto_tiers = {v for v in pb.Tier.values() if v != pb.TIER_UNSPECIFIED}
    assert set(TIER_NAMES) == proto_tiers, "a tier added to the proto is named without touching the client"
    # The names are the server's TierName values (metric labels, stats keys), one for one.
    assert sorted(TIER_NAMES.values()) == sorted(t.value for t in TierName)
    for name in TierName:
        assert TIER_NAMES[pb.Tier.Value(f"TIER_{name.name}")] == name.value


def test_object_tier_is_named_and_an_unknown_tier_is_unknown() -> None:
    assert tier_name(pb.TIER_OBJECT) == "object"
    future = max(pb.Tier.values()) + 1  # a newer server's tier: wire-compatible, just not named here
    resp = pb.LookupResponse(matched=3, tiers=[pb.TIER_SHARED, pb.TIER_OBJECT, future])  # type: ignore[list-item]
    assert lookup_result(resp).tiers == ["shared", "object", "unknown"]
