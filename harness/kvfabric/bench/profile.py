"""Where the time of the missed performance goals goes: ``python -m kvfabric.bench.profile``.

cProfile summaries (top functions by own time) of

1. a same-node lookup of 128 keys answered from the published index, with its wall time against
   its own CPU time per call (p50/p99/p99.9): the difference is waiting for a CPU;
2. a same-node shared-memory load of 8 x 32 MiB (client side), next to memcpy of the same bytes;
3. cold disk-tier promotions of 8 x 32 MiB in-process (server side: O_DIRECT read, checksum);
4. the ways a client can copy a 32 MiB sealed memfd into a warm buffer, against memcpy in the same
   run: mapping it for one load (what a load does today, with and without ``MAP_POPULATE``),
   ``preadv``, and a mapping kept from an earlier load (the ceiling of a client-side mapping cache);
5. cold disk promotions, the ways of filling a fresh memfd from a block file;
6. a 16k-token restore into the reference engine's KV tensors from kept mappings of sealed blocks:
   through the connector's staging buffer (today: copy, verify, scatter), against verifying
   and scattering in place from the mappings (no staging copy), with memcpy of the same bytes;
7. the same-node store path stage by stage, in-process with the real pieces (the connector's MAC,
   the arena's handshake, the client's write, the commit with its index publication, the
   write-back's checksum and disk write): CPU time per MiB of each stage, beside memcpy;
8. a cold disk-tier load stage by stage, in-process on real block files: the O_DIRECT read in the
   promotion's pieces, the checksum, the write into a fresh memfd, the client's first mapping and
   copy of it, and the promotion as coded (``read_block_to_fd``), each beside the raw O_DIRECT read
   of the same file: CPU and wall time per MiB;
9. object-tier promotions of 32 MiB objects into fresh memfds from a real S3 server (SeaweedFS on
   loopback), four at a time as a load promotes them: through a fresh mapping (``read_into``) and
   written part by part into the memfd (``read_into_fd``, what a promotion does), against the same
   ranged GETs by a bare obstore client: GB/s, ratio to raw per round, and this process's CPU per MiB.
10. a fresh client's first lent load of blocks resident in DRAM (an engine's first hit after its
    restart): the blocks fetched with one hold request each (as the client did before it batched
    them) against one request for all of them, alternating, on the same server.

Not a benchmark (no targets, nothing judged): the evidence behind docs/performance.md.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

MiB = 1 << 20


def _show(pr: cProfile.Profile, title: str, n: int = 10) -> None:
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(n)
    out = s.getvalue()
    i = out.find("ncalls")
    print(f"== {title}\n{out[i : i + 2400]}", flush=True)


def _q(xs: list[int], f: float) -> float:
    return xs[min(len(xs) - 1, int(len(xs) * f))] / 1e3


def lookups_and_shm() -> None:
    """Parts 1 and 2, against a real server process."""
    from kvfabric.client import CacheClient
    from kvfabric.testing.serverproc import cache_server, digest

    ns = digest("prof")
    overrides = {"limits.max_payload_bytes": 32 * MiB, "shm.arena_bytes": 128 * MiB}
    with (
        cache_server(server_id="prof", metrics=False, dram_bytes=1 << 30, overrides=overrides) as srv,
        CacheClient(srv.unix_target, shared_memory=True, local_index=True) as c,
    ):
        keys = [digest("k", i) for i in range(128)]
        for i in range(0, 128, 32):
            c.store(ns, keys[i : i + 32], [b"x" * 1024] * 32, timeout=30)
        for _ in range(100):
            c.lookup(ns, keys, timeout=5)
        wall: list[int] = []
        cpu: list[int] = []
        for _ in range(5000):
            w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            c.lookup(ns, keys, timeout=5)
            cpu.append(time.thread_time_ns() - c0)
            wall.append(time.perf_counter_ns() - w0)
        wall.sort()
        cpu.sort()
        print(
            "local lookup wall p50/p99/p99.9 "
            f"{_q(wall, 0.5):.1f}/{_q(wall, 0.99):.1f}/{_q(wall, 0.999):.1f} us;"
            f" its own CPU time {_q(cpu, 0.5):.1f}/{_q(cpu, 0.99):.1f}/{_q(cpu, 0.999):.1f} us;"
            f" load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(3000):
            c.lookup(ns, keys, timeout=5)
        pr.disable()
        _show(pr, "local lookup, 128 keys (3000 calls)")

        big = [digest("b", i) for i in range(8)]
        pay = [os.urandom(32 * MiB) for _ in big]
        for k, p in zip(big, pay, strict=True):
            c.store(ns, [k], [p], timeout=60)
        bufs = [memoryview(bytearray(32 * MiB)) for _ in big]
        c.load_into(ns, big, bufs, timeout=60)
        t0 = time.perf_counter()
        for b, p in zip(bufs, pay, strict=True):
            b[:] = p
        mc = time.perf_counter() - t0
        pr = cProfile.Profile()
        pr.enable()
        t0 = time.perf_counter()
        c.load_into(ns, big, bufs, timeout=60)
        ld = time.perf_counter() - t0
        pr.disable()
        print(
            f"memcpy {8 * 32 * MiB / mc / 1e9:.2f} GB/s, "
            f"shm load {8 * 32 * MiB / ld / 1e9:.2f} GB/s (profiled)"
        )
        _show(pr, "shm load_into of 8 x 32 MiB (client side)")


def disk_promotion() -> None:
    """Part 3, in-process."""
    from kvfabric.cacheserver.config import ServerConfig
    from kvfabric.cacheserver.engine.ids import BlockId
    from kvfabric.cacheserver.engine.tiered import TieredStore
    from kvfabric.testing.serverproc import digest

    tmp = Path(tempfile.mkdtemp(prefix="kvf-prof-", dir="/var/tmp"))
    shm = Path(tempfile.mkdtemp(prefix="kvf-prof-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        cfg = ServerConfig.model_validate(
            {
                "server_id": "prof",
                "listen": {"unix_socket": str(tmp / "s.sock")},
                "tiers": {
                    "dram": {"capacity_bytes": 1 << 30},
                    "local_disk": {"path": str(tmp / "local"), "capacity_bytes": 2 << 30},
                },
                "limits": {"max_payload_bytes": 32 * MiB, "store_queue_bytes": 1 << 30},
                "janitor_interval_seconds": 3600,
            }
        )
        ns = digest("prof-disk")
        bids = [BlockId(ns, digest("d", i)) for i in range(8)]
        st = TieredStore(cfg)
        st.start()
        for b in bids:
            st.put(b, os.urandom(32 * MiB))
        st.flush(120)
        st.close()
        st = TieredStore(cfg)  # empty DRAM, index rebuilt: every read comes from disk (O_DIRECT)
        st.start()
        pr = cProfile.Profile()
        pr.enable()
        t0 = time.perf_counter()
        for b in bids:
            if st.ensure_dram(b) is None:
                raise RuntimeError("promotion missed")
        dt = time.perf_counter() - t0
        pr.disable()
        st.close()
        print(f"cold disk promotion {8 * 32 * MiB / dt / 1e9:.2f} GB/s (profiled, one thread)")
        _show(pr, "cold disk-tier promotion of 8 x 32 MiB (server side, in-process)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def copy_paths(rounds: int = 15) -> None:
    """Part 4: GB/s per way of copying one sealed 32 MiB block, median (min-max) of ``rounds``."""
    import mmap
    import statistics

    from kvfabric.cacheserver.engine.dram import new_memfd, seal

    n = 32 * MiB
    src = bytearray(os.urandom(MiB) * 32)
    fd = new_memfd("profile", n)
    assert fd is not None
    os.pwrite(fd, src, 0)
    seal(fd)
    dst = memoryview(bytearray(n))
    kept = mmap.mmap(fd, n, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)

    def mapped(flags: int) -> None:
        with mmap.mmap(fd, n, prot=mmap.PROT_READ, flags=flags) as m:
            dst[:] = m

    def memcpy() -> None:
        dst[:] = src

    def from_kept() -> None:
        dst[:] = kept

    def pread() -> None:
        os.preadv(fd, [dst], 0)

    ways: dict[str, Callable[[], None]] = {
        "memcpy (baseline)": memcpy,
        "map per load, MAP_POPULATE (today)": lambda: mapped(mmap.MAP_SHARED | mmap.MAP_POPULATE),
        "map per load, faulting": lambda: mapped(mmap.MAP_SHARED),
        "preadv": pread,
        "mapping kept across loads": from_kept,
    }
    memcpy()  # fault the destination in: an engine's KV buffers are long-lived
    rates: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):  # interleaved, so that a noisy moment hits every way alike
        for name, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            rates[name].append(n / (time.perf_counter() - t0) / 1e9)
    base = statistics.median(rates["memcpy (baseline)"])
    print("== copying one sealed 32 MiB memfd into a warm buffer")
    for name, got in rates.items():
        med = statistics.median(got)
        print(f"{name:38s} {med:6.2f} GB/s ({min(got):.2f}-{max(got):.2f}), {med / base:.2f} of memcpy")
    kept.close()
    os.close(fd)


def promotion_paths(workdir: Path | None = None, rounds: int = 5, blocks: int = 8) -> None:
    """Part 5: ways of promoting cold 32 MiB block files into fresh memfds, against raw O_DIRECT reads.

    Each way runs the real code on real block files (``blockfile.write_block``; header, checksum and
    all), interleaved: the raw read of the whole file into one warm buffer (the benchmark's
    baseline), ``read_block_into`` a fresh memfd mapping (what a promotion did before), the same
    after ``fallocate`` + ``MAP_POPULATE``, and ``read_block_to_fd`` (what a promotion does now:
    pieces read while the previous one is checksummed and written).
    """
    import mmap
    import statistics

    from kvfabric.cacheserver.engine import blockfile
    from kvfabric.cacheserver.engine.ids import BlockId
    from kvfabric.testing.serverproc import digest

    n = 32 * MiB
    direct = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    with tempfile.TemporaryDirectory(prefix="kvf-prof-", dir=workdir or "/var/tmp") as tmp:
        (Path(tmp) / "tmp").mkdir()
        files: list[tuple[Path, BlockId]] = []
        for i in range(blocks):
            bid = BlockId(digest("prof-ns"), digest("prof", i))
            path = Path(tmp) / "b" / bid.filename
            blockfile.write_block(Path(tmp) / "tmp", path, bid, os.urandom(n), created_at=0.0, bucket=0)
            files.append((path, bid))
        os.sync()
        warm = mmap.mmap(-1, blockfile.HEADER_SIZE + n)
        warm[:] = b"\1" * len(warm)

        def each(fill: Callable[[Path, BlockId, int], None]) -> None:
            made = []
            for path, bid in files:
                dst = os.memfd_create("profile", os.MFD_CLOEXEC)
                made.append(dst)
                fill(path, bid, dst)
            for fd in made:
                os.close(fd)

        def raw() -> None:
            for path, _ in files:
                src = os.open(path, direct)
                os.preadv(src, [warm], 0)
                os.close(src)

        def fresh(path: Path, bid: BlockId, dst: int) -> None:
            os.ftruncate(dst, n)
            with mmap.mmap(dst, n) as m:
                view = memoryview(m)
                blockfile.read_block_into(path, bid, view)
                view.release()

        def prealloc(path: Path, bid: BlockId, dst: int) -> None:
            os.posix_fallocate(dst, 0, n)
            with mmap.mmap(dst, n, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)) as m:
                view = memoryview(m)
                blockfile.read_block_into(path, bid, view)
                view.release()

        def overlapped(path: Path, bid: BlockId, dst: int) -> None:
            os.ftruncate(dst, n)
            blockfile.read_block_to_fd(path, bid, dst, length=n)

        ways: dict[str, Callable[[], None]] = {
            "raw O_DIRECT read (baseline)": raw,
            "read_block_into a fresh mapping (before)": lambda: each(fresh),
            "fallocate + MAP_POPULATE, then read": lambda: each(prealloc),
            "read_block_to_fd, overlapped (now)": lambda: each(overlapped),
        }
        rates: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(rounds):
            for name, fn in ways.items():
                t0 = time.perf_counter()
                fn()
                rates[name].append(blocks * n / (time.perf_counter() - t0) / 1e9)
        warm.close()
    base = statistics.median(rates["raw O_DIRECT read (baseline)"])
    print(f"== promoting {blocks} cold 32 MiB block files into fresh memfds")
    for name, got in rates.items():
        med = statistics.median(got)
        print(f"{name:42s} {med:6.2f} GB/s ({min(got):.2f}-{max(got):.2f}), {med / base:.2f} of raw")


def restore_paths(
    rounds: int = 15, tokens: int = 16384, chunk_tokens: int = 256, block_size: int = 16
) -> None:
    """Part 6: ms per restore of ``tokens`` from kept mappings, staged or in place, median (min-max)."""
    import mmap
    import statistics
    import warnings

    import torch

    from kvfabric.cacheserver.engine.dram import new_memfd, seal
    from kvfabric.connector import layout

    # The reference engine's benchmark model (4 layers, 2 KV heads of 32, fp32): 2 KiB per token.
    kv = {f"layer.{i}": torch.zeros(tokens // block_size + 8, 2, block_size, 64) for i in range(4)}
    geo = layout.ChunkGeometry.from_kv_caches(kv, block_size=block_size, chunk_tokens=chunk_tokens)
    n = tokens // chunk_tokens
    ns, size = "ab" * 32, geo.payload_bytes
    keys = [f"{i:064x}" for i in range(n)]
    block_ids = [list(range(i * geo.blocks_per_chunk, (i + 1) * geo.blocks_per_chunk)) for i in range(n)]
    maps, fds = [], []
    for key in keys:
        payload = bytearray(os.urandom(size))
        layout.seal(payload, namespace=ns, key=key, num_tokens=chunk_tokens, num_layers=4)
        fd = new_memfd("profile", size)
        assert fd is not None
        os.pwrite(fd, payload, 0)
        seal(fd)
        fds.append(fd)
        maps.append(mmap.mmap(fd, size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE))
    views = [memoryview(m) for m in maps]
    staging = bytearray(n * size)
    src = bytearray(os.urandom(n * size))

    def verify(buf: memoryview, key: str) -> None:
        layout.verify(buf, namespace=ns, key=key, num_tokens=chunk_tokens, num_layers=4)

    def memcpy() -> None:
        staging[:] = src

    def staged() -> None:
        for i, v in enumerate(views):
            staging[i * size : (i + 1) * size] = v
        for i, key in enumerate(keys):
            verify(memoryview(staging)[i * size : (i + 1) * size], key)
        for idx, t in enumerate(kv.values()):
            layout.scatter_chunks(geo, idx, staging, t, block_ids)

    def in_place() -> None:
        for v, key in zip(views, keys, strict=True):
            verify(v, key)
        for idx, t in enumerate(kv.values()):
            for v, ids in zip(views, block_ids, strict=True):
                layout.scatter_layer(geo, idx, v, t, ids)

    def verify_only() -> None:
        for v, key in zip(views, keys, strict=True):
            verify(v, key)

    def scatter_only() -> None:
        for idx, t in enumerate(kv.values()):
            for v, ids in zip(views, block_ids, strict=True):
                layout.scatter_layer(geo, idx, v, t, ids)

    def staged_scatter_only() -> None:
        for idx, t in enumerate(kv.values()):
            layout.scatter_chunks(geo, idx, staging, t, block_ids)

    # What a lean in-place scatter costs: one tensor per mapping, index tensors made once, one
    # index_put_ per chunk and layer (scatter_layer builds its view and index on every call).
    offsets = [layout.HEADER_SIZE + sum(geo.layer_bytes[:i]) for i in range(4)]
    index = [torch.as_tensor(ids) for ids in block_ids]

    def lean_scatter() -> None:
        for v, ix in zip(views, index, strict=True):
            whole = torch.frombuffer(v, dtype=torch.uint8)
            for idx, t in enumerate(kv.values()):
                g = geo.layers[idx]
                part = whole[offsets[idx] : offsets[idx] + geo.layer_bytes[idx]]
                t.index_put_((ix,), part.view(g.dtype).view(geo.blocks_per_chunk, *g.block_shape))

    def in_place_lean() -> None:
        verify_only()
        lean_scatter()

    ways: dict[str, Callable[[], None]] = {
        "memcpy of the same bytes (baseline)": memcpy,
        "staged: copy, verify, scatter (today)": staged,
        "  of which the scatter from staging": staged_scatter_only,
        "in place: verify, scatter per chunk": in_place,
        "  of which the keyed MAC (verify)": verify_only,
        "  of which the scatter per chunk": scatter_only,
        "in place, lean scatter per chunk": in_place_lean,
        "  of which the lean scatter": lean_scatter,
    }
    memcpy()
    ms: dict[str, list[float]] = {name: [] for name in ways}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch.frombuffer of a read-only mapping
        for _ in range(rounds):
            for name, fn in ways.items():
                t0 = time.perf_counter()
                fn()
                ms[name].append((time.perf_counter() - t0) * 1e3)
    print(f"== restoring {tokens} tokens ({n} chunks, {n * size / MiB:.0f} MiB) from kept mappings")
    for name, got in ms.items():
        med = statistics.median(got)
        print(f"{name:40s} {med:7.2f} ms ({min(got):.2f}-{max(got):.2f}), {n * size / med / 1e6:.2f} GB/s")
    for v, m, fd in zip(views, maps, fds, strict=True):
        v.release()
        m.close()
        os.close(fd)


def store_paths(rounds: int = 5, blocks: int = 4, chunk: int = 32 * MiB) -> None:
    """Part 7: CPU (process time: the MAC's threads count) and wall time per MiB of each store stage.

    Each round stores ``blocks`` fresh keys through a real :class:`StagingArena` into a real
    :class:`TieredStore` whose listener is a real :class:`IndexPublisher`; the write-back's two
    steps (checksum, disk write) run here on the blocks just stored, as the write-back thread runs
    them, so that each stage is timed on its own. The stages run one after the other in this
    thread, so a noisy machine inflates wall times much more than CPU times.
    """
    import statistics

    from kvfabric.cacheserver.config import ServerConfig
    from kvfabric.cacheserver.engine.blockfile import payload_checksum, write_block
    from kvfabric.cacheserver.engine.ids import BlockId
    from kvfabric.cacheserver.engine.stats import Counters
    from kvfabric.cacheserver.engine.tiered import TieredStore
    from kvfabric.cacheserver.transport.arena import BeginResult, StagingArena
    from kvfabric.cacheserver.transport.indexpub import IndexPublisher
    from kvfabric.client.blocks import write_all
    from kvfabric.connector import layout
    from kvfabric.testing.serverproc import digest

    tmp = Path(tempfile.mkdtemp(prefix="kvf-prof-", dir="/var/tmp"))
    cfg = ServerConfig.model_validate(
        {
            "server_id": "prof",
            "listen": {"unix_socket": str(tmp / "s.sock")},
            "tiers": {"dram": {"capacity_bytes": 4 * blocks * chunk}, "write_back": "none"},
            "limits": {"max_payload_bytes": chunk},
            "janitor_interval_seconds": 3600,
        }
    )
    st = TieredStore(cfg)
    pub = IndexPublisher(st.tier_of, known=lambda ns: True)
    published = [0]

    def changed(bids: list[BlockId]) -> None:
        t = time.process_time_ns()
        pub.changed(bids)
        published[0] += time.process_time_ns() - t

    st.set_listener(changed)
    st.start()
    pub.start()
    arena = StagingArena(2 * blocks * chunk, 60.0, Counters())
    ns = digest("prof-store")
    src = [bytearray(os.urandom(MiB) * (chunk // MiB)) for _ in range(blocks)]
    dst = bytearray(chunk)
    mac_key = os.urandom(32)
    mib = blocks * chunk / MiB
    names = ["memcpy", "mac", "begin", "client_write", "commit", "of_which_publish"]
    names += ["wb_checksum", "wb_write"]
    cpu: dict[str, list[float]] = {k: [] for k in names}
    wall: dict[str, list[float]] = {k: [] for k in names}
    wb = tmp / "wb"
    wb.mkdir()

    def stage(name: str, fn: Callable[[], None]) -> None:
        w, c = time.perf_counter_ns(), time.process_time_ns()
        fn()
        cpu[name].append((time.process_time_ns() - c) / mib / 1e3)
        wall[name].append((time.perf_counter_ns() - w) / mib / 1e3)

    try:
        for r in range(rounds):
            bids = [BlockId(ns, digest("s", r, i)) for i in range(blocks)]
            staged: list[BeginResult] = []
            sums: list[bytes] = []

            def memcpy() -> None:
                for s in src:
                    dst[:] = s

            def mac(bids: list[BlockId] = bids) -> None:
                for b, s in zip(bids, src, strict=True):
                    layout.seal(s, namespace=ns, key=b.key, num_tokens=256, num_layers=32, mac_key=mac_key)

            def begin(bids: list[BlockId] = bids, staged: list[BeginResult] = staged) -> None:
                staged.append(arena.begin(bids, [chunk] * blocks, [False] * blocks))

            def client_write(staged: list[BeginResult] = staged) -> None:
                for name, s in zip(staged[0].names, src, strict=True):
                    got = arena.dup_by_name(name)
                    assert got is not None
                    write_all(got[0], memoryview(s))

            def commit(staged: list[BeginResult] = staged) -> None:
                if arena.commit(staged[0].lease_id, st)[0] != blocks:
                    raise RuntimeError("a store was dropped")

            stage("memcpy", memcpy)
            stage("mac", mac)
            stage("begin", begin)
            stage("client_write", client_write)
            published[0] = 0
            stage("commit", commit)
            cpu["of_which_publish"].append(published[0] / mib / 1e3)
            handles = [h for h in (st.dram.open(b) for b in bids) if h is not None]
            views = [h.view() for h in handles]

            def checksum(views: list[memoryview] = views, sums: list[bytes] = sums) -> None:
                sums.extend(payload_checksum(v) for v in views)

            def write(
                bids: list[BlockId] = bids, views: list[memoryview] = views, sums: list[bytes] = sums
            ) -> None:
                for b, v, s in zip(bids, views, sums, strict=True):
                    write_block(wb, wb / b.key, b, v, created_at=0.0, bucket=0, checksum=s)

            stage("wb_checksum", checksum)
            stage("wb_write", write)
            for v in views:
                v.release()
            for h in handles:
                h.close()
            for b in bids:
                st.delete(b)
                os.unlink(wb / b.key)
    finally:
        st.close()
        arena.close()
        shutil.rmtree(tmp, ignore_errors=True)
    load = os.getloadavg()[0]
    print(f"== the store path, {blocks} x {chunk // MiB} MiB per round, {rounds} rounds, load {load:.1f}")
    print(f"{'stage':18s} {'CPU us/MiB':>24s} {'wall us/MiB':>24s}")
    for k in names:
        c, w = cpu[k], wall[k]
        cs = f"{statistics.median(c):8.1f} ({min(c):.1f}-{max(c):.1f})"
        ws = f"{statistics.median(w):8.1f} ({min(w):.1f}-{max(w):.1f})" if w else ""
        print(f"{k:18s} {cs:>24s} {ws:>24s}")


def cold_load_stages(rounds: int = 5, blocks: int = 4, workdir: Path | None = None) -> None:
    """Part 8: CPU (process time: a reader thread counts) and wall time per MiB of a cold disk load.

    Every round writes ``blocks`` fresh 32 MiB block files (``write_block``: header and checksum
    as a tier writes them; O_DIRECT reads never come from the page cache) and, per file, times:
    the raw O_DIRECT read of the whole file into one warm buffer (the benchmark's baseline);
    the promotion's stages one at a time (the O_DIRECT read of the payload in the promotion's
    pieces into a warm buffer; xxh3-128 of it; its ``pwrite`` into a fresh memfd; the client's first
    load of that memfd: map it with ``MAP_POPULATE``, copy into a warm buffer, unmap); and the
    promotion as coded (``read_block_to_fd`` into a fresh memfd: read, checksum and write
    overlapped), then the whole cold load (that promotion and the client's first load).
    """
    import mmap
    import statistics

    import xxhash

    from kvfabric.cacheserver.engine import blockfile
    from kvfabric.cacheserver.engine.ids import BlockId
    from kvfabric.testing.serverproc import digest

    n = 32 * MiB
    piece = blockfile._PIPE_PIECE  # the promotion's own piece size
    direct = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    names = ["raw_read", "read_pieces", "checksum", "memfd_write", "client_map_copy"]
    names += ["promotion_as_coded", "cold_load_as_coded"]
    cpu: dict[str, list[float]] = {k: [] for k in names}
    wall: dict[str, list[float]] = {k: [] for k in names}
    warm = mmap.mmap(-1, blockfile.HEADER_SIZE + n)
    warm[:] = b"\1" * len(warm)
    dest = memoryview(bytearray(n))
    dest[:] = warm[:n]
    mib = n / MiB

    def stage(name: str, fn: Callable[[], None]) -> None:
        w, c = time.perf_counter_ns(), time.process_time_ns()
        fn()
        cpu[name].append((time.process_time_ns() - c) / mib / 1e3)
        wall[name].append((time.perf_counter_ns() - w) / mib / 1e3)

    def fresh_memfd() -> int:
        fd = os.memfd_create("profile", os.MFD_CLOEXEC)
        os.ftruncate(fd, n)
        return fd

    def client_copy(fd: int) -> None:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        with mmap.mmap(fd, n, prot=mmap.PROT_READ, flags=flags) as m:
            dest[:] = m

    with tempfile.TemporaryDirectory(prefix="kvf-prof-", dir=workdir or "/var/tmp") as tmp:
        (Path(tmp) / "tmp").mkdir()
        payload = os.urandom(n)
        for r in range(rounds):
            files: list[tuple[Path, BlockId]] = []
            for i in range(blocks):
                bid = BlockId(digest("prof-ns"), digest("cold", r, i))
                path = Path(tmp) / "b" / bid.filename
                blockfile.write_block(Path(tmp) / "tmp", path, bid, payload, created_at=0.0, bucket=0)
                files.append((path, bid))
            os.sync()
            for path, bid in files:
                view = memoryview(warm)

                def raw(path: Path = path) -> None:
                    src = os.open(path, direct)
                    os.preadv(src, [warm], 0)
                    os.close(src)

                def read_pieces(path: Path = path, view: memoryview = view) -> None:
                    src = os.open(path, direct)
                    for off in range(0, n, piece):
                        os.preadv(src, [view[off : off + piece]], blockfile.HEADER_SIZE + off)
                    os.close(src)

                def checksum(view: memoryview = view) -> None:
                    h = xxhash.xxh3_128()
                    for off in range(0, n, piece):
                        h.update(view[off : off + piece])
                    h.digest()

                memfds: list[int] = []

                def write(view: memoryview = view, memfds: list[int] = memfds) -> None:
                    fd = fresh_memfd()
                    memfds.append(fd)
                    for off in range(0, n, piece):
                        os.pwrite(fd, view[off : off + piece], off)

                def as_coded(path: Path = path, bid: BlockId = bid, memfds: list[int] = memfds) -> None:
                    fd = fresh_memfd()
                    memfds.append(fd)
                    blockfile.read_block_to_fd(path, bid, fd, length=n)

                def whole(path: Path = path, bid: BlockId = bid) -> None:
                    fd = fresh_memfd()
                    try:
                        blockfile.read_block_to_fd(path, bid, fd, length=n)
                        client_copy(fd)
                    finally:
                        os.close(fd)

                stage("raw_read", raw)
                stage("read_pieces", read_pieces)
                stage("checksum", checksum)
                stage("memfd_write", write)

                def map_copy(memfds: list[int] = memfds) -> None:
                    client_copy(memfds[0])

                stage("client_map_copy", map_copy)
                stage("promotion_as_coded", as_coded)
                stage("cold_load_as_coded", whole)
                view.release()
                for fd in memfds:
                    os.close(fd)
            for path, _ in files:
                path.unlink()
    warm.close()
    load = os.getloadavg()[0]
    print(f"== a cold disk load, {blocks} x 32 MiB per round, {rounds} rounds, load {load:.1f}")
    raw_w = statistics.median(wall["raw_read"])
    print(f"{'stage':20s} {'CPU us/MiB':>24s} {'wall us/MiB':>24s} {'wall / raw':>10s}")
    for k in names:
        c, w = cpu[k], wall[k]
        cs = f"{statistics.median(c):8.1f} ({min(c):.1f}-{max(c):.1f})"
        ws = f"{statistics.median(w):8.1f} ({min(w):.1f}-{max(w):.1f})"
        print(f"{k:20s} {cs:>24s} {ws:>24s} {statistics.median(w) / raw_w:10.2f}")


def object_promotion_paths(blocks: int = 4, rounds: int = 5) -> None:
    """Part 9: object-tier promotions into fresh memfds, two ways, against raw ranged GETs.

    Needs the SeaweedFS test server (``python -m kvfabric.testing.s3server build``). The S3 server
    runs on the same cores, so its CPU is in the wall times but not in the CPU column (this process
    only).
    """
    import mmap
    import statistics
    from concurrent.futures import ThreadPoolExecutor

    import obstore

    from kvfabric.cacheserver.config import ObjectStoreTierConfig
    from kvfabric.cacheserver.engine.blockfile import HEADER_SIZE
    from kvfabric.cacheserver.engine.ids import BlockId
    from kvfabric.cacheserver.engine.objectclient import make_store
    from kvfabric.cacheserver.engine.objectstore import ObjectStoreTier, object_path, part_ranges
    from kvfabric.cacheserver.engine.stats import Counters
    from kvfabric.testing.s3server import s3_server
    from kvfabric.testing.serverproc import digest

    chunk = 32 * MiB
    tmp = Path(tempfile.mkdtemp(prefix="kvf-prof-"))
    rates: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    try:
        with s3_server() as s3:
            (tmp / "ak").write_text(s3.access_key)
            (tmp / "sk").write_text(s3.secret_key)
            cfg = ObjectStoreTierConfig.model_validate(
                {
                    "endpoint": s3.endpoint,
                    "bucket": s3.bucket,
                    "prefix": "prof",
                    "access_key_id_file": str(tmp / "ak"),
                    "secret_access_key_file": str(tmp / "sk"),
                    "capacity_bytes": 4 * blocks * (chunk + HEADER_SIZE),
                }
            )
            tier = ObjectStoreTier(
                cfg, server_id="prof", bucket_seconds=3600, ttl_seconds=86400, counters=Counters()
            )
            tier.start(background=False)
            bids = [BlockId(digest("prof-ns"), digest("obj", i)) for i in range(blocks)]
            for b in bids:
                if not tier.put(b, os.urandom(chunk)):
                    raise RuntimeError("upload failed")
            store = make_store(cfg)
            entries = [tier.entry(b) for b in bids]
            paths = [object_path(b, e.bucket, e.gen) for b, e in zip(bids, entries, strict=True) if e]
            gets = ThreadPoolExecutor(cfg.max_concurrent_gets)
            loads = ThreadPoolExecutor(4)  # ShmLoad's promotions in flight (max(2, io_threads))

            def raw() -> None:
                jobs = [(p, s, e) for p in paths for s, e in part_ranges(chunk + HEADER_SIZE, cfg.part_bytes)]
                list(gets.map(lambda j: len(obstore.get_range(store, j[0], start=j[1], end=j[2])), jobs))

            def mapped(b: BlockId) -> None:
                fd = os.memfd_create("profile", os.MFD_CLOEXEC)
                os.ftruncate(fd, chunk)
                with mmap.mmap(fd, chunk) as m:
                    view = memoryview(m)
                    ok = tier.read_into(b, view).ok
                    view.release()
                os.close(fd)
                if not ok:
                    raise RuntimeError("object read missed")

            def to_fd(b: BlockId) -> None:
                fd = os.memfd_create("profile", os.MFD_CLOEXEC)
                ok = tier.read_into_fd(b, fd).ok
                os.close(fd)
                if not ok:
                    raise RuntimeError("object read missed")

            def each(fn: Callable[[BlockId], None]) -> Callable[[], None]:
                def run() -> None:
                    for _ in loads.map(fn, bids):  # the promotions of one load, four in flight
                        pass

                return run

            ways: dict[str, Callable[[], None]] = {
                "raw ranged GETs (baseline)": raw,
                "into a fresh mapping (read_into)": each(mapped),
                "pwrite per part (read_into_fd, now)": each(to_fd),
            }
            for _ in range(rounds):
                for name, fn in ways.items():
                    c, w = time.process_time(), time.perf_counter()
                    fn()
                    rates.setdefault(name, []).append(blocks * chunk / (time.perf_counter() - w) / 1e9)
                    cpu.setdefault(name, []).append((time.process_time() - c) / (blocks * chunk / MiB) * 1e6)
            tier.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = rates["raw ranged GETs (baseline)"]
    load = os.getloadavg()[0]
    print(f"== object-tier promotions, {blocks} x 32 MiB, {rounds} rounds, load {load:.1f}")
    for name, got in rates.items():
        ratios = [a / b for a, b in zip(got, base, strict=True)]
        print(
            f"{name:36s} {statistics.median(got):6.3f} GB/s ({min(got):.3f}-{max(got):.3f}), "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) of raw, "
            f"CPU {statistics.median(cpu[name]):.0f} us/MiB ({min(cpu[name]):.0f}-{max(cpu[name]):.0f})"
        )


def first_loads(rounds: int = 10, blocks: int = 32, chunk: int = 2 * MiB) -> None:
    """Part 10: wall time of a fresh client's first lent load, one hold request per block vs one in all.

    ``blocks`` x ``chunk`` is the bench model's 8k-token hit (32 chunks of 2 MiB). Each round starts
    a fresh client (nothing mapped, nothing held) whose gRPC channel is up before the timing starts;
    the timing covers the ``ShmLoad`` stream, the block-socket exchanges and the mappings.
    """
    import statistics

    from kvfabric.client import CacheClient
    from kvfabric.client import _common as c
    from kvfabric.client.mappings import Lease, release_all
    from kvfabric.rpc.v1 import cache_pb2 as pb
    from kvfabric.testing.serverproc import cache_server, digest, payload_for

    ns = digest("prof-first")
    keys = [digest("first", i) for i in range(blocks)]
    overrides = {"limits.max_payload_bytes": chunk, "log_level": "WARNING"}
    dram = 4 * blocks * chunk + 256 * MiB
    with cache_server(server_id="prof", metrics=False, dram_bytes=dram, overrides=overrides) as srv:
        with CacheClient(srv.unix_target, shared_memory=True) as writer:
            for k in keys:
                if writer.store(ns, [k], [payload_for(k, chunk)], timeout=60).accepted != 1:
                    raise RuntimeError("store dropped")

        def first_load(batched: bool) -> float:
            with CacheClient(srv.unix_target, shared_memory=True) as client:
                client.stats(timeout=10)
                chan = client._blocks
                assert chan is not None
                conn = client._conn
                req = pb.LoadRequest(namespace=ns, keys=keys, batch_slots=True)
                t0 = time.perf_counter()
                deadline = time.monotonic() + 60
                leases: list[Lease] = []
                for group in c.shm_slot_groups(conn.stub.ShmLoad(req, timeout=60, metadata=conn.md)):
                    refs = c.shm_refs(ns, keys, len(leases), group)
                    if batched:
                        leases += chan.borrow_blocks(refs, deadline=deadline)
                    else:
                        for ref in refs:
                            leases += chan.borrow_blocks([ref], deadline=deadline)
                took = time.perf_counter() - t0
                release_all(leases)
                if len(leases) != blocks:
                    raise RuntimeError("first load missed")
                return took

        ms: dict[bool, list[float]] = {False: [], True: []}
        for r in range(rounds):
            for batched in (r % 2 == 1, r % 2 == 0):
                ms[batched].append(first_load(batched) * 1e3)
    load = os.getloadavg()[0]
    size = f"{blocks} x {chunk // MiB} MiB"
    print(f"== a fresh client's first lent load of {size}, {rounds} rounds, load {load:.1f}")
    for batched, name in ((False, "one hold request per block"), (True, "one hold request in all")):
        got = ms[batched]
        print(f"{name:30s} {statistics.median(got):7.2f} ms ({min(got):.2f}-{max(got):.2f})")
    print(f"ratio {statistics.median(ms[True]) / statistics.median(ms[False]):.2f}")


if __name__ == "__main__":
    lookups_and_shm()
    disk_promotion()
    copy_paths()
    promotion_paths()
    restore_paths()
    store_paths()
    cold_load_stages()
    object_promotion_paths()
    first_loads()
