"""The routing effect of kvfabric's events, their cost at 1,000 stores/s, and a start-up announcement.

Part of ``kvfabric bench routing`` (:mod:`kvfabric.bench.routing`). Three measurements:

* **Routing effect.** A replayed multi-round chat workload (several conversations, several rounds;
  each round's prompt is the conversation so far plus a new turn, all conversations share a system
  prompt) is routed over two nodes x two engines by a router MODEL, llm-d's example configuration:
  its longest-prefix scorer over :class:`~kvfabric.testing.routerindex.RouterIndexModel` (tier
  weights ``gpu`` 1.0, ``cpu`` 0.8, ``storage`` 0.4) weighted 2, plus its queue scorer weighted 1
  (a request counts as in flight on its endpoint for the next 8 requests of the replay: without a
  load term every conversation would pile onto the endpoint holding the shared system prompt),
  under three policies:
  its index fed kvfabric's events (each engine's GPU blocks and its node's tiers, the connector's
  real event path following a real cache server), fed vLLM's GPU events only, and round-robin.
  Each node is a real cache-server process; each engine's GPU prefix cache is an LRU of
  ``--gpu-chunks`` chunks that publishes GPU ``BlockStored``/``BlockRemoved`` as vLLM does. The
  number is the share of prompt tokens found on the picked endpoint's node at the time of the pick
  (the longest prefix that its GPU or its node's DRAM or local disk holds), with the spread over
  ``--repeats`` (different seeds: conversation order and lengths).
* **Event cost per node at 1,000 stores/s**: one real server, one engine following it, chunk stores
  (16 KiB payloads: the cost of events depends on the number of chunks, not their size) at the
  target rate; events and wire bytes per second and the engine-side CPU time of following the feed
  and encoding the batches, per second of wall time.
* **Start-up announcement of a full DRAM tier**: a server whose DRAM is full, a new engine's
  connector announcing it (bytes, events, engine steps, time).

Pure parts (workload, scoring, the GPU cache model) are functions; the runs do the I/O.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import random
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfabric.connector.nodefeed import NodeResidency
    from kvfabric.rpc.kvevents import Event
    from kvfabric.rpc.kvledger import ChunkMeta

MIB = 1 << 20
BLOCK = 16  # tokens per engine block
CHUNK_BLOCKS = 16  # blocks per chunk (256 tokens)
CHUNK_TOKENS = BLOCK * CHUNK_BLOCKS
WEIGHTS = {"gpu": 1.0, "cpu": 0.8, "storage": 0.4}
"""llm-d tier weights: its defaults for ``gpu`` and ``cpu``; ``storage`` as docs/routing.md advises."""
PREFIX_WEIGHT = 2.0  # llm-d's example EPP configuration: prefix-cache scorer 2, queue scorer 1
IN_FLIGHT_WINDOW = 8  # a request is "in flight" on its endpoint for the next 8 requests of the replay
POLICIES = ("kvfabric", "gpu_only", "round_robin")
ANY_DISK = {"tiers.local_disk.min_free_fraction": 0}
"""Write back to local disk however full the machine's filesystem is (the budget is small)."""
ENGINES = ("n0e0", "n0e1", "n1e0", "n1e1")


def configure(parser: argparse.ArgumentParser) -> None:
    """The routing-effect options (added to ``kvfabric bench routing``)."""
    g = parser.add_argument_group("routing effect, event cost, start-up announcement")
    g.add_argument("--conversations", type=int, default=12, help="conversations replayed (default 12)")
    g.add_argument("--rounds", type=int, default=6, help="rounds per conversation (default 6)")
    g.add_argument("--repeats", type=int, default=3, help="replays per policy, each its own seed (default 3)")
    g.add_argument(
        "--gpu-chunks", type=int, default=6, help="GPU prefix cache per engine, chunks (default 6)"
    )
    g.add_argument("--node-dram-mib", type=int, default=8, help="node DRAM in the effect runs (default 8)")
    g.add_argument(
        "--cost-stores", type=float, default=1000.0, help="stores/s of the cost run (default 1000)"
    )
    g.add_argument("--cost-seconds", type=float, default=5.0, help="length of the cost run (default 5)")
    g.add_argument(
        "--startup-dram-mib",
        type=int,
        default=64,
        help="DRAM filled for the start-up announcement (default 64)",
    )


# --------------------------------------------------------------------------------- pure parts


@dataclass(frozen=True)
class Request:
    """One replayed request: its conversation and round, and its prompt as chunk keys in prefix order."""

    conv: int
    round: int
    chunks: tuple[str, ...]


def workload(conversations: int, rounds: int, seed: int) -> list[Request]:
    """A replayed multi-round trace: conversations interleaved at random, each one's rounds in order.

    Every prompt starts with a shared system chunk; each round adds one to three chunks (the last
    answer and the new user turn) to the conversation's history.
    """
    rng = random.Random(seed)
    histories: list[list[str]] = [["sys"] for _ in range(conversations)]
    due = [0] * conversations
    out: list[Request] = []
    while any(r < rounds for r in due):
        c = rng.choice([c for c in range(conversations) if due[c] < rounds])
        grow = rng.randint(1, 3)
        start = len(histories[c])
        histories[c].extend(f"s{seed}c{c}k{start + i}" for i in range(grow))
        out.append(Request(c, due[c], tuple(histories[c])))
        due[c] += 1
    return out


def block_hashes(chunk: str) -> tuple[int, ...]:
    """A chunk's block hashes: 63-bit, distinct per chunk and block (stable across processes)."""
    base = int.from_bytes(hashlib.sha256(chunk.encode()).digest()[:8], "big") >> 8
    return tuple(base * CHUNK_BLOCKS + i for i in range(CHUNK_BLOCKS))


def chunk_meta(chunk: str, parent: str | None) -> ChunkMeta:
    """What the connector hands the server for a chunk: its blocks, the parent block, tokens."""
    from kvfabric.rpc.kvledger import ChunkMeta

    hashes = block_hashes(chunk)
    return ChunkMeta(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else block_hashes(parent)[-1],
        token_ids=tuple((hashes[0] + i) % 50_000 for i in range(CHUNK_TOKENS)),
        block_size=BLOCK,
    )


def prefix_score(hashes: Sequence[int], tiers_of: dict[int, set[str]], weights: dict[str, float]) -> float:
    """llm-d's longest-prefix score, normalised by the prompt's blocks.

    Along the prompt's blocks while the endpoint holds each in some tier, the best weight among them.
    """
    total = 0.0
    for h in hashes:
        tiers = tiers_of.get(h)
        if not tiers:
            break
        total += max(weights.get(t, 1.0) for t in tiers)
    return total / len(hashes) if hashes else 0.0


def pick(prefix: dict[str, float], in_flight: dict[str, int], load: dict[str, int]) -> str:
    """The endpoint llm-d's example configuration picks: prefix score x 2 + queue score x 1.

    The queue score is 1 for the endpoint with the fewest requests in flight, 0 for the most
    (min-max, as llm-d's queue scorer); ties go to the fewest requests so far, then the name.
    """
    lo, hi = min(in_flight.values()), max(in_flight.values())
    total = {
        e: PREFIX_WEIGHT * p + (1.0 if hi == lo else (hi - in_flight[e]) / (hi - lo))
        for e, p in prefix.items()
    }
    best = max(total.values())
    return min((e for e, s in total.items() if s >= best - 1e-9), key=lambda e: (load[e], e))


@dataclass
class GpuCache:
    """An engine's GPU prefix cache (LRU of whole chunks) and the vLLM events its changes publish."""

    capacity: int
    chunks: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def run(self, prompt: Sequence[str]) -> list[Event]:
        """Serve ``prompt``: its chunks become the most recent; new ones stored, the oldest evicted."""
        from kvfabric.rpc.kvevents import MEDIUM_GPU, BlockRemoved, BlockStored

        events: list[Event] = []
        for i, chunk in enumerate(prompt):
            if chunk in self.chunks:
                self.chunks.move_to_end(chunk)
                continue
            meta = chunk_meta(chunk, prompt[i - 1] if i else None)
            events.append(
                BlockStored(
                    meta.block_hashes, meta.parent_block_hash, meta.token_ids, BLOCK, None, MEDIUM_GPU, None
                )
            )
            self.chunks[chunk] = None
            while len(self.chunks) > self.capacity:
                old, _ = self.chunks.popitem(last=False)
                events.append(BlockRemoved(block_hashes(old), MEDIUM_GPU))
        return events


def spread(values: Sequence[float]) -> dict[str, float]:
    """Mean, min, max and standard deviation of per-repeat values."""
    return {
        "mean": round(statistics.fmean(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "stdev": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
    }


# ---------------------------------------------------------------------------------------- runs


def _follow(socket: str, namespace: str, ledger: Any) -> NodeResidency:
    """An engine's connector following the cache server at ``socket`` (as inside vLLM)."""
    from kvfabric.connector.nodefeed import node_residency_for

    node = node_residency_for(socket, namespace, ledger)
    assert node is not None  # a socket is given
    return node


class _Node:
    """One node: its cache server, a client, and a subscriber recording what it holds."""

    def __init__(self, srv: Any, ns: str) -> None:
        from kvfabric.client import CacheClient

        self.srv = srv
        self.ns = ns
        self.sock = str(srv.config.listen.unix_socket)
        self.client = CacheClient(srv.unix_target)
        self.held: dict[str, set[str]] = {}
        self.observer: Any = None

    def observe(self) -> None:
        from kvfabric.client.errors import CacheUnavailable
        from kvfabric.client.residency import ResidencyFeedClient
        from kvfabric.rpc.residency import Change, residency_socket_for

        if self.observer is None:
            with contextlib.suppress(CacheUnavailable):
                self.observer = ResidencyFeedClient(residency_socket_for(self.sock), self.ns)
            return
        for m in self.observer.read(0.0):
            if isinstance(m, Change):
                tiers = self.held.setdefault(m.key, set())
                (tiers.add if m.op == "stored" else tiers.discard)(m.tier)

    def holds(self, chunk: str) -> bool:
        return bool(self.held.get(chunk, set()) & {"dram", "local_disk"})

    def close(self) -> None:
        self.client.close()
        if self.observer is not None:
            self.observer.close()


def _replay(policy: str, seed: int, args: argparse.Namespace) -> dict[str, float]:
    """One replay of the workload under ``policy`` on two fresh nodes; the shares it measured."""
    from kvfabric.rpc.kvledger import EventLedger
    from kvfabric.testing.routerindex import RouterIndexModel
    from kvfabric.testing.serverproc import cache_server, digest, payload_for

    ns = digest("bench-routing-effect", seed)
    requests = workload(args.conversations, args.rounds, seed)
    key_of: dict[str, str] = {}

    def key(chunk_path: tuple[str, ...]) -> str:
        # A chunk's cache key names its whole prefix (as the connector's chained keys do).
        name = chunk_path[-1]
        if name not in key_of:
            key_of[name] = digest("effect", ns, *chunk_path)
        return key_of[name]

    router = RouterIndexModel("llm-d")
    gpus = {e: GpuCache(args.gpu_chunks) for e in ENGINES}
    load = dict.fromkeys(ENGINES, 0)
    recent: deque[str] = deque(maxlen=IN_FLIGHT_WINDOW)
    found_tokens = gpu_tokens = prompt_tokens = 0
    sizes = {
        "dram_bytes": args.node_dram_mib * MIB,
        "local_disk_bytes": 4 * args.node_dram_mib * MIB,
        "overrides": ANY_DISK,
    }
    with cache_server(server_id="e-node-0", **sizes) as s0, cache_server(server_id="e-node-1", **sizes) as s1:
        nodes = [_Node(s0, ns), _Node(s1, ns)]
        feeds = (
            {e: _follow(nodes[int(e[1])].sock, ns, EventLedger()) for e in ENGINES}
            if policy == "kvfabric"
            else {}
        )

        def step(rounds: int = 3) -> None:
            for _ in range(rounds):
                for n in nodes:
                    n.observe()
                for e, feed in feeds.items():
                    feed.poll()
                    events = feed.ledger.take()
                    if events:
                        router.apply(e, events)
                time.sleep(0.01)

        step(10)
        for i, req in enumerate(requests):
            hashes = [h for c in req.chunks for h in block_hashes(c)]
            if policy == "round_robin":
                chosen = ENGINES[i % len(ENGINES)]
            else:
                scores = {}
                for e in ENGINES:
                    tiers_of: dict[int, set[str]] = {}
                    for t, h in router.entries(e):
                        tiers_of.setdefault(int(h), set()).add(t)
                    scores[e] = prefix_score(hashes, tiers_of, WEIGHTS)
                in_flight = {e: recent.count(e) for e in ENGINES}
                chosen = pick(scores, in_flight, load)
            load[chosen] += 1
            recent.append(chosen)
            node = nodes[int(chosen[1])]
            gpu = gpus[chosen]
            keys = [key(req.chunks[: j + 1]) for j in range(len(req.chunks))]
            # What the picked endpoint's node holds of the prompt: the longest prefix found in the
            # engine's GPU or the node's DRAM or local disk (and, of it, the run the GPU holds).
            on_gpu = on_node = 0
            gpu_run = True
            for j, c in enumerate(req.chunks):
                in_gpu = c in gpu.chunks
                if not (in_gpu or node.holds(keys[j])):
                    break
                on_node += 1
                gpu_run = gpu_run and in_gpu
                on_gpu += gpu_run
            prompt_tokens += len(req.chunks) * CHUNK_TOKENS
            found_tokens += on_node * CHUNK_TOKENS
            gpu_tokens += on_gpu * CHUNK_TOKENS
            # The engine serves the prompt (vLLM's GPU events) and the connector stores on its node
            # what it computed (everything past the prefix it found) and the node lacks.
            gpu_events = gpu.run(req.chunks)
            if gpu_events and policy != "round_robin":
                router.apply(chosen, gpu_events)
            stores = [
                (keys[j], chunk_meta(c, req.chunks[j - 1] if j else None))
                for j, c in enumerate(req.chunks)
                if j >= on_node and not node.holds(keys[j])
            ]
            if stores:
                if chosen in feeds:
                    for k, meta in stores:
                        feeds[chosen].describe(k, meta)
                payloads = [payload_for(k, 256 << 10) for k, _ in stores]
                with contextlib.suppress(Exception):  # a refused store is a miss later, as in vLLM
                    node.client.store(ns, [k for k, _ in stores], payloads, timeout=5)
            step()
        for feed in feeds.values():
            feed.close()
        for n in nodes:
            n.close()
    return {
        "node": found_tokens / prompt_tokens,
        "gpu": gpu_tokens / prompt_tokens,
        "max_load_share": max(load.values()) / len(requests),
    }


def routing_effect(args: argparse.Namespace, progress: Callable[[str], None]) -> dict[str, Any]:
    """Every policy, ``--repeats`` seeds each: shares of prompt tokens found on the picked node."""
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
    for r in range(args.repeats):
        for policy in POLICIES:
            progress(f"routing effect: {policy}, repeat {r + 1}/{args.repeats}")
            runs[policy].append(_replay(policy, args.seed + r, args))
    return {
        "requests": args.conversations * args.rounds,
        "repeats": args.repeats,
        **{
            policy: {
                "found_on_picked_node": spread([x["node"] for x in xs]),
                "found_on_picked_gpu": spread([x["gpu"] for x in xs]),
                "busiest_endpoint_share": spread([x["max_load_share"] for x in xs]),
            }
            for policy, xs in runs.items()
        },
    }


def event_cost(args: argparse.Namespace) -> dict[str, Any]:
    """One engine following a real server taking ``--cost-stores`` chunk stores per second."""
    from kvfabric.rpc.kvevents import encode_batch
    from kvfabric.rpc.kvledger import EventLedger
    from kvfabric.testing.serverproc import cache_server, digest, payload_for

    ns = digest("bench-routing-cost")
    size = 16 << 10
    with cache_server(
        server_id="cost", dram_bytes=64 * MIB, local_disk_bytes=256 * MIB, overrides=ANY_DISK
    ) as srv:
        from kvfabric.client import CacheClient

        feed = _follow(str(srv.config.listen.unix_socket), ns, EventLedger())
        with CacheClient(srv.unix_target) as client:
            for _ in range(50):
                feed.poll()
                feed.ledger.take()
                if feed.connected:
                    break
                time.sleep(0.02)
            events = wire = stored = 0
            cpu = 0.0
            batch = 10
            start = time.monotonic()
            end = start + args.cost_seconds
            n = 0
            while time.monotonic() < end:
                tick = time.monotonic()
                keys = [digest("cost", n + i) for i in range(batch)]
                # Prompts of eight chunks: each chunk's parent is the one before it in its prompt.
                metas = [
                    chunk_meta(f"cost{j}", f"cost{j - 1}" if j % 8 else None) for j in range(n, n + batch)
                ]
                n += batch
                c0 = time.process_time()
                for k, m in zip(keys, metas, strict=True):
                    feed.describe(k, m)
                cpu += time.process_time() - c0
                with contextlib.suppress(Exception):
                    stored += client.store(ns, keys, [payload_for(k, size) for k in keys], timeout=5).accepted
                c0 = time.process_time()
                feed.poll()
                taken = feed.ledger.take()
                if taken:
                    events += len(taken)
                    wire += len(encode_batch(time.time(), taken))
                cpu += time.process_time() - c0
                time.sleep(max(0.0, batch / args.cost_stores - (time.monotonic() - tick)))
            elapsed = time.monotonic() - start
        feed.close()
    return {
        "target_stores_per_s": args.cost_stores,
        "achieved_stores_per_s": round(stored / elapsed, 1),
        "events_per_s": round(events / elapsed, 1),
        "wire_bytes_per_s": round(wire / elapsed),
        "engine_cpu_seconds_per_s": round(cpu / elapsed, 4),
    }


def startup_announcement(args: argparse.Namespace) -> dict[str, Any]:
    """A new engine announcing a server whose DRAM is full (64 KiB chunks: many chunks per MiB).

    Prompts are chains of eight chunks; a chunk whose parent chunk was evicted is not announced
    (routers drop an event whose parent they never saw), so ``events`` may be fewer than the chunks.
    """
    from kvfabric.client import CacheClient
    from kvfabric.rpc.kvevents import encode_batch
    from kvfabric.rpc.kvledger import EventLedger
    from kvfabric.testing.serverproc import cache_server, digest, payload_for

    ns = digest("bench-routing-startup")
    size = 64 << 10
    chunks = args.startup_dram_mib * MIB // size
    with cache_server(server_id="startup", dram_bytes=args.startup_dram_mib * MIB) as srv:
        sock = str(srv.config.listen.unix_socket)
        storer = _follow(sock, ns, EventLedger())
        with CacheClient(srv.unix_target) as client:
            for i in range(0, chunks, 32):
                keys = [digest("startup", j) for j in range(i, min(i + 32, chunks))]
                for j, k in zip(range(i, i + len(keys)), keys, strict=True):
                    storer.describe(k, chunk_meta(f"st{j}", f"st{j - 1}" if j % 8 else None))
                client.store(ns, keys, [payload_for(k, size) for k in keys], timeout=30)
                storer.poll()
                storer.ledger.take()
        resident = 0
        for _ in range(200):
            storer.poll()
            storer.ledger.take()
            resident = sum("dram" in t for t in storer.resident.values())
            if storer.connected and resident and not storer._backlog:
                break
            time.sleep(0.02)
        fresh = _follow(sock, ns, EventLedger())
        t0 = time.monotonic()
        wire = events = steps = 0
        while time.monotonic() - t0 < 120:
            fresh.poll()
            taken = fresh.ledger.take()
            if taken:
                steps += 1  # engine steps that published part of the announcement
                events += len(taken)
                wire += len(encode_batch(time.time(), taken))
            elif fresh.connected and not fresh._backlog:
                break
        elapsed = time.monotonic() - t0
        storer.close()
        fresh.close()
    return {
        "dram_mib": args.startup_dram_mib,
        "chunks_in_dram": resident,
        "bytes": wire,
        "bytes_per_chunk": round(wire / resident) if resident else None,
        "events": events,
        "engine_steps_with_events": steps,
        "seconds": round(elapsed, 3),
    }
