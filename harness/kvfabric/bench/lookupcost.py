"""Where a same-node lookup's CPU goes: ``python -m kvfabric.bench.lookupcost``.

One 128-key lookup answered from the published index, from the connector's call
(:meth:`ResilientCache.lookup`) down, in-process against a real cache-server process: each layer and
each step of it is run on its own many times, and its **CPU time** per call (this thread's clock,
so waiting for a core on a busy machine does not count) is printed, outermost first, with the share
of the first. The connector passes the keys' digests with the keys (``raw``); the hex-keys-only call
is the client API's other form. Then a cProfile of the connector's call (top functions by own time).

Not a benchmark (no targets, nothing judged): the evidence behind docs/performance.md ("Lookups
measured reproducibly"). ``--repeats`` sets the calls per step (default 20,000).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time
from collections.abc import Callable

KEYS = 128


def cpu_us(fn: Callable[[], object], repeats: int) -> float:
    """Median over 5 batches of this thread's CPU time per call of ``fn``, in microseconds."""
    per: list[float] = []
    batch = max(1, repeats // 5)
    for _ in range(5):
        t0 = time.thread_time_ns()
        for _ in range(batch):
            fn()
        per.append((time.thread_time_ns() - t0) / batch / 1e3)
    per.sort()
    return per[2]


def main(argv: list[str] | None = None) -> None:
    """Run the breakdown against a fresh server and print it."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20_000)
    args = p.parse_args(argv)

    from kvfabric.client import CacheClient, indexprobe
    from kvfabric.client import _common as c
    from kvfabric.connector.keys import NamespaceSpec
    from kvfabric.connector.resilient import CircuitBreaker, Endpoint, ResilientCache, transport_factory
    from kvfabric.rpc import indextable as it
    from kvfabric.testing.serverproc import MiB, cache_server, digest

    spec = NamespaceSpec("m", "r", "float32", 2, 1, 4, 16, 32)
    ns = spec.digest()
    keys = [digest("lookupcost", i) for i in range(KEYS)]
    with cache_server(server_id="lookupcost", metrics=False, dram_bytes=256 * MiB) as srv:
        target = f"unix://{srv.config.listen.unix_socket}"
        ep = Endpoint(
            "local", transport_factory(target, shared_memory=True, local_index=True), CircuitBreaker(3, 1.0)
        )
        cache = ResilientCache([ep])
        cache.describe(ns, spec.canonical().decode())
        try:
            for i in range(0, KEYS, 32):
                if cache.store(ns, keys[i : i + 32], [b"k" * 1024] * 32, 30) is None:
                    raise RuntimeError("store failed")
            for _ in range(200):  # describes, maps the table, warms up
                got = cache.lookup(ns, keys, 5.0)
            if got.matched != KEYS or cache.counters.get("lookup_local") < 100:
                raise RuntimeError(f"not answered from the published index: {got}")
            client = ep.client()
            assert isinstance(client, CacheClient)
            index = client.local_index
            assert index is not None
            m = index._maps[ns]
            raw = c.check_ids(ns, keys)
            words = m.words
            hdr = it.header(words)
            n = args.repeats
            steps: list[tuple[str, Callable[[], object]]] = [
                ("ResilientCache.lookup, keys and digests", lambda: cache.lookup(ns, keys, 5.0, raw=raw)),
                (
                    "  CacheClient.lookup, keys and digests",
                    lambda: client.lookup(ns, keys, timeout=5.0, raw=raw),
                ),
                ("  CacheClient.lookup_local, keys and digests", lambda: client.lookup_local(ns, keys, raw)),
                ("    check_raw_ids", lambda: c.check_raw_ids(ns, keys, raw)),
                ("ResilientCache.lookup, hex keys only", lambda: cache.lookup(ns, keys, 5.0)),
                ("  CacheClient.lookup_local, hex keys only", lambda: client.lookup_local(ns, keys)),
                ("    check_ids (validate, hex -> bytes)", lambda: c.check_ids(ns, keys)),
                ("LocalIndex.lookup (both)", lambda: index.lookup(ns, raw, fetch=False)),
            ]
            if m.slots is not None:
                slots, fa = m.slots, indexprobe.fingerprint_array(raw)
                codes = indexprobe.lookup_prefix(words, slots, fa)
                steps += [
                    ("  fingerprint_array", lambda: indexprobe.fingerprint_array(raw)),
                    (
                        "  indexprobe.lookup_prefix (the probe)",
                        lambda: indexprobe.lookup_prefix(words, slots, fa),
                    ),
                    ("  tier_names", lambda: indexprobe.tier_names(codes)),
                ]
            fps = it.fingerprints_raw(raw)
            names = ("", "dram", "local_disk", "shared")
            listed = it.lookup_prefix(words, fps)
            steps += [
                ("  server_gone (one poll)", m.server_gone),
                ("  heartbeat age (monotonic_ns)", lambda: time.monotonic_ns() - words[it.W_HEARTBEAT]),
                ("  count (batched report)", lambda: m.count(KEYS, KEYS, 0, 1 << 62)),
                ("  without numpy: fingerprints_raw", lambda: it.fingerprints_raw(raw)),
                ("  without numpy: indextable.lookup_prefix", lambda: it.lookup_prefix(words, fps)),
                ("  without numpy: tier names", lambda: list(map(names.__getitem__, listed))),
            ]
            load0 = os.getloadavg()[0]
            print(
                f"== CPU per 128-key lookup from the published index (table capacity {hdr['capacity']}, "
                f"{hdr['count']} keys), {n} calls per step, median of 5 batches",
                flush=True,
            )
            total = 0.0
            for name, fn in steps:
                us = cpu_us(fn, n)
                total = total or us
                print(f"{name:48s} {us:7.2f} us  {us / total:6.1%}", flush=True)
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(n // 4):
                cache.lookup(ns, keys, 5.0, raw=raw)
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
            out = s.getvalue()
            print(f"== cProfile, ResilientCache.lookup with digests x {n // 4}\n{out[out.find('ncalls') :]}")
            print(f"load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
        finally:
            cache.close()


if __name__ == "__main__":
    main()
