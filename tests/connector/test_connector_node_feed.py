"""Engines announce what their node's cache server holds: the residency feed turned into KV events.

Two engines' event logs follow one real cache-server process. Engine A stores chunks (handing the
server their metadata); both engines announce them, the sibling included; DRAM pressure, a delete
and a restart each reach both engines' next ``take_events()``; the events, decoded by the models of
llm-d's and Dynamo's indexes, equal the server's residency. Unit tests drive the follower with a
scripted feed: prefix order, the per-step announcement budget, a lost connection, a new epoch.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvfabric.client import CacheClient
from kvfabric.client.errors import CacheUnavailable
from kvfabric.connector import vllmevents
from kvfabric.connector.keys import NamespaceSpec
from kvfabric.connector.nodefeed import MAX_RETRY_SECONDS, NodeResidency, node_residency_for
from kvfabric.connector.steps import SaveSpec
from kvfabric.rpc import kvevents as kv
from kvfabric.rpc.kvledger import ChunkMeta, EventLedger, GroupTag
from kvfabric.rpc.residency import Change
from kvfabric.testing.routerindex import RouterIndexModel
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, payload_for, wait_until

BLOCK = 2
SPEC = NamespaceSpec("meta-llama/Llama-3.1-8B", "0e9e39f", "bfloat16", 32, 8, 128, 16, 256)
NS = SPEC.digest()  # described over gRPC before metadata is attached, as a connector does


def _meta(i: int, parent: int | None) -> ChunkMeta:
    """Chunk ``i``: two blocks hashed ``i*10``, ``i*10+1``; its parent block is ``parent*10+1``."""
    return ChunkMeta(
        block_hashes=(i * 10, i * 10 + 1),
        parent_block_hash=None if parent is None else parent * 10 + 1,
        token_ids=tuple(range(i * 4, i * 4 + 4)),
        block_size=BLOCK,
    )


# ----------------------------------------------------------------------------------------- unit


class ScriptedFeed:
    """A feed connection that returns queued messages, then (optionally) hangs up."""

    def __init__(self, messages: list[Any]) -> None:
        self.messages = messages
        self.described: list[str] = []
        self.gone = False

    def describe(self, key: str, meta: ChunkMeta | bytes) -> None:
        self.described.append(key)

    def read(self, timeout: float = 0.0) -> list[Any]:
        if self.gone:
            raise CacheUnavailable("gone")
        out, self.messages = self.messages, []
        return out

    def close(self) -> None:
        self.gone = True


def _follower(feeds: list[ScriptedFeed], **kwargs: Any) -> NodeResidency:
    it = iter(feeds)
    return NodeResidency(lambda: next(it), EventLedger(), clock=lambda: 0.0, **kwargs)


def test_a_snapshot_is_announced_parents_first_within_the_per_step_budget() -> None:
    metas = {f"k{i}": _meta(i, i - 1 if i else None) for i in range(4)}
    # The server lists children before parents (e.g. a disk scan's order).
    snapshot = [Change("stored", f"k{i}", "local_disk", metas[f"k{i}"]) for i in (3, 1, 2, 0)]
    node = _follower([ScriptedFeed([("hello", 7), *snapshot, ("synced", None)])], announce_per_step=3)
    node.poll()
    first = node.ledger.take()
    assert [e.block_hashes[0] for e in first if isinstance(e, kv.BlockStored)] == [0, 10, 20]
    node.poll()
    (last,) = node.ledger.take()
    assert isinstance(last, kv.BlockStored)
    assert (last.block_hashes, last.parent_block_hash, last.medium, last.locality) == (
        (30, 31),
        21,
        "STORAGE",
        "LOCAL",
    )


def test_a_lost_connection_withdraws_dram_and_a_new_epoch_withdraws_what_its_snapshot_lacks() -> None:
    m0, m1 = _meta(0, None), _meta(1, 0)
    first = ScriptedFeed(
        [
            ("hello", 1),
            Change("stored", "k0", "dram", m0),
            Change("stored", "k0", "local_disk", m0),
            Change("stored", "k1", "local_disk", m1),
            ("synced", None),
        ]
    )
    second = ScriptedFeed([("hello", 2), Change("stored", "k0", "local_disk", None), ("synced", None)])
    node = _follower([first, second])
    node.poll()
    assert node.ledger.credited() == {(kv.Scope("CPU"), 0), (kv.Scope("CPU"), 1)} | {
        (kv.Scope("STORAGE", "LOCAL"), h) for h in (0, 1, 10, 11)
    }
    node.ledger.take()
    first.gone = True
    node.poll()  # the hang-up: DRAM went with the server; the next poll reconnects
    assert node.ledger.take() == [kv.BlockRemoved((0, 1), "CPU")]
    node.poll()  # epoch 2: k1 is no longer on disk; k0 is, without metadata (re-described)
    assert node.epoch == 2
    assert node.ledger.take() == [kv.BlockRemoved((10, 11), "STORAGE", locality="LOCAL")]
    assert second.described == ["k0"]
    assert node.ledger.credited() == {(kv.Scope("STORAGE", "LOCAL"), h) for h in (0, 1)}


def test_a_store_is_announced_at_once_and_withdrawn_if_the_server_never_confirms_it() -> None:
    now = [0.0]
    feed = ScriptedFeed([("hello", 1), ("synced", None)])
    node = NodeResidency(lambda: feed, EventLedger(), clock=lambda: now[0], confirm_seconds=10)
    node.poll()
    node.describe("kept", _meta(0, None))
    node.describe("dropped", _meta(5, None))
    assert [e.block_hashes for e in node.ledger.take() if not isinstance(e, kv.AllBlocksCleared)] == [
        (0, 1),
        (50, 51),
    ]  # in the storing step
    assert feed.described == ["kept", "dropped"]
    feed.messages = [Change("stored", "kept", "dram", None)]
    now[0] = 5.0
    node.poll()
    assert node.ledger.take() == []
    now[0] = 10.5
    node.poll()  # "dropped" never reached the server (back-pressure): its credit goes
    assert node.ledger.take() == [kv.BlockRemoved((50, 51), "CPU")]


def test_a_store_handed_over_before_the_snapshot_arrived_is_announced_once() -> None:
    """An engine's first stores can precede its feed's snapshot: they are in flight, not gone."""
    feed = ScriptedFeed([])
    now = [0.0]
    node = NodeResidency(lambda: feed, EventLedger(), clock=lambda: now[0])
    node.describe("k0", _meta(0, None))  # before the first take_events(): not even connected yet
    feed.messages = [("hello", 1), ("synced", None)]  # the store has not landed yet
    node.poll()
    feed.messages = [Change("stored", "k0", "dram", _meta(0, None))]
    node.poll()
    events = node.ledger.take()
    assert events == [kv.BlockStored((0, 1), None, (0, 1, 2, 3), BLOCK, None, "CPU", None)]


def test_a_siblings_chunk_whose_prefix_is_gone_is_not_announced() -> None:
    """Routers drop an event whose parent they never saw; a prefix walk could never reach it."""
    feed = ScriptedFeed([("hello", 1), ("synced", None)])
    node = _follower([feed])
    node.poll()
    feed.messages = [
        Change("stored", "orphan", "dram", _meta(3, 2)),
        Change("stored", "root", "dram", _meta(0, None)),
    ]
    node.poll()
    assert [e.block_hashes for e in node.ledger.take() if isinstance(e, kv.BlockStored)] == [(0, 1)]
    # Its parent comes (stored in the same batch, after it): then it is announced, after the parent.
    feed.messages = [Change("stored", "k2", "dram", _meta(2, 1)), Change("stored", "k1", "dram", _meta(1, 0))]
    node.poll()
    assert [e.block_hashes for e in node.ledger.take() if isinstance(e, kv.BlockStored)] == [
        (10, 11),
        (20, 21),
        (30, 31),
    ]
    # This engine's own chunk is announced whatever the feed holds of its prefix (vLLM announced it).
    node.describe("mine", _meta(5, 4))
    assert [e.block_hashes for e in node.ledger.take() if isinstance(e, kv.BlockStored)] == [(50, 51)]


def test_a_siblings_window_object_is_relayed_with_its_groups_once_its_parent_is_known() -> None:
    """A hybrid model's sliding-window object starts inside its span: its parent is a middle block
    of the full-attention object of the same span. Relayed before that object, it waits; once the
    full object is announced it follows, with the group fields the storing engine gave it."""
    full = GroupTag(1, "full_attention", None)
    window = GroupTag(0, "sliding_window", 3)
    chunk = ChunkMeta((0, 1, 2, 3), None, tuple(range(8)), BLOCK, groups=(full,))
    tail = ChunkMeta((2, 3), 1, tuple(range(4, 8)), BLOCK, groups=(window,))
    feed = ScriptedFeed([("hello", 1), ("synced", None)])
    node = _follower([feed], groups=(full, window))
    node.poll()
    feed.messages = [Change("stored", "window", "dram", tail)]
    node.poll()
    assert node.ledger.take() == []  # its parent (block 1) is not known to a router yet
    feed.messages = [Change("stored", "full", "dram", chunk)]
    node.poll()
    events = [e for e in node.ledger.take() if isinstance(e, kv.BlockStored)]
    assert [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in events] == [
        (1, "full_attention", None),
        (0, "sliding_window", 3),
    ]
    assert [e.block_hashes for e in events] == [(0, 1, 2, 3), (2, 3)]
    feed.messages = [Change("removed", "window", "dram")]
    node.poll()
    assert node.ledger.take() == [kv.BlockRemoved((2, 3), "CPU", group_idx=0)]


def test_relayed_metadata_naming_groups_this_model_lacks_is_dropped_and_counted() -> None:
    """A process on the node can describe a chunk with groups of its choosing: every engine would
    relay it once per group. An engine announces only its own model's groups."""
    full = GroupTag(1, "full_attention", None)
    window = GroupTag(0, "sliding_window", 3)
    forged = [GroupTag(g, "full_attention") for g in range(2, 64)]
    feed = ScriptedFeed([("hello", 1), ("synced", None)])
    node = _follower([feed], groups=(full, window))
    node.poll()
    feed.messages = [
        Change(
            "stored",
            "forged",
            "dram",
            ChunkMeta((0, 1), None, tuple(range(4)), BLOCK, groups=(full, *forged)),
        ),
        Change(
            "stored",
            "other-window",
            "dram",
            ChunkMeta((0, 1), None, tuple(range(4)), BLOCK, groups=(GroupTag(0, "sliding_window", 4),)),
        ),
        Change("stored", "mine", "dram", ChunkMeta((5, 6), None, tuple(range(4)), BLOCK, groups=(full,))),
        Change("stored", "plain", "dram", _meta(7, None)),
    ]
    node.poll()
    events = node.ledger.take()
    assert [(e.block_hashes, e.group_idx) for e in events if isinstance(e, kv.BlockStored)] == [
        ((5, 6), 1),
        ((70, 71), None),
    ]
    assert len(events) == 2
    assert node.foreign_groups_dropped == 2
    # Stored again in another tier: still never announced, and not decoded (nor counted) again.
    feed.messages = [Change("stored", "forged", "local_disk", None)]
    node.poll()
    assert node.ledger.take() == []
    assert node.foreign_groups_dropped == 2


def test_a_store_of_a_chunk_the_server_holds_is_credited_as_the_feed_says() -> None:
    """The server drops a store of a chunk it holds: only the tiers it holds are credited, not DRAM."""
    feed = ScriptedFeed(
        [("hello", 1), Change("stored", "k0", "local_disk", _meta(0, None)), ("synced", None)]
    )
    node = _follower([feed])
    node.poll()
    node.ledger.take()
    node.describe("k0", _meta(0, None))
    assert node.ledger.take() == []
    assert node.ledger.credited() == {(kv.Scope("STORAGE", "LOCAL"), h) for h in (0, 1)}


def test_without_a_feed_the_log_announces_stores_itself() -> None:
    node = _follower([])
    node._next_try = 1.0  # the feed is down until the clock reaches 1.0
    assert not node.connected
    node.poll()
    assert node.ledger.take() == []


def _connects_over(feed: Callable[[], ScriptedFeed], seconds: float) -> list[float]:
    """When a follower polled every 0.1 s opened ``feed`` over ``seconds`` (a fake clock)."""
    now = [0.0]
    opened: list[float] = []

    def connect() -> ScriptedFeed:
        opened.append(now[0])
        return feed()

    node = NodeResidency(connect, EventLedger(), clock=lambda: now[0])
    while now[0] < seconds:
        node.poll()
        now[0] = round(now[0] + 0.1, 1)
    return opened


def test_a_feed_that_fails_repeatedly_is_retried_with_growing_delay() -> None:
    """Refused, or lost right after its snapshot: retried ever later, not every step."""

    def refused() -> ScriptedFeed:
        raise CacheUnavailable("refused")

    def lost_at_once() -> ScriptedFeed:
        feed = ScriptedFeed([("hello", 1), ("synced", None)])
        feed.gone = True  # hangs up as soon as it is read (evicted, overflowing)
        return feed

    for make in (refused, lost_at_once):
        opened = _connects_over(make, 100.0)
        gaps = [round(b - a, 1) for a, b in itertools.pairwise(opened)]
        assert gaps == sorted(gaps), gaps  # never sooner than the last time
        assert gaps[-1] == MAX_RETRY_SECONDS  # growing up to the cap
        assert len(opened) <= 10, opened  # polled 1,000 times


def test_a_feed_raising_anything_never_breaks_a_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """``build_connector_meta`` calls ``stored()``: a feed raising OSError (EMFILE) falls back."""
    monkeypatch.setattr(vllmevents, "_VLLM", True)
    monkeypatch.setattr(vllmevents, "to_vllm", lambda e: e)

    def emfile() -> ScriptedFeed:
        raise OSError(24, "Too many open files")

    events = vllmevents.KVEventLog(BLOCK, enabled=True, follow=lambda ledger: NodeResidency(emfile, ledger))
    request = SimpleNamespace(block_hashes=[0, 1, 10, 11], all_token_ids=list(range(8)), lora_request=None)
    events.stored(request, SaveSpec("r", ["k0", "k1"], [[5, 6], [7, 8]], first_blocks=[0, 2]))
    assert events.node is None  # no longer followed
    assert events.failures == 1
    stored = [e for e in events.take() if isinstance(e, kv.BlockStored)]
    assert [e.block_hashes for e in stored] == [(0, 1), (10, 11)]  # both announced, as without a feed


# ----------------------------------------------------------------------------------------- process


# Write-backs must land whatever else fills this machine's disk (the tier refuses below 5 % free).
ROOMY = {"tiers.local_disk.min_free_fraction": 0.0}


@pytest.fixture
def srv() -> Iterator[ServerProcess]:
    with cache_server(dram_bytes=8 * MiB, local_disk_bytes=64 * MiB, overrides=ROOMY) as s:
        yield s


def _engine_log(srv: ServerProcess) -> vllmevents.KVEventLog:
    """An engine's event log following ``srv`` (``to_vllm`` patched: events as kvfabric's records)."""
    sock = str(srv.config.listen.unix_socket)
    return vllmevents.KVEventLog(
        BLOCK, enabled=True, follow=lambda ledger: node_residency_for(sock, NS, ledger)
    )


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch, srv: ServerProcess) -> Iterator[list[vllmevents.KVEventLog]]:
    """Two engines' event logs following ``srv`` (events as kvfabric's wire records)."""
    monkeypatch.setattr(vllmevents, "_VLLM", True)
    monkeypatch.setattr(vllmevents, "to_vllm", lambda e: e)
    logs = [_engine_log(srv) for _ in range(2)]
    yield logs
    for log in logs:
        assert log.node is not None
        log.node.close()


class Router:
    """Both routers' index models, fed every engine's events (as wire bytes)."""

    def __init__(self) -> None:
        self.models = [RouterIndexModel("llm-d"), RouterIndexModel("dynamo")]

    def step(self, logs: list[vllmevents.KVEventLog]) -> bool:
        """Take and apply every engine's events; True (so a wait can step and test in one lambda)."""
        for i, log in enumerate(logs):
            events = log.take()
            if events:
                payload = kv.encode_batch(time.time(), events)
                for m in self.models:
                    m.apply_bytes(f"engine-{i}", payload)
        return True

    def entries(self, i: int) -> set[tuple[str, int]]:
        return {(t, h) for t, h in self.models[0].entries(f"engine-{i}") if isinstance(h, int)}


def _expected(resident: dict[str, tuple[str, ...]], metas: dict[str, ChunkMeta]) -> set[tuple[str, int]]:
    names = {"dram": "cpu", "local_disk": "storage"}
    return {
        (names[t], int(h))
        for key, tiers in resident.items()
        if key in metas
        for t in tiers
        if t in names
        for h in metas[key].block_hashes
    }


def _resident(srv: ServerProcess) -> dict[str, tuple[str, ...]]:
    from kvfabric.client.residency import ResidencyFeedClient
    from kvfabric.rpc.residency import residency_socket_for

    client = ResidencyFeedClient(residency_socket_for(srv.config.listen.unix_socket), NS)
    tiers: dict[str, set[str]] = {}
    try:
        done = False
        while not done:
            for m in client.read(1.0):
                if isinstance(m, Change):
                    tiers.setdefault(m.key, set()).add(m.tier)
                done = done or m == ("synced", None)
    finally:
        client.close()
    return {k: tuple(sorted(v)) for k, v in tiers.items()}


@pytest.mark.process
@pytest.mark.slow
def test_sibling_engines_announce_the_nodes_residency_and_follow_every_change(
    srv: ServerProcess, engines: list[vllmevents.KVEventLog]
) -> None:
    router = Router()
    a, b = engines
    assert a.node is not None
    assert b.node is not None
    wait_until(
        lambda: router.step(engines) and a.node.connected and b.node.connected, what="both engines follow"
    )
    keys = [digest("chunk", i) for i in range(40)]
    metas = {k: _meta(i, i - 1 if i else None) for i, k in enumerate(keys)}

    def agree() -> bool:
        router.step(engines)
        want = _expected(_resident(srv), metas)
        return router.entries(0) == want and router.entries(1) == want

    with CacheClient(srv.unix_target) as client:
        client.describe(NS, SPEC.canonical().decode(), timeout=10)
        # Engine A names what it stores (as build_connector_meta does) and stores it, prefix first;
        # 40 x 256 KiB through 8 MiB of DRAM: the oldest are evicted to disk on the way.
        assert a.node is not None
        for i in range(0, 40, 8):
            for k in keys[i : i + 8]:
                a.node.describe(k, metas[k])
            payloads = [payload_for(k, 256 << 10) for k in keys[i : i + 8]]
            assert client.store(NS, keys[i : i + 8], payloads, timeout=10).accepted == 8
        wait_until(agree, timeout=30, what="both engines to announce the node's residency")
        assert ("storage", 0) in router.entries(1), "the sibling is credited with A's chunk on disk"
        assert ("cpu", 390) in router.entries(1), "and with A's newest chunk in DRAM"
        # A delete reaches both engines (how soon is measured by `kvfabric bench routing`).
        assert client.delete(NS, keys[39:], timeout=10) == 1
        wait_until(lambda: router.step(engines) and ("cpu", 390) not in router.entries(1), what="the removal")
        wait_until(agree, timeout=30, what="agreement after the delete")
    # A restart loses DRAM: both engines withdraw it on their next step, then re-follow.
    srv.kill()
    wait_until(
        lambda: router.step(engines) and not any(t == "cpu" for t, _ in router.entries(1)),
        what="DRAM withdrawn",
    )
    srv.start()
    wait_until(lambda: router.step(engines) and a.node.connected and b.node.connected, what="re-following")
    wait_until(agree, timeout=30, what="agreement after the restart")
    assert router.entries(0), "the disk tier survived the restart and stays credited"
    for m in router.models:
        assert m.violations.double_stores == 0
        assert m.violations.removals_of_unheld == 0
        assert m.violations.clears == 0


@pytest.mark.process
@pytest.mark.slow
def test_an_engine_started_after_a_sigkill_announces_the_disk_no_connector_remembers(
    monkeypatch: pytest.MonkeyPatch, srv: ServerProcess
) -> None:
    """The storing engine is gone and the server was SIGKILLed: the names kept on disk name the chunks."""
    monkeypatch.setattr(vllmevents, "_VLLM", True)
    monkeypatch.setattr(vllmevents, "to_vllm", lambda e: e)
    keys = [digest("kept", i) for i in range(4)]
    metas = {k: _meta(i, i - 1 if i else None) for i, k in enumerate(keys)}
    storing = _engine_log(srv)
    router = Router()
    assert storing.node is not None
    wait_until(lambda: router.step([storing]) and storing.node.connected, what="the storing engine follows")
    with CacheClient(srv.unix_target) as client:
        client.describe(NS, SPEC.canonical().decode(), timeout=10)
        for k in keys:
            storing.node.describe(k, metas[k])
        assert client.store(NS, keys, [payload_for(k, 256 << 10) for k in keys], timeout=10).accepted == 4
    wait_until(lambda: all("local_disk" in _resident(srv).get(k, ()) for k in keys), what="write-backs")
    storing.node.close()  # the engine that remembers the names is gone
    srv.kill()
    srv.start()
    fresh, seen = _engine_log(srv), Router()  # a new engine: its router index starts empty
    try:
        want = {("storage", h) for k in keys for h in metas[k].block_hashes}
        wait_until(
            lambda: seen.step([fresh]) and seen.entries(0) == want, timeout=30, what="the disk announced"
        )
        for m in seen.models:
            assert m.violations.double_stores == 0
            assert m.violations.orphan_parents == 0
    finally:
        assert fresh.node is not None
        fresh.node.close()


def test_a_feed_that_sends_garbage_or_fails_never_breaks_take_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """A malformed message restarts the subscription; an unexpected failure stops following."""
    monkeypatch.setattr(vllmevents, "_VLLM", True)
    monkeypatch.setattr(vllmevents, "to_vllm", lambda e: e)
    bad = ScriptedFeed([("hello", 1)])
    bad.read = lambda timeout=0.0: (_ for _ in ()).throw(kv.DecodeError("garbage"))  # type: ignore[method-assign]
    log = vllmevents.KVEventLog(BLOCK, enabled=True, follow=lambda ledger: _follower([bad]))
    assert log.take() == []
    assert log.node is not None
    assert not log.node.connected

    def fail() -> None:
        raise RuntimeError("a bug")

    def broken(ledger: EventLedger) -> NodeResidency:
        node = _follower([])
        node.poll = fail  # type: ignore[method-assign]
        return node

    log = vllmevents.KVEventLog(BLOCK, enabled=True, follow=broken)
    assert log.take() == []
    assert log.node is None
