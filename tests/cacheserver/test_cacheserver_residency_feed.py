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
from typing import Any

import pytest

from kvfabric.client import CacheClient
from kvfabric.client.errors import CacheUnavailable
from kvfabric.connector.keys import NamespaceSpec
from kvfabric.rpc.kvevents import msgpack_encode
from kvfabric.rpc.kvledger import ChunkMeta
from kvfabric.rpc.residency import Change, frame, residency_socket_for
from kvfabric.testing import feedfollower
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, payload_for, wait_until

pytestmark = [pytest.mark.process, pytest.mark.slow]

SPEC = NamespaceSpec("meta-llama/Llama-3.1-8B", "0e9e39f", "bfloat16", 32, 8, 128, 16, 256)
NS = SPEC.digest()  # described over gRPC where a test attaches metadata before the store
META = ChunkMeta(block_hashes=(b"h0", b"h1"), parent_block_hash=None, token_ids=(1, 2, 3, 4), block_size=2)


class Follower(feedfollower.Follower):
    """A follower of this module's namespace."""

    def __init__(self, srv: ServerProcess) -> None:
        super().__init__(srv, NS)


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
    # Write-backs must land whatever else fills this machine's disk (the tier refuses below 5 % free).
    roomy = {"tiers.local_disk.min_free_fraction": 0.0}
    with cache_server(dram_bytes=8 * MiB, local_disk_bytes=64 * MiB, overrides=roomy) as s:
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
        # The metrics say engines follow the feed, and how much it sent.
        metrics = _get(srv.metrics_url + "/metrics")
        assert "kvfabric_residency_subscribers 2.0" in metrics
        assert "kvfabric_residency_records_total" in metrics
        # Every key's last word is its current residency: the feed and the server agree. Every
        # store was written back (64 MiB of disk holds all 41), so every key is on disk; DRAM holds
        # what its 8 MiB kept, and the feed says which, as the server's lookup does.
        a.until(lambda: all("local_disk" in a.tiers.get(k, ()) for k in others), "every write-back")
        time.sleep(0.5)
        a.pump()
        lookup = client.lookup(NS, others, timeout=10)
        assert lookup.matched == len(others)
        assert lookup.tiers == ["dram" if "dram" in a.tiers[k] else "local_disk" for k in others]
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
    overrides = {"ttl_seconds": 2, "bucket_seconds": 1, "tiers.local_disk.min_free_fraction": 0.0}
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


def _error_for(srv: ServerProcess, *messages: list[Any]) -> str:
    """The error the feed answers ``messages`` with (each fault names its own field)."""
    import socket

    from kvfabric.rpc.residency import FrameReader

    reader = FrameReader()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(residency_socket_for(srv.config.listen.unix_socket)))
        s.sendall(b"".join(frame(m) for m in messages))
        while True:
            data = s.recv(65536)
            assert data, "the feed hung up without an error"
            for reply in reader.feed(data):
                if reply[0] == "error":
                    return str(reply[1])


def test_bad_requests_get_an_error_naming_what_is_wrong(
    srv: ServerProcess, follow: Callable[[ServerProcess], Follower]
) -> None:
    sub: list[Any] = ["sub", NS]
    key = digest("k")
    errors = {
        "first kind": _error_for(srv, ["meta", key, b""]),
        "sub arity": _error_for(srv, ["sub", NS, "extra"]),
        "sub type": _error_for(srv, ["sub", 7]),
        "sub hex": _error_for(srv, ["sub", "not-a-namespace"]),
        "later kind": _error_for(srv, sub, ["sub", NS]),
        "meta arity": _error_for(srv, sub, ["meta", key]),
        "key type": _error_for(srv, sub, ["meta", 7, b""]),
        "key hex": _error_for(srv, sub, ["meta", "k", b""]),
        "meta type": _error_for(srv, sub, ["meta", key, "not bytes"]),
        "extra keys": _error_for(
            srv, sub, ["meta", key, msgpack_encode([[1], None, bytes(8), 2, ["salt"], None, None])]
        ),
    }
    assert errors.pop("meta type").startswith("meta: msgpack bytes (a bin) of the chunk's")
    assert errors == {
        "first kind": "message kind: the first message is [\"sub\", <namespace>], not 'meta'",
        "sub arity": 'sub message: ["sub", <namespace>], not 3 fields',
        "sub type": "sub namespace: a string of 64 hex digits",
        "sub hex": "sub namespace: namespace must be 64 lower-case hex characters, got 'not-a-namespace'",
        "later kind": 'message kind: after "sub" only "meta" messages are read, not \'sub\'',
        "meta arity": 'meta message: ["meta", <key>, <meta>], not 2 fields',
        "key type": "meta key: a string of 64 hex digits",
        "key hex": "meta key: key must be 64 lower-case hex characters, got 'k'",
        "extra keys": "meta.extra_keys: each entry an array or nil",
    }
    f = follow(srv)
    f.client.describe(digest("k"), ChunkMeta((1,), None, (1, 2), 2))
    f.client._out += frame(["meta", digest("k"), msgpack_encode([[1], None, bytes(8), 0, None, None, None])])
    f.until(lambda: any(isinstance(m, tuple) and m[0] == "error" for m in f.log), "an error", timeout=10)
    (error,) = [m for m in f.log if isinstance(m, tuple) and m[0] == "error"]
    assert "meta.block_size" in str(error[1])


def test_metadata_naming_more_groups_than_a_model_has_is_refused_naming_meta_groups(
    srv: ServerProcess, follow: Callable[[ServerProcess], Follower]
) -> None:
    """One message naming 8,000 groups would be relayed by every engine as 8,000 events: refused."""
    sub: list[Any] = ["sub", NS]
    key = digest("k")

    def meta(groups: list[Any]) -> bytes:
        return msgpack_encode([[1], None, bytes(8), 2, None, None, None, groups])

    errors = {
        "count": _error_for(srv, sub, ["meta", key, meta([[g, None, None] for g in range(8000)])]),
        "bool": _error_for(srv, sub, ["meta", key, meta([[True, "full_attention", None]])]),
        "kind": _error_for(srv, sub, ["meta", key, meta([[0, "k" * 1000, None]])]),
        "window": _error_for(srv, sub, ["meta", key, meta([[0, "sliding_window", -5]])]),
    }
    assert errors["count"] == "meta.groups: an array of 1 to 64 [group_idx, kind, sliding_window] arrays"
    assert errors["bool"].startswith("meta.groups.group_idx: an integer from 0 to 63")
    assert errors["kind"].startswith("meta.groups.kind: a lower-case name of at most 64 characters")
    assert errors["window"].startswith("meta.groups.sliding_window: an integer from 1 to")
    # Nothing of them reached a subscriber.
    f = follow(srv)
    assert [m for m in f.log if isinstance(m, Change)] == []


def _subscribers(srv: ServerProcess) -> float:
    import urllib.request

    with urllib.request.urlopen(f"{srv.metrics_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    gauge = "kvfabric_residency_subscribers "
    values = [line.split()[-1] for line in text.splitlines() if line.startswith(gauge)]
    return float(values[0]) if values else -1.0  # -1: not registered yet (once every listener answers)


def test_only_followers_of_a_namespace_the_server_knows_count_as_routing_subscribers(
    srv: ServerProcess, follow: Callable[[ServerProcess], Follower]
) -> None:
    """The pool's routingSubscribers (hence RoutingEvents and the router's podCacheSize) come from
    this gauge: connections following made-up namespaces are nobody's engine and do not count."""
    import socket

    from kvfabric.rpc.residency import FrameReader

    with CacheClient(srv.unix_target) as client:
        client.describe(NS, SPEC.canonical().decode(), timeout=10)
    made_up = []
    for i in range(5):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(str(residency_socket_for(srv.config.listen.unix_socket)))
        s.sendall(frame(["sub", digest("made-up", i)]))
        reader = FrameReader()
        got: list[list[Any]] = []
        while ["synced"] not in got:
            data = s.recv(65536)
            assert data
            got += reader.feed(data)
        made_up.append(s)
    try:
        wait_until(lambda: _subscribers(srv) >= 0, what="the gauge")
        assert _subscribers(srv) == 0
        follow(srv)  # an engine following the namespace it described
        wait_until(lambda: _subscribers(srv) == 1, what="the engine counted")
        assert _subscribers(srv) == 1
    finally:
        for s in made_up:
            s.close()


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()  # type: ignore[no-any-return]


def _query(srv: ServerProcess, body: object) -> tuple[int, object]:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        srv.metrics_url + "/query",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_the_query_endpoint_answers_matched_tokens_per_tier(
    follow: Callable[[ServerProcess], Follower],
) -> None:
    overrides = {"metrics.residency_query": True, "tiers.local_disk.min_free_fraction": 0.0}
    with cache_server(dram_bytes=64 * MiB, local_disk_bytes=64 * MiB, overrides=overrides) as srv:
        f = follow(srv)
        keys = [digest("q", i) for i in range(3)]
        metas = [
            ChunkMeta((10, 11), None, (1, 2, 3, 4), 2),
            ChunkMeta((20, 21), 11, (5, 6, 7, 8), 2),
            ChunkMeta((30,), 21, (9, 10), 2),  # a tail block
        ]
        salted = ChunkMeta((40, 41), None, (1, 2, 3, 4), 2, extra_keys=(("salt",), None))
        with CacheClient(srv.unix_target) as client:
            client.describe(NS, SPEC.canonical().decode(), timeout=10)  # as a connector does first
            for k, m in zip(keys, metas, strict=True):
                f.client.describe(k, m)
            _store(client, keys)
            f.until(
                lambda: all(f.tiers.get(k) == {"dram", "local_disk"} for k in keys), "stores and write-back"
            )
            f.until(lambda: all(k in f.metas for k in keys), "the metadata")
            tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
            status, body = _query(srv, {"namespace": NS, "token_ids": tokens})
            assert status == 200
            assert body == {
                "matched_tokens": {"dram": 10, "local_disk": 10, "shared": 0, "object": 0, "any": 10}
            }
            # The second chunk leaves DRAM: DRAM's run stops after the first chunk, the disk's goes on.
            client.delete(NS, keys[1:2], timeout=10)
            f.until(lambda: not f.tiers.get(keys[1]), "the delete")
            _, body = _query(srv, {"namespace": NS, "token_ids": tokens})
            assert body == {
                "matched_tokens": {"dram": 4, "local_disk": 4, "shared": 0, "object": 0, "any": 4}
            }
            # A salted chunk never answers an unsalted prompt, nor another LoRA's.
            salted_key = digest("salted")
            f.client.describe(salted_key, salted)
            _store(client, [salted_key])
            f.until(lambda: f.metas.get(salted_key) == salted, "the salted chunk")
            _, body = _query(srv, {"namespace": NS, "token_ids": [1, 2, 3, 4], "lora_name": "other"})
            assert body == {
                "matched_tokens": {"dram": 0, "local_disk": 0, "shared": 0, "object": 0, "any": 0}
            }
        status, text = _query(srv, {"namespace": "nope", "token_ids": []})
        assert (status, "namespace" in str(text)) == (400, True)
        status, text = _query(srv, {"namespace": NS, "token_ids": [-1]})
        assert (status, "token_ids" in str(text)) == (400, True)


def test_the_query_endpoint_is_off_by_default(srv: ServerProcess) -> None:
    status, _ = _query(srv, {"namespace": NS, "token_ids": [1]})
    assert status == 404


def _rss_bytes(srv: ServerProcess) -> int:
    assert srv.proc is not None
    from pathlib import Path

    for line in Path(f"/proc/{srv.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _pending_meta_bytes(srv: ServerProcess) -> float:
    for line in _get(srv.metrics_url + "/metrics").splitlines():
        if line.startswith("kvfabric_residency_pending_meta_bytes "):
            return float(line.split()[1])
    raise AssertionError("no kvfabric_residency_pending_meta_bytes metric")


def test_pending_metadata_flood_leaves_the_server_bounded_and_serving(
    srv: ServerProcess, follow: Callable[[ServerProcess], Follower]
) -> None:
    """Thousands of large metadata messages for chunks never stored: bounded bytes, oversize refused."""
    import socket

    from kvfabric.cacheserver.transport.residencyfeed import MAX_PENDING_BYTES
    from kvfabric.rpc.residency import MAX_META_BYTES, encode_meta

    f = follow(srv)
    with CacheClient(srv.unix_target) as client:
        _store(client, [digest("known", 0)])  # the namespace is known: pending metadata is kept
    f.until(lambda: digest("known", 0) in f.tiers, "the store")
    big = encode_meta(ChunkMeta((b"h" * 32,), None, tuple(range(15_000)), 15_000))  # ~60 KiB, the tokens
    assert len(big) < MAX_META_BYTES
    rss_before = _rss_bytes(srv)
    sock_path = str(residency_socket_for(srv.config.listen.unix_socket))
    count = 1200  # ~70 MiB in all: over four times the pending bound
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(60)
        s.connect(sock_path)
        s.sendall(frame(["sub", NS]))
        for i in range(count):
            s.sendall(frame(["meta", digest("never-stored", i), big]))
        # A made-up namespace reserves nothing.
        other = digest("made-up")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as t:
            t.settimeout(60)
            t.connect(sock_path)
            t.sendall(frame(["sub", other]))
            for i in range(50):
                t.sendall(frame(["meta", digest("made-up", i), big]))
            # One chunk's metadata larger than it can legitimately be is refused, naming the field.
            t.sendall(frame(["meta", digest("made-up", 999), bytes(MAX_META_BYTES + 64)]))
            reply = b""
            while b"error" not in reply:
                data = t.recv(65536)
                if not data:
                    break
                reply += data
        assert b"meta: at most" in reply
        # Messages are handled in order: the error answering a bad one means the flood was read.
        s.sendall(frame(["bogus"]))
        s.shutdown(socket.SHUT_WR)
        got = b""
        while data := s.recv(1 << 20):
            got += data
        assert b"only" in got
    assert _rss_bytes(srv) - rss_before < MAX_PENDING_BYTES + (32 << 20)
    assert MAX_PENDING_BYTES - len(big) - 200 < _pending_meta_bytes(srv) <= MAX_PENDING_BYTES
    # Still serving: a store reaches the follower.
    with CacheClient(srv.unix_target) as client:
        _store(client, [digest("known", 1)])
    f.until(lambda: digest("known", 1) in f.tiers, "a store after the flood")


def test_a_process_hoarding_connections_leaves_another_processs_subscription_working(
    srv: ServerProcess,
) -> None:
    """256 connections from this process (the total bound) cannot keep another process off the feed."""
    import socket
    import subprocess
    import sys

    from kvfabric.cacheserver.transport.residencyfeed import MAX_CONNECTIONS, MAX_CONNECTIONS_PER_PEER

    path = str(residency_socket_for(srv.config.listen.unix_socket))
    hoard: list[socket.socket] = []
    try:
        for _ in range(MAX_CONNECTIONS):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            s.sendall(frame(["sub", NS]))
            hoard.append(s)
        script = (
            "import sys\n"
            "from kvfabric.client.residency import ResidencyFeedClient\n"
            "c = ResidencyFeedClient(sys.argv[1], sys.argv[2])\n"
            "got = []\n"
            "while ('synced', None) not in got:\n"
            "    got += c.read(5.0)\n"
            "print('synced')\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script, path, NS], capture_output=True, timeout=60, check=False
        )
        assert done.stdout.decode().strip() == "synced", done.stderr.decode()[-2000:]
        # The oldest of ours were closed to keep us within our own bound: read them to the hang-up.
        open_ones = 0
        for s in hoard:
            s.settimeout(1.0)
            try:
                while s.recv(65536):
                    pass
            except TimeoutError:
                open_ones += 1  # still subscribed (an evicted one reads its hang-up at once)
        assert open_ones == MAX_CONNECTIONS_PER_PEER
    finally:
        for s in hoard:
            s.close()


def test_a_snapshot_larger_than_the_queue_bound_still_reaches_synced() -> None:
    """The snapshot does not count against the live bound: any namespace size can be followed."""
    from kvfabric.cacheserver.engine.ids import BlockId
    from kvfabric.cacheserver.transport.residencyfeed import ResidencyFeed

    bids = [BlockId.parse(NS, digest("big", i)) for i in range(2000)]
    feed = ResidencyFeed(lambda bid: ["dram"], max_queued_bytes=64 << 10)
    feed.changed(bids)
    sub = feed.subscribe(NS)
    frames = sub.take(1.0)
    assert frames is not None, "the subscriber was closed by its own snapshot"
    assert len(frames) == 2 + len(bids)
    assert frames[-1] == frame(["synced"])
    # Live records still count: falling 64 KiB behind closes it.
    feed.changed([BlockId.parse(NS, digest("more", i)) for i in range(1000)])
    assert sub.take(0.0) is None


def _raw_http(srv: ServerProcess, request: bytes, *, wait: float = 30.0) -> bytes:
    """Send ``request`` as is; what the server answers before it closes (or ``wait`` runs out)."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(srv.metrics_url)
    with socket.create_connection((url.hostname, url.port), timeout=wait) as s:
        s.sendall(request)
        got = b""
        while data := s.recv(65536):
            got += data
        return got


def test_the_query_endpoint_refuses_bad_lengths_stalled_clients_and_huge_token_ids() -> None:
    overrides = {"metrics.residency_query": True}
    with cache_server(dram_bytes=8 * MiB, local_disk_bytes=8 * MiB, overrides=overrides) as srv:
        body = b'{"namespace": "' + NS.encode() + b'", "token_ids": [1]}'
        # A negative Content-Length would read to the end of the stream: a 400 naming it, at once.
        reply = _raw_http(srv, b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n" + body)
        assert reply.startswith(b"HTTP/1.0 400"), reply
        assert b"Content-Length" in reply
        # A client that stops mid-body is dropped by the socket timeout (not a thread held forever).
        start = time.monotonic()
        reply = _raw_http(srv, b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{", wait=60)
        assert time.monotonic() - start < 30
        # Token ids are uint32: a larger one is a 400 naming the field, not a dropped connection.
        status, text = _query(srv, {"namespace": NS, "token_ids": [2**32]})
        assert (status, "token_ids" in str(text)) == (400, True)
        # Still serving.
        status, _ = _query(srv, {"namespace": NS, "token_ids": [1, 2]})
        assert status == 200


def test_the_query_walks_only_the_lengths_resident_chunks_have() -> None:
    """A namespace's chunk lengths shrink with its chunks (the walk tries each length per position)."""
    from kvfabric.cacheserver.engine.ids import BlockId
    from kvfabric.cacheserver.transport.residencyfeed import ResidencyFeed

    held: set[BlockId] = set()
    feed = ResidencyFeed(lambda bid: ["dram"] if bid in held else [], known=lambda ns: True)
    bids = [BlockId.parse(NS, digest("len", n)) for n in range(1, 50)]
    for n, bid in enumerate(bids, start=1):
        feed.describe(bid, ChunkMeta((b"h",), None, tuple(range(n)), n))
        held.add(bid)
        feed.changed([bid])
    assert len(feed._lengths[NS]) == 49
    held.clear()
    feed.changed(bids)
    assert NS not in feed._lengths
    assert feed.match(NS, list(range(10))) == {"dram": 0, "local_disk": 0, "shared": 0, "object": 0, "any": 0}


def test_the_query_of_a_hybrid_chunk_follows_its_full_attention_object_not_its_window_object() -> None:
    """A hybrid chunk's objects share parent and tokens; the window object (a few blocks) never answers."""
    from kvfabric.cacheserver.engine.ids import BlockId
    from kvfabric.cacheserver.transport.residencyfeed import ResidencyFeed
    from kvfabric.rpc.kvledger import GroupTag

    tiers: dict[BlockId, list[str]] = {}
    feed = ResidencyFeed(lambda bid: tiers.get(bid, []), known=lambda ns: True)
    full = BlockId.parse(NS, digest("hybrid", "full"))
    window = BlockId.parse(NS, digest("hybrid", "window"))
    tokens = tuple(range(16))
    tiers[full] = ["dram"]
    tiers[window] = ["local_disk"]
    feed.describe(full, ChunkMeta((b"a", b"b"), None, tokens, 8, groups=(GroupTag(0, "full_attention"),)))
    feed.describe(
        window, ChunkMeta((b"a", b"b"), None, tokens, 8, groups=(GroupTag(1, "sliding_window", 8),))
    )
    feed.changed([full, window])
    assert feed.match(NS, list(tokens)) == {"dram": 16, "local_disk": 0, "shared": 0, "object": 0, "any": 16}
    # The full-attention object gone, the window object alone answers nothing.
    del tiers[full]
    feed.changed([full])
    assert feed.match(NS, list(tokens)) == {"dram": 0, "local_disk": 0, "shared": 0, "object": 0, "any": 0}
