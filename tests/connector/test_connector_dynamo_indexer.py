"""Dynamo's own KV indexer, fed over ZMQ, holds exactly what the node's cache server holds.

An independent consumer: NVIDIA Dynamo's standalone indexer (``python -m dynamo.indexer``, the
``dynamo-kv-router`` Rust code in PyPI's ``ai-dynamo-runtime``; :mod:`kvfabric.testing.dynamoindexer`)
dials two engines' ZMQ publishers, decodes the frames with Dynamo's parser and files the blocks in
its per-tier radix trees. The engines are the connector's event path (``KVEventLog`` following a real
cache-server process, as inside vLLM) publishing vLLM's three-frame messages. Through stores that
evict to local disk, a delete, a cache-server SIGKILL and restart, an engine restart (a new engine,
a new identity for the router, announcing the node from the feed's snapshot) and TTL expiry,
Dynamo's index of each engine's host and disk tiers must equal the server's residency, block for
block.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from tests.connector.test_connector_node_feed import NS, SPEC, _resident

from kvfabric.client import CacheClient
from kvfabric.connector import vllmevents
from kvfabric.connector.nodefeed import node_residency_for
from kvfabric.rpc import kvevents as kv
from kvfabric.rpc.kvledger import ChunkMeta
from kvfabric.testing.dynamoindexer import DynamoIndexer, find_python, skip_reason
from kvfabric.testing.serverproc import (
    MiB,
    ServerProcess,
    cache_server,
    digest,
    free_port,
    payload_for,
    wait_until,
)

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(300)]

BLOCK = 4
MODEL = "tiny"
TTL = 20


def _meta(i: int) -> ChunkMeta:
    """Chunk ``i`` of one long prompt: blocks ``i*10+1``, ``i*10+2``, chained to chunk ``i-1``."""
    return ChunkMeta(
        block_hashes=(i * 10 + 1, i * 10 + 2),
        parent_block_hash=None if i == 0 else (i - 1) * 10 + 2,
        token_ids=tuple(range(1000 + i * 2 * BLOCK, 1000 + (i + 1) * 2 * BLOCK)),
        block_size=BLOCK,
    )


class Engine:
    """One engine's event path and its ZMQ publisher (vLLM's frames: topic, 8-byte sequence, batch)."""

    def __init__(self, log: vllmevents.KVEventLog) -> None:
        import zmq

        self.log = log
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.port = free_port()
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.seq = 0
        self.events = 0

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def publish(self, events: list[kv.Event]) -> None:
        payload = kv.encode_batch(time.time(), events)
        self.sock.send_multipart([f"kv@engine@{MODEL}".encode(), self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def step(self) -> bool:
        """One engine step: ``take_events()`` handed to the publisher; True (to step inside a wait)."""
        events = self.log.take()
        if events:
            self.events += len(events)
            self.publish(events)
        return True

    def close(self) -> None:
        if self.log.node is not None:
            self.log.node.close()
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def srv() -> Iterator[ServerProcess]:
    # min_free_fraction 0: write-back must not depend on how full this machine's disk happens to be.
    overrides = {
        "ttl_seconds": TTL,
        "bucket_seconds": 2,
        "janitor_interval_seconds": 0.5,
        "tiers.local_disk.min_free_fraction": 0,
    }
    with cache_server(dram_bytes=8 * MiB, local_disk_bytes=64 * MiB, overrides=overrides) as s:
        yield s


@pytest.fixture
def indexer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DynamoIndexer]:
    if find_python() is None:
        pytest.skip(skip_reason())
    with DynamoIndexer.start(tmp_path_factory.mktemp("dynamo") / "indexer.log") as idx:
        yield idx


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch, srv: ServerProcess) -> Iterator[list[Engine]]:
    monkeypatch.setattr(vllmevents, "_VLLM", True)
    monkeypatch.setattr(vllmevents, "to_vllm", lambda e: e)
    sock = str(srv.config.listen.unix_socket)
    out = [
        Engine(
            vllmevents.KVEventLog(
                BLOCK, enabled=True, follow=lambda ledger: node_residency_for(sock, NS, ledger)
            )
        )
        for _ in range(2)
    ]
    yield out
    for e in out:
        e.close()


def _subscribed(idx: DynamoIndexer, workers: dict[int, Engine]) -> None:
    """Register engines and wait until Dynamo reads each publisher (ZMQ's slow joiner)."""
    for w, e in workers.items():
        idx.register(w, e.endpoint, model=MODEL, block_size=BLOCK)
    probe = kv.BlockStored((7,), None, (1, 2, 3, 4), BLOCK, None, kv.MEDIUM_GPU, None)

    def seen() -> bool:
        for e in workers.values():
            e.publish([probe])
        got = idx.entries()
        return all(7 in got[w]["device"] for w in workers)

    wait_until(seen, timeout=30, interval=0.2, what="Dynamo's indexer to read the publishers")
    for e in workers.values():
        e.publish([kv.BlockRemoved((7,), kv.MEDIUM_GPU)])


def _expected(srv: ServerProcess, metas: dict[str, ChunkMeta]) -> dict[str, set[int]]:
    """The server's residency as Dynamo files it: DRAM -> host_pinned, local disk -> disk."""
    tiers = {"dram": "host_pinned", "local_disk": "disk"}
    out: dict[str, set[int]] = {"host_pinned": set(), "disk": set()}
    for key, held in _resident(srv).items():
        for t in held:
            if key in metas and t in tiers:
                out[tiers[t]].update(int(h) for h in metas[key].block_hashes)
    return out


def test_dynamos_indexer_holds_exactly_the_nodes_residency_through_churn(
    srv: ServerProcess, indexer: DynamoIndexer, engines: list[Engine]
) -> None:
    a = engines[0]
    workers = dict(enumerate(engines))  # Dynamo's worker id -> the engine it follows
    wait_until(
        lambda: all(e.step() and e.log.node is not None and e.log.node.connected for e in engines),
        what="both engines follow the feed",
    )
    _subscribed(indexer, workers)
    keys = [digest("dyn-chunk", i) for i in range(40)]
    metas = {k: _meta(i) for i, k in enumerate(keys)}
    last: dict[str, object] = {}

    def agree(settled: Callable[[dict[str, set[int]]], bool] = lambda want: True) -> bool:
        for e in workers.values():
            e.step()
        want = _expected(srv, metas)
        got = indexer.entries()
        last.update(want=want, got=got)
        same = all({t: got[w][t] for t in want} == want and not got[w]["device"] for w in workers)
        return same and settled(want)

    def agreed(what: str, settled: Callable[[dict[str, set[int]]], bool]) -> dict[str, set[int]]:
        """Wait for a quiescent point the server reached (``settled``) where both indexes equal it."""
        try:
            wait_until(lambda: agree(settled), timeout=60, interval=0.3, what=what)
        except TimeoutError:
            raise AssertionError(f"Dynamo's index never equalled the residency ({what}): {last}") from None
        want = last["want"]
        assert isinstance(want, dict)
        return want

    with CacheClient(srv.unix_target) as client:
        client.describe(NS, SPEC.canonical().decode(), timeout=10)
        # Engine A names and stores 40 x 256 KiB, prefix first, through 8 MiB of DRAM: the oldest
        # are evicted to disk on the way (write-back, then DRAM eviction).
        assert a.log.node is not None
        for i in range(0, 40, 8):
            for k in keys[i : i + 8]:
                a.log.node.describe(k, metas[k])
            payloads = [payload_for(k, 256 << 10) for k in keys[i : i + 8]]
            assert client.store(NS, keys[i : i + 8], payloads, timeout=10).accepted == 8
        # Settled: the first chunk written back to disk and evicted from DRAM, the newest in DRAM.
        want = agreed(
            "stores and evictions",
            lambda w: {1, 2} <= w["disk"] and 1 not in w["host_pinned"] and 392 in w["host_pinned"],
        )
        # The sibling (engine B) stored nothing and is credited with all of it, in Dynamo's own index.
        assert indexer.entries()[1]["disk"] == want["disk"]
        # A delete of the newest chunk is withdrawn from both engines' entries.
        assert client.delete(NS, keys[39:], timeout=10) == 1
        agreed("a delete", lambda w: 392 not in w["host_pinned"] and 392 not in w["disk"])
    # SIGKILL: the server's DRAM is gone; both engines withdraw it, then follow the new process.
    srv.kill()
    wait_until(
        lambda: (
            all([e.step() for e in workers.values()])
            and not any(indexer.entries()[w]["host_pinned"] for w in workers)
        ),
        timeout=30,
        what="DRAM withdrawn from Dynamo's index after the SIGKILL",
    )
    srv.start()
    # Local disk survived the restart and is credited again; a restarted server holds no DRAM.
    want = agreed("the restart", lambda w: {1, 2} <= w["disk"])
    assert not want["host_pinned"]
    # Engine A restarts: a new process (a new identity for the router, as a new pod) that stored
    # nothing announces the node's residency from the feed's snapshot, the names included.
    del workers[0]
    indexer.unregister(0)
    sock = str(srv.config.listen.unix_socket)
    fresh = Engine(
        vllmevents.KVEventLog(BLOCK, enabled=True, follow=lambda ledger: node_residency_for(sock, NS, ledger))
    )
    engines.append(fresh)  # closed by the fixture
    workers[2] = fresh
    _subscribed(indexer, {2: fresh})
    agreed("an engine restart", lambda w: {1, 2} <= w["disk"])
    # TTL expiry: nothing was hit since the stores; every block leaves the disk and the index.
    try:
        wait_until(lambda: agree(lambda w: not any(w.values())), timeout=TTL + 30, interval=0.5)
    except TimeoutError:
        raise AssertionError(f"expiry did not empty the server and Dynamo's index alike: {last}") from None
    assert "Failed to decode" not in indexer.log_tail(1 << 20), "every frame decodes under Dynamo's parser"
