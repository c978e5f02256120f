"""The residency feed of a real cache-server process: every tier change of a chunk, in order.

A subscriber reads a snapshot, then ``stored``/``removed`` records per tier: a store lands in DRAM,
write-back adds the local disk, DRAM pressure evicts, a delete removes every tier, TTL expiry
removes the disk copy of what was not hit, and a restart starts a new epoch whose snapshot holds
the disk tier only.
Metadata a connector attaches travels with every later ``stored`` record, to every subscriber.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from kvfabric.client import CacheClient
from kvfabric.client.errors import CacheUnavailable
from kvfabric.client.residency import FeedMessage, ResidencyFeedClient
from kvfabric.rpc.kvledger import ChunkMeta
from kvfabric.rpc.residency import Change, frame, residency_socket_for
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, payload_for, wait_until

pytestmark = [pytest.mark.process, pytest.mark.slow]

NS = digest("residency-ns")
META = ChunkMeta(block_hashes=(b"h0", b"h1"), parent_block_hash=None, token_ids=(1, 2, 3, 4), block_size=2)


class Follower:
    """A subscriber that keeps what it read and each key's tiers as the feed says."""

    def __init__(self, srv: ServerProcess) -> None:
        self.client = ResidencyFeedClient(residency_socket_for(srv.config.listen.unix_socket), NS)
        self.log: list[FeedMessage] = []
        self.tiers: dict[str, set[str]] = {}
        self.metas: dict[str, ChunkMeta] = {}
        self.until(lambda: ("synced", None) in self.log, "the snapshot")

    def pump(self) -> None:
        for message in self.client.read(0.05):
            self.log.append(message)
            if isinstance(message, Change):
                tiers = self.tiers.setdefault(message.key, set())
                if message.op == "stored":
                    tiers.add(message.tier)
                    if message.meta is not None:
                        self.metas[message.key] = message.meta
                else:
                    tiers.discard(message.tier)

    def until(self, pred: object, what: str, timeout: float = 30.0) -> None:
        def check() -> bool:
            self.pump()
            return bool(pred())  # type: ignore[operator]

        wait_until(check, timeout=timeout, what=what)

    def changes(self, key: str) -> list[tuple[str, str]]:
        return [(m.op, m.tier) for m in self.log if isinstance(m, Change) and m.key == key]


@pytest.fixture
def follow() -> Iterator[Callable[[ServerProcess], Follower]]:
    """Make followers; all are closed at the end."""
    made: list[Follower] = []

    def make(srv: ServerProcess) -> Follower:
        made.append(Follower(srv))
        return made[-1]

    yield make
    for f in made:
        f.client.close()


@pytest.fixture
def srv() -> Iterator[ServerProcess]:
    with cache_server(dram_bytes=8 * MiB, local_disk_bytes=64 * MiB) as s:
        yield s


def _store(client: CacheClient, keys: list[str], size: int = 256 << 10) -> None:
    result = client.store(NS, keys, [payload_for(k, size) for k in keys], timeout=10)
    assert result.accepted == len(keys)


def test_store_write_back_metadata_eviction_and_delete_each_reach_every_subscriber(
    srv: ServerProcess, follow: Callable[[ServerProcess], Follower]
) -> None:
    a, b = follow(srv), follow(srv)
    key = digest("chunk", 0)
    with CacheClient(srv.unix_target) as client:
        _store(client, [key])
        for f in (a, b):
            f.until(lambda f=f: f.tiers.get(key) == {"dram", "local_disk"}, "store and write-back")
            assert f.changes(key) == [("stored", "dram"), ("stored", "local_disk")]
        # A connector attaches the router's names; both subscribers get them, per tier holding it.
        a.client.describe(key, META)
        for f in (a, b):
            f.until(lambda f=f: f.metas.get(key) == META, "the metadata")
        # DRAM pressure: 8 MiB of DRAM, 40 x 256 KiB stored; the oldest leave DRAM, stay on disk.
        others = [digest("chunk", i) for i in range(1, 41)]
        for i in range(0, 40, 8):
            _store(client, others[i : i + 8])
        a.until(lambda: "dram" not in a.tiers.get(key, set()), "a DRAM eviction")
        assert ("removed", "dram") in a.changes(key)
        assert "local_disk" in a.tiers[key]
        assert client.delete(NS, [key], timeout=10) == 1
        for f in (a, b):
            f.until(lambda f=f: not f.tiers.get(key), "the delete")
            removed = [c for c in f.changes(key) if c[0] == "removed"]
            assert sorted(removed) == [("removed", "dram"), ("removed", "local_disk")]
        # Every key's last word is its current residency: the feed and the server agree.
        time.sleep(0.5)
        a.pump()
        lookup = client.lookup(NS, [*others], timeout=10)
        assert lookup.matched >= 1
    # Stores, removals and metadata in the one order: no subscriber saw a removal of a tier it
    # was never told the key was stored in.
    for f in (a, b):
        held: dict[tuple[str, str], int] = {}
        for m in f.log:
            if isinstance(m, Change):
                slot = (m.key, m.tier)
                held[slot] = held.get(slot, 0) + (1 if m.op == "stored" else -1)
                assert held[slot] >= 0


def test_ttl_expiry_removes_the_disk_copy(follow: Callable[[ServerProcess], Follower]) -> None:
    overrides = {"ttl_seconds": 2, "bucket_seconds": 1}
    with cache_server(dram_bytes=64 * MiB, local_disk_bytes=64 * MiB, overrides=overrides) as srv:
        f = follow(srv)
        key = digest("expiring")
        with CacheClient(srv.unix_target) as client:
            _store(client, [key])
            f.until(lambda: f.tiers.get(key) == {"dram", "local_disk"}, "store and write-back")
            # Expiry is the disk tiers' (DRAM is LRU): the disk copy goes, the DRAM copy stays.
            f.until(lambda: f.tiers.get(key) == {"dram"}, "expiry", timeout=60)
        assert f.changes(key) == [("stored", "dram"), ("stored", "local_disk"), ("removed", "local_disk")]


def test_a_restart_is_a_new_epoch_whose_snapshot_has_lost_dram(
    srv: ServerProcess, follow: Callable[[ServerProcess], Follower]
) -> None:
    f = follow(srv)
    key = digest("survivor")
    with CacheClient(srv.unix_target) as client:
        _store(client, [key])
        f.until(lambda: f.tiers.get(key) == {"dram", "local_disk"}, "store and write-back")
    old_epoch = f.client.epoch
    srv.restart()

    def drain() -> None:
        for _ in range(100):
            f.pump()

    with pytest.raises(CacheUnavailable):
        drain()  # the old connection reads as closed
    g = follow(srv)
    assert g.client.epoch != old_epoch
    assert g.tiers == {key: {"local_disk"}}


def test_bad_requests_get_an_error_naming_what_is_wrong(
    srv: ServerProcess, follow: Callable[[ServerProcess], Follower]
) -> None:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(str(residency_socket_for(srv.config.listen.unix_socket)))
        s.sendall(frame(["sub", "not-a-namespace"]))
        reply = s.recv(4096)
    assert b"namespace" in reply
    f = follow(srv)
    f.client.describe(digest("k"), ChunkMeta((1,), None, (1, 2), 2))
    f.client._out += frame(["meta", digest("k"), [[1], None, [1, 2], 0, None, None, None]])
    f.until(lambda: any(isinstance(m, tuple) and m[0] == "error" for m in f.log), "an error", timeout=10)
    (error,) = [m for m in f.log if isinstance(m, tuple) and m[0] == "error"]
    assert "meta.block_size" in str(error[1])
