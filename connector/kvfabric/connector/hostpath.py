"""The host-staging data path: payloads pass through host buffers between the cache and the KV cache.

Loads: one loader thread fetches each request's chunks through the resilient cache. From a
same-node server whose blocks this client keeps mapped, they are *lent*, not copied: each payload
is verified in the sealed mapping itself (it cannot change afterwards) and the engine thread
scatters it from there as soon as it is verified (while the loader verifies the next one), one
payload at a time, then lets the lease go. Otherwise (the gRPC stream,
or no kept mappings) they land in a private staging buffer, are verified there, and the engine
thread scatters the verified chunks of each layer with one indexed copy per layer.

Saves: each layer's chunks are gathered into a staging payload during the step; a background
thread seals (header + keyed MAC) and stores them. ``store_queue_bytes`` bounds the host memory of
saves: staging is reserved against it *before* it is allocated and filled (this step's saves, the
stores queued or running, and the reusable buffers kept for later steps all count), and a save that
does not fit is dropped at once: the chunk is simply not stored. A hung server therefore costs the
engine at most that many bytes, however many steps it saves meanwhile.

This is the only data path today; see :mod:`kvfabric.connector.datapath` for the contract.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvfabric.client.mappings import Lease, release_all
from kvfabric.connector import layout, stagetimes
from kvfabric.connector.datapath import LoadResult
from kvfabric.connector.groups import GroupPlan, KindType
from kvfabric.connector.resilient import Counters, LoadOutcome, Reason, ResilientCache
from kvfabric.connector.steps import LoadSpec, SaveSpec

log = logging.getLogger(__name__)

# Chunks per load RPC. Splitting a request's load into groups lets the engine scatter group g while
# g+1 is copied, but on the CPU reference engine that measured 2-3x slower (8 chunks per group,
# 16k tokens: 124 ms vs 41 ms median restore; the per-call cost of the RPC and of the GIL-holding copy
# dominate), so a request is one RPC unless it exceeds this many chunks (64k tokens at 256/chunk).
GROUP_CHUNKS = 256

SHUTDOWN_DRAIN_S = 4.0
"""How long a closing worker waits for its queued stores (within vLLM's 5-second shutdown grace)."""

# Staging buffers of abandoned loads kept aside until their transport calls end (then reused).
# Beyond this many they are dropped for good: never reused, freed when the last call lets go.
_QUARANTINE = 16


@dataclass(frozen=True)
class _ObjectRun:
    """A run of one hybrid save's objects of one kind and block count, planned once per step."""

    kind: int
    geometry: layout.ChunkGeometry
    staging: bytearray
    start: int
    end: int
    """The run's bytes in ``staging``."""
    block_ids: tuple[list[list[int]], ...]
    """Per group of the kind (its position), the engine blocks of each object of the run."""


@dataclass
class _PendingLoad:
    spec: LoadSpec
    staging: bytearray | None
    """The load's private buffer; None for a lent load (its payloads are the leases in ``lent``)."""
    buffers: list[memoryview]
    futures: list[cf.Future[LoadOutcome]]
    tail_offset: int = 0
    """Where the tail blocks' payloads start in ``staging`` (after the whole chunks')."""
    lent: dict[int, list[Lease]] = dataclasses.field(default_factory=dict)
    """A lent load: per group, the leases of its verified leading payloads.

    Its loader task appends each lease once it is verified (under ``ready``), so the engine thread
    scatters payload i while payload i+1 is verified; the engine never reads past what is there.
    """
    ready: threading.Condition = dataclasses.field(default_factory=threading.Condition)
    """Notified when a verified lease is appended to ``lent``, and when a loader task ends."""

    def publish(self, first: int, lease: Lease) -> None:
        """Hand one verified lease of the group at chunk ``first`` to the engine thread."""
        with self.ready:
            self.lent.setdefault(first, []).append(lease)
            self.ready.notify_all()

    def notify(self, _fut: object = None) -> None:
        """Wake the engine thread (a loader task ended)."""
        with self.ready:
            self.ready.notify_all()

    def release(self) -> None:
        """Let go of every lease this load holds (idempotent)."""
        for leases in list(self.lent.values()):
            release_all(leases)

    def settled(self) -> bool:
        """True when nothing can write into ``staging`` any more.

        That is: every group's loader task is done, and so is every transport call a group gave
        up on (see ``LoadOutcome.inflight``).
        """
        for fut in self.futures:
            if not fut.done():
                return False
            if fut.cancelled() or fut.exception() is not None:
                continue
            if not fut.result().settled:
                return False
        return True


def _release_when_done(pl: _PendingLoad, _fut: cf.Future[LoadOutcome]) -> None:
    pl.release()


class HostStagingPath:
    """:class:`~kvfabric.connector.datapath.DataPath` through host staging buffers."""

    def __init__(
        self,
        cache: ResilientCache | None,
        *,
        namespace: str,
        chunk_tokens: int,
        block_size: int,
        store_deadline_s: float,
        store_queue_bytes: int,
        counters: Counters,
        mac_key: bytes = layout.PUBLIC_KEY,
        plan: GroupPlan | None = None,
        warm_save_tokens: int = 0,
    ) -> None:
        """Move the chunks of ``namespace`` through ``cache`` (``None``: nothing ever moves).

        Chunks are sealed and verified with ``mac_key`` (the pool's payload key). ``plan``: a hybrid
        model's group plan (specs then name, per key, the kind's object it is). ``warm_save_tokens``:
        when the KV cache is registered, a save staging buffer for that many tokens is made ready
        (pages faulted in), for the first saves (0: none).
        """
        self.warm_save_tokens = warm_save_tokens
        self.plan = plan if plan is not None and not plan.plain else None
        # Hybrid: layer name -> (kind, position in the kind's body, position of its group in the kind).
        self._places: dict[str, tuple[int, int, int]] = self.plan.layer_places() if self.plan else {}
        self._kind_layers: list[list[tuple[int, str]]] = []  # per kind: (global index, name) in body order
        self._kind_geos: dict[tuple[int, int], layout.ChunkGeometry] = {}
        self._regrouped: set[str] = set()  # layers whose kernel blocks are viewed as whole blocks
        self.cache = cache
        self.mac_key = mac_key
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.store_deadline_s = store_deadline_s
        self.store_queue_bytes = store_queue_bytes
        self.counters = counters
        self.geometry: layout.ChunkGeometry | None = None
        self.block_geometry: layout.ChunkGeometry | None = None
        """The payload of one tail block (a single engine block, same layers)."""
        self._kv: dict[str, torch.Tensor] = {}
        # loads
        self._loads: list[_PendingLoad] = []
        self._load_deadline = 0.0
        self._staging_pool: list[bytearray] = []
        self._quarantine: list[_PendingLoad] = []
        self._load_pool: cf.ThreadPoolExecutor | None = None
        # saves: per save spec, one staging buffer holding its payloads back to back
        self._saves: list[tuple[SaveSpec, bytearray]] = []
        self._object_runs: list[_ObjectRun] = []  # hybrid saves, per run: what each layer gathers
        self._store_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kvfabric-store")
        self._store_lock = threading.Lock()
        self._store_inflight_bytes = 0
        """Save staging reserved: this step's saves, and the stores queued or running."""
        self.save_bytes_peak = 0
        """The most save staging bytes ever held at once (reserved plus kept for reuse)."""
        self.save_staging_allocated = 0
        """Save staging buffers allocated on the step (the others were kept ones, reused)."""
        self.save_staging_warmed = 0
        """Bytes of the save staging buffer made ready when the KV cache was registered (0: none)."""
        self._store_futures: dict[cf.Future[None], int] = {}  # queued or running store -> its chunks
        self._save_pool: list[bytearray] = []

    @property
    def num_layers(self) -> int:
        """Layers in a chunk payload (0 before :meth:`register_kv_caches`)."""
        return len(self.geometry.layers) if self.geometry is not None else 0

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Adopt the per-layer KV tensors (forward order) and derive the payload geometry."""
        self._kv = dict(kv_caches)
        if self.plan is not None:
            # Each layer in whole blocks of its own group (vLLM may hand kernel blocks).
            self._regrouped = set()
            for name, (kind, _, _) in self._places.items():
                t = self._kv.get(name)
                if t is None or self.plan.kinds[kind].type is KindType.STATE:
                    continue  # a state block is one page: whatever its "tokens", one row
                view = layout.in_blocks_of(t, self.plan.kinds[kind].block_size)
                if view is not None and view is not t:
                    self._kv[name] = view
                    self._regrouped.add(name)
            # Each layer's blocks are of its own group's size: the whole-chunk geometry only
            # counts the layers (every layer's hook must run before a step's saves are stored).
            self.geometry = layout.ChunkGeometry(
                tuple(
                    layout.LayerGeometry(n, layout.block_dim_of(t), (), t.dtype) for n, t in self._kv.items()
                ),
                1,
                self.block_size,
            )
            self.block_geometry = self.geometry
            index = {name: i for i, name in enumerate(self._kv)}
            self._kind_layers = [
                [(index[n], n) for n in kind.layer_names if n in index] for kind in self.plan.kinds
            ]
            self._kind_geos = {}
            return
        self.geometry = layout.ChunkGeometry.from_kv_caches(
            self._kv, block_size=self.block_size, chunk_tokens=self.chunk_tokens
        )
        self.block_geometry = dataclasses.replace(self.geometry, blocks_per_chunk=1)
        chunks = self.warm_save_tokens // self.chunk_tokens
        size = min(chunks * self.geometry.payload_bytes, self.store_queue_bytes // 2)
        if size > 0 and self.cache is not None and not self._save_pool:
            self._warm_save_staging(size)

    def _warm_save_staging(self, size: int) -> None:
        """Allocate a save staging buffer of ``size`` bytes, fault its pages in and keep it for reuse.

        At registration, on the engine's start-up (before any step: nothing else is reserved, so it
        fits the bound, and later saves may let it go like any kept buffer): the first requests'
        saves are spared a page fault and zeroing per 4 KiB on their step (1 GiB takes about 0.3 s).
        """
        buf = bytearray(size)  # calloc: the pages are mapped at their first write
        ctypes.memset((ctypes.c_char * size).from_buffer(buf), 0, size)
        with self._store_lock:
            self._save_pool.append(buf)
        self.save_staging_warmed = size

    def _kind_geometry(self, kind: int, blocks: int) -> layout.ChunkGeometry:
        """The body of kind ``kind``'s object holding ``blocks`` blocks per layer (hybrid)."""
        geo = self._kind_geos.get((kind, blocks))
        if geo is None:
            assert self.plan is not None
            layers = []
            for _, name in self._kind_layers[kind]:
                t = self._kv[name]
                bd = 0 if name in self._regrouped else layout.block_dim_of(t)
                shape = list(t.shape)
                del shape[bd]
                layers.append(layout.LayerGeometry(name, bd, tuple(shape), t.dtype))
            geo = layout.ChunkGeometry(tuple(layers), blocks, self.plan.kinds[kind].block_size)
            self._kind_geos[(kind, blocks)] = geo
        return geo

    def _spec_shapes(self, spec: LoadSpec | SaveSpec) -> tuple[list[int], list[int], list[int]]:
        """Per key of ``spec``: payload bytes, tokens in its header, layers in its header."""
        objs = spec.objects
        if objs is None:
            sizes, tokens = self._sizes(spec.whole, spec.tail)
            return sizes, tokens, [self.num_layers] * len(sizes)
        geos = [self._kind_geometry(k, n) for k, n in zip(objs.kinds, objs.stored, strict=True)]
        return [g.payload_bytes for g in geos], list(objs.tokens), [len(g.layers) for g in geos]

    def _sizes(self, whole: int, tail: int) -> tuple[list[int], list[int]]:
        """Payload bytes and tokens of ``whole`` chunks followed by ``tail`` tail blocks."""
        geo, bgeo = self.geometry, self.block_geometry
        assert geo is not None
        assert bgeo is not None
        return (
            [geo.payload_bytes] * whole + [bgeo.payload_bytes] * tail,
            [self.chunk_tokens] * whole + [self.block_size] * tail,
        )

    # ------------------------------------------------------------------ loads

    def _take_staging(self, size: int) -> bytearray:
        for i, buf in enumerate(self._staging_pool):
            if len(buf) == size:
                return self._staging_pool.pop(i)
        return bytearray(size)

    def _recycle_staging(self) -> None:
        # Reuse a staging buffer (its pages are already mapped) only once nothing can write into it:
        # a transport call abandoned at the deadline may still be copying into it long after its
        # loader task returned, so such a buffer waits in quarantine and never serves another load
        # until that call ended (issue 9: another key's bytes in this step's buffer).
        waiting: list[_PendingLoad] = []
        for pl in (*self._quarantine, *self._loads):
            if pl.staging is None:
                # Lent: nothing can write anywhere; let go of the leases, now or when its task ends
                # (a task still queued is cancelled: it would run under the next step's deadline).
                pl.release()
                for fut in pl.futures:
                    if not fut.cancel():
                        fut.add_done_callback(functools.partial(_release_when_done, pl))
            elif pl.settled():
                self._staging_pool.append(pl.staging)
            else:
                waiting.append(pl)
        if len(waiting) > _QUARANTINE:
            self.counters.add("staging_dropped_abandoned", len(waiting) - _QUARANTINE)
        self._quarantine = waiting[-_QUARANTINE:]
        del self._staging_pool[:-4]
        self._loads = []

    def _loader(self) -> cf.ThreadPoolExecutor:
        # Loads get their own single thread: groups complete in order, and a slow store can never
        # delay them.
        if self._load_pool is None:
            self._load_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kvfabric-load")
        return self._load_pool

    def start_loads(self, loads: Sequence[LoadSpec], deadline: float) -> None:
        """Start every load into staging buffers; returns without waiting.

        A request's chunks are fetched (in groups of at most :data:`GROUP_CHUNKS`) on one loader
        thread and verified there as they land; :meth:`finish_loads` scatters each verified group.
        """
        self._recycle_staging()
        geo = self.geometry
        if not loads or geo is None:
            return
        self._load_deadline = deadline
        pool = self._loader()
        lend = self.cache is not None and self.cache.lends
        for spec in loads:
            sizes, tokens, nlayers = self._spec_shapes(spec)
            if lend:
                pl = _PendingLoad(spec, None, [], [])
                pl.futures = [
                    pool.submit(
                        self._lend_group,
                        pl,
                        g,
                        spec.keys[g : g + GROUP_CHUNKS],
                        sizes=sizes[g : g + GROUP_CHUNKS],
                        tokens=tokens[g : g + GROUP_CHUNKS],
                        nlayers=nlayers[g : g + GROUP_CHUNKS],
                    )
                    for g in range(0, len(spec.keys), GROUP_CHUNKS)
                ]
                self._loads.append(pl)
                continue
            staging = self._take_staging(sum(sizes))
            buffers, offset = [], 0
            for size in sizes:
                buffers.append(memoryview(staging)[offset : offset + size])
                offset += size
            futures = [
                pool.submit(
                    self._load_group,
                    spec.keys[g : g + GROUP_CHUNKS],
                    buffers[g : g + GROUP_CHUNKS],
                    tokens[g : g + GROUP_CHUNKS],
                    nlayers[g : g + GROUP_CHUNKS],
                )
                for g in range(0, len(spec.keys), GROUP_CHUNKS)
            ]
            tail_offset = spec.whole * geo.payload_bytes if spec.objects is None else 0
            self._loads.append(_PendingLoad(spec, staging, buffers, futures, tail_offset))

    def _lend_group(
        self,
        pl: _PendingLoad,
        first: int,
        keys: list[str],
        *,
        sizes: list[int],
        tokens: list[int],
        nlayers: list[int],
    ) -> LoadOutcome:
        """Borrow and verify one group of chunks in place (loader thread); keeps the intact leading ones."""
        geo, cache = self.geometry, self.cache
        if cache is None or geo is None:
            return LoadOutcome(0, Reason.UNAVAILABLE)
        if time.monotonic() >= self._load_deadline:
            return LoadOutcome(0, Reason.TIMEOUT)
        with stagetimes.stage("load_rpc"):
            got = cache.load_views(self.namespace, keys, sizes, self._load_deadline)
        leases = got.leases
        kept = 0
        try:
            for i, lease in enumerate(leases):
                with stagetimes.stage("verify"):
                    if len(lease.view) != sizes[i]:
                        raise layout.PayloadError(
                            "corrupt", f"payload is {len(lease.view)} bytes, not {sizes[i]}"
                        )
                    layout.verify(
                        lease.view,
                        namespace=self.namespace,
                        key=keys[i],
                        num_tokens=tokens[i],
                        num_layers=nlayers[i],
                        mac_key=self.mac_key,
                    )
                kept = i + 1
                # Verified, and sealed (it cannot change): the engine may scatter it now.
                pl.publish(first, lease)
        except layout.PayloadError as exc:
            log.warning("chunk %s: %s", keys[kept][:12], exc)
            release_all(leases[kept:])
            return LoadOutcome(kept, Reason(exc.reason))
        except BaseException:
            # The published leases are the engine's to release (pl.release); the rest are let go.
            release_all(leases[kept:])
            raise
        return LoadOutcome(len(leases), got.reason)

    def _load_group(
        self, keys: list[str], buffers: list[memoryview], tokens: list[int], nlayers: list[int]
    ) -> LoadOutcome:
        """Load and verify one group of chunks (loader thread); the count is of *intact* chunks."""
        geo, cache = self.geometry, self.cache
        if cache is None or geo is None:
            return LoadOutcome(0, Reason.UNAVAILABLE)
        if time.monotonic() >= self._load_deadline:
            return LoadOutcome(0, Reason.TIMEOUT)
        with stagetimes.stage("load_rpc"):
            outcome = cache.load_into(self.namespace, keys, buffers, self._load_deadline)
        if not outcome.settled:
            # A call that was given up may still write: nothing in these buffers can be trusted,
            # and verifying now would not cover its later writes.
            return LoadOutcome(0, outcome.reason or Reason.TIMEOUT, outcome.inflight)
        with stagetimes.stage("verify"):
            for i in range(outcome.count):
                try:
                    layout.verify(
                        buffers[i],
                        namespace=self.namespace,
                        key=keys[i],
                        num_tokens=tokens[i],
                        num_layers=nlayers[i],
                        mac_key=self.mac_key,
                    )
                except layout.PayloadError as exc:
                    log.warning("chunk %s: %s", keys[i][:12], exc)
                    return LoadOutcome(i, Reason(exc.reason), outcome.inflight)
        return outcome

    def finish_loads(self) -> list[LoadResult]:
        """Wait for the loads group by group (bounded), scatter every layer of each verified group.

        Chunks after the first missing, late or damaged one are not placed.
        """
        geo = self.geometry
        results: list[LoadResult] = []
        if geo is None:
            return results
        for pl in self._loads:
            t0 = time.monotonic()
            valid, reason = 0, None
            for g, fut in enumerate(pl.futures):
                first = g * GROUP_CHUNKS
                if pl.staging is None:
                    outcome = self._scatter_lent_as_verified(pl, first, fut)
                else:
                    outcome = self._wait_group(fut)
                    with stagetimes.stage("scatter"):
                        if pl.spec.objects is not None:
                            self._scatter_objects(pl, first, first + outcome.count)
                        else:
                            self._scatter(pl, first, first + outcome.count)
                valid += outcome.count
                if outcome.reason is not None or outcome.count < len(
                    pl.spec.keys[first : first + GROUP_CHUNKS]
                ):
                    reason = outcome.reason or Reason.NOT_FOUND
                    for later in pl.futures[g + 1 :]:
                        later.cancel()
                    break
            if pl.staging is None:
                self.counters.add("loads_lent")
                pl.release()
            self._count_loaded(pl.spec, valid)
            failed = len(pl.spec.keys) - valid
            results.append(LoadResult(valid, reason if failed else None, time.monotonic() - t0))
        return results

    def _count_loaded(self, spec: LoadSpec | SaveSpec, count: int, what: str = "loaded_bytes") -> None:
        """Count the payload bytes of the first ``count`` keys of ``spec``, per kind."""
        sizes = self._spec_shapes(spec)[0][:count]
        if spec.objects is None or self.plan is None:
            if sizes:
                self.counters.add(f"{what}.full", sum(sizes))
            return
        by_kind: dict[str, int] = {}
        for kind, size in zip(spec.objects.kinds, sizes, strict=False):
            name = self.plan.kinds[kind].type.value
            by_kind[name] = by_kind.get(name, 0) + size
        for name, n in by_kind.items():
            self.counters.add(f"{what}.{name}", n)

    def spec_bytes(self, spec: LoadSpec | SaveSpec, count: int) -> int:
        """Payload bytes of the first ``count`` keys of ``spec`` (what a load of them moved)."""
        return sum(self._spec_shapes(spec)[0][:count])

    def _object_ids(self, spec: LoadSpec | SaveSpec, i: int, group: int) -> list[int]:
        """The engine blocks of group ``group`` (position in its kind) of object ``i`` of ``spec``."""
        objs = spec.objects
        assert objs is not None
        n = objs.stored[i] - objs.skips[i]
        return list(spec.block_ids[i][group * n : (group + 1) * n])

    def _runs(self, spec: LoadSpec | SaveSpec, begin: int, end: int) -> list[tuple[int, int]]:
        """Maximal runs ``[a, b)`` within ``[begin, end)`` of objects with one kind and block count."""
        objs = spec.objects
        assert objs is not None
        runs: list[tuple[int, int]] = []
        a = begin
        for i in range(begin + 1, end + 1):
            if i == end or (objs.kinds[i], objs.stored[i], objs.skips[i] > 0) != (
                objs.kinds[a],
                objs.stored[a],
                objs.skips[a] > 0,
            ):
                runs.append((a, i))
                a = i
        return [r for r in runs if r[0] < r[1]]

    def _scatter_objects(self, pl: _PendingLoad, begin: int, end: int) -> None:
        """Write objects ``begin..end`` of a hybrid load: each layer with its own group's blocks."""
        spec, objs = pl.spec, pl.spec.objects
        assert objs is not None
        assert pl.staging is not None
        offsets = [0]
        for buf in pl.buffers:
            offsets.append(offsets[-1] + len(buf))
        for a, b in self._runs(spec, begin, end):
            kind, n, skip = objs.kinds[a], objs.stored[a], objs.skips[a]
            geo = self._kind_geometry(kind, n)
            for pos, (_, name) in enumerate(self._kind_layers[kind]):
                kv = self._kv[name]
                group = self._places[name][2]
                if skip:
                    for i in range(a, b):
                        layout.scatter_layer(
                            geo,
                            pos,
                            pl.buffers[i],
                            kv,
                            self._object_ids(spec, i, group),
                            first_block=objs.skips[i],
                        )
                    continue
                layout.scatter_chunks(
                    geo,
                    pos,
                    memoryview(pl.staging)[offsets[a] :],
                    kv,
                    [self._object_ids(spec, i, group) for i in range(a, b)],
                )

    def _scatter_lent_objects(self, pl: _PendingLoad, first: int, leases: list[Lease]) -> None:
        """Write leased objects of a hybrid load, layer by layer with each layer's group's blocks."""
        objs = pl.spec.objects
        assert objs is not None
        for j, lease in enumerate(leases):
            i = first + j
            kind, n, skip = objs.kinds[i], objs.stored[i], objs.skips[i]
            geo = self._kind_geometry(kind, n)
            for pos, (_, name) in enumerate(self._kind_layers[kind]):
                ids = self._object_ids(pl.spec, i, self._places[name][2])
                layout.scatter_layer(geo, pos, lease.view, self._kv[name], ids, first_block=skip)

    def _scatter(self, pl: _PendingLoad, begin: int, end: int) -> None:
        """Copy chunks ``begin..end`` of ``pl`` into every registered layer (tail blocks: their block)."""
        geo, bgeo = self.geometry, self.block_geometry
        assert geo is not None
        assert bgeo is not None
        assert pl.staging is not None
        whole = pl.spec.whole
        if begin >= end:
            return
        for idx, kv in enumerate(self._kv.values()):
            first, last = begin, min(end, whole)
            if first < last and first == 0 and pl.spec.skip_blocks:
                # The first chunk is partly in the engine's own prefix cache already.
                layout.scatter_layer(
                    geo, idx, pl.buffers[0], kv, pl.spec.block_ids[0], first_block=pl.spec.skip_blocks
                )
                first = 1
            if first < last:
                layout.scatter_chunks(
                    geo,
                    idx,
                    memoryview(pl.staging)[first * geo.payload_bytes :],
                    kv,
                    pl.spec.block_ids[first:last],
                )
            t_first = max(begin, whole)
            if t_first < end:
                # Tail blocks: single-block payloads, each written into exactly its one block.
                layout.scatter_chunks(
                    bgeo,
                    idx,
                    memoryview(pl.staging)[pl.tail_offset + (t_first - whole) * bgeo.payload_bytes :],
                    kv,
                    pl.spec.block_ids[t_first:end],
                )

    def _wait_group(self, fut: cf.Future[LoadOutcome]) -> LoadOutcome:
        """Wait (until the deadline) for a staged group's loader task."""
        try:
            with stagetimes.stage("wait"):
                return fut.result(timeout=max(0.0, self._load_deadline - time.monotonic()))
        except cf.TimeoutError:
            self.counters.add("load_abandoned")
            return LoadOutcome(0, Reason.TIMEOUT)

    def _scatter_lent_as_verified(
        self, pl: _PendingLoad, first: int, fut: cf.Future[LoadOutcome]
    ) -> LoadOutcome:
        """Scatter the group at chunk ``first`` lease by lease as its loader task verifies them.

        The engine thread's copies overlap the loader's verification of the next payloads (both
        release the GIL). Returns the group's outcome; at the deadline, the leading payloads
        already placed still count (each was verified before it was read).
        """
        placed = 0
        fut.add_done_callback(pl.notify)
        while True:
            with pl.ready, stagetimes.stage("wait"):
                while len(pl.lent.get(first, ())) <= placed and not fut.done():
                    left = self._load_deadline - time.monotonic()
                    if left <= 0:
                        break
                    pl.ready.wait(left)
                ready = pl.lent.get(first, [])[placed:]
            if ready:
                with stagetimes.stage("scatter"):
                    self._scatter_leases(pl, first + placed, ready)
                placed += len(ready)
                continue
            if not fut.done():
                self.counters.add("load_abandoned")
                return LoadOutcome(placed, Reason.TIMEOUT)
            break
        if fut.cancelled():
            return LoadOutcome(placed, Reason.TIMEOUT)
        outcome = fut.result()  # raises what the task raised, as waiting on it did
        if outcome.count != placed:
            raise RuntimeError(f"lent load placed {placed} payloads, its task reported {outcome.count}")
        return outcome

    def _scatter_leases(self, pl: _PendingLoad, first: int, leases: list[Lease]) -> None:
        """Scatter verified leased payloads ``first..`` of ``pl`` into every registered layer."""
        geo, bgeo = self.geometry, self.block_geometry
        assert geo is not None
        assert bgeo is not None
        if pl.spec.objects is not None:
            self._scatter_lent_objects(pl, first, leases)
            return
        kvs = list(self._kv.values())
        for j, lease in enumerate(leases):
            i = first + j
            ids = pl.spec.block_ids[i]
            if i < pl.spec.whole:
                skip = pl.spec.skip_blocks if i == 0 else 0
                # block_ids[0] already leaves out the blocks the engine's own prefix cache has.
                layout.scatter_payload(geo, kvs, lease.view, ids, first_block=skip)
            else:
                layout.scatter_payload(bgeo, kvs, lease.view, ids)

    def abandon_loads(self) -> None:
        """Forget the started loads (their staging is reused only if their calls finished)."""
        self._recycle_staging()

    # ------------------------------------------------------------------ saves

    def _reserve_save_staging(self, size: int) -> bytearray | None:
        """A staging buffer of at least ``size`` bytes, reserved against ``store_queue_bytes`` (or None).

        Reserved before a byte is allocated: with a hung server the stores ahead never finish, and
        a step that allocated first and checked at submit time held a whole step's payloads (GBs
        for a long prefill of a large model) on top of the backlog.
        """
        with self._store_lock:
            # The smallest kept buffer that holds ``size``: its pages are mapped, and a fresh buffer
            # costs the engine's step a page fault and zeroing per 4 KiB (about 0.5 ms per MiB, 35
            # times the copy into a reused one). Saves differ in size from step to step (a prompt's
            # length, a chat's growing history), so any buffer at least as large serves; the
            # payloads take its first ``size`` bytes, and its whole length stays reserved.
            fits = [i for i, buf in enumerate(self._save_pool) if len(buf) >= size]
            if fits:
                best = min(fits, key=lambda i: len(self._save_pool[i]))
                buf = self._save_pool.pop(best)
                self._store_inflight_bytes += len(buf)
                return buf
            kept = sum(len(b) for b in self._save_pool)
            while self._save_pool and self._store_inflight_bytes + kept + size > self.store_queue_bytes:
                kept -= len(self._save_pool.pop(0))  # room before reuse: let the oldest go
            if self._store_inflight_bytes + kept + size > self.store_queue_bytes:
                return None
            self._store_inflight_bytes += size
            self.save_bytes_peak = max(self.save_bytes_peak, self._store_inflight_bytes + kept)
            self.save_staging_allocated += 1
        return bytearray(size)

    def _unreserve(self, size: int) -> None:
        with self._store_lock:
            self._store_inflight_bytes -= size

    def begin_saves(self, saves: Sequence[SaveSpec]) -> None:
        """Reserve and allocate one staging buffer per save spec (its payloads back to back, tail last).

        A save whose staging does not fit in ``store_queue_bytes`` is dropped here, before its
        memory exists (``store_dropped_backlog``, in chunks).
        """
        self.abandon_saves()  # a step that never submitted must not keep its reservations
        for spec in saves:
            sizes = self._spec_shapes(spec)[0]
            staging = self._reserve_save_staging(sum(sizes))
            if staging is None:
                self.counters.add("store_dropped_backlog", len(spec.keys))
                continue
            self._saves.append((spec, staging))
            if spec.objects is not None:
                self._object_runs += self._plan_object_runs(spec, staging, sizes)

    def _plan_object_runs(self, spec: SaveSpec, staging: bytearray, sizes: list[int]) -> list[_ObjectRun]:
        """Once per step: each run's body geometry, bytes in ``staging`` and blocks per group.

        Every layer of a kind gathers the same objects from its own group's blocks; computing that
        here leaves each layer's hook only the copies.
        """
        objs = spec.objects
        assert objs is not None
        assert self.plan is not None
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + size)
        runs = []
        for a, b in self._runs(spec, 0, len(spec.keys)):
            kind = objs.kinds[a]
            groups = len(self.plan.kinds[kind].groups)
            runs.append(
                _ObjectRun(
                    kind,
                    self._kind_geometry(kind, objs.stored[a]),
                    staging,
                    offsets[a],
                    offsets[b],
                    tuple([self._object_ids(spec, i, g) for i in range(a, b)] for g in range(groups)),
                )
            )
        return runs

    def save_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        """Gather ``layer`` of every prepared chunk (and tail block) from ``kv_layer`` into its payload."""
        geo, bgeo = self.geometry, self.block_geometry
        assert geo is not None
        assert bgeo is not None
        if self.plan is not None:
            name = geo.layers[layer].name
            # The registered view of the same tensor: in whole blocks of the layer's group.
            self._save_layer_objects(name, self._kv.get(name, kv_layer))
            return
        for spec, staging in self._saves:
            whole = spec.whole
            layout.gather_chunks(geo, layer, kv_layer, spec.block_ids[:whole], staging)
            if spec.tail:
                tail_view = memoryview(staging)[whole * geo.payload_bytes :]
                layout.gather_chunks(bgeo, layer, kv_layer, spec.block_ids[whole:], tail_view)

    def _save_layer_objects(self, name: str, kv_layer: torch.Tensor) -> None:
        """Gather one layer into the hybrid objects of its kind, with its own group's blocks."""
        place = self._places.get(name)
        if place is None:
            return
        kind, pos, group = place
        for run in self._object_runs:
            if run.kind == kind:
                view = memoryview(run.staging)[run.start : run.end]
                layout.gather_chunks(run.geometry, pos, kv_layer, run.block_ids[group], view)

    def abandon_saves(self) -> int:
        """Drop the prepared chunks (and their reservations); return how many."""
        saves, self._saves = self._saves, []
        self._object_runs = []
        for _, staging in saves:
            self._unreserve(len(staging))
        return sum(len(spec.keys) for spec, _ in saves)

    def submit_saves(self) -> None:
        """Hand the prepared payloads to the background storer (their bytes were reserved at begin)."""
        saves, self._saves = self._saves, []
        self._object_runs = []
        for spec, staging in saves:
            if self.cache is None:
                self._unreserve(len(staging))
                continue
            try:
                fut = self._store_pool.submit(self._store, spec, staging)
            except RuntimeError:  # closed
                self._unreserve(len(staging))
                continue
            with self._store_lock:
                self._store_futures[fut] = len(spec.keys)
            fut.add_done_callback(self._store_done)

    def _store_done(self, fut: cf.Future[None]) -> None:
        with self._store_lock:
            self._store_futures.pop(fut, None)

    def _store(self, spec: SaveSpec, staging: bytearray) -> None:
        geo, cache = self.geometry, self.cache
        store_finished = False
        try:
            assert geo is not None
            assert cache is not None
            sizes, tokens, nlayers = self._spec_shapes(spec)
            payloads, offset = [], 0
            for size in sizes:
                payloads.append(memoryview(staging)[offset : offset + size])
                offset += size
            for key, payload, num_tokens, layers in zip(spec.keys, payloads, tokens, nlayers, strict=True):
                layout.seal(
                    payload,
                    namespace=self.namespace,
                    key=key,
                    num_tokens=num_tokens,
                    num_layers=layers,
                    mac_key=self.mac_key,
                )
            result = cache.store(self.namespace, spec.keys, payloads, self.store_deadline_s)
            store_finished = result is not None
            if store_finished:
                self._count_loaded(spec, len(spec.keys), "stored_bytes")
        except Exception:  # a failed store costs a future recompute, never the engine
            log.exception("store of %d chunks failed", len(spec.keys))
        finally:
            with self._store_lock:
                self._store_inflight_bytes -= len(staging)
                # The transport is done with it (a store that timed out may not be: drop those).
                if store_finished and len(self._save_pool) < 8:
                    self._save_pool.append(staging)

    def wait_for_stores(self, timeout: float) -> bool:
        """Wait until background stores are done; return whether they all finished."""
        with self._store_lock:
            pending = list(self._store_futures)
        _done, not_done = cf.wait(pending, timeout=timeout)
        return not not_done

    def close(self, drain_s: float = SHUTDOWN_DRAIN_S) -> None:
        """Stop the threads: queued stores get ``drain_s`` seconds to finish, the rest are dropped.

        vLLM gives a worker a few seconds to exit (``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``, 5 by
        default) before it terminates it, and waiting for a long backlog of stores to a slow server
        would be cut short there anyway. A store still running at the deadline ends within its own
        deadline; the stores not started are dropped and counted (``store_dropped_shutdown``, chunks).
        """
        self.wait_for_stores(drain_s)
        with self._store_lock:
            pending = list(self._store_futures.items())
        dropped = sum(n for fut, n in pending if fut.cancel())  # (its callback takes the lock)
        if dropped:
            self.counters.add("store_dropped_shutdown", dropped)
            log.warning("kvfabric: %d chunks not stored at shutdown (queued past %.1f s)", dropped, drain_s)
        self._store_pool.shutdown(wait=False, cancel_futures=True)
        if self._load_pool is not None:
            self._load_pool.shutdown(wait=False, cancel_futures=True)
