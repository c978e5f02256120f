"""The connector's logic, independent of vLLM: scheduler side and worker side.

:class:`KVFabricConnectorCore` implements the KV connector v1 call sequence of vLLM 0.33 on duck-typed
arguments (``request.request_id``/``prompt_token_ids``, ``blocks.get_block_ids()``, vLLM's
``SchedulerOutput`` field names, per-layer KV tensors). The vLLM class in :mod:`kvfabric.connector.vllm`
wraps it; the torch reference engine drives it directly with small look-alike objects. Like vLLM,
construct one instance per role: the two never share memory, only the picklable metadata.

Data flow of one request:

1. scheduler: ``get_num_new_matched_tokens`` hashes the prompt's whole chunks and asks the cache for
   the longest stored prefix (deadline ``lookup_deadline_ms``); it reports whole chunks only, never
   the whole prompt, and nothing below ``min_hit_tokens``.
2. scheduler: ``update_state_after_alloc`` remembers which blocks the hit must fill;
   ``build_connector_meta`` turns that into load specs, and every chunk the step completes and the
   cache lacks into save specs.
3. worker: ``start_load_kv`` starts one load per request into private staging buffers (no waiting);
   the first ``wait_for_layer_load`` waits (bounded by ``load_deadline_ms``), verifies every payload
   (namespace, key, shape, xxh3) and then each layer's wait scatters that layer. Chunks that did not
   arrive intact are reported by ``get_block_ids_with_load_errors`` so the engine recomputes them;
   the leading chunks that did arrive are still used.
4. worker: ``save_kv_layer`` copies each layer's finished chunks into a staging payload (so the
   engine may reuse its blocks at once); ``wait_for_save`` hands sealed payloads to a background
   thread that stores them. Stores never block a step; over ``store_queue_bytes`` they are dropped.
"""

from __future__ import annotations

import concurrent.futures as cf
import enum
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvfabric.connector import keys as keyslib
from kvfabric.connector import layout
from kvfabric.connector.resilient import (
    CircuitBreaker,
    Counters,
    Endpoint,
    LoadOutcome,
    Reason,
    ResilientCache,
    transport_factory,
)
from kvfabric.connector.settings import ConnectorSettings

log = logging.getLogger(__name__)

# Chunks per load RPC. Splitting a request's load into groups lets the engine scatter group g while
# g+1 is copied, but on the CPU reference engine that measured 2-3x slower (8 chunks per group,
# 16k tokens: 124 ms vs 41 ms median restore; the per-call cost of the RPC and of the GIL-holding copy
# dominate), so a request is one RPC unless it exceeds this many chunks (64k tokens at 256/chunk).
_GROUP_CHUNKS = 256

# Order used to name the "source tier" of a hit: the slowest tier involved bounds its speed.
_TIER_ORDER = {"dram": 0, "local_disk": 1, "shared": 2, "object": 3}


class Role(enum.Enum):
    """Which half of the connector an instance is (mirrors vLLM's ``KVConnectorRole``)."""

    SCHEDULER = 0
    WORKER = 1


class _Request(Protocol):
    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> Sequence[int] | None: ...


@dataclass
class LoadSpec:
    """Load the chunks ``keys`` into the blocks ``block_ids[i]`` (skipping ``skip_blocks`` of chunk 0)."""

    req_id: str
    keys: list[str]
    block_ids: list[list[int]]
    skip_blocks: int = 0
    tiers: list[str] = field(default_factory=list)


@dataclass
class SaveSpec:
    """Save the chunks ``keys``, held in the blocks ``block_ids[i]``."""

    req_id: str
    keys: list[str]
    block_ids: list[list[int]]


@dataclass
class ConnectorMetadata:
    """Scheduler -> worker message of one step (picklable)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class LoadReport:
    """What happened to one request's load: for logs, metrics and the reference engine's output."""

    req_id: str
    requested_chunks: int
    loaded_chunks: int
    tier: str | None
    reason: Reason | None
    wait_s: float


@dataclass
class _ReqState:
    token_ids: list[int]
    keys: list[str]
    hit_tokens: int = 0
    matched_chunks: int = 0
    tiers: list[str] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    saved_chunks: int = 0
    pending_load: tuple[int, int] | None = None  # token range [start, end) to load
    progress: int = 0  # tokens computed as of the last step
    last_reason: Reason | None = None


@dataclass
class _PendingLoad:
    spec: LoadSpec
    staging: bytearray
    buffers: list[memoryview]
    futures: list[cf.Future[LoadOutcome]]
    valid: int = 0
    report: LoadReport | None = None


def build_cache(settings: ConnectorSettings, counters: Counters | None = None) -> ResilientCache | None:
    """Build the resilient cache for ``settings`` (``None`` when no server is configured)."""
    if not settings.configured:
        return None
    endpoints: list[Endpoint] = []
    cooldown = settings.breaker_cooldown_ms / 1000
    if settings.socket:
        endpoints.append(
            Endpoint(
                "local",
                transport_factory(f"unix://{settings.socket}", shm_dir=settings.shm_dir),
                CircuitBreaker(settings.breaker_failures, cooldown),
            )
        )
    if settings.remote:
        endpoints.append(
            Endpoint(
                "remote",
                transport_factory(settings.remote, token=settings.token, tls_ca=settings.tls_ca),
                CircuitBreaker(settings.breaker_failures, cooldown),
            )
        )
    return ResilientCache(endpoints, retries=settings.retries, counters=counters)


class KVFabricConnectorCore:
    """Both halves of the connector; an instance acts as the half given by ``role``."""

    def __init__(
        self,
        role: Role,
        settings: ConnectorSettings,
        spec: keyslib.NamespaceSpec,
        *,
        cache: ResilientCache | None = None,
        scheduler_spec: keyslib.NamespaceSpec | None = None,
    ) -> None:
        """Create one half.

        ``spec`` is this instance's namespace (the worker's TP rank). The scheduler looks up the
        namespace of rank 0 (``scheduler_spec`` defaults to ``spec``): a rank that lacks a chunk
        reports a load error for it and the engine recomputes.
        """
        if spec.chunk_tokens != settings.chunk_tokens:
            raise ValueError("spec.chunk_tokens must equal settings.chunk_tokens")
        self.role = role
        self.settings = settings
        self.spec = spec
        self.namespace = (scheduler_spec or spec).digest() if role is Role.SCHEDULER else spec.digest()
        self.chunk_tokens = spec.chunk_tokens
        self.block_size = spec.block_size
        self.counters = cache.counters if cache is not None else Counters()
        self.cache = cache
        # scheduler state
        self._reqs: dict[str, _ReqState] = {}
        # worker state
        self._meta: ConnectorMetadata | None = None
        self._kv: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self.geometry: layout.ChunkGeometry | None = None
        self._loads: list[_PendingLoad] = []
        self._loads_verified = False
        self._failed_reqs: set[str] = set()
        self._staging_pool: list[bytearray] = []
        self.restore_s = 0.0
        """Seconds the last step spent blocked restoring KV (waiting, verifying, scattering)."""
        self._load_pool: cf.ThreadPoolExecutor | None = None
        self._load_deadline = 0.0
        self._load_errors: set[int] = set()
        self._reports: list[LoadReport] = []
        # Per save spec: one staging buffer holding its payloads back to back.
        self._saves: list[tuple[SaveSpec, bytearray]] = []
        self._saved_layers: set[int] = set()
        self._store_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kvfabric-store")
        self._store_lock = threading.Lock()
        self._store_inflight_bytes = 0
        self._store_futures: set[cf.Future[None]] = set()
        self._save_pool: list[bytearray] = []

    # ------------------------------------------------------------------ scheduler side

    def _state(self, request: _Request) -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None:
            tokens = list(request.prompt_token_ids or [])
            st = _ReqState(tokens, keyslib.chunk_keys(self.namespace, tokens, self.chunk_tokens))
            self._reqs[request.request_id] = st
        return st

    def get_num_new_matched_tokens(self, request: _Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Return ``(tokens the cache can add beyond num_computed_tokens, load_async=False)``.

        Never raises: any failure is "no hit" (the engine recomputes).
        """
        try:
            return self._get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:
            log.exception("lookup for request %s failed", getattr(request, "request_id", "?"))
            self.counters.add("internal_error.lookup")
            st = self._reqs.get(request.request_id)
            if st is not None:
                st.hit_tokens, st.matched_chunks, st.pending_load = 0, 0, None
            return 0, False

    def _get_num_new_matched_tokens(self, request: _Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Return ``(tokens the cache can add beyond num_computed_tokens, load_async=False)``."""
        if self.cache is None:
            return 0, False
        st = self._state(request)
        loadable = keyslib.num_loadable_chunks(len(st.token_ids), self.chunk_tokens)
        if loadable == 0 or loadable * self.chunk_tokens <= num_computed_tokens:
            st.hit_tokens, st.matched_chunks = 0, 0
            return 0, False
        outcome = self.cache.lookup(
            self.namespace, st.keys[:loadable], self.settings.lookup_deadline_ms / 1000
        )
        st.matched_chunks, st.tiers, st.last_reason = outcome.matched, outcome.tiers, outcome.reason
        hit = outcome.matched * self.chunk_tokens
        if outcome.reason is not None:
            self.counters.miss(outcome.reason, loadable)
        elif hit < self.settings.min_hit_tokens:
            self.counters.add("miss.below_min_hit_tokens")
            hit = 0
        st.hit_tokens = hit
        self.counters.add("lookups")
        if hit <= num_computed_tokens:
            return 0, False
        self.counters.add("hit_tokens", hit - num_computed_tokens)
        return hit - num_computed_tokens, False

    def update_state_after_alloc(self, request: _Request, blocks: Any, num_external_tokens: int) -> None:
        """Remember the request's blocks and, if ``num_external_tokens`` > 0, the range to load."""
        st = self._state(request)
        ids = blocks.get_block_ids() if blocks is not None else ()
        if ids:
            st.block_ids = list(ids[0])
        if num_external_tokens > 0 and st.hit_tokens > 0:
            st.pending_load = (st.hit_tokens - num_external_tokens, st.hit_tokens)

    def _chunk_blocks(self, st: _ReqState, chunk: int) -> list[int]:
        bpc = self.chunk_tokens // self.block_size
        return st.block_ids[chunk * bpc : (chunk + 1) * bpc]

    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMetadata:
        """Turn this step's allocations into load and save specs; resets per-step state."""
        meta = ConnectorMetadata()
        if self.cache is None:
            return meta
        bpc = self.chunk_tokens // self.block_size
        progress: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            if new.block_ids:
                st.block_ids = list(new.block_ids[0])
            progress[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        # vLLM < 0.2x had no resumed_req_ids (it sent whole block lists for resumed requests).
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids:
                if req_id in resumed:
                    st.block_ids = list(new_ids[0])
                else:
                    st.block_ids.extend(new_ids[0])
            progress[req_id] = cached.num_computed_tokens[i]
        for req_id, computed in progress.items():
            st = self._reqs[req_id]
            if computed < st.progress:
                # The engine rolled the request back (a failed load, preemption): chunks past the
                # new position were never stored intact, so they must be saved again.
                st.saved_chunks = min(st.saved_chunks, computed // self.chunk_tokens)
                st.matched_chunks = min(st.matched_chunks, computed // self.chunk_tokens)
            if st.pending_load is not None:
                start, end = st.pending_load
                st.pending_load = None
                first, last = start // self.chunk_tokens, end // self.chunk_tokens
                skip = (start - first * self.chunk_tokens) // self.block_size
                chunks = [self._chunk_blocks(st, c) for c in range(first, last)]
                if chunks:
                    chunks[0] = chunks[0][skip:]
                meta.loads.append(LoadSpec(req_id, st.keys[first:last], chunks, skip, st.tiers[first:last]))
            done = min(computed + scheduler_output.num_scheduled_tokens.get(req_id, 0), len(st.token_ids))
            complete = keyslib.num_whole_chunks(done, self.chunk_tokens)
            begin = max(st.saved_chunks, st.matched_chunks)
            todo = [c for c in range(begin, complete) if len(self._chunk_blocks(st, c)) == bpc]
            if todo:
                meta.saves.append(
                    SaveSpec(req_id, [st.keys[c] for c in todo], [self._chunk_blocks(st, c) for c in todo])
                )
            st.saved_chunks = max(st.saved_chunks, complete)
            st.progress = done
        for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
            self._reqs.pop(req_id, None)
        return meta

    def request_finished(self, request: _Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request. Saves copy blocks out during the step, so blocks can be freed now."""
        self._reqs.pop(request.request_id, None)
        return False, None

    def hit_tier(self, request: _Request) -> str | None:
        """Return the slowest tier among the request's hit chunks (``None`` without a hit)."""
        st = self._reqs.get(request.request_id)
        if st is None or not st.hit_tokens:
            return None
        tiers = st.tiers[: st.hit_tokens // self.chunk_tokens]
        return max(tiers, key=lambda t: _TIER_ORDER.get(t, 4)) if tiers else None

    def lookup_reason(self, request: _Request) -> Reason | None:
        """Return why the last lookup for ``request`` found nothing (``None`` after a hit)."""
        st = self._reqs.get(request.request_id)
        return st.last_reason if st is not None else None

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Remember the per-layer KV tensors (forward order) and derive the payload geometry."""
        self._kv = dict(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(self._kv)}
        self.geometry = layout.ChunkGeometry.from_kv_caches(
            self._kv, block_size=self.block_size, chunk_tokens=self.chunk_tokens
        )

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        """Receive this step's specs."""
        self._meta = metadata

    def _take_staging(self, size: int) -> bytearray:
        for i, buf in enumerate(self._staging_pool):
            if len(buf) == size:
                return self._staging_pool.pop(i)
        return bytearray(size)

    def _recycle_staging(self) -> None:
        # Reuse a staging buffer (its pages are already mapped) only if its load finished: an
        # abandoned load may still write into it, so that one is dropped.
        for pl in self._loads:
            if all(f.done() for f in pl.futures):
                self._staging_pool.append(pl.staging)
        del self._staging_pool[:-4]

    def clear_connector_metadata(self) -> None:
        """Drop this step's specs (and any load state left behind)."""
        self._meta = None
        self._recycle_staging()
        self._loads = []
        self._loads_verified = False
        self._failed_reqs = set()

    # The worker hooks never raise into the forward pass: a failure turns the step's loads into load
    # errors (recomputed) and drops its saves. build_connector_meta, by contrast, is allowed to
    # raise: once vLLM was told that tokens will be loaded, silently loading nothing would be wrong.

    def _fail_step(self, what: str) -> None:
        log.exception("kvfabric %s failed; the engine recomputes", what)
        self.counters.add(f"internal_error.{what}")
        meta = self._meta
        if meta is not None:
            for spec in meta.loads:
                self._failed_reqs.add(spec.req_id)
                for blocks in spec.block_ids:
                    self._load_errors.update(blocks)
        self._loads, self._loads_verified, self._saves = [], True, []

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        """Start every load of this step into staging buffers; returns without waiting."""
        try:
            self._start_load_kv(forward_context, **kwargs)
        except Exception:
            self._fail_step("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until the step's KV is in place or known missing (the first call does the work)."""
        try:
            self._wait_for_layer_load(layer_name)
        except Exception:
            self._fail_step("wait_for_layer_load")

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None, **kwargs: Any
    ) -> None:
        """Copy this layer's part of every chunk to save into staging payloads."""
        try:
            self._save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        except Exception:
            log.exception("kvfabric save_kv_layer failed; this step stores nothing")
            self.counters.add("internal_error.save_kv_layer")
            self._saves, self._saved_layers = [], set()

    def wait_for_save(self) -> None:
        """Hand this step's complete payloads to the background storer (never blocks)."""
        try:
            self._wait_for_save()
        except Exception:
            log.exception("kvfabric wait_for_save failed; this step stores nothing")
            self.counters.add("internal_error.wait_for_save")
            self._saves, self._saved_layers = [], set()

    def _start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        """Start every load of this step into staging buffers; returns without waiting.

        A request's chunks are fetched (in groups of at most ``_GROUP_CHUNKS``) on one loader
        thread and verified there as they land; the engine thread scatters each group into the KV
        cache as soon as it is verified.
        """
        t0 = time.perf_counter()
        self._recycle_staging()
        self._loads, self._loads_verified, self._failed_reqs = [], False, set()
        self.restore_s = 0.0
        meta, geo = self._meta, self.geometry
        if meta is None or not meta.loads or geo is None:
            return
        self._load_deadline = time.monotonic() + self.settings.load_deadline_ms / 1000
        pool = self._loader()
        for spec in meta.loads:
            staging = self._take_staging(len(spec.keys) * geo.payload_bytes)
            buffers = [
                memoryview(staging)[i * geo.payload_bytes : (i + 1) * geo.payload_bytes]
                for i in range(len(spec.keys))
            ]
            futures = [
                pool.submit(
                    self._load_group, spec.keys[g : g + _GROUP_CHUNKS], buffers[g : g + _GROUP_CHUNKS]
                )
                for g in range(0, len(spec.keys), _GROUP_CHUNKS)
            ]
            self._loads.append(_PendingLoad(spec, staging, buffers, futures))
        self.restore_s += time.perf_counter() - t0

    def _loader(self) -> cf.ThreadPoolExecutor:
        # Loads get their own single thread: groups complete in order, and a slow store can never
        # delay them.
        if self._load_pool is None:
            self._load_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kvfabric-load")
        return self._load_pool

    def _load_group(self, keys: list[str], buffers: list[memoryview]) -> LoadOutcome:
        """Load and verify one group of chunks (loader thread); the count is of *intact* chunks."""
        geo, cache = self.geometry, self.cache
        if cache is None or geo is None:
            return LoadOutcome(0, Reason.UNAVAILABLE)
        if time.monotonic() >= self._load_deadline:
            return LoadOutcome(0, Reason.TIMEOUT)
        outcome = cache.load_into(self.namespace, keys, buffers, self._load_deadline)
        for i in range(outcome.count):
            try:
                layout.verify(
                    buffers[i],
                    namespace=self.namespace,
                    key=keys[i],
                    num_tokens=self.chunk_tokens,
                    num_layers=len(geo.layers),
                )
            except layout.PayloadError as exc:
                log.warning("chunk %s: %s", keys[i][:12], exc)
                return LoadOutcome(i, Reason(exc.reason))
        return outcome

    def _finish_loads(self) -> None:
        """Wait for this step's loads group by group (bounded), scatter every layer of each group.

        Runs at the first ``wait_for_layer_load`` of the step; chunks after the first missing,
        late or damaged one are reported as load errors (the engine recomputes them).
        """
        self._loads_verified = True
        geo = self.geometry
        assert geo is not None
        for pl in self._loads:
            t0 = time.monotonic()
            valid, reason = 0, None
            for g, fut in enumerate(pl.futures):
                try:
                    outcome = fut.result(timeout=max(0.0, self._load_deadline - time.monotonic()))
                except cf.TimeoutError:
                    outcome = LoadOutcome(0, Reason.TIMEOUT)
                    self.counters.add("load_abandoned")
                first = g * _GROUP_CHUNKS
                self._scatter(pl, first, first + outcome.count)
                valid += outcome.count
                if outcome.reason is not None or outcome.count < len(
                    pl.spec.keys[first : first + _GROUP_CHUNKS]
                ):
                    reason = outcome.reason or Reason.NOT_FOUND
                    for later in pl.futures[g + 1 :]:
                        later.cancel()
                    break
            pl.valid = valid
            failed = len(pl.spec.keys) - valid
            if failed:
                self._failed_reqs.add(pl.spec.req_id)
                self.counters.fallback(reason or Reason.NOT_FOUND, failed)
                for blocks in pl.spec.block_ids[valid:]:
                    self._load_errors.update(blocks)
            self.counters.add("loaded_chunks", valid)
            self.counters.add("loaded_bytes", valid * geo.payload_bytes)
            tiers = pl.spec.tiers[:valid]
            tier = max(tiers, key=lambda t: _TIER_ORDER.get(t, 4)) if tiers else None
            pl.report = LoadReport(
                pl.spec.req_id,
                len(pl.spec.keys),
                valid,
                tier,
                reason if failed else None,
                time.monotonic() - t0,
            )
            self._reports.append(pl.report)

    def _scatter(self, pl: _PendingLoad, begin: int, end: int) -> None:
        """Copy chunks ``begin..end`` of ``pl`` into every registered layer."""
        geo = self.geometry
        assert geo is not None
        if begin >= end:
            return
        for idx, kv in enumerate(self._kv.values()):
            first = begin
            if first == 0 and pl.spec.skip_blocks:
                # The first chunk is partly in the engine's own prefix cache already.
                layout.scatter_layer(
                    geo, idx, pl.buffers[0], kv, pl.spec.block_ids[0], first_block=pl.spec.skip_blocks
                )
                first = 1
            layout.scatter_chunks(
                geo,
                idx,
                memoryview(pl.staging)[first * geo.payload_bytes :],
                kv,
                pl.spec.block_ids[first:end],
            )

    def _wait_for_layer_load(self, layer_name: str) -> None:
        """Block until the step's KV is in place or known missing (the first call does the work)."""
        if not self._loads or self._loads_verified:
            return
        t0 = time.perf_counter()
        self._finish_loads()
        self.restore_s += time.perf_counter() - t0

    def _save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None, **kwargs: Any
    ) -> None:
        """Copy this layer's part of every chunk to save into staging payloads."""
        meta, geo = self._meta, self.geometry
        if meta is None or not meta.saves or geo is None or self.cache is None:
            return
        idx = self._layer_index.get(layer_name)
        if idx is None:
            return
        self._saved_layers.add(idx)
        if idx == 0:
            self._saved_layers = {0}
            # A request whose load failed computed this step on missing KV: saving it would poison
            # the cache. The engine recomputes it in a later step, which saves it then.
            self._saves = [
                (spec, self._take_save_staging(len(spec.keys) * geo.payload_bytes))
                for spec in meta.saves
                if spec.req_id not in self._failed_reqs
            ]
        for spec, staging in self._saves:
            layout.gather_chunks(geo, idx, kv_layer, spec.block_ids, staging)

    def _wait_for_save(self) -> None:
        """Hand this step's complete payloads to the background storer (never blocks)."""
        saves, self._saves = self._saves, []
        layers, self._saved_layers = self._saved_layers, set()
        geo, cache = self.geometry, self.cache
        if not saves or geo is None or cache is None:
            return
        if len(layers) != len(geo.layers):
            # Some layer's hook did not run (e.g. a full CUDA-graph replay): the payloads are
            # incomplete and must never be stored.
            self.counters.add("store_skipped_incomplete", sum(len(spec.keys) for spec, _ in saves))
            return
        for spec, staging in saves:
            size = len(staging)
            with self._store_lock:
                if self._store_inflight_bytes + size > self.settings.store_queue_bytes:
                    self.counters.add("store_dropped_backlog", len(spec.keys))
                    continue
                self._store_inflight_bytes += size
            fut = self._store_pool.submit(self._store, spec, staging)
            with self._store_lock:
                self._store_futures.add(fut)
            fut.add_done_callback(self._store_done)

    def _store_done(self, fut: cf.Future[None]) -> None:
        with self._store_lock:
            self._store_futures.discard(fut)

    def _take_save_staging(self, size: int) -> bytearray:
        # Reusing buffers whose pages are mapped saves a page fault per 4 KiB on the request path.
        with self._store_lock:
            for i, buf in enumerate(self._save_pool):
                if len(buf) == size:
                    return self._save_pool.pop(i)
        return bytearray(size)

    def _store(self, spec: SaveSpec, staging: bytearray) -> None:
        geo, cache = self.geometry, self.cache
        store_finished = False
        try:
            assert geo is not None
            assert cache is not None
            size = geo.payload_bytes
            payloads = [memoryview(staging)[i * size : (i + 1) * size] for i in range(len(spec.keys))]
            for key, payload in zip(spec.keys, payloads, strict=True):
                layout.seal(
                    payload,
                    namespace=self.namespace,
                    key=key,
                    num_tokens=self.chunk_tokens,
                    num_layers=len(geo.layers),
                )
            result = cache.store(self.namespace, spec.keys, payloads, self.settings.store_deadline_ms / 1000)
            store_finished = result is not None
        except Exception:  # a failed store costs a future recompute, never the engine
            log.exception("store of %d chunks failed", len(spec.keys))
        finally:
            with self._store_lock:
                self._store_inflight_bytes -= len(staging)
                # The transport is done with it (a store that timed out may not be: drop those).
                if store_finished and len(self._save_pool) < 8:
                    self._save_pool.append(staging)

    def wait_for_stores(self, timeout: float) -> bool:
        """Wait until background stores are done (tests, shutdown); return whether they all finished."""
        with self._store_lock:
            pending = list(self._store_futures)
        _done, not_done = cf.wait(pending, timeout=timeout)
        return not not_done

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Report nothing pending: loads are synchronous and saves copy their blocks out."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Return (and forget) the blocks whose load failed since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_load_reports(self) -> list[LoadReport]:
        """Return (and forget) the load reports since the last call."""
        reports, self._reports = self._reports, []
        return reports

    def shutdown(self) -> None:
        """Stop background threads (pending stores finish first, bounded by their deadline)."""
        self._store_pool.shutdown(wait=True, cancel_futures=False)
        if self._load_pool is not None:
            self._load_pool.shutdown(wait=False, cancel_futures=True)
        if self.cache is not None:
            self.cache.close()
