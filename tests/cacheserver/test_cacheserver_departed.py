"""Departed servers' files on the shared volume go, a live one's never; one that comes back recreates its own.

Sixty server ids that once ran (autoscaled nodes: half shut down cleanly and dropped their lease,
half died with it) left their journals, clock files, leases and temp directories. Two live servers
share the volume with them. After the margin (shortened here from ten minutes), every departed id's
files are gone and the journal tailer scans the live servers' journals only; the live servers'
files are all there. A server paused past the margin is taken for departed and its files removed:
at its next janitor tick it recreates them, and its blocks reach the others again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfabric.cacheserver.config import ServerConfig
from kvfabric.cacheserver.engine.base import TierName
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.shared import SharedTier
from kvfabric.cacheserver.engine.tiered import TieredStore
from kvfabric.testing.serverproc import digest, payload_for, wait_until

MARGIN_S = 1.0
DEPARTED = [f"gone-{i:02d}" for i in range(60)]


def _store(shared: Path, sid: str, tmp: Path) -> TieredStore:
    config = ServerConfig.model_validate(
        {
            "server_id": sid,
            "listen": {"unix_socket": str(tmp / f"{sid}.sock")},
            "tiers": {
                "dram": {"capacity_bytes": 1 << 22},
                "shared": {"path": str(shared), "capacity_bytes": 1 << 24},
            },
            "journal_poll_seconds": 0.05,
            "janitor_interval_seconds": 3600,  # the test ticks
            "lease_seconds": 0.5,
            "limits": {"max_payload_bytes": 65536},
        }
    )
    store = TieredStore(config)
    departed = getattr(_shared(store), "departed", None)  # (so that the test runs, and fails, without it)
    if departed is not None:
        departed.departed_after_s = MARGIN_S
    store.start()
    return store


def _shared(store: TieredStore) -> SharedTier:
    tier = store.tier(TierName.SHARED)
    assert isinstance(tier, SharedTier)
    return tier


def _files(shared: Path, sid: str) -> dict[str, bool]:
    return {
        "lease": (shared / "leases" / sid).exists(),
        "clock": (shared / "clocks" / sid).exists(),
        "journal": (shared / "journals" / f"{sid}.log").exists(),
        "tmp": (shared / "tmp" / sid).is_dir(),
    }


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    root = tmp_path / "shared"
    for sub in ("leases", "clocks", "journals", "tmp"):
        (root / sub).mkdir(parents=True)
    for i, sid in enumerate(DEPARTED):
        (root / "journals" / f"{sid}.log").write_bytes(b"E 0123456789abcdef\nX 1\n")
        (root / "clocks" / sid).touch()
        (root / "tmp" / sid).mkdir()
        (root / "tmp" / sid / "dead-write.tmp").write_bytes(b"x" * 4096)
        if i % 2:
            (root / "leases" / sid).touch()  # died with its lease; the others dropped theirs
    return root


@pytest.fixture
def live(shared: Path, tmp_path: Path) -> Iterator[tuple[TieredStore, TieredStore]]:
    a, b = _store(shared, "live-a", tmp_path), _store(shared, "live-b", tmp_path)
    yield a, b
    a.close()
    b.close()


def _tick_for(seconds: float, *stores: TieredStore) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for s in stores:
            s.janitor_tick()
        time.sleep(0.05)


def test_departed_servers_files_go_after_the_margin_and_live_ones_stay(
    shared: Path, live: tuple[TieredStore, TieredStore]
) -> None:
    a, b = live
    reader = _shared(a)._reader
    assert len(reader._files()) == len(DEPARTED) + 1  # every departed journal, and b's
    _tick_for(MARGIN_S / 2, a, b)
    assert all(_files(shared, sid)["journal"] for sid in DEPARTED), "removed before the margin"
    _tick_for(MARGIN_S * 1.5, a, b)
    for sid in DEPARTED:
        assert not any(_files(shared, sid).values()), f"{sid}'s files are still there: {_files(shared, sid)}"
    for sid in ("live-a", "live-b"):
        assert all(_files(shared, sid).values()), f"a live server's files were removed: {_files(shared, sid)}"
    # The tailer scans the live servers' journals only, and keeps no state for the removed ones.
    assert [name for name, _, _ in reader._files()] == ["live-b.log"]
    _shared(a).poll()
    assert set(reader._pos) <= {"live-b.log"}
    assert _shared(a).departed.removed + _shared(b).departed.removed == len(DEPARTED)
    assert not [p for p in (shared / "leases").iterdir() if p.name.startswith(".")], "a claim was left behind"


def test_a_server_paused_past_the_margin_recreates_its_files_and_is_heard_again(
    shared: Path, live: tuple[TieredStore, TieredStore], tmp_path: Path
) -> None:
    a, _b = live
    z = _store(shared, "paused-z", tmp_path)
    try:
        z.janitor_tick()
        _tick_for(MARGIN_S * 2.5, *live)  # z does not tick: it looks departed
        assert not any(_files(shared, "paused-z").values()), "z was not taken for departed"
        z.janitor_tick()  # z comes back
        assert all(_files(shared, "paused-z").values()), f"z did not recreate: {_files(shared, 'paused-z')}"
        bid = BlockId(digest("ns"), digest("after-pause"))
        assert z.put(bid, payload_for("after-pause", 8192))
        assert z.flush(10)
        wait_until(lambda: a.lookup([bid]) == [TierName.SHARED], timeout=10, what="a to hear of z's block")
        data = a.open_block(bid)
        assert data is not None
        assert bytes(data.view()) == payload_for("after-pause", 8192)
        data.close()
    finally:
        z.close()
