"""``kvfabric bench visibility``: how soon a chunk stored on one node is a hit on another node.

Two real cache-server processes (nodes ``a`` and ``b``) share one volume, with the product's
defaults for what decides the delay: write-back to the shared tier as soon as a store lands, and
other servers' journals tailed every ``journal_poll_seconds`` (0.25 s). For each sample a fresh
chunk is stored on ``a``; from the store's acknowledgement, ``b`` is asked for it every
``--poll-ms`` until it answers a hit. The time until then is the visibility delay a round sent to
the other node sees (goal: p99 <= 500 ms). Samples start at random offsets so they fall
evenly across the tail interval. Also printed: when the block file was on the volume (``a``'s
write-back), so the delay splits into write-back and ``b``'s tailing.

Not a test: nothing is asserted. The last line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from kvfabric.bench.report import summary

MIB = 1 << 20


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options."""
    parser.add_argument("--samples", type=int, default=200, help="chunks stored on node a (default 200)")
    parser.add_argument("--chunk-mib", type=float, default=2.0, help="payload per chunk in MiB (default 2)")
    parser.add_argument("--poll-ms", type=float, default=2.0, help="how often node b is asked (default 2 ms)")
    parser.add_argument(
        "--journal-poll-seconds",
        type=float,
        default=None,
        help="the servers' journal_poll_seconds (default: the product's, 0.25)",
    )
    parser.add_argument("--json", action="store_true", help="print only the final JSON line")


def _ms(values: list[float]) -> dict[str, float] | None:
    return summary(values, scale=1000, digits=1, unit="_ms") if values else None


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print the delays' percentiles."""
    import tempfile

    from kvfabric.cacheserver.config import ServerConfig
    from kvfabric.client import CacheClient
    from kvfabric.testing.serverproc import cache_server, digest, payload_for

    poll = args.journal_poll_seconds
    if poll is None:
        poll = ServerConfig.model_fields["journal_poll_seconds"].default
    overrides = {"journal_poll_seconds": poll, "janitor_interval_seconds": 5.0}
    size = int(args.chunk_mib * MIB)
    dram = max(256 * MIB, 2 * size * args.samples)
    ns = digest("bench-visibility")
    rng = random.Random(0)
    visible: list[float] = []
    on_volume: list[float] = []
    with tempfile.TemporaryDirectory(prefix="kvf-bench-vis-") as tmp:
        shared = Path(tmp) / "shared"
        common: dict[str, Any] = {
            "shared_dir": shared,
            "dram_bytes": dram,
            "shared_bytes": 4 * dram,
            "overrides": overrides,
        }
        with (
            cache_server(server_id="node-a", **common) as a,
            cache_server(server_id="node-b", **common) as b,
            CacheClient(a.unix_target, shared_memory=True) as ca,
            CacheClient(b.unix_target, shared_memory=True) as cb,
        ):
            buckets = shared / "buckets"
            for i in range(args.samples):
                key = digest("visibility", i)
                time.sleep(rng.uniform(0, poll))  # a uniform phase against b's tail interval
                payload = payload_for(key, size)
                if ca.store(ns, [key], [payload], timeout=30).accepted != 1:
                    continue
                acked = time.perf_counter()
                name = f"{ns}_{key}.blk"  # the block file's name (BlockId.filename)
                file_at: float | None = None
                while True:
                    if file_at is None and any(buckets.glob(f"*/{name}")):
                        file_at = time.perf_counter() - acked
                    if cb.lookup(ns, [key], timeout=5).matched == 1:
                        visible.append(time.perf_counter() - acked)
                        break
                    if time.perf_counter() - acked > 30:
                        break
                    time.sleep(args.poll_ms / 1000)
                if file_at is not None:
                    on_volume.append(file_at)
    result = {
        "benchmark": "visibility",
        "journal_poll_seconds": poll,
        "chunk_bytes": size,
        "poll_ms": args.poll_ms,
        "store_to_hit_on_other_node": _ms(visible),
        "store_to_file_on_volume": _ms(on_volume),
        "never_visible": args.samples - len(visible),
    }
    if not args.json:
        for name in ("store_to_hit_on_other_node", "store_to_file_on_volume"):
            print(f"{name}: {result[name]}")
    print(json.dumps(result))
    return 0
