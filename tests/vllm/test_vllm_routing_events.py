"""Real ``vllm serve`` with the connector: Dynamo's own indexer holds exactly what the cache server holds.

One cache server (4 MiB of DRAM, so stores evict to local disk), one vLLM OpenAI server with the
connector and ``--kv-events-config`` (vLLM's ZMQ publisher and its replay socket, vLLM's default
integer block hashes), and two independent consumers of the real ZMQ frames:

- a subscriber in the vLLM environment that decodes every frame with vLLM's own
  ``KVEventBatch`` class (msgspec, typed): every frame must decode;
- NVIDIA Dynamo's standalone KV indexer (:mod:`kvfabric.testing.dynamoindexer`), which dials the
  publisher and its replay socket, parses the frames with Dynamo's ``zmq_wire`` code and files the
  blocks per tier.

At quiescent points (the server settled, the engine stepped by a short request so that vLLM
publishes what the connector took), Dynamo's ``host_pinned`` and ``disk`` trees for the engine must
equal, block for block, the cache server's DRAM and local-disk residency read from its feed, through
stores and evictions, a promotion (a disk hit loaded back into DRAM), a delete, a cache-server
SIGKILL and restart, an engine restart (a new process, announced under a new identity, as a new
pod is) and TTL expiry.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.vllm import workload
from tests.vllm.spyconnector import read_records, spy_environ, spy_transfer_config

from kvfabric.client import CacheClient
from kvfabric.client.errors import CacheUnavailable
from kvfabric.client.residency import ResidencyFeedClient
from kvfabric.rpc.kvledger import ChunkMeta
from kvfabric.rpc.residency import Change, residency_socket_for
from kvfabric.testing.dynamoindexer import DynamoIndexer, find_python, skip_reason
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, free_port, wait_until
from kvfabric.testing.vllmenv import VllmEnv, VllmServer, connector_config, metric_sum

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

CHUNK = 256
BLOCK = 128  # the CPU backend's KV-cache block
CONNECTOR = {
    "chunk_tokens": CHUNK,
    "lookup_deadline_ms": 3000,
    "load_deadline_ms": 15000,
    "cost_model": False,
}
SERVER_ARGS = ["--num-gpu-blocks-override", "32", "--max-num-seqs", "4"]
POKE = [7, 8, 9]  # shorter than a block: a request that steps the engine and stores nothing
TIERS = {"dram": "host_pinned", "local_disk": "disk"}

_DECODER = """
import json, sys, msgspec, zmq
from vllm.distributed.kv_events import KVEventBatch
sock = zmq.Context().socket(zmq.SUB)
for endpoint in sys.argv[1:]:
    sock.connect(endpoint)
sock.setsockopt(zmq.SUBSCRIBE, b"")
print(json.dumps({"ready": True}), flush=True)
decode = msgspec.msgpack.Decoder(KVEventBatch).decode
while True:
    topic, seq, payload = sock.recv_multipart()
    try:
        batch = decode(payload)
        media = [getattr(e, "medium", None) for e in batch.events]
        print(json.dumps({"ok": True, "events": len(batch.events), "media": media}), flush=True)
    except Exception as exc:
        print(json.dumps({"ok": False, "error": repr(exc)}), flush=True)
"""


class VllmDecoder:
    """Every frame of the publishers, decoded by vLLM's own classes in the vLLM environment."""

    def __init__(self, env: VllmEnv, endpoints: list[str]) -> None:
        self.proc = subprocess.Popen(
            [str(env.python), "-c", _DECODER, *endpoints],
            stdout=subprocess.PIPE,
            text=True,
            env=env.environ(),
        )
        self.frames: list[dict[str, Any]] = []
        assert self.proc.stdout is not None
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.frames.append(json.loads(line))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.reader.join(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Residency:
    """The cache server's residency of one namespace, from fresh feed snapshots.

    A subscriber thread records the chunk names the server publishes in every live record: a chunk
    stored and evicted from DRAM between two snapshots is later listed on disk, and its names come
    from its ``stored`` record.
    """

    def __init__(self, srv: ServerProcess, namespace: str) -> None:
        self.srv = srv
        self.namespace = namespace
        self.names: dict[str, ChunkMeta] = {}
        self.unnamed_on_server = 0
        """Resident chunks the last snapshot listed without names (a new engine cannot announce them)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _socket(self) -> Path:
        return residency_socket_for(self.srv.config.listen.unix_socket)

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                client = ResidencyFeedClient(self._socket(), self.namespace)
            except CacheUnavailable:
                time.sleep(0.2)
                continue
            try:
                while not self._stop.is_set():
                    for m in client.read(0.2):
                        if isinstance(m, Change) and m.has_meta and m.meta is not None:
                            self.names[m.key] = m.meta
            except CacheUnavailable:
                pass
            finally:
                client.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def tiers(self) -> dict[str, set[str]]:
        """key -> the tiers holding it (a snapshot read to ``synced``)."""
        client = ResidencyFeedClient(self._socket(), self.namespace)
        held: dict[str, set[str]] = {}
        named: set[str] = set()
        try:
            done = False
            while not done:
                for m in client.read(1.0):
                    if isinstance(m, Change):
                        held.setdefault(m.key, set()).add(m.tier)
                        if m.has_meta and m.meta is not None:
                            self.names[m.key] = m.meta
                            named.add(m.key)
                    done = done or m == ("synced", None)
        finally:
            client.close()
        self.unnamed_on_server = len(set(held) - named)
        return held

    def expected(self) -> tuple[dict[str, set[int]], dict[str, set[str]], int]:
        """What Dynamo must hold for an engine on this node (host_pinned, disk), the raw tiers, and
        how many resident chunks no connector has named (yet: after a restart they are named again)."""
        held = self.tiers()
        out: dict[str, set[int]] = {t: set() for t in TIERS.values()}
        unnamed = 0
        for key, tiers in held.items():
            for t in tiers & set(TIERS):
                if key not in self.names:
                    unnamed += 1
                    continue
                out[TIERS[t]].update(int(h) for h in self.names[key].block_hashes)
        return out, held, unnamed


def disk_hits_of(srv: ServerProcess) -> float:
    """The cache server's hits in its local-disk tier (each one promoted into DRAM)."""
    with urllib.request.urlopen(srv.metrics_url + "/metrics", timeout=10) as resp:
        return metric_sum(resp.read().decode(), "kvfabric_cache_hits", tier="local_disk")


def _events_cfg(port: int, replay: int) -> list[str]:
    cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv@engine@tiny",
    }
    return ["--kv-events-config", json.dumps(cfg)]


@pytest.fixture
def indexer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DynamoIndexer]:
    if find_python() is None:
        pytest.skip(skip_reason())
    with DynamoIndexer.start(tmp_path_factory.mktemp("dynamo") / "indexer.log") as idx:
        yield idx


def test_dynamos_indexer_follows_real_vllm_and_the_cache_server_through_churn(
    vllm_env: VllmEnv, tiny_model: Path, vllm_workdir: Path, indexer: DynamoIndexer
) -> None:
    ports = {name: free_port() for name in ("e1", "e1r", "e2", "e2r")}
    spy = vllm_workdir / "routing-spy"
    decoder = VllmDecoder(vllm_env, [f"tcp://127.0.0.1:{ports[p]}" for p in ("e1", "e2")])
    # min_free_fraction 0: write-back must not depend on how full this machine's disk happens to be.
    disk = {"tiers.local_disk.min_free_fraction": 0}
    with cache_server(
        server_id="routing", dram_bytes=4 * MiB, local_disk_bytes=256 * MiB, overrides=disk
    ) as srv:

        def engine(name: str) -> VllmServer:
            kv = spy_transfer_config(connector_config(srv.config.listen.unix_socket, **CONNECTOR))
            return VllmServer(
                vllm_env,
                tiny_model,
                vllm_workdir / f"routing-{name}.log",
                kv,
                [*SERVER_ARGS, *_events_cfg(ports[name], ports[name + "r"])],
                extra_env=spy_environ(vllm_env, spy),
                max_model_len=2048,
            )

        def follow(worker: int, name: str, vllm: VllmServer) -> None:
            """Register a started engine with Dynamo and wait until Dynamo indexes its events.

            Each try is a new 130-token prompt: its whole block is a GPU ``BlockStored`` (and a
            tail block kvfabric stores); a batch Dynamo missed while its socket was joining is
            recovered through the replay socket once a later one shows the gap.
            """
            indexer.register(
                worker,
                f"tcp://127.0.0.1:{ports[name]}",
                model="tiny",
                block_size=BLOCK,
                replay_endpoint=f"tcp://127.0.0.1:{ports[name + 'r']}",
            )
            tries = iter(range(1000))

            def indexed() -> bool:
                vllm.complete(workload.tokens(7000 + 100 * worker + next(tries), 130), 1)
                return bool(indexer.entries().get(worker, {}).get("device"))

            wait_until(indexed, timeout=120, interval=1.0, what=f"Dynamo to index engine {name}")

        e1 = engine("e1")
        e1.start()
        truth: Residency | None = None
        try:
            follow(1, "e1", e1)
            namespace = next(r["namespace"] for r in read_records(spy) if r["what"] == "keys")
            truth = Residency(srv, namespace)
            last: dict[str, Any] = {}

            def agreed(
                vllm: VllmServer, worker: int, what: str, settled: Callable[[dict[str, set[str]]], bool]
            ) -> dict[str, set[str]]:
                """Step the engine until Dynamo's trees equal the residency at a point ``settled``."""

                def same() -> bool:
                    vllm.complete(POKE, 1)
                    want, held, unnamed = truth.expected()
                    got = indexer.entries().get(worker, {})
                    last.update(what=what, want=want, got=got, held=held, unnamed=unnamed)
                    last["frames"] = [(f.get("events"), f.get("media")) for f in decoder.frames[-20:]]
                    return settled(held) and not unnamed and all(got.get(t) == want[t] for t in want)

                try:
                    wait_until(same, timeout=120, interval=0.5, what=what)
                except TimeoutError:
                    raise AssertionError(f"Dynamo's index never equalled the residency: {last}") from None
                return dict(last["held"])

            def in_tier(tier: str) -> Callable[[dict[str, set[str]]], int]:
                return lambda held: sum(1 for t in held.values() if tier in t)

            # Stores: six 700-token prompts, two chunks and a tail block each (~2.5 MiB), through
            # 4 MiB of DRAM: the older ones are written back to disk and evicted from DRAM.
            prompts = [workload.tokens(300 + i, 700) for i in range(6)]
            for p in prompts:
                e1.complete(p, 4)
            held = agreed(
                e1,
                1,
                "stores and evictions",
                lambda h: in_tier("local_disk")(h) >= 12 and in_tier("dram")(h) > 0,
            )
            disk_only = {k for k, t in held.items() if t == {"local_disk"}}
            assert disk_only, f"some chunk lives on disk only: {held}"
            # Promotion: the first prompt again, its GPU blocks gone (other traffic): its chunks on
            # disk only are hits there, promoted into DRAM (and evicted again by what follows).
            for i in range(3):
                e1.complete(workload.tokens(9000 + i, 1900), 1)
            disk_hits = disk_hits_of(srv)
            e1.complete(prompts[0], 4)
            # At least one: which of its three objects (two chunks, a tail block) are still in DRAM
            # after the flush traffic depends on the order of the stores.
            assert disk_hits_of(srv) > disk_hits, "the first prompt's objects were hits on disk"
            agreed(e1, 1, "promotions", lambda h: True)
            # A delete of one chunk (every tier).
            # The victim ends its prompt (no resident chunk's parent block is in it): a chunk whose
            # parent chunk is gone is never announced by an engine that did not store it (routers
            # drop an event whose parent they never saw), which the engine restart below would show.
            resident = [k for k, t in truth.tiers().items() if t and k in truth.names]
            parents = {truth.names[k].parent_block_hash for k in resident}
            victim = next(k for k in resident if truth.names[k].block_hashes[-1] not in parents)
            with CacheClient(srv.unix_target) as client:
                assert client.delete(namespace, [victim], timeout=10) == 1
            agreed(e1, 1, "a delete", lambda h: not h.get(victim))
            # Cache-server SIGKILL: its DRAM is withdrawn on the engine's next steps, then the new
            # process is followed again (local disk survived and stays credited).
            srv.kill()
            wait_until(
                lambda: e1.complete(POKE, 1) is not None and not indexer.entries()[1]["host_pinned"],
                timeout=60,
                interval=0.5,
                what="DRAM withdrawn from Dynamo's index",
            )
            srv.start()
            # Settled once the engine followed the new process and named again what its disk kept
            # (the names live in the server's memory): a new engine can then announce all of it.
            agreed(
                e1,
                1,
                "a cache-server restart",
                lambda h: in_tier("local_disk")(h) > 0 and truth.unnamed_on_server == 0,
            )
            # Engine restart: a new process (a new pod: a new identity the router follows) announces
            # the node's residency at start; the old identity is dropped as a router drops a pod.
            e1.stop()
            indexer.unregister(1)
            e2 = engine("e2")
            e2.start()
            try:
                follow(2, "e2", e2)
                agreed(e2, 2, "an engine restart", lambda h: in_tier("local_disk")(h) > 0)
                # TTL expiry: the server restarts with a 2-second TTL; every chunk expires.
                srv.stop()
                srv.config = srv.config.model_copy(
                    update={"ttl_seconds": 2, "bucket_seconds": 1, "janitor_interval_seconds": 0.5}
                )
                srv.start()
                agreed(e2, 2, "TTL expiry", lambda h: not any(h.values()))
            finally:
                e2.stop()
        finally:
            e1.stop()
            decoder.close()
            if truth is not None:
                truth.close()
    frames = decoder.frames
    assert frames, "the decoder saw the publishers' frames"
    assert [f for f in frames if not f["ok"]] == [], "every frame decodes under vLLM's own classes"
    assert any("CPU" in f["media"] for f in frames)
    assert any("STORAGE" in f["media"] for f in frames)
    assert "Failed to decode" not in indexer.log_tail(1 << 22), "every frame decodes under Dynamo's parser"
