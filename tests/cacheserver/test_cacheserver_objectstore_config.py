"""The object-store tier's configuration: what a ConfigMap may say, and what it may not."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from pydantic import ValidationError

from kvfabric.cacheserver.config import ObjectStoreTierConfig
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.objectstore import object_path, parse_object_path, part_ranges

BASE: dict[str, Any] = {"endpoint": "http://127.0.0.1:8333", "bucket": "kv-cache", "capacity_bytes": 1 << 30}


def test_defaults_are_bounded_and_path_style() -> None:
    cfg = ObjectStoreTierConfig.model_validate(BASE)
    assert cfg.path_style
    assert cfg.prefix == "kvfabric"
    assert cfg.checksum == "sha256"
    assert cfg.max_retries <= 10
    assert cfg.request_timeout_seconds > 0


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"endpoint": "s3.amazonaws.com"}, "endpoint"),
        ({"endpoint": "http://host:9000/path"}, "endpoint"),
        ({"bucket": "Bad_Bucket"}, "bucket"),
        ({"prefix": "../escape"}, "prefix"),
        ({"prefix": "/abs"}, "prefix"),
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"part_bytes": 1024}, "part_bytes"),
        ({"max_retries": 100}, "max_retries"),
        ({"checksum": "md5"}, "checksum"),
        ({"low_watermark": 0.95, "high_watermark": 0.9}, "low_watermark"),
        ({"access_key_id_file": "/secret/ak"}, "secret_access_key_file"),
        ({"unknown": 1}, "unknown"),
    ],
)
def test_bad_settings_fail_naming_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        ObjectStoreTierConfig.model_validate({**BASE, **change})
    assert field in str(info.value)


def test_object_names_round_trip_and_reject_foreign_paths() -> None:
    bid = BlockId("a" * 64, "b" * 64)
    assert parse_object_path(object_path(bid, 42, 9)) == (bid, 42, 9)
    assert parse_object_path("pool/x/" + object_path(bid, 7, 1)) == (bid, 7, 1)
    for bad in [
        "blocks/zz/1/" + "b" * 64 + ".1",
        f"blocks/{'a' * 64}/x/{'b' * 64}.1",
        f"blocks/{'a' * 64}/1/{'b' * 64}",  # no generation
        f"blocks/{'a' * 64}/1/{'b' * 64}.x",
        "journal/a/b/c",
        "blocks",
    ]:
        assert parse_object_path(bad) is None


def test_part_ranges_cover_the_object_exactly_in_equal_parts() -> None:
    mib = 1 << 20
    assert part_ranges(32 * mib + 4096, 8 * mib)[-1][1] == 32 * mib + 4096
    assert len(part_ranges(32 * mib + 4096, 8 * mib)) == 5
    assert len(part_ranges(32 * mib, 8 * mib)) == 4
    for size in [1, 4096, 8 * mib - 1, 8 * mib, 8 * mib + 1, 100 * mib + 3]:
        r = part_ranges(size, 8 * mib)
        assert r[0][0] == 0
        assert r[-1][1] == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(r))
        assert max(e - s for s, e in r) - min(e - s for s, e in r) <= len(r)
        assert max(e - s for s, e in r) <= 8 * mib
