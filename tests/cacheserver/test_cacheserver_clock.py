"""One clock for every expiry decision, correct on a client-stamped filesystem (CephFS, Lustre, FUSE)."""

from __future__ import annotations

import os
import time
import urllib.request
from pathlib import Path

import pytest

from kvfabric.cacheserver.engine.ttl import LocalClock, PeerClocks, SharedClock, clock_path
from kvfabric.client import CacheClient
from kvfabric.testing.serverproc import cache_server, digest, payload_for, wait_until

DAY = 86400.0


def test_peer_liveness_and_clocks_come_from_watching_leases_change(tmp_path: Path) -> None:
    leases = tmp_path / "leases"
    leases.mkdir()
    ahead = LocalClock(skew_seconds=2 * DAY)
    (leases / "peer").touch()
    ahead.stamp(leases / "peer")  # the peer's client-stamped lease, two days ahead
    (leases / "dead").touch()
    os.utime(leases / "dead", (1.0, 1.0))  # a lease from 1970: its age says nothing about liveness
    peers = PeerClocks(leases, "me", lease_seconds=3600)
    peers.observe()
    assert peers.live() == ["dead", "peer"], "first sight: live until unchanged for lease_seconds"
    clock = peers.clock_of("peer")
    assert clock is not None
    assert clock == pytest.approx(ahead.now(), abs=60), "a peer's clock is read from its own stamps"
    gone = PeerClocks(leases, "me", lease_seconds=0)
    gone.observe()
    assert gone.live() == [], "unchanged for lease_seconds of our monotonic clock: dead"


class _TouchedBetween(LocalClock):
    """This server's (correct) clock, with a peer touching its clock file between our touch and read."""

    def __init__(self, peer: SharedClock | None = None) -> None:
        super().__init__()
        self.peer = peer

    def stamp(self, path: Path) -> None:
        super().stamp(path)
        if self.peer is not None:
            self.peer.sync()


def test_a_peer_touching_its_clock_between_our_touch_and_read_does_not_move_our_clock(tmp_path: Path) -> None:
    """A client-stamped volume, a peer two days ahead whose touch lands between ours and our read.

    With one clock file for every server, that read returned the peer's clock: this server then
    believed it was two days ahead and expired every bucket (a CI run caught it as a flaky test).
    """
    ahead = SharedClock(clock_path(tmp_path, "node-ahead"), LocalClock(skew_seconds=2 * DAY))
    local = _TouchedBetween()
    ok = SharedClock(clock_path(tmp_path, "node-ok"), local)
    local.peer = ahead
    assert ok.sync()
    now = ok.now()
    assert now is not None
    assert now == pytest.approx(time.time(), abs=60)
    assert ahead.now() == pytest.approx(time.time() + 2 * DAY, abs=60)


@pytest.mark.process
@pytest.mark.slow
def test_a_server_two_days_ahead_on_a_client_stamped_volume_expires_nothing_early(
    ns: str, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    cfg = {"ttl_seconds": 3600, "bucket_seconds": 60, "janitor_interval_seconds": 0.1, "lease_seconds": 5}
    # node-ahead's clock, and every timestamp it stamps on the volume, run two days ahead (what a
    # client-stamped filesystem does for a client with such a clock).
    # Its stores stay in its DRAM (no write-back), so no journal record tells node-ok its generations.
    ahead = {**cfg, "tiers.shared.faults": {"clock_skew_seconds": 2 * DAY}, "tiers.write_back": "none"}
    keys = [digest("client-stamped", i) for i in range(4)]
    with cache_server(server_id="node-ok", shared_dir=shared, local_disk_bytes=None, overrides=cfg) as ok:
        with CacheClient(ok.unix_target, shared_memory=True) as c:
            assert c.store(ns, keys, [payload_for(k, 64 * 1024) for k in keys], timeout=10).accepted == 4
            wait_until(lambda: len(list((shared / "buckets").rglob("*.blk"))) == 4, what="write-back")
        # A write node-ok has in flight: its temp file, stamped by node-ok's (correct) clock.
        live_tmp = shared / "tmp" / "node-ok" / "in-flight.tmp"
        live_tmp.write_bytes(b"half a block")
        with (
            cache_server(
                server_id="node-ahead", shared_dir=shared, local_disk_bytes=None, overrides=ahead
            ) as ah,
            CacheClient(ah.unix_target, shared_memory=True) as ca,
        ):
            lease = shared / "leases" / "node-ahead"
            for _ in range(30):  # many janitor ticks of node-ahead (each renews its lease)
                prev = lease.stat().st_mtime_ns
                wait_until(lambda prev=prev: lease.stat().st_mtime_ns != prev, what="a janitor tick")
            assert lease.stat().st_mtime > ok_lease_mtime(shared) + DAY, "the skew is real on the volume"
            expired = [r for r in ah.log_records() if r.get("message") == "bucket expired"]
            assert len(list((shared / "buckets").rglob("*.blk"))) == 4, (
                "no bucket younger than the TTL expired",
                # Which server expired what, and when node-ok last renewed its lease (a peer whose
                # lease stops changing for lease_seconds counts as dead: its clock no longer counts).
                expired[:4],
                [r for r in ok.log_records() if r.get("message") == "bucket expired"][:4],
                round(time.time() - ok_lease_mtime(shared), 3),
            )
            assert live_tmp.exists(), "another server's live temp file was reaped"
            stats = ca.stats(timeout=5)
            assert "expired_buckets" not in stats["counters"]
            assert ca.lookup(ns, keys, timeout=5).matched == 4
            # The start-up check saw stamps following its own clock, and the spread is visible.
            assert stats["clock_stamps_local"] is True
            assert stats["clock_spread_seconds"] > DAY
            metrics = urllib.request.urlopen(ah.metrics_url + "/metrics", timeout=5).read().decode()
            assert any(
                line.startswith("kvfabric_volume_stamps_local_clock") and line.endswith(" 1.0")
                for line in metrics.splitlines()
            ), "the start-up check is exported as a metric"
            logs = [r for r in ah.log_records() if "follow this server's clock" in r.get("message", "")]
            assert logs, "the start-up check says so in the log"
            # A delete made on node-ok supersedes a store node-ahead made before it, though node-ahead's
            # generations run two days ahead: node-ahead drops its DRAM copy once it reads the journal.
            late = digest("client-stamped", "late")
            assert ca.store(ns, [late], [payload_for(late, 4096)], timeout=10).accepted == 1
            with CacheClient(ok.unix_target, shared_memory=True) as c:
                wait_until(
                    lambda: c.stats(timeout=5)["clock_spread_seconds"] > DAY, what="node-ok to see the spread"
                )
                c.delete(ns, [late], timeout=5)
            wait_until(lambda: ca.lookup(ns, [late], timeout=5).matched == 0, what="node-ahead to honour it")
            assert ca.load(ns, [late], timeout=10) == []


def ok_lease_mtime(shared: Path) -> float:
    return (shared / "leases" / "node-ok").stat().st_mtime
