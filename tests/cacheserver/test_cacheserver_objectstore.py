"""The object-store tier against a real S3 server (SeaweedFS on loopback): index, integrity, budget,
TTL, journal, throttling and a hung server. No mock of the client: every request is real HTTP."""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import obstore
import pytest

from kvfabric.cacheserver.config import ObjectStoreTierConfig
from kvfabric.cacheserver.engine.base import MissReason
from kvfabric.cacheserver.engine.blockfile import HEADER_SIZE, DestinationFailed
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.objectclient import ObjectClient, ObjectStoreError, make_store
from kvfabric.cacheserver.engine.objectstore import ObjectStoreTier, object_path, part_ranges
from kvfabric.cacheserver.engine.stats import Counters
from kvfabric.cacheserver.engine.ttl import bucket_of
from kvfabric.testing.s3server import FaultProxy, S3Server, s3_server
from kvfabric.testing.serverproc import MiB, digest, payload_for, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.process]  # a real S3 server process


def tier_config(
    s3: S3Server, prefix: str, tmp: Any, *, endpoint: str | None = None, **kw: Any
) -> ObjectStoreTierConfig:
    ak, sk = tmp / "ak", tmp / "sk"
    ak.write_text(s3.access_key)
    sk.write_text(s3.secret_key)
    data: dict[str, Any] = {
        "endpoint": endpoint or s3.endpoint,
        "bucket": s3.bucket,
        "prefix": prefix,
        "access_key_id_file": str(ak),
        "secret_access_key_file": str(sk),
        "capacity_bytes": 256 * MiB,
        "request_timeout_seconds": 3.0,
        "connect_timeout_seconds": 1.0,
        "max_retries": 2,
        "retry_timeout_seconds": 4.0,
        "failure_threshold": 3,
        "cooldown_seconds": 1.0,
        "part_bytes": 1 * MiB,
        **kw,
    }
    return ObjectStoreTierConfig.model_validate(data)


class CountingClient(ObjectClient):
    """The real client, counting the requests it sends (to prove what does not send any)."""

    def __init__(self, cfg: ObjectStoreTierConfig) -> None:
        super().__init__(cfg)
        self.calls: dict[str, int] = {}

    def _n(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1

    def get_range(self, *a: Any, **kw: Any) -> Any:
        self._n("get_range")
        return super().get_range(*a, **kw)

    def head(self, *a: Any, **kw: Any) -> Any:
        self._n("head")
        return super().head(*a, **kw)

    def list(self, *a: Any, **kw: Any) -> Any:
        self._n("list")
        return super().list(*a, **kw)


@contextlib.contextmanager
def tier(cfg: ObjectStoreTierConfig, server_id: str = "a", **kw: Any) -> Iterator[ObjectStoreTier]:
    t = ObjectStoreTier(
        cfg,
        server_id=server_id,
        bucket_seconds=kw.pop("bucket_seconds", 3600),
        ttl_seconds=kw.pop("ttl_seconds", 86400),
        counters=Counters(),
        **kw,
    )
    t.start(background=False)
    try:
        yield t
    finally:
        t.close()


@pytest.fixture
def prefix() -> str:
    return f"t-{secrets.token_hex(6)}"


def bid(i: object, ns: str = digest("ns")) -> BlockId:
    return BlockId(ns, digest("key", i))


def read(t: ObjectStoreTier, b: BlockId, via: str = "mapping") -> bytes | None:
    """The verified payload of ``b``: through ``read_into`` (a buffer) or ``read_into_fd`` (a memfd)."""
    if via == "mapping":
        return t.get(b)
    fd = os.memfd_create("test", os.MFD_CLOEXEC)
    try:
        res = t.read_into_fd(b, fd)
        return os.pread(fd, res.length, 0) if res.ok else None
    finally:
        os.close(fd)


def path_of(t: ObjectStoreTier, k: BlockId) -> str:
    """The object name of ``k``'s indexed copy."""
    e = t.entry(k)
    assert e is not None
    return object_path(k, e.bucket, e.gen)


def listing(cfg: ObjectStoreTierConfig) -> set[str]:
    store = make_store(cfg)
    return {m["path"] for batch in obstore.list(store, "blocks/") for m in batch}


# --- index, reads, journal ----------------------------------------------------------------------------


def test_blocks_round_trip_and_a_new_server_indexes_them_from_one_listing(
    s3: S3Server, prefix: str, tmp_path: Any
) -> None:
    cfg = tier_config(s3, prefix, tmp_path)
    blocks = {bid(i): payload_for(str(i), size) for i, size in enumerate([1, 4096, MiB - 7, 3 * MiB + 5])}
    with tier(cfg, "a") as a:
        for b, p in blocks.items():
            assert a.put(b, p)
        assert all(read(a, b) == p for b, p in blocks.items())
    client = CountingClient(cfg)
    with tier(cfg, "b", client=client) as b_tier:
        assert client.calls.get("list", 0) >= 1
        before = dict(client.calls)
        # Lookups answer from the index: not one request, however many keys.
        assert all(b_tier.contains(b) and b_tier.has(b) for b in blocks)
        assert not b_tier.contains(bid("absent"))
        assert client.calls == before
        for b, p in blocks.items():
            assert read(b_tier, b) == p
        # The 3 MiB + 5 block is fetched as four parallel 1 MiB ranges (plus the header's 4 KiB).
        parts = -(-(3 * MiB + 5 + HEADER_SIZE) // MiB)
        assert client.calls["get_range"] - before.get("get_range", 0) >= parts
        # ... and reads send GETs only: the one HEAD was the clock's, at start-up.
        assert client.calls.get("head", 0) == before.get("head", 0) == 1


def test_journal_segments_spread_puts_deletes_and_expiries(s3: S3Server, prefix: str, tmp_path: Any) -> None:
    cfg = tier_config(s3, prefix, tmp_path)
    with tier(cfg, "a") as a, tier(cfg, "b") as b:
        keys = [bid(i) for i in range(5)]
        for k in keys:
            assert a.put(k, payload_for(k.key, 1000))
        assert not any(b.contains(k) for k in keys)
        a.journal_tick()  # publishes A's segment
        b.journal_tick()  # one LIST, then one GET per new segment
        assert all(b.contains(k) for k in keys)
        assert read(b, keys[0]) == payload_for(keys[0].key, 1000)
        a.delete(keys[1])
        a.journal_tick()
        b.journal_tick()
        assert not b.contains(keys[1])
        # A stale hint (deleted behind B's back) is one miss, then forgotten.
        obstore.delete(make_store(cfg), path_of(b, keys[2]))
        assert read(b, keys[2]) is None
        assert not b.contains(keys[2])
        assert b.counters.get("stale_index", "object") == 1
        assert b.counters.get("checksum_failures", "object") == 0


def test_a_journal_gap_rebuilds_the_index_from_a_listing(s3: S3Server, prefix: str, tmp_path: Any) -> None:
    cfg = tier_config(s3, prefix, tmp_path)
    with tier(cfg, "a") as a, tier(cfg, "b") as b:
        k0, k1 = bid(0), bid(1)
        a.put(k0, b"x" * 10)
        a.journal_tick()
        a.put(k1, b"y" * 10)
        a.journal_tick()
        # B missed segment 0 (e.g. it was paused past the retention): it reads segment 1, sees the gap,
        # and rescans, so it learns k0 as well.
        obstore.delete(make_store(cfg), f"journal/a/{a.journal.incarnation}/{0:012d}")
        b.journal_tick()
        assert b.contains(k0)
        assert b.contains(k1)


# --- integrity -----------------------------------------------------------------------------------------


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :]


@pytest.mark.parametrize("via", ["mapping", "memfd"])
@pytest.mark.parametrize(
    "damage",
    ["payload_bit", "header_bit", "truncated", "header_only", "empty", "other_block"],
)
def test_corrupt_or_truncated_objects_are_never_served_deleted_and_counted(
    s3: S3Server, prefix: str, tmp_path: Any, damage: str, via: str
) -> None:
    cfg = tier_config(s3, prefix, tmp_path)
    store = make_store(cfg)
    k = bid("victim")
    payload = payload_for("victim", 2 * MiB + 123)
    with tier(cfg, "a") as a:
        assert a.put(k, payload)
        path = path_of(a, k)
        good = bytes(obstore.get(store, path).bytes())
        bad = {
            "payload_bit": _flip(good, HEADER_SIZE + MiB + 17),
            "header_bit": _flip(good, 70),
            "truncated": good[: HEADER_SIZE + MiB],
            "header_only": good[:HEADER_SIZE],
            "empty": b"",
            "other_block": None,
        }[damage]
        if bad is None:  # a whole valid block of another key copied under this name
            other = bid("other")
            a.put(other, payload)
            bad = bytes(obstore.get(store, path_of(a, other)).bytes())
        obstore.put(store, path, bad)
    # A fresh server indexes the damaged object from the listing and must not serve it.
    with tier(cfg, "b") as b:
        if damage == "empty":
            # An object shorter than a header is caught by the start-up listing itself.
            assert not b.contains(k)
        else:
            assert read(b, k, via) is None
        assert b.counters.get("checksum_failures", "object") == 1
        assert not b.contains(k)
        with pytest.raises(FileNotFoundError):
            obstore.head(store, path)


class SlowPartsClient(ObjectClient):
    """The real client; every ranged GET waits a little (so that parts overlap) and the one at
    ``fail_at`` fails; it counts the GETs sent and those in flight."""

    def __init__(self, cfg: ObjectStoreTierConfig, fail_at: int | None = None) -> None:
        super().__init__(cfg)
        self.fail_at = fail_at
        self.sent = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self._count = threading.Lock()

    def get_range(self, path: str, start: int, end: int, *, timeout: float) -> Any:
        with self._count:
            self.sent += 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            time.sleep(0.05)
            if start == self.fail_at:
                raise ObjectStoreError("injected: this part failed")
            return super().get_range(path, start, end, timeout=timeout)
        finally:
            with self._count:
                self.in_flight -= 1


@pytest.mark.parametrize("via", ["mapping", "memfd"])
def test_a_multi_part_object_loads_equal_to_the_object_one_get_per_part(
    s3: S3Server, prefix: str, tmp_path: Any, via: str
) -> None:
    # Sizes around the 1 MiB part (and the header that shifts every part's payload) and a payload
    # of many parts; each must come back byte for byte, in exactly as many GETs as parts, in parallel.
    cfg = tier_config(s3, prefix, tmp_path)
    sizes = [1, MiB - HEADER_SIZE, MiB - HEADER_SIZE + 1, 3 * MiB + 12345, 6 * MiB]
    # Random bytes, not a repeating pattern: a part written at the wrong offset must show.
    payloads = {n: random.Random(n).randbytes(n) for n in sizes}
    with tier(cfg, "a") as a:
        for n in sizes:
            assert a.put(bid(n), payloads[n])
    client = SlowPartsClient(cfg)
    with tier(cfg, "b", client=client) as b:
        for n in sizes:
            sent = client.sent
            assert read(b, bid(n), via) == payloads[n], n
            assert client.sent - sent == len(part_ranges(n + HEADER_SIZE, MiB)), n
            assert client.in_flight == 0
        assert client.most_in_flight > 1  # the parts of one object overlap
        assert b.counters.get("checksum_failures", "object") == 0


def test_a_promotion_sized_for_a_shorter_copy_is_a_stale_miss_with_nothing_written(
    s3: S3Server, prefix: str, tmp_path: Any
) -> None:
    # The promotion sized its memfd from the length it read first; the object was replaced by a
    # longer copy since: nothing is fetched or written past the room, the miss says stale.
    cfg = tier_config(s3, prefix, tmp_path)
    client = SlowPartsClient(cfg)
    with tier(cfg, "a", client=client) as a:
        assert a.put(bid("grown"), random.Random(1).randbytes(2 * MiB))
        fd = os.memfd_create("test", os.MFD_CLOEXEC)
        try:
            sent = client.sent
            res = a.read_into_fd(bid("grown"), fd, room=MiB)
            assert (res.ok, res.miss) == (False, MissReason.STALE)
            assert client.sent == sent
            assert os.fstat(fd).st_size == 0
            full = a.read_into_fd(bid("grown"), fd, room=2 * MiB)
            assert full.ok
        finally:
            os.close(fd)


@pytest.mark.parametrize("via", ["mapping", "memfd"])
def test_a_failing_part_is_a_miss_and_no_part_runs_after_it(
    s3: S3Server, prefix: str, tmp_path: Any, via: str
) -> None:
    # One GET slot: the parts queue behind each other. The first part fails: the read is a miss
    # (an I/O error, not corruption: the object stays indexed and is not deleted), the parts not
    # yet sent are never sent, and none is in flight once the read has returned.
    cfg = tier_config(s3, prefix, tmp_path, max_concurrent_gets=1)
    k, payload = bid("parts"), payload_for("parts", 6 * MiB)
    with tier(cfg, "a") as a:
        assert a.put(k, payload)
    parts = len(part_ranges(len(payload) + HEADER_SIZE, MiB))
    client = SlowPartsClient(cfg, fail_at=0)
    with tier(cfg, "b", client=client) as b:
        assert read(b, k, via) is None
        assert client.in_flight == 0
        sent = client.sent
        assert sent <= 2 < parts  # the failing part, and at most the one the pool had started
        time.sleep(0.3)
        assert client.sent == sent  # nothing was left queued to run later
        assert b.contains(k)
        assert b.counters.get("checksum_failures", "object") == 0
        assert b.counters.get("object_errors", "get") == 1
        client.fail_at = None
        assert read(b, k, via) == payload


def test_a_destination_that_fails_is_raised_after_every_part_and_the_object_stays(
    s3: S3Server, prefix: str, tmp_path: Any
) -> None:
    # A promotion whose memfd cannot take the bytes (memory full) is the DRAM side's failure: it is
    # raised to the promotion (which counts it as a DRAM miss), never counted against the object.
    cfg = tier_config(s3, prefix, tmp_path)
    k, payload = bid("dest"), payload_for("dest", 3 * MiB)
    with tier(cfg, "a") as a:
        assert a.put(k, payload)
    client = SlowPartsClient(cfg)
    with tier(cfg, "b", client=client) as b:
        fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)  # every write fails (EBADF)
        try:
            with pytest.raises(DestinationFailed):
                b.read_into_fd(k, fd)
        finally:
            os.close(fd)
        assert client.in_flight == 0
        assert b.contains(k)
        assert b.counters.get("checksum_failures", "object") == 0
        assert read(b, k, "memfd") == payload


# --- capacity and TTL ----------------------------------------------------------------------------------


def test_budget_holds_with_oldest_bucket_evicted_first(s3: S3Server, prefix: str, tmp_path: Any) -> None:
    size = 256 * 1024
    obj = size + HEADER_SIZE
    cfg = tier_config(s3, prefix, tmp_path, capacity_bytes=10 * obj, high_watermark=0.9, low_watermark=0.5)
    rng = random.Random(7)
    with tier(cfg, "a") as a:
        now_bucket = bucket_of(a.clock.now() or 0, a.bucket_seconds)
        model: dict[BlockId, int] = {}
        for i in range(40):
            k = bid(("budget", i))
            bucket = now_bucket - rng.randrange(0, 4)
            if a.put(k, payload_for(k.key, size), bucket=bucket):
                model[k] = bucket
            u = a.usage()
            assert u.used_bytes <= u.high_bytes
            for gone in [b for b in model if not a.contains(b)]:
                model.pop(gone)
        assert a.counters.get("evictions", "object") > 0
        # The store holds exactly what the index holds: evicted objects were deleted.
        assert listing(cfg) == {path_of(a, k) for k in model}
        assert all(a.entry(k).bucket == b for k, b in model.items())  # type: ignore[union-attr]


def test_eviction_order_is_oldest_bucket_first(s3: S3Server, prefix: str, tmp_path: Any) -> None:
    size = 64 * 1024
    obj = size + HEADER_SIZE
    cfg = tier_config(s3, prefix, tmp_path, capacity_bytes=8 * obj, high_watermark=1.0, low_watermark=0.75)
    with tier(cfg, "a") as a:
        now = bucket_of(a.clock.now() or 0, a.bucket_seconds)
        old = [bid(("old", i)) for i in range(4)]
        new = [bid(("new", i)) for i in range(4)]
        for k in new:
            assert a.put(k, payload_for(k.key, size), bucket=now)
        for k in old:
            assert a.put(k, payload_for(k.key, size), bucket=now - 3)
        # Full: the next put first evicts down to the low watermark (6 objects, with room for itself):
        # three blocks of the oldest bucket go, least recently used first, and nothing newer.
        assert a.put(bid("next"), payload_for("next", size), bucket=now)
        assert all(a.contains(k) for k in new)
        assert [a.contains(k) for k in old] == [False, False, False, True]


def test_ttl_expires_whole_buckets_by_the_stores_clock_never_early(
    s3: S3Server, prefix: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tier_config(s3, prefix, tmp_path)
    with tier(cfg, "a", bucket_seconds=60, ttl_seconds=120) as a:
        now = a.clock.now()
        assert now is not None
        cur = bucket_of(now, 60)
        expired_k, live_k = bid("expired"), bid("live")
        assert a.put(expired_k, b"e" * 100, bucket=cur - 4)  # ended 3+ buckets = 180 s+ ago > ttl
        assert a.put(live_k, b"l" * 100, bucket=cur - 1)  # ended < 60 s ago
        # A node clock a day ahead changes nothing: the tier never reads the node's wall clock.
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 86400)
        assert a.expire() == [cur - 4]
        assert not a.contains(expired_k)
        assert a.contains(live_k)
        assert listing(cfg) == {path_of(a, live_k)}
        assert a.entry(live_k).bucket == cur - 1  # type: ignore[union-attr]
        assert a.counters.get("expirations", "object") == 1


def test_a_hit_refreshes_the_object_into_the_current_bucket(s3: S3Server, prefix: str, tmp_path: Any) -> None:
    cfg = tier_config(s3, prefix, tmp_path)
    with (
        tier(cfg, "a", bucket_seconds=60, ttl_seconds=120) as a,
        tier(cfg, "b", bucket_seconds=60, ttl_seconds=120) as b,
    ):
        cur = bucket_of(a.clock.now() or 0, 60)
        k = bid("hot")
        a.put(k, b"h" * 5000, bucket=cur - 2)
        a.touch(k)
        wait_until(lambda: a.entry(k) is not None and a.entry(k).bucket == cur, what="refresh")  # type: ignore[union-attr]
        assert listing(cfg) == {path_of(a, k)}
        a.journal_tick()
        b.journal_tick()
        entry = b.entry(k)
        assert entry is not None
        assert entry.bucket == cur
        assert read(b, k) == b"h" * 5000


# --- backpressure and faults ---------------------------------------------------------------------------


def test_throttling_is_bounded_retries_then_a_miss_then_the_tier_is_skipped(
    s3: S3Server, prefix: str, tmp_path: Any
) -> None:
    with FaultProxy(s3.ports["s3"]) as proxy:
        cfg = tier_config(s3, prefix, tmp_path, endpoint=proxy.endpoint, part_bytes=8 * MiB)
        k = bid("throttled")
        with tier(cfg, "a") as a:
            assert a.put(k, b"t" * 1000)
            proxy.set_mode("throttle")
            wait_until(lambda: proxy.mode == "throttle", what="proxy mode")
            before = proxy.throttled
            assert read(a, k) is None  # a miss, not an exception
            # One GET: at most 1 + max_retries attempts reached the store.
            assert 1 <= proxy.throttled - before <= 1 + cfg.max_retries
            assert a.counters.get("object_errors", "get") == 1
            # Enough failures open the breaker: lookups miss and reads send nothing at all.
            for _ in range(cfg.failure_threshold):
                read(a, k)
            assert not a.has(k)
            assert a.contains(k)  # still indexed, only skipped
            sent = proxy.throttled
            assert read(a, k) is None
            assert proxy.throttled == sent
            # After the cooldown and with the store healthy again, the block is served.
            proxy.set_mode("pass")
            wait_until(lambda: a.has(k), what="breaker to close")
            assert read(a, k) == b"t" * 1000


def test_write_backs_are_dropped_and_counted_when_the_store_is_slow(prefix: str, tmp_path: Any) -> None:
    with s3_server() as own:
        cfg = tier_config(
            own, prefix, tmp_path, max_pending_bytes=4 * (MiB + HEADER_SIZE), max_concurrent_puts=1
        )
        with tier(cfg, "a") as a:
            own.pause()  # SIGSTOP: connections hang, nothing answers
            try:
                keys = [bid(("slow", i)) for i in range(10)]
                accepted = [
                    a.write(k, memoryview(payload_for(k.key, MiB)), gen=a.generations.next(), bucket=0,
                            created_at=0.0, checksum=b"")
                    for k in keys
                ]  # fmt: skip
                # write never waits for the store: what does not fit in max_pending_bytes is dropped.
                assert accepted.count(True) == 4
                assert a.counters.get("dropped_writebacks", "object") == 6
                assert not any(a.contains(k) for k in keys)  # indexed only once uploaded
            finally:
                own.resume()
            assert a.flush(60)
            assert [a.contains(k) for k in keys] == accepted
            assert all(
                read(a, k) == payload_for(k.key, MiB) for k, ok in zip(keys, accepted, strict=True) if ok
            )


def test_a_hung_or_dead_store_is_a_miss_within_the_retry_budget(prefix: str, tmp_path: Any) -> None:
    with s3_server() as own:
        cfg = tier_config(own, prefix, tmp_path)
        k = bid("hung")
        with tier(cfg, "a") as a:
            assert a.put(k, payload_for("hung", 3 * MiB))
            own.pause()
            try:
                assert read(a, k) is None
                assert a.counters.get("object_errors", "get") == 1
            finally:
                own.resume()
            wait_until(lambda: read(a, k) is not None, timeout=30, what="store back")
            own.kill()
            assert read(a, k) is None
            assert a.counters.get("object_errors", "get") >= 2


# --- ordering: deletes ---------------------------------------------------------------------------------


def test_a_delete_is_never_undone_by_an_older_copy_even_for_a_server_starting_later(
    s3: S3Server, prefix: str, tmp_path: Any
) -> None:
    cfg = tier_config(s3, prefix, tmp_path)
    k = bid("deleted")
    with tier(cfg, "a") as a:
        assert a.put(k, b"v1" * 1000)
        old_gen = a.generation(k)
        assert old_gen is not None
        old_body = bytes(obstore.get(make_store(cfg), path_of(a, k)).bytes())
        old_path = path_of(a, k)
        delete_gen = a.generations.for_delete()
        a.generations.tombstone(k, delete_gen)
        assert a.delete(k, delete_gen)
        assert not a.contains(k)
        # A server that had not heard of the delete finishes uploading its (older) copy afterwards.
        obstore.put(make_store(cfg), old_path, old_body)
        a.journal_tick()
    # A server starting now honours the tombstone object: the older copy is neither indexed nor kept.
    with tier(cfg, "c") as c:
        assert not c.contains(k)
        assert c.get(k) is None
        assert old_path not in listing(cfg)
        # ... and refuses a write-back of a generation the delete superseded.
        assert not c.write(k, memoryview(b"v1" * 1000), gen=old_gen, bucket=0, created_at=0.0, checksum=b"")


def test_quiesced_for_a_hand_over_the_tier_lands_its_uploads_and_then_expires_nothing(
    s3: S3Server, prefix: str, tmp_path: Any
) -> None:
    # The successor lists the store while the predecessor is frozen: nothing of the predecessor may
    # add or remove objects meanwhile, including on the tier's own threads.
    size = 64 * 1024
    cfg = tier_config(s3, prefix, tmp_path)
    with tier(cfg, "a", bucket_seconds=10, ttl_seconds=20) as a:
        now_bucket = bucket_of(a.clock.now() or 0, a.bucket_seconds)
        old = bid("expired")
        assert a.put(old, payload_for(old.key, size), bucket=now_bucket - 10)
        queued = bid("queued")
        assert a.write(
            queued,
            memoryview(payload_for(queued.key, size)),
            gen=a.generations.next(),
            bucket=now_bucket,
            created_at=0.0,
            checksum=b"",
        )
        assert a.quiesce(30)
        assert a.contains(queued), "an upload queued before the freeze has landed when it returns"
        before = listing(cfg)
        a.janitor_tick()
        a.journal_tick()
        assert a.contains(old), "nothing expires while quiesced"
        assert listing(cfg) == before
        a.resume()
        a.janitor_tick()
        assert not a.contains(old), "expiry resumes with the hand-over called off"
