"""``kvfabric bench storage``: the cache server's data paths, measured in one run against baselines.

With 32 MiB chunks (one chunk of Llama-8B KV at 256 tokens), it measures:

* ``memcpy_gbps`` — copying a chunk between two warm buffers in this process (the ceiling for any
  same-node load, which must land bytes in the caller's buffer);
* ``shm_store_gbps`` / ``shm_load_gbps`` — store and ``load_into`` through a real server process over
  its Unix socket and shared memory (sealed memfds); ``shm_store_over_memcpy`` is the store's rate
  against memcpy of the same bytes in the same round (``shm_store_memcpy_gbps``), every round storing
  keys of its own (flushed and deleted, untimed, before the next);
* ``disk_raw_read_gbps`` — O_DIRECT sequential reads of the very block files the server wrote;
* ``disk_tier_load_gbps`` — loads after a server restart (DRAM empty, index rebuilt), so every byte
  comes from the local-disk tier through O_DIRECT (cold: not from the page cache), checksummed,
  promoted into DRAM and copied into the client's buffers; ``disk_tier_cpu_us_per_mib`` (client and
  server) against ``disk_raw_cpu_us_per_mib``: the CPU time each spends per MiB, which a busy
  machine's other processes stretch far less than wall times;
* ``grpc_load_gbps`` — ``load`` over TCP loopback (payloads streamed in gRPC messages);
* ``redis_get_gbps`` — ``GET`` of the same payloads from a real ``redis-server`` on loopback via redis-py;
* ``object_tier_load_gbps`` — loads from the object-store tier of a server with DRAM and the object
  tier only, after a restart (index rebuilt from a listing), from a real S3 server on loopback
  (SeaweedFS): parallel ranged GETs, verified, promoted into DRAM and copied into the client's
  buffers; against ``object_raw_get_gbps``, the very same objects fetched with the same ranged GETs
  and concurrency by a bare obstore client (``object_single_get_gbps``: one plain GET per object, one
  object at a time); ``object_tier_cpu_us_per_mib`` (client, cache server and S3 server) against
  ``object_raw_cpu_us_per_mib`` (client and S3 server). Skipped with ``--no-object-store``;
* ``object_ttft_s`` / ``recompute_ttft_s`` — the torch reference engine (preset ``bench``) with
  the kvfabric connector: time to first token of a 16k-token prompt whose prefix is a hit from the
  object tier (a restarted server: DRAM empty), against recomputing it (connector off), in the same
  run (``object_ttft_speedup``). Skipped without the ``engine`` extra (torch);
* ``lookup_<path>_c<N>_p50_ms`` / ``_p99_ms`` / ``_p999_ms`` — 128-key lookups from N concurrent
  clients (1, the core count, 8 and 32 by default) in a closed loop, and ``lookup_<path>_paced_*``
  at a fixed rate per client (open loop, latency from the scheduled send time: no coordinated
  omission). ``path`` is ``rpc`` (a gRPC call over the Unix socket) and, where the client supports
  it, ``local`` (the client answers from the index the server publishes in shared memory). More
  clients than cores measure the kernel's scheduler as much as the lookup (a client that is ready
  waits for a core), so the p99 is judged at the core count, beside the 32-client figure;
* ``lookup_<path>_<config>_client_cpu_us`` / ``_server_cpu_us`` — CPU time per lookup: the client
  processes' CPU time (every thread, timed lookups only) and the server process's
  (``/proc/<pid>/stat``, the whole round: its heartbeat and janitor threads included) divided by the
  lookups of the round. Unlike latencies under load, these do not depend on what else the machine
  runs, so another machine can reproduce them. The ``local`` path passes the keys' digests with the
  keys, as the connector does (where the client accepts them: ``raw``).

Every measurement is taken in several rounds; the result holds the median under the plain name and
``spread[name] = {median, min, max, rounds}``. Paired paths (memcpy / shm load, raw read / tier load)
alternate rounds and their ratio is computed per round, so that a burst of load from other processes
skews a ratio as little as possible. The targets are those of the performance issue; the table at
the end shows each with its spread and whether it is met.

The last line printed is one JSON object with every number; ``--json`` prints only that line.
"""

from __future__ import annotations

# Only the standard library at import time (``kvfabric --help`` must stay light); the client, the
# test helpers and redis are imported inside the functions that use them.
import argparse
import asyncio
import contextlib
import json
import mmap
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["configure", "run"]

MiB = 1 << 20
LOOKUP_PATHS = ("rpc", "local")


def _targets(clients: list[int], *, object_tier: bool, cores: int) -> list[Any]:
    """The performance issue's targets for this benchmark (the paths' best lookup path is judged)."""
    from kvfabric.bench.report import Target

    top = max(clients)
    fitting = [c for c in clients if c <= cores]
    out = [
        Target(
            f"lookup p99, {top} closed-loop clients x 128 keys (ms)", f"lookup_best_c{top}_p99_ms", "<=", 0.05
        ),
        Target("lookup p99, paced per client (ms)", "lookup_best_paced_p99_ms", "<=", 0.05),
        Target("CPU per 128-key local lookup, client (us)", "lookup_local_c1_client_cpu_us", "<=", 20.0),
    ]
    if fitting:
        at = max(fitting)
        out.append(
            Target(
                f"lookup p99, {at} closed-loop clients (<= {cores} cores) x 128 keys (ms)",
                f"lookup_best_c{at}_p99_ms",
                "<=",
                0.2,
            )
        )
    out += [
        Target("shm load / memcpy", "shm_load_over_memcpy", ">=", 0.9),
        Target("shm store / memcpy", "shm_store_over_memcpy", ">=", 0.5),
        Target("disk-tier cold load / raw O_DIRECT read", "disk_tier_over_raw", ">=", 0.95),
        Target("gRPC load (TCP) / Redis GET", "grpc_over_redis", ">=", 1.0),
    ]
    if object_tier:
        out.append(
            Target("object_tier_load_gbps >= 0.9 x object_raw_get_gbps", "object_tier_over_raw", ">=", 0.9)
        )
    return out


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the storage benchmark's options."""
    parser.add_argument("--quick", action="store_true", help="fewer chunks and rounds: about a minute")
    parser.add_argument("--json", action="store_true", help="print only the final JSON line")
    parser.add_argument("--chunk-mib", type=int, default=32, help="chunk payload size in MiB (default 32)")
    parser.add_argument(
        "--chunks", type=int, default=None, help="chunks per round (default 4 quick, 16 full)"
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="timed rounds per measurement (default 3 quick, 5 full)"
    )
    parser.add_argument(
        "--lookup-clients",
        default=f"1,{os.cpu_count() or 1},8,32",
        help="comma-separated concurrent lookup client counts (default 1, the core count, 8, 32)",
    )
    parser.add_argument("--lookup-keys", type=int, default=128, help="keys per lookup (default 128)")
    parser.add_argument(
        "--lookups",
        type=int,
        default=None,
        help="timed lookups per round, all clients together (default 1000 quick, 2000 full; "
        "at least 10 per client)",
    )
    parser.add_argument(
        "--lookup-rate",
        type=float,
        default=20.0,
        help="also measure paced lookups of the most clients at this rate per client, open loop "
        "(0 = skip; default 20/s)",
    )
    parser.add_argument(
        "--lookup-paths",
        default=",".join(LOOKUP_PATHS),
        help="lookup paths to measure: rpc (gRPC over the Unix socket), local (the shared-memory index; "
        "skipped where the client lacks it). Default: rpc,local",
    )
    parser.add_argument(
        "--no-object-store",
        action="store_true",
        help="skip the object-store tier (which starts a SeaweedFS S3 server, built on first use)",
    )
    parser.add_argument(
        "--object-ttft-tokens",
        type=int,
        default=16384,
        help="prompt tokens of the object-tier TTFT measurement (default 16384; 0 = skip)",
    )
    parser.add_argument(
        "--workdir",
        default=None,
        help="directory for the disk tier (default: a temp dir under /var/tmp, which must be a real disk "
        "for the O_DIRECT numbers to mean anything; tmpfs is detected and reported)",
    )


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _make_payloads(n: int, size: int) -> list[bytes]:
    # Distinct, incompressible-looking chunks without paying for n * 32 MiB of os.urandom.
    base = os.urandom(MiB)
    out = []
    for i in range(n):
        rot = base[i * 4099 % MiB :] + base[: i * 4099 % MiB]
        out.append((rot * (size // MiB + 1))[:size])
    return out


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _memcpy_round(payloads: list[bytes], bufs: list[memoryview]) -> None:
    for b, p in zip(bufs, payloads, strict=True):
        b[:] = p


def _raw_direct_read(files: list[Path]) -> float:
    """O_DIRECT sequential read of whole files into one aligned buffer (one large request per file)."""
    size = max(f.stat().st_size for f in files)
    buf = mmap.mmap(-1, -(-size // 4096) * 4096)
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    total = 0
    t0 = time.perf_counter()
    for f in files:
        fd = os.open(f, flags)
        try:
            total += os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
    elapsed = time.perf_counter() - t0
    buf.close()
    return _gbps(total, elapsed)


@contextlib.contextmanager
def _redis(payload_count: int, chunk: int) -> Iterator[Any]:
    exe = shutil.which("redis-server")
    if exe is None:
        yield None
        return
    import redis

    from kvfabric.testing.serverproc import free_port

    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--maxmemory", str(payload_count * chunk * 2 + 256 * MiB),
         "--proto-max-bulk-len", str(max(chunk * 2, 512 * MiB))],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        r = redis.Redis(host="127.0.0.1", port=port)
        end = time.monotonic() + 30
        while True:
            try:
                r.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.05)
        yield r
        r.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _median_gbps(nbytes: int, times: list[float]) -> float:
    # The median round, not the mean: this box is shared, and one descheduled round should not
    # decide a ratio. Paired paths are measured in alternating rounds for the same reason.
    return _gbps(nbytes, statistics.median(times))


def _object_tier(
    work: Path,
    *,
    chunk: int,
    rounds: int,
    payloads: list[bytes],
    ns: str,
    keys: list[str],
    say: Any,
    ttft_tokens: int = 16384,
) -> dict[str, Any]:
    """Cold loads from the object tier against raw GETs of the same objects, in alternating rounds."""
    from concurrent.futures import ThreadPoolExecutor

    import obstore

    from kvfabric.cacheserver.config import ObjectStoreTierConfig
    from kvfabric.cacheserver.engine.objectclient import make_store
    from kvfabric.cacheserver.engine.objectstore import part_ranges
    from kvfabric.client import CacheClient
    from kvfabric.testing.s3server import s3_server
    from kvfabric.testing.serverproc import cache_server, wait_until

    out: dict[str, Any] = {}
    n = len(keys)
    with s3_server() as s3:
        (work / "ak").write_text(s3.access_key)
        (work / "sk").write_text(s3.secret_key)
        tier = {
            "endpoint": s3.endpoint,
            "bucket": s3.bucket,
            "prefix": "bench",
            "access_key_id_file": str(work / "ak"),
            "secret_access_key_file": str(work / "sk"),
            "capacity_bytes": 4 * n * (chunk + 4096),
            "max_pending_bytes": 2 * n * chunk,
        }
        cfg = ObjectStoreTierConfig.model_validate(tier)
        with cache_server(
            server_id="bench-object",
            dram_bytes=(n + 4) * chunk + 256 * MiB,
            local_disk_bytes=None,
            metrics=False,
            overrides={
                "tiers.object_store": tier,
                "limits.max_payload_bytes": chunk,
                "shm.arena_bytes": 2 * chunk * max(2, n // 4),
                "log_level": "WARNING",
            },
        ) as srv:
            with CacheClient(srv.unix_target, shared_memory=True) as c:
                for k, p in zip(keys, payloads, strict=True):
                    if c.store(ns, [k], [p], timeout=60).accepted != 1:
                        raise RuntimeError("store dropped during the benchmark")

                def uploaded() -> bool:
                    up = c.stats(timeout=10)["counters"].get("bytes_uploaded", {}).get("object", 0)
                    return bool(up >= n * chunk)

                wait_until(uploaded, 600, 0.2, "object write-back")
            store = make_store(cfg)
            paths = sorted(m["path"] for batch in obstore.list(store, "blocks/") for m in batch)
            sizes = {m["path"]: m["size"] for batch in obstore.list(store, "blocks/") for m in batch}
            if len(paths) != n:
                raise RuntimeError(f"expected {n} objects, found {len(paths)}")
            part = cfg.part_bytes
            pool = ThreadPoolExecutor(cfg.max_concurrent_gets)

            def raw_parallel() -> None:
                jobs = [(p, s, e) for p in paths for s, e in part_ranges(sizes[p], part)]
                got = sum(
                    len(b)
                    for b in pool.map(lambda j: obstore.get_range(store, j[0], start=j[1], end=j[2]), jobs)
                )
                if got != sum(sizes.values()):
                    raise RuntimeError("raw GET returned short data")

            def raw_single() -> None:
                for p in paths:
                    if len(obstore.get(store, p).bytes()) != sizes[p]:
                        raise RuntimeError("raw GET returned short data")

            bufs = [memoryview(bytearray(chunk)) for _ in keys]
            raw_t, single_t, tier_t = [], [], []
            raw_cpu: list[float] = []
            tier_cpu: list[float] = []
            s3_pids = [s3.proc.pid] if s3.proc is not None else []
            raw_parallel()
            for _ in range(rounds):
                srv.restart()  # DRAM empty; the index is rebuilt from a listing of the bucket
                assert srv.proc is not None
                with CacheClient(srv.unix_target, shared_memory=True) as cold:
                    tiers = cold.lookup(ns, keys, timeout=10).tiers
                    if tiers != ["object"] * n:
                        raise RuntimeError(
                            f"expected every chunk in the object tier after restart, got {tiers}"
                        )
                    meter = _CpuMeter(srv.proc.pid, *s3_pids)
                    meter.start()
                    t0 = time.perf_counter()
                    got_n = cold.load_into(ns, keys, bufs, timeout=600)
                    tier_t.append(time.perf_counter() - t0)
                    tier_cpu.append(meter.us_per_mib(n * chunk))
                    if got_n != n or bytes(bufs[-1]) != payloads[-1]:
                        raise RuntimeError("object tier load returned wrong data")
                meter = _CpuMeter(*s3_pids)
                meter.start()
                raw_t.append(_timed(raw_parallel))
                raw_cpu.append(meter.us_per_mib(n * chunk))
                single_t.append(_timed(raw_single))
            pool.shutdown()
            if ttft_tokens > 0:
                out.update(_object_ttft(srv, say, ttft_tokens))
    out["object_raw_get_gbps"] = _median_gbps(n * chunk, raw_t)
    out["object_single_get_gbps"] = _median_gbps(n * chunk, single_t)
    out["object_tier_load_gbps"] = _median_gbps(n * chunk, tier_t)
    # Each round's tier load against the raw GETs right after it: the spread of the ratio.
    out["object_tier_over_raw_rounds"] = [round(r / t, 4) for r, t in zip(raw_t, tier_t, strict=True)]
    # CPU per MiB of every process involved (this client, the cache server, the S3 server).
    out["object_tier_cpu_us_per_mib_rounds"] = tier_cpu
    out["object_raw_cpu_us_per_mib_rounds"] = raw_cpu
    say(f"object raw GET (ranged, parallel) {out['object_raw_get_gbps']:8.2f} GB/s")
    say(f"object raw GET (one per object)   {out['object_single_get_gbps']:8.2f} GB/s")
    say(f"object tier load (cold)           {out['object_tier_load_gbps']:8.2f} GB/s")
    return out


def _object_ttft(srv: Any, say: Any, tokens_n: int = 16384) -> dict[str, Any]:
    """TTFT of a ``tokens_n``-token prompt: a hit from the object tier against recompute."""
    try:
        from kvfabric.connector.settings import ConnectorSettings
        from kvfabric.refengine.engine import Engine
        from kvfabric.refengine.model import RefModel
        from kvfabric.refengine.presets import preset
        from kvfabric.refengine.testing import prompt
    except ImportError:
        say("torch not installed (the engine extra): object_ttft_s is null")
        return {"object_ttft_s": None, "recompute_ttft_s": None}
    from kvfabric.client import CacheClient
    from kvfabric.testing.serverproc import wait_until

    cfg = preset("bench")
    model = RefModel(cfg)
    suffix = 32
    tokens = prompt(tokens_n + suffix, tokens_n, cfg.vocab_size)
    blocks = (tokens_n + suffix) // 16 + 4
    settings = ConnectorSettings(
        socket=str(srv.config.listen.unix_socket), shared_memory=True, chunk_tokens=256,
        lookup_deadline_ms=1000, load_deadline_ms=60000, store_deadline_ms=60000,
        tail=False,  # whole chunks only: the object tier's restore of a fixed 1024-token prefix
    )  # fmt: skip
    off = Engine(cfg, num_blocks=blocks, model=model)
    off.generate(prompt(256, 0, cfg.vocab_size), 1)  # warm up torch's kernels
    cold = min(off.generate(tokens, 1).ttft_s for _ in range(2))
    off.close()
    with CacheClient(srv.unix_target) as c:
        before = c.stats(timeout=10)["counters"].get("bytes_uploaded", {}).get("object", 0)
    on = Engine(cfg, num_blocks=blocks, settings=settings, model=model)
    on.generate(tokens, 1)  # stores every whole chunk
    assert on.worker_conn is not None
    on.worker_conn.wait_for_stores(300)
    on.close()

    def uploaded() -> bool:
        with CacheClient(srv.unix_target) as c:
            up = c.stats(timeout=10)["counters"].get("bytes_uploaded", {}).get("object", 0)
        return bool(up > before)

    wait_until(uploaded, 600, 0.2, "object write-back of the prompt")
    runs = []
    for _ in range(2):
        srv.restart()  # DRAM empty: the prefix comes from the object tier
        wait_until(lambda: _object_blocks(srv) > 0, 120, 0.2, "the restarted server to index the objects")
        warm = Engine(cfg, num_blocks=blocks, settings=settings, model=model)
        r = warm.generate(tokens, 1)
        warm.close()
        if r.tier != "object":
            raise RuntimeError(f"expected a hit from the object tier, got {r.tier} ({r.fallback_reason})")
        runs.append(r)
    best = min(runs, key=lambda r: r.ttft_s)
    out = {
        "object_ttft_prompt_tokens": tokens_n,
        "recompute_ttft_s": round(cold, 4),
        "object_ttft_s": round(best.ttft_s, 4),
        "object_ttft_hit_tokens": best.hit_tokens,
        "object_ttft_speedup": round(cold / best.ttft_s, 2),
    }
    say(
        f"TTFT {tokens_n} tokens: recompute {cold * 1000:.0f} ms, "
        f"object-tier hit {best.ttft_s * 1000:.0f} ms "
        f"({best.hit_tokens} tokens restored, {out['object_ttft_speedup']}x)"
    )
    return out


def _object_blocks(srv: Any) -> int:
    from kvfabric.client import CacheClient

    with CacheClient(srv.unix_target) as c:
        return int(c.stats(timeout=10)["tiers"].get("object", {}).get("blocks", 0))


# One job of a lookup worker process: (path, target, namespace, keys, clients, lookups per
# client, interval between a client's lookups (0 = closed loop)).
_LookupJob = tuple[str, str, str, list[str], int, int, float]


def _lookup_worker(job: _LookupJob) -> dict[str, Any]:
    """Run ``clients`` lookup clients in this process: their latencies (s) and this process's CPU time.

    Returns ``lat`` (seconds, timed lookups only), ``cpu_s`` (this process's CPU time over the timed
    lookups, every thread), ``lookups`` and, on the local path, ``answered`` (from the table).

    ``interval`` 0: closed loop (each client sends its next lookup when the previous one returns).
    Otherwise open loop: each client sends on a fixed schedule, and latency counts from the scheduled
    time, so a path that falls behind is charged for it (no coordinated omission).

    ``rpc``: each client is an asyncio task with its own channel (they queue at the server, which is
    what a closed loop measures). ``local``: the clients take turns on this process's thread (a local
    lookup never waits for another client, only for a CPU; threads would measure the GIL's 5 ms
    switch interval instead).
    """
    path, target, ns, keys, clients, count, interval = job
    warmup = 20 if not interval else 2

    def check(matched: int) -> None:
        if matched != len(keys):
            raise RuntimeError(f"lookup matched {matched} of {len(keys)}")

    if path == "local":
        from kvfabric.client import CacheClient
        from kvfabric.client.errors import CacheUnavailable

        with CacheClient(target, shared_memory=True, local_index=True) as c:
            index = c.local_index
            assert index is not None
            # As the connector looks up: with the digests it holds (decoded once per request).
            import inspect

            kw: dict[str, Any] = {}
            if "raw" in inspect.signature(c.lookup).parameters:
                kw["raw"] = bytes.fromhex("".join(keys))
            # Warm up until the table is mapped (its fetch may have been refused under load).
            end = time.monotonic() + 30
            while index.answered < warmup and time.monotonic() < end:
                check(c.lookup(ns, keys, timeout=10, **kw).matched)
            if index.answered < warmup:
                raise RuntimeError("the client never answered from the published index")
            lat: list[float] = []
            start = time.perf_counter() + 0.01
            answered0 = index.answered
            cpu0 = time.process_time()
            for i in range(count * clients):
                if interval:
                    t0 = start + (i // clients) * interval + (i % clients) * interval / clients
                    pause = t0 - time.perf_counter()
                    if pause > 0:
                        time.sleep(pause)
                else:
                    t0 = time.perf_counter()
                # A starved heartbeat reads as a hung server: a miss, timed like any lookup.
                with contextlib.suppress(CacheUnavailable):
                    check(c.lookup(ns, keys, timeout=10, **kw).matched)
                lat.append(time.perf_counter() - t0)
            used = time.process_time() - cpu0
            # Lookups the table could not answer went over RPC: they are in the latencies too.
            return {"lat": lat, "cpu_s": used, "lookups": len(lat), "answered": index.answered - answered0}

    from kvfabric.client import AsyncCacheClient

    cpu = [0.0, 0.0]  # process CPU time when every client has warmed up, and at the end

    async def one(lat: list[float], offset: float, warm: list[int], go: asyncio.Event) -> None:
        async with AsyncCacheClient(target) as c:
            for _ in range(warmup):
                check((await c.lookup(ns, keys, timeout=10)).matched)
            warm[0] += 1
            if warm[0] == clients:
                cpu[0] = time.process_time()
                go.set()
            await go.wait()
            start = time.perf_counter() + offset
            for i in range(count):
                t0 = time.perf_counter()
                if interval:
                    t0 = start + i * interval
                    await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
                res = await c.lookup(ns, keys, timeout=10)
                dt = time.perf_counter() - t0
                check(res.matched)
                lat.append(dt)

    async def main() -> list[float]:
        lat: list[float] = []
        warm, go = [0], asyncio.Event()
        await asyncio.gather(*(one(lat, interval * i / max(1, clients), warm, go) for i in range(clients)))
        cpu[1] = time.process_time()
        return lat

    lat = asyncio.run(main())
    return {"lat": lat, "cpu_s": cpu[1] - cpu[0], "lookups": len(lat), "answered": 0}


class _CpuMeter:
    """CPU time (this process's, and other processes' by pid) spent between ``start`` and ``us_per_mib``.

    Per MiB moved, so that a cold load can be compared with its raw baseline on a machine whose other
    work stretches wall times (CPU time it barely changes). Other processes' CPU comes from
    ``/proc/<pid>/stat`` in clock ticks (10 ms at 100 Hz): a round of a few hundred MiB spans many.
    """

    def __init__(self, *pids: int) -> None:
        self.pids = pids
        self.t0 = 0.0

    def _now(self) -> float:
        return time.process_time() + sum(_process_cpu_s(p) for p in self.pids)

    def start(self) -> None:
        self.t0 = self._now()

    def us_per_mib(self, nbytes: int) -> float:
        return round((self._now() - self.t0) / (nbytes / MiB) * 1e6, 1)


def _process_cpu_s(pid: int) -> float:
    """CPU time (user + system, every thread) a process has used so far, from ``/proc/<pid>/stat``."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # After the command: state is field 3, utime and stime fields 14 and 15 (clock ticks).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _local_supported(unix_target: str) -> bool:
    """Whether this client can read a published index and the server publishes one."""
    import inspect

    from kvfabric.client import CacheClient

    if "local_index" not in inspect.signature(CacheClient).parameters:
        return False
    from kvfabric.rpc.indextable import index_socket_for

    return index_socket_for(unix_target[len("unix://") :]).exists()


def _lookup_round(
    pool: Any,
    job: tuple[str, str, str, list[str]],
    clients: int,
    count: int,
    interval: float,
    *,
    server_pid: int,
) -> dict[str, float]:
    """One round: ``clients`` over the pool's processes; p50/p99/p99.9 in ms, CPU per lookup in us."""
    from kvfabric.bench.report import percentile

    procs = max(1, min(4, clients))
    per = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    server0 = _process_cpu_s(server_pid)
    parts = pool.map(_lookup_worker, [(*job, n, count, interval) for n in per if n])
    server_cpu = _process_cpu_s(server_pid) - server0
    lat = sorted(x for part in parts for x in part["lat"])
    lookups = sum(part["lookups"] for part in parts)
    answered = sum(part["answered"] for part in parts)
    return {
        "local_share": round(answered / lookups, 4) if job[0] == "local" else 0.0,
        "p50_ms": round(percentile(lat, 0.50) * 1e3, 4),
        "p99_ms": round(percentile(lat, 0.99) * 1e3, 4),
        "p999_ms": round(percentile(lat, 0.999) * 1e3, 4),
        "client_cpu_us": round(sum(part["cpu_s"] for part in parts) / lookups * 1e6, 2),
        "server_cpu_us": round(server_cpu / lookups * 1e6, 2),
        "n": len(lat),
    }


def _is_tmpfs(path: Path) -> bool:
    best, fstype = "", ""
    with open("/proc/mounts", encoding="utf-8") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1]
            if str(path.resolve()).startswith(mnt) and len(mnt) > len(best):
                best, fstype = mnt, parts[2]
    return fstype == "tmpfs"


def run(args: argparse.Namespace) -> int:
    """Run every measurement and print the results; the last line is the JSON summary."""
    from kvfabric.bench.report import Spread, judge, spread, table
    from kvfabric.client import CacheClient
    from kvfabric.testing.serverproc import cache_server, digest, wait_until

    chunk = args.chunk_mib * MiB
    n = args.chunks or (4 if args.quick else 16)
    rounds = args.rounds or (3 if args.quick else 5)
    lookup_rounds = min(rounds, 2 if args.quick else 3)
    lookups_total = args.lookups or (1000 if args.quick else 2000)
    client_counts = sorted({int(x) for x in str(args.lookup_clients).split(",") if x.strip()})
    paths = [p for p in str(args.lookup_paths).split(",") if p in LOOKUP_PATHS]

    def say(*parts: object) -> None:
        if not args.json:
            print(*parts, file=sys.stderr, flush=True)

    res: dict[str, Any] = {
        "bench": "storage",
        "chunk_mib": args.chunk_mib,
        "chunks": n,
        "rounds": rounds,
        "quick": bool(args.quick),
        "cpus": os.cpu_count(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }
    spreads: dict[str, Spread] = {}

    def put(name: str, samples: list[float], unit: str = "") -> Spread:
        s = spread(samples)
        spreads[name] = s
        res[name] = s.median
        say(f"{name:<34} {s.text():>28} {unit}")
        return s

    payloads = _make_payloads(n, chunk)
    ns = digest("bench-storage")
    keys = [digest("chunk", i) for i in range(n)]

    base = Path(args.workdir) if args.workdir else Path("/var/tmp")
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvf-bench-", dir=base))
    res["disk_is_tmpfs"] = _is_tmpfs(work)
    overrides = {
        "tiers.local_disk.path": str(work / "local"),
        "limits.max_payload_bytes": chunk,
        "shm.arena_bytes": 2 * chunk * max(2, n // 4),
        "limits.store_queue_bytes": n * chunk * 2,
        "janitor_interval_seconds": 5.0,
        "log_level": "WARNING",
    }
    try:
        with cache_server(
            server_id="bench",
            # Twice the chunks: clients may hold (keep mapped) at most half of DRAM, and the loads
            # below keep every chunk mapped.
            dram_bytes=2 * (n + 4) * chunk + 256 * MiB,
            local_disk_bytes=int((n + 4) * (chunk + 4096) / 0.85),
            metrics=False,
            overrides=overrides,
        ) as srv:
            shm = CacheClient(srv.unix_target, shared_memory=True)
            # The same loads with no kept mappings: each block mapped and unmapped per load (what a
            # first load of a block costs, and every load did before mappings were kept).
            fresh = CacheClient(srv.unix_target, shared_memory=True, mapping_cache_bytes=0)
            tcp = CacheClient(srv.tcp_target)
            # memcpy, shm stores and shm loads use the same warm buffers (an engine's KV buffers and
            # save staging are long-lived), in alternating rounds.
            bufs = [memoryview(bytearray(chunk)) for _ in keys]
            _memcpy_round(payloads, bufs)

            def store_all(some: list[str]) -> None:
                # One key per call, as an engine stores chunk by chunk.
                for k, p in zip(some, payloads, strict=True):
                    if shm.store(ns, [k], [p], timeout=60).accepted != 1:
                        raise RuntimeError("store dropped during the benchmark")

            # Stores through the arena, each round against memcpy of the same bytes. Every round
            # stores keys of its own, then (untimed) waits for their write-back and deletes them, so
            # each round starts from the same state and none times the previous one's write-back.
            store_r, store_memcpy_r = [], []
            for r in range(rounds):
                fresh_keys = [digest("store-round", r, i) for i in range(n)]
                store_memcpy_r.append(_gbps(n * chunk, _timed(lambda: _memcpy_round(payloads, bufs))))
                store_r.append(_gbps(n * chunk, _timed(lambda ks=fresh_keys: store_all(ks))))
                shm.flush(ns, fresh_keys, timeout=120)
                shm.delete(ns, fresh_keys, timeout=60)
            put("shm_store_gbps", store_r, "GB/s")
            put("shm_store_memcpy_gbps", store_memcpy_r, "GB/s")
            put("shm_store_over_memcpy", [a / b for a, b in zip(store_r, store_memcpy_r, strict=True)])
            store_all(keys)  # what the loads below read (untimed)

            shm.load_into(ns, keys, bufs, timeout=60)
            memcpy_r, shm_r, fresh_r = [], [], []

            def shm_round(client: CacheClient) -> None:
                if client.load_into(ns, keys, bufs, timeout=60) != n:
                    raise RuntimeError("shm load missed")

            for _ in range(rounds):
                memcpy_r.append(_gbps(n * chunk, _timed(lambda: _memcpy_round(payloads, bufs))))
                shm_r.append(_gbps(n * chunk, _timed(lambda: shm_round(shm))))
                fresh_r.append(_gbps(n * chunk, _timed(lambda: shm_round(fresh))))
                if bytes(bufs[-1]) != payloads[-1]:
                    raise RuntimeError("shm load returned wrong data")
            res["shm_held_bytes"] = shm.stats(timeout=10)["tiers"]["dram"].get("held_bytes")
            fresh.close()
            put("memcpy_gbps", memcpy_r, "GB/s")
            put("shm_load_gbps", shm_r, "GB/s")
            put("shm_load_over_memcpy", [a / b for a, b in zip(shm_r, memcpy_r, strict=True)])
            put("shm_load_fresh_gbps", fresh_r, "GB/s")
            put("shm_load_fresh_over_memcpy", [a / b for a, b in zip(fresh_r, memcpy_r, strict=True)])

            def grpc_round() -> None:
                if len(tcp.load(ns, keys, timeout=120)) != n:
                    raise RuntimeError("grpc load missed")

            tcp.load(ns, keys[:1], timeout=60)
            grpc_r = [_gbps(n * chunk, _timed(grpc_round)) for _ in range(rounds)]
            put("grpc_load_gbps", grpc_r, "GB/s")

            # Lookups: 128 keys, all present (the most work per lookup), small payloads.
            lk = [digest("lookup", i) for i in range(args.lookup_keys)]
            for i in range(0, len(lk), 32):
                shm.store(ns, lk[i : i + 32], [b"k" * 1024] * len(lk[i : i + 32]), timeout=60)
            if "local" in paths and not _local_supported(srv.unix_target):
                say("lookup path 'local': no published index (client or server lacks it); skipped")
                paths.remove("local")
            res["lookup_keys"] = args.lookup_keys
            res["lookup_clients"] = client_counts
            res["lookup_paths"] = paths
            assert srv.proc is not None
            server_pid = srv.proc.pid
            res["cpu_clock_ticks_per_s"] = os.sysconf("SC_CLK_TCK")  # the server CPU's resolution
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(max(1, min(4, max(client_counts)))) as pool:
                for path in paths:
                    job = (path, srv.unix_target, ns, lk)
                    configs: list[tuple[str, int, float]] = [(f"c{c}", c, 0.0) for c in client_counts]
                    if args.lookup_rate > 0:
                        configs.append(("paced", max(client_counts), 1.0 / args.lookup_rate))
                    for label, clients, interval in configs:
                        per_client = max(10, -(-lookups_total // clients))
                        if interval:
                            # Paced rounds last count x interval: keep them to a few seconds.
                            per_client = max(10, min(per_client, int(5.0 / interval)))
                        got = [
                            _lookup_round(pool, job, clients, per_client, interval, server_pid=server_pid)
                            for _ in range(lookup_rounds)
                        ]
                        for q in ("p50_ms", "p99_ms", "p999_ms"):
                            put(f"lookup_{path}_{label}_{q}", [g[q] for g in got], "ms")
                        for q in ("client_cpu_us", "server_cpu_us"):
                            put(f"lookup_{path}_{label}_{q}", [g[q] for g in got], "us CPU per lookup")
                        res[f"lookup_{path}_{label}_samples_per_round"] = got[0]["n"]
                        if path == "local":
                            # Share answered from the table (the rest went over RPC): close to 1.
                            res[f"lookup_local_{label}_answered_share"] = min(g["local_share"] for g in got)
            if args.lookup_rate > 0:
                res["lookup_paced_rate_per_client"] = args.lookup_rate
            # The target is the engine's lookup: the best path this client offers.
            for label in [f"c{c}" for c in client_counts] + (["paced"] if args.lookup_rate > 0 else []):
                for q in ("p50_ms", "p99_ms", "p999_ms"):
                    medians = {p: spreads[f"lookup_{p}_{label}_{q}"].median for p in paths}
                    best = min(medians, key=medians.__getitem__)
                    spreads[f"lookup_best_{label}_{q}"] = spreads[f"lookup_{best}_{label}_{q}"]
                    res[f"lookup_best_{label}_{q}"] = res[f"lookup_{best}_{label}_{q}"]
                    res[f"lookup_best_{label}_path"] = best

            # Disk: wait for write-back; then, in alternating rounds, restart the server (DRAM empty,
            # index rebuilt from headers) and load every chunk from the disk tier, cold, and read the
            # very same block files raw with O_DIRECT.
            wait_until(lambda: shm.stats(timeout=10)["writeback_pending_bytes"] == 0, 300, 0.1, "write-back")
            files = sorted((work / "local" / "buckets").rglob("*.blk"))
            big = [f for f in files if f.stat().st_size > chunk]
            shm.close()
            tcp.close()
            raw_r: list[float] = []
            tier_r: list[float] = []
            raw_cpu: list[float] = []
            tier_cpu: list[float] = []
            for _ in range(max(2, rounds - 2)):
                srv.restart()
                assert srv.proc is not None
                with CacheClient(srv.unix_target, shared_memory=True) as cold:
                    tiers = cold.lookup(ns, keys, timeout=10).tiers
                    if tiers != ["local_disk"] * n:
                        raise RuntimeError(f"expected every chunk on local disk after restart, got {tiers}")
                    meter = _CpuMeter(srv.proc.pid)
                    meter.start()
                    t0 = time.perf_counter()
                    got_n = cold.load_into(ns, keys, bufs, timeout=300)
                    tier_r.append(_gbps(n * chunk, time.perf_counter() - t0))
                    tier_cpu.append(meter.us_per_mib(n * chunk))
                    if got_n != n or bytes(bufs[-1]) != payloads[-1]:
                        raise RuntimeError("disk tier load returned wrong data")
                meter = _CpuMeter()
                meter.start()
                raw_r.append(_raw_direct_read(big))
                raw_cpu.append(meter.us_per_mib(sum(f.stat().st_size for f in big)))
            put("disk_raw_read_gbps", raw_r, "GB/s")
            put("disk_tier_load_gbps", tier_r, "GB/s")
            put("disk_tier_over_raw", [a / b for a, b in zip(tier_r, raw_r, strict=True)])
            # CPU per MiB of the load (client and server) and of the raw read: what the load adds
            # to the device's work, which a busy machine's other processes barely change.
            put("disk_tier_cpu_us_per_mib", tier_cpu, "us CPU/MiB")
            put("disk_raw_cpu_us_per_mib", raw_cpu, "us CPU/MiB")

        with _redis(n, chunk) as r:
            if r is None:
                res["redis_get_gbps"] = None
                say("redis-server not found (apt-get install -y redis-server): redis_get_gbps is null")
            else:
                for k, p in zip(keys, payloads, strict=True):
                    r.set(k, p)
                r.get(keys[0])

                def redis_round() -> None:
                    for k in keys:
                        if r.get(k) is None:
                            raise RuntimeError("redis lost a key")

                redis_r = [_gbps(n * chunk, _timed(redis_round)) for _ in range(rounds)]
                put("redis_get_gbps", redis_r, "GB/s")
                # Not paired round by round (different servers): the ratio of the medians, with the
                # extremes' ratios as its spread.
                g = statistics.median(grpc_r) / statistics.median(redis_r)
                s = Spread(round(g, 4), round(min(grpc_r) / max(redis_r), 4),
                           round(max(grpc_r) / min(redis_r), 4), rounds)  # fmt: skip
                spreads["grpc_over_redis"] = s
                res["grpc_over_redis"] = s.median
                say(f"{'grpc_over_redis':<34} {s.text():>28}")
        if not args.no_object_store:
            res.update(
                _object_tier(
                    work,
                    chunk=chunk,
                    rounds=rounds,
                    payloads=payloads,
                    ns=ns,
                    keys=keys,
                    say=say,
                    ttft_tokens=args.object_ttft_tokens,
                )
            )
            if res.get("object_raw_get_gbps"):
                # Paired in alternating rounds by _object_tier: the ratio per round, as for the disk.
                put("object_tier_over_raw", res.pop("object_tier_over_raw_rounds"))
                put("object_tier_cpu_us_per_mib", res.pop("object_tier_cpu_us_per_mib_rounds"), "us CPU/MiB")
                put("object_raw_cpu_us_per_mib", res.pop("object_raw_cpu_us_per_mib_rounds"), "us CPU/MiB")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    res["spread"] = {k: v.as_dict() for k, v in spreads.items()}
    verdicts = judge(
        _targets(client_counts, object_tier="object_tier_over_raw" in spreads, cores=os.cpu_count() or 1),
        spreads,
    )
    res["targets"] = verdicts
    say("")
    say(table(verdicts))
    print(json.dumps(res), flush=True)
    return 0
