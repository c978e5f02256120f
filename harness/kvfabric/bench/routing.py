"""``kvfabric bench routing``: how exactly a router's index follows the fabric under churn.

Two nodes, each a real cache-server process (small DRAM so stores evict, a short TTL so the disk
copies expire), two engines per node. Each engine is the connector's event path without vLLM: a
:class:`~kvfabric.connector.nodefeed.NodeResidency` following its node's residency feed into an
:class:`~kvfabric.rpc.kvledger.EventLedger`, stepped every ``--step-ms`` (what ``take_events()``
does once per engine step); every batch is encoded to vLLM's wire bytes and applied to the models
of llm-d's and Dynamo's indexes (:mod:`kvfabric.testing.routerindex`). Engines store chunks of
prompts that share prefixes (naming them as the connector does, then storing 256 KiB payloads),
delete some, and halfway node 0's cache server is killed and restarted; later one engine restarts
(a fresh follower; the router drops what it credited, as llm-d does on a sequence reset).

The baseline, measured in the same run on the same operations: the events the connector sent
before it followed the feed (each store announced in DRAM, nothing withdrawn unless a lookup of
the same engine missed: never, here).

Measured, from a separate subscriber per node that records the servers' truth:

* precision: credited (engine, tier, block) entries that the engine's node holds in that tier,
  sampled every 0.5 s (and, for the feed, entries older than their removal + 2 s);
* recall: resident (tier, block) entries of a node credited to each engine on it;
* removal -> ``BlockRemoved`` applied by the router, per engine (p50/p99);
* cache-server restart (SIGKILL) -> its DRAM entries withdrawn from every engine on the node;
* events and wire bytes per node per second; the start-up announcement of the restarted engine.

Not a test: nothing is asserted. The last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from typing import Any

from kvfabric.bench import routingeffect
from kvfabric.bench.report import summary

PARTS = ("churn", "effect", "cost", "startup")

MIB = 1 << 20
BLOCK = 16  # tokens per engine block
CHUNK_BLOCKS = 16  # blocks per chunk (256 tokens)


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options."""
    parser.add_argument("--seconds", type=float, default=30.0, help="length of the churn (default 30)")
    parser.add_argument(
        "--stores", type=float, default=40.0, help="chunk stores per second per node (default 40)"
    )
    parser.add_argument("--deletes", type=float, default=2.0, help="deletes per second per node (default 2)")
    parser.add_argument("--step-ms", type=float, default=20.0, help="engine step interval (default 20 ms)")
    parser.add_argument("--prompts", type=int, default=60, help="distinct prompts (default 60)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a short run (8 s) for a smoke check")
    parser.add_argument("--json", action="store_true", help="print only the final JSON line")
    parser.add_argument(
        "--only",
        action="append",
        choices=PARTS,
        help="run only this part (repeatable; default: all of " + ", ".join(PARTS) + ")",
    )
    routingeffect.configure(parser)


def _meta(prompt: int, index: int, shared: int) -> Any:
    from kvfabric.rpc.kvledger import ChunkMeta

    owner = 0 if index < shared else prompt  # the first chunks are a prefix every prompt shares

    def h(i: int) -> int:
        return ((owner * 1000 + index) * 100 + i) * 7919 + 1

    parent = None if index == 0 else ((0 if index - 1 < shared else prompt) * 1000 + index - 1) * 100 * 7919
    return ChunkMeta(
        block_hashes=tuple(h(i) for i in range(CHUNK_BLOCKS)),
        parent_block_hash=None if parent is None else parent + (CHUNK_BLOCKS - 1) * 7919 + 1,
        token_ids=tuple(range(owner * 10_000 + index * 256, owner * 10_000 + index * 256 + 256)),
        block_size=BLOCK,
    )


def run(args: argparse.Namespace) -> int:
    """Run the parts asked for and print the measurements (the last line: one JSON object)."""
    parts = args.only or list(PARTS)
    if args.quick:
        args.repeats = min(args.repeats, 2)
        args.conversations = min(args.conversations, 6)
        args.rounds = min(args.rounds, 4)
        args.cost_seconds = min(args.cost_seconds, 2.0)
        args.startup_dram_mib = min(args.startup_dram_mib, 16)

    def progress(text: str) -> None:
        if not args.json:
            print(f"# {text}", file=sys.stderr, flush=True)

    result: dict[str, Any] = {}
    if "churn" in parts:
        progress("churn: precision, recall, removal latency, restarts")
        result["churn"] = _churn(args)
    if "effect" in parts:
        result["routing_effect"] = routingeffect.routing_effect(args, progress)
    if "cost" in parts:
        progress(f"event cost at {args.cost_stores:g} stores/s")
        result["event_cost_per_node"] = routingeffect.event_cost(args)
    if "startup" in parts:
        progress("start-up announcement of a full DRAM tier")
        result["startup_announcement"] = routingeffect.startup_announcement(args)
    if not args.json:
        for part, values in result.items():
            print(f"{part}:")
            for key, value in values.items():
                print(f"  {key}: {value}")
    print(json.dumps(result, sort_keys=True))
    return 0


def _churn(args: argparse.Namespace) -> dict[str, Any]:
    """The churn scenario (module docstring): precision, recall, latencies, restarts, event rates."""
    from kvfabric.client import CacheClient
    from kvfabric.client.errors import CacheUnavailable
    from kvfabric.client.residency import ResidencyFeedClient
    from kvfabric.connector.nodefeed import node_residency_for
    from kvfabric.rpc.kvevents import BlockRemoved, encode_batch
    from kvfabric.rpc.kvledger import EventLedger
    from kvfabric.rpc.residency import Change, residency_socket_for
    from kvfabric.testing.routerindex import RouterIndexModel
    from kvfabric.testing.serverproc import cache_server, digest, payload_for

    if args.quick:
        args.seconds = min(args.seconds, 8.0)
    rng = random.Random(args.seed)
    ns = digest("bench-routing")
    names = {"dram": "cpu", "local_disk": "storage"}
    overrides = {"ttl_seconds": 6, "bucket_seconds": 2, "janitor_interval_seconds": 0.5}
    # Chained keys: the shared first chunk is one key, whichever prompt stores it.
    prompts = [[digest("prompt", 0 if i < 1 else p, i) for i in range(6)] for p in range(args.prompts)]
    metas = {prompts[p][i]: _meta(p, i, 1) for p in range(args.prompts) for i in range(6)}
    chain_of = {prompts[p][i]: prompts[p][:i] for p in range(args.prompts) for i in range(6)}
    key_of = {h: k for k, m in metas.items() for h in m.block_hashes}
    with (
        cache_server(
            server_id="node-0", dram_bytes=12 * MIB, local_disk_bytes=24 * MIB, overrides=overrides
        ) as s0,
        cache_server(
            server_id="node-1", dram_bytes=12 * MIB, local_disk_bytes=24 * MIB, overrides=overrides
        ) as s1,
    ):
        servers = [s0, s1]
        socks = [str(s.config.listen.unix_socket) for s in servers]
        clients = [CacheClient(s.unix_target) for s in servers]
        router = RouterIndexModel("llm-d")
        baseline = RouterIndexModel("llm-d")
        engines: dict[str, Any] = {}
        base_ledgers: dict[str, EventLedger] = {}
        for n in range(2):
            for e in range(2):
                name = f"n{n}e{e}"
                engines[name] = node_residency_for(socks[n], ns, EventLedger())
                base_ledgers[name] = EventLedger()
        node_of = {name: int(name[1]) for name in engines}
        truth: list[dict[str, set[str]]] = [{}, {}]
        observers: list[ResidencyFeedClient | None] = [None, None]
        removed_at: dict[tuple[int, str, int], float] = {}  # (node, tier, hash) -> when the server said so
        stored_at: dict[tuple[int, str, int], float] = {}
        # Withdrawals seen by the router, matched with the server's removal once the subscriber that
        # records the truth has read it (it may read it a little after an engine did).
        pending: list[tuple[int, str, int, float]] = []
        latencies: list[float] = []
        stats = {"events": [0, 0], "bytes": [0, 0]}
        precision: list[float] = []
        stale_past_grace: list[int] = []
        stale_in_flight: list[int] = []
        recall: list[float] = []
        base_precision: list[float] = []
        base_recall: list[float] = []
        startup: dict[str, Any] = {}
        restart: dict[str, Any] = {}

        def observe(n: int) -> None:
            obs = observers[n]
            if obs is None:
                try:
                    observers[n] = obs = ResidencyFeedClient(residency_socket_for(socks[n]), ns)
                except CacheUnavailable:
                    return
                truth[n].clear()
            try:
                messages = obs.read(0.0)
            except CacheUnavailable:
                obs.close()
                observers[n] = None
                now = time.monotonic()
                for key, tiers in truth[n].items():
                    if "dram" in tiers:
                        for h in metas[key].block_hashes:
                            removed_at[(n, "cpu", h)] = now
                truth[n] = {k: t - {"dram"} for k, t in truth[n].items()}
                return
            now = time.monotonic()
            for m in messages:
                if not isinstance(m, Change) or m.tier not in names:
                    continue
                tiers = truth[n].setdefault(m.key, set())
                if m.op == "stored":
                    tiers.add(m.tier)
                    for h in metas[m.key].block_hashes:
                        stored_at[(n, names[m.tier], h)] = now
                else:
                    tiers.discard(m.tier)
                    for h in metas[m.key].block_hashes:
                        removed_at[(n, names[m.tier], h)] = now

        def resident(n: int) -> set[tuple[str, int]]:
            # A block stays resident in a tier while any key holding it is (keys share blocks).
            return {
                (names[t], h) for k, tiers in truth[n].items() for t in tiers for h in metas[k].block_hashes
            }

        def routable(n: int) -> set[tuple[str, int]]:
            # Resident blocks of chunks whose whole prefix the node holds (a router can reach them).
            held = {k for k, tiers in truth[n].items() if tiers}
            ok = {k for k in held if all(prefix in held for prefix in chain_of[k])}
            return {(names[t], h) for k in ok for t in truth[n][k] for h in metas[k].block_hashes}

        def step(name: str) -> None:
            node = engines[name]
            node.poll()
            events = node.ledger.take()
            if events:
                payload = encode_batch(time.time(), events)
                stats["events"][node_of[name]] += len(events)
                stats["bytes"][node_of[name]] += len(payload)
                router.apply_bytes(name, payload)
                now = time.monotonic()
                for ev in events:
                    if isinstance(ev, BlockRemoved):
                        tier = ev.medium.lower() if ev.medium else "gpu"
                        pending.extend((node_of[name], tier, int(h), now) for h in ev.block_hashes)
                if name in startup and "bytes" in startup[name] and startup[name].get("done") is None:
                    startup[name]["bytes"] += len(payload)
                    startup[name]["events"] += len(events)
            if name in startup and startup[name].get("done") is None and node.connected and not node._backlog:
                startup[name]["done"] = time.monotonic() - startup[name]["t0"]
            base = base_ledgers[name].take()
            if base:
                baseline.apply_bytes(name, encode_batch(time.time(), base))

        def sample() -> None:
            for name, node in engines.items():
                n = node_of[name]
                have = resident(n)
                reachable = routable(n)
                for model, p_out, r_out in (
                    (router, precision, recall),
                    (baseline, base_precision, base_recall),
                ):
                    credited = {(t, h) for t, h in model.entries(name) if t in ("cpu", "storage")}
                    if credited:
                        p_out.append(len(credited & have) / len(credited))
                    if reachable:
                        r_out.append(len(credited & reachable) / len(reachable))
                    if model is router:
                        now = time.monotonic()
                        stale = [
                            h
                            for t, h in credited - have
                            if (t0 := removed_at.get((n, t, int(h)))) is not None and now - t0 > 2.0
                        ]
                        stale_past_grace.append(len(stale))
                        # Of those, the ones credited on the strength of a store the server dropped
                        # (announced in the storing step, withdrawn when not confirmed in 3 s).
                        stale_in_flight.append(sum(1 for h in stale if node.in_flight(key_of[h])))

        next_chain: dict[tuple[str, int], int] = {}
        dropped = 0
        start = time.monotonic()
        end = start + args.seconds
        next_sample = start + 1.0
        killed = restarted_engine = False
        t_kill = 0.0
        kill_at = start + args.seconds * 0.4
        engine_restart_at = start + args.seconds * 0.7
        step_s = args.step_ms / 1000
        while time.monotonic() < end:
            tick = time.monotonic()
            for n in range(2):
                observe(n)
                for _ in range(_poisson(rng, args.stores * step_s)):
                    name = f"n{n}e{rng.randrange(2)}"
                    p = rng.randrange(args.prompts)
                    i = next_chain.get((name, p), 0)
                    key = prompts[p][i]
                    next_chain[(name, p)] = (i + 1) % 6
                    # vLLM's own events announce every block the engine computed or loaded (GPU): a
                    # router knows the whole prefix of what this engine stores or hits.
                    for model in (router, baseline):
                        model.seen.update(
                            (name, h) for k in prompts[p][: i + 1] for h in metas[k].block_hashes
                        )
                    if truth[n].get(key):
                        continue  # the connector loads it rather than storing it again
                    engines[name].describe(key, metas[key])
                    base_ledgers[name].stored(key, "dram", metas[key])
                    # A restarting server refuses stores (the connector drops them the same way).
                    with contextlib.suppress(Exception):
                        done = clients[n].store(ns, [key], [payload_for(key, 256 << 10)], timeout=5)
                        dropped += done.dropped
                for _ in range(_poisson(rng, args.deletes * step_s)):
                    keys = [k for k, t in truth[n].items() if t]
                    if keys:
                        with contextlib.suppress(Exception):
                            clients[n].delete(ns, [rng.choice(keys)], timeout=5)
            for name in list(engines):
                step(name)
            for n in range(2):
                observe(n)
            now = time.monotonic()
            waiting = []
            for n, tier, h, t_seen in pending:
                t0 = removed_at.get((n, tier, h))
                if t0 is not None and t0 >= stored_at.get((n, tier, h), 0.0):
                    latencies.append(max(0.0, t_seen - t0))
                elif now - t_seen < 2.0:
                    waiting.append((n, tier, h, t_seen))
            pending[:] = waiting
            if not killed and tick >= kill_at:
                killed = True
                t_kill = time.monotonic()
                dram_before = {name: router.entries(name) for name in engines if node_of[name] == 0}
                s0.kill()
                while any(t == "cpu" for name in dram_before for t, _ in router.entries(name)):
                    for name in engines:
                        step(name)
                    time.sleep(step_s)
                restart["dram_withdrawn_s"] = round(time.monotonic() - t_kill, 3)
                s0.start_process()  # the churn goes on meanwhile; engines follow it again when it is back
            if (
                killed
                and "followed_again_s" not in restart
                and all(engines[name].connected for name in engines if node_of[name] == 0)
            ):
                restart["followed_again_s"] = round(time.monotonic() - t_kill, 3)
            if not restarted_engine and tick >= engine_restart_at:
                restarted_engine = True
                engines["n1e1"].close()
                for entry in [e for e in router.counts if e[0] == "n1e1"]:
                    del router.counts[entry]  # a sequence reset: llm-d drops what it credited the pod
                router.seen = {s for s in router.seen if s[0] != "n1e1"}
                engines["n1e1"] = node_residency_for(socks[1], ns, EventLedger())
                startup["n1e1"] = {"t0": time.monotonic(), "bytes": 0, "events": 0, "done": None}
            if tick >= next_sample:
                sample()
                next_sample += 0.5
            time.sleep(max(0.0, step_s - (time.monotonic() - tick)))
        elapsed = time.monotonic() - start
        unconfirmed = sum(node.unconfirmed_withdrawn for node in engines.values())
        for c in clients:
            c.close()
        for obs in observers:
            if obs is not None:
                obs.close()
        for node in engines.values():
            node.close()

    resident_blocks = max((len(resident(n)) for n in range(2)), default=0)
    result = {
        "seconds": round(elapsed, 1),
        "stores_per_s_per_node": args.stores,
        "engines": 4,
        "precision_feed": _low(precision),
        "precision_stores_only": _low(base_precision),
        "recall_feed": _low(recall),
        "recall_stores_only": _low(base_recall),
        "credited_past_removal_plus_2s_max": max(stale_past_grace, default=0),
        "credited_past_removal_plus_2s_max_excluding_dropped_stores": max(
            (a - b for a, b in zip(stale_past_grace, stale_in_flight, strict=True)), default=0
        ),
        "removal_to_router_ms": summary(latencies, scale=1000, digits=1, unit="_ms") if latencies else None,
        "cache_server_restart": restart,
        "engine_restart_announcement": {k: v for k, v in startup.get("n1e1", {}).items() if k != "t0"},
        "events_per_s_per_node": [round(e / elapsed, 1) for e in stats["events"]],
        "bytes_per_s_per_node": [round(b / elapsed) for b in stats["bytes"]],
        "violations": vars(router.violations),
        "stores_never_confirmed": unconfirmed,
        "stores_dropped_by_server": dropped,
        "resident_blocks_at_end": resident_blocks,
    }
    return result


def _low(samples: list[float]) -> dict[str, float] | None:
    """A fraction's samples: where it is low matters (min, p1, p10, median)."""
    if not samples:
        return None
    return summary(samples, qs=(0.01, 0.1), digits=4) | {"min": round(min(samples), 4)}


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw (Knuth; the means here are small)."""
    import math

    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1
