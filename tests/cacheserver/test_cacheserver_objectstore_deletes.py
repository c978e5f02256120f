"""Deletes on the object-store tier survive journal gaps: two servers sharing a bucket, against a model.

A server that misses journal segments (paused past their retention) learns what it missed from a
full listing. Deletes must come back with it: the tombstones are read before anything is indexed,
so an older copy still in the bucket (an upload that landed after the delete) is never indexed and
never served, and a delete applied from another server removes the object, not only the index entry.

Each test runs against the real S3 server (SeaweedFS, ``s3``) and against obstore's in-process
``MemoryStore`` behind the same :class:`ObjectClient` (``memory``): the tier's code is the same, only
the HTTP is missing from the second.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import obstore
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test
from obstore.store import MemoryStore

from kvfabric.cacheserver.config import ObjectStoreTierConfig
from kvfabric.cacheserver.engine.base import MissReason
from kvfabric.cacheserver.engine.blockfile import HEADER_SIZE, unpack_header
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.journal import Event
from kvfabric.cacheserver.engine.objectclient import ObjectClient, ObjectStoreError, make_store
from kvfabric.cacheserver.engine.objectjournal import JOURNAL
from kvfabric.cacheserver.engine.objectstore import ObjectStoreTier, object_path
from kvfabric.cacheserver.engine.stats import Counters
from kvfabric.testing.serverproc import MiB, digest, payload_for

NS = digest("object-deletes")
KEYS = [BlockId(NS, digest("object-deletes-key", i)) for i in range(3)]


@dataclass
class Bucket:
    """One bucket (a fresh prefix) and how to reach it: real S3, or an in-process MemoryStore."""

    cfg: ObjectStoreTierConfig
    store: Any
    """The raw obstore store of the bucket (what the test uses to act behind the tiers' backs)."""
    memory: MemoryStore | None = None
    tiers: list[ObjectStoreTier] = field(default_factory=list)

    def client(self) -> ObjectClient | None:
        """A client of the in-process store (None: the tier builds its S3 client)."""
        if self.memory is None:
            return None
        return ObjectClient(self.cfg, store=self.memory)  # type: ignore[arg-type]  # any obstore store

    def tier(self, server_id: str, *, start: bool = True) -> ObjectStoreTier:
        t = ObjectStoreTier(
            self.cfg,
            server_id=server_id,
            bucket_seconds=3600,
            ttl_seconds=86400,
            counters=Counters(),
            client=self.client(),
        )
        self.tiers.append(t)
        if start:
            t.start(background=False)
        return t

    def close(self) -> None:
        for t in self.tiers:
            with contextlib.suppress(Exception):
                t.close()
        self.tiers.clear()

    def paths(self, under: str) -> list[str]:
        return [m["path"] for batch in obstore.list(self.store, under) for m in batch]


def _config(
    tmp: Path, prefix: str, endpoint: str, bucket: str, keys: tuple[str, str] | None
) -> ObjectStoreTierConfig:
    data: dict[str, Any] = {
        "endpoint": endpoint,
        "bucket": bucket,
        "prefix": prefix,
        "capacity_bytes": 256 * MiB,
        "request_timeout_seconds": 3.0,
        "connect_timeout_seconds": 1.0,
        "max_retries": 1,
        "retry_timeout_seconds": 4.0,
        "part_bytes": 1 * MiB,
    }
    if keys is not None:
        (tmp / "ak").write_text(keys[0])
        (tmp / "sk").write_text(keys[1])
        data |= {"access_key_id_file": str(tmp / "ak"), "secret_access_key_file": str(tmp / "sk")}
    return ObjectStoreTierConfig.model_validate(data)


@pytest.fixture(
    params=[
        pytest.param("s3", marks=[pytest.mark.slow, pytest.mark.process]),  # a real S3 server process
        "memory",
    ]
)
def buckets(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Bucket]]:
    """A factory of fresh buckets (one prefix each) on the parametrized backend."""
    made: list[Bucket] = []

    def new() -> Bucket:
        prefix = f"t-{secrets.token_hex(6)}"
        if request.param == "s3":
            s3 = request.getfixturevalue("s3")
            cfg = _config(tmp_path, prefix, s3.endpoint, s3.bucket, (s3.access_key, s3.secret_key))
            b = Bucket(cfg, make_store(cfg))
        else:
            cfg = _config(tmp_path, prefix, "http://127.0.0.1:9", "memory", None)
            mem = MemoryStore()
            b = Bucket(cfg, mem, memory=mem)
        made.append(b)
        return b

    yield new
    for b in made:
        b.close()


def _delete(t: ObjectStoreTier, k: BlockId) -> int:
    """What the store does for a client's delete: a tombstone a margin ahead, then the tier's delete."""
    gen = t.generations.for_delete()
    t.generations.tombstone(k, gen)
    t.delete(k, gen)
    return gen


def _miss_segments(bucket: Bucket, reader: ObjectStoreTier) -> None:
    """``reader`` is paused past the retention: every segment it has not read yet is gone."""
    seen = {name: st.last_seq for name, st in reader.journal._streams.items()}
    lost = []
    for path in bucket.paths(f"{JOURNAL}/"):
        server, inc, seq = path.split("/")[-3:]
        if server != reader.server_id and int(seq) > seen.get(f"{server}/{inc}", -1):
            lost.append(path[path.find(f"{JOURNAL}/") :])
    obstore.delete(bucket.store, lost)


# --- the direct reproduction ---------------------------------------------------------------------------


def test_a_delete_during_a_journal_gap_is_learned_and_the_old_copy_never_served(
    buckets: Callable[[], Bucket],
) -> None:
    bucket = buckets()
    a, b = bucket.tier("a"), bucket.tier("b")
    k = KEYS[0]
    old = payload_for("old", 8192)
    assert a.put(k, old)
    a.journal_tick()
    b.journal_tick()
    assert b.get(k) == old
    old_path = object_path(k, *_entry(a, k))
    old_body = bytes(obstore.get(bucket.store, old_path).bytes())
    # B is paused; meanwhile A deletes k, and an upload of the old copy that was in flight elsewhere
    # lands after the delete (the copy a relisting finds in the bucket).
    _delete(a, k)
    a.journal_tick()
    obstore.put(bucket.store, old_path, old_body)
    _miss_segments(bucket, b)
    # A writes on; B reads the next segment, sees the gap and relists.
    a.journal.append([Event("D", KEYS[2])])
    a.journal_tick()
    b.journal_tick()
    assert b.get(k) is None, "the gapped server serves the deleted bytes"
    assert not b.contains(k)
    assert old_path not in bucket.paths("blocks/"), "the superseded copy stays in the bucket"
    # ... and a write-back of the superseded generation is refused there from now on.
    assert not b.write(k, memoryview(old), gen=_entry_gen(old_body), bucket=0, created_at=0.0, checksum=b"")


def test_a_server_that_could_not_reach_the_store_at_start_reads_the_tombstones_before_indexing(
    buckets: Callable[[], Bucket],
) -> None:
    bucket = buckets()
    a = bucket.tier("a")
    k = KEYS[1]
    assert a.put(k, payload_for("late", 4096))
    old_path = object_path(k, *_entry(a, k))
    old_body = bytes(obstore.get(bucket.store, old_path).bytes())
    _delete(a, k)
    obstore.put(bucket.store, old_path, old_body)  # the late upload of the superseded copy
    c = bucket.tier("c", start=False)
    real_list = c.client.list
    down = {"yes": True}

    def list_or_fail(prefix: str) -> Any:
        if down["yes"]:
            raise ObjectStoreError("connection refused")
        return real_list(prefix)

    c.client.list = list_or_fail  # type: ignore[method-assign]
    c.start(background=False)  # unreachable: starts empty
    down["yes"] = False
    c.journal_tick()  # the store answers: the first rescan
    assert not c.contains(k)
    assert c.get(k) is None


def test_purge_removes_the_object_a_delete_elsewhere_superseded(buckets: Callable[[], Bucket]) -> None:
    bucket = buckets()
    a, b = bucket.tier("a"), bucket.tier("b")
    k = KEYS[2]
    # B uploads a copy A has not heard of yet; A's delete removes only what A's index knows.
    assert b.put(k, payload_for("b-copy", 4096))
    b_path = object_path(k, *_entry(b, k))
    _delete(a, k)
    assert b_path in bucket.paths("blocks/")
    a.journal_tick()
    b.journal_tick()  # B applies A's T: drops its entry *and* deletes its object
    assert not b.contains(k)
    assert b_path not in bucket.paths("blocks/"), "deleted bytes left at rest in the bucket"


def test_a_read_into_a_destination_sized_from_a_replaced_entry_is_a_miss_not_an_error(
    buckets: Callable[[], Bucket],
) -> None:
    bucket = buckets()
    a = bucket.tier("a")
    k = KEYS[0]
    assert a.put(k, payload_for("short", 4096))
    # The caller sized its destination from the index; a journal event then replaced the entry with
    # a longer copy (the race between BackingTier.length() and read_into()).
    assert a.put(k, payload_for("long", 3 * 4096))
    res = a.read_into(k, memoryview(bytearray(4096)))
    assert res.miss is MissReason.STALE
    assert a.contains(k), "the newer entry stays"
    assert a.get(k) == payload_for("long", 3 * 4096)


def _entry(t: ObjectStoreTier, k: BlockId) -> tuple[int, int]:
    e = t.entry(k)
    assert e is not None
    return e.bucket, e.gen


def _entry_gen(body: bytes) -> int:
    return unpack_header(memoryview(body)[:HEADER_SIZE]).gen


# --- the model -----------------------------------------------------------------------------------------


class TwoServersOneBucket(RuleBasedStateMachine):
    """Stores, deletes, late uploads and journal gaps on two servers vs a model of generations.

    The model holds, per key, every successful store ``(gen, bytes)`` and every delete's generation.
    The live copy of a key is its newest store if that is newer than its newest delete. Whenever both
    servers have caught up with the journal (a gapped one relists), each serves exactly a key's live
    bytes: never a deleted copy, never an older store, and a re-stored key its newest bytes.
    """

    def __init__(self, new_bucket: Callable[[], Bucket]) -> None:
        super().__init__()
        self.new_bucket = new_bucket
        self.bucket: Bucket | None = None
        self.servers: dict[str, ObjectStoreTier] = {}
        self.stores: dict[BlockId, list[tuple[int, bytes, str, bytes]]] = {k: [] for k in KEYS}
        self.deletes: dict[BlockId, int] = dict.fromkeys(KEYS, 0)
        self.n = 0

    @initialize()
    def start(self) -> None:
        self.bucket = self.new_bucket()
        self.servers = {sid: self.bucket.tier(sid) for sid in ("a", "b")}

    def teardown(self) -> None:
        if self.bucket is not None:
            self.bucket.close()

    @rule(sid=st.sampled_from(["a", "b"]), k=st.sampled_from(KEYS))
    def store(self, sid: str, k: BlockId) -> None:
        self.n += 1
        data = payload_for(f"{k.key}-{self.n}", 2048)
        t = self.servers[sid]
        if t.put(k, data):
            bucket, gen = _entry(t, k)
            path = object_path(k, bucket, gen)
            assert self.bucket is not None
            body = bytes(obstore.get(self.bucket.store, path).bytes())
            self.stores[k].append((gen, data, path, body))

    @rule(sid=st.sampled_from(["a", "b"]), k=st.sampled_from(KEYS))
    def delete(self, sid: str, k: BlockId) -> None:
        self.deletes[k] = max(self.deletes[k], _delete(self.servers[sid], k))

    @rule(k=st.sampled_from(KEYS), which=st.integers(0, 3))
    def late_upload(self, k: BlockId, which: int) -> None:
        """An upload of a copy a delete superseded lands after the delete (its uploader had not heard)."""
        dead = [s for s in self.stores[k] if s[0] <= self.deletes[k]]
        if dead:
            _gen, _data, path, body = dead[which % len(dead)]
            assert self.bucket is not None
            obstore.put(self.bucket.store, path, body)

    @rule(sid=st.sampled_from(["a", "b"]))
    def tick(self, sid: str) -> None:
        self.servers[sid].journal_tick()

    @rule(sid=st.sampled_from(["a", "b"]))
    def gap(self, sid: str) -> None:
        """``sid`` is paused past the retention: the segments it has not read are gone."""
        assert self.bucket is not None
        for t in self.servers.values():
            t.journal.flush()
        _miss_segments(self.bucket, self.servers[sid])

    def _live(self, k: BlockId) -> bytes | None:
        if not self.stores[k]:
            return None
        gen, data, _, _ = max(self.stores[k], key=lambda s: s[0])
        return data if gen > self.deletes[k] else None

    @rule()
    def catch_up(self) -> None:
        """Both servers read every segment (a gapped one notices the gap and relists), then check."""
        for _ in range(2):
            for t in self.servers.values():
                # Something to read after any gap, so that every reader notices it.
                t.journal.append([Event("D", BlockId(NS, digest("nobody")))])
                t.journal_tick()
        for sid, t in self.servers.items():
            for k in KEYS:
                live, got = self._live(k), t.get(k)
                assert live is not None or got is None, f"server {sid} served a deleted copy of {k.key[:8]}"
                assert got == live, f"server {sid} does not serve the newest copy of {k.key[:8]}"


@pytest.mark.timeout(600)
def test_two_servers_never_serve_a_deleted_or_older_copy_across_journal_gaps(
    buckets: Callable[[], Bucket], request: pytest.FixtureRequest
) -> None:
    real = "s3" in request.node.callspec.id
    run_state_machine_as_test(
        lambda: TwoServersOneBucket(buckets),  # type: ignore[arg-type]  # a factory, not the class
        settings=settings(
            max_examples=15 if real else 60,
            stateful_step_count=20,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        ),
    )
