"""The worker half of the connector: executes each step's plan against the engine's KV cache.

Engine-agnostic: it receives a :class:`~kvfabric.connector.steps.StepPlan` and per-layer tensors,
and moves bytes only through a :class:`~kvfabric.connector.datapath.DataPath`. What it decides:

1. :meth:`WorkerHalf.start_load` starts the step's loads (no waiting); the first
   :meth:`WorkerHalf.wait_for_layer_load` waits (bounded by ``load_deadline_ms``) for the data path
   to place every verified chunk. Chunks that did not arrive intact become load errors
   (:meth:`WorkerHalf.take_load_errors`) so the engine recomputes them; the leading chunks that did
   arrive are still used.
   Loads the scheduler marked ``background`` (vLLM's asynchronous loads) run on threads of their
   own (up to :data:`BACKGROUND_LOADS` at once), each on a data path of its own;
   :meth:`WorkerHalf.take_finished_loads` reports a request only once its load stopped writing
   and its failed blocks were handed out by :meth:`WorkerHalf.take_load_errors` (vLLM requires
   them no later than the finish).
2. :meth:`WorkerHalf.save_kv_layer` has the data path copy each layer's finished chunks out (so the
   engine may reuse its blocks at once), except for requests whose load failed this step;
   :meth:`WorkerHalf.wait_for_save` submits them only if every layer was copied.

The hooks never raise into the forward pass: a failure turns the step's loads into load errors
(recomputed) and drops its saves.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvfabric.connector import keys as keyslib
from kvfabric.connector import layout, stagetimes
from kvfabric.connector.datapath import DataPath, LoadResult
from kvfabric.connector.groups import GroupPlan, KindType
from kvfabric.connector.hostpath import SHUTDOWN_DRAIN_S, HostStagingPath
from kvfabric.connector.hybridplan import NULL_BLOCK
from kvfabric.connector.resilient import Counters, Reason, ResilientCache
from kvfabric.connector.scheduler import keyed_spec, slowest_tier, usable_cache
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.connector.steps import LoadSpec, RestoreTiming, Role, StepPlan, WorkerFeedback

log = logging.getLogger(__name__)

# Background loads in flight at once per worker: hits that arrive together load side by side (each
# on a data path of its own, whose staging buffers it keeps for reuse: host memory grows with this).
BACKGROUND_LOADS = 2


@dataclass
class LoadReport:
    """What happened to one request's load: for logs, metrics and the reference engine's output."""

    req_id: str
    requested_chunks: int
    loaded_chunks: int
    tier: str | None
    reason: Reason | None
    wait_s: float


class WorkerHalf:
    """Loads and saves the chunks a :class:`StepPlan` names (one instance per worker / TP rank)."""

    role = Role.WORKER

    def __init__(
        self,
        settings: ConnectorSettings,
        spec: keyslib.NamespaceSpec,
        *,
        cache: ResilientCache | None = None,
        datapath: DataPath | None = None,
        background_datapath: Callable[[], DataPath] | None = None,
        plan: GroupPlan | None = None,
    ) -> None:
        """Create the half for this rank's namespace ``spec``; ``datapath`` defaults to host staging.

        ``background_datapath`` makes the data path of background loads (default: host staging),
        created at the first one. ``plan``: the model's KV cache groups (a hybrid or
        sliding-window plan: one object per kind, each layer indexed with its own group's blocks).
        """
        if spec.chunk_tokens != settings.chunk_tokens:
            raise ValueError("spec.chunk_tokens must equal settings.chunk_tokens")
        self.settings = settings
        self.plan: GroupPlan | None = plan if plan is not None and not plan.plain else None
        spec = keyed_spec(spec, settings)
        if not spec.payload_key_id and settings.configured:
            log.warning("no payload key (KVFABRIC_PAYLOAD_KEY): chunks are checked for damage, not forgery")
        self.spec = spec
        self.namespace = spec.digest()
        self.chunk_tokens = spec.chunk_tokens
        self.block_size = spec.block_size
        self.counters = cache.counters if cache is not None else Counters()
        self.cache = usable_cache(cache, settings, self.counters)
        if self.cache is not None:
            # The server exports what the namespace stands for (pool status: namespaces in use).
            self.cache.describe(self.namespace, spec.canonical().decode())
        self.datapath: DataPath = datapath or self._host_path(
            warm_save_tokens=self.settings.save_staging_warm_tokens
        )
        self._background_factory = background_datapath or self._host_path
        # One data path per loader thread (a data path's staging is per load in flight), made lazily.
        self._background_paths: dict[int, DataPath] = {}
        self._background_pool: cf.ThreadPoolExecutor | None = None
        self._background_running: set[cf.Future[None]] = set()  # queued or running (shutdown waits)
        self._kv_caches: dict[str, torch.Tensor] = {}
        # Guards what background loads hand to the engine thread: errors, reports, finished ids.
        self._results_lock = threading.Lock()
        self._background_errors: dict[str, set[int]] = {}  # req -> failed blocks not yet taken
        self._background_done: set[str] = set()  # finished, not yet reported
        self._plan: StepPlan | None = None
        self._layer_index: dict[str, int] = {}
        self._loads_pending = False
        self._failed_reqs: set[str] = set()
        self._load_errors: set[int] = set()
        self._reports: list[LoadReport] = []
        self._saved_layers: set[int] = set()
        self.disabled: str | None = None
        """Why this worker never loads or stores (the engine does not match its namespace), or None."""
        self.restore_s = 0.0
        """Seconds the last step spent blocked restoring KV (waiting, verifying, scattering)."""
        # Timing of the current step, for the scheduler's cost model (WorkerFeedback).
        self._step_t0: float | None = None
        self._step_cpu0 = 0.0  # the engine thread's CPU time at the step's start (stage timings only)
        self._save_s = 0.0
        # (tier, chunks loaded, all intact, bytes moved when the data path knows them)
        self._step_loads: list[tuple[str | None, int, bool, int | None]] = []
        self._feedback: WorkerFeedback | None = None

    def _host_path(self, warm_save_tokens: int = 0) -> DataPath:
        """Host staging (the default data path): bytes through host memory buffers.

        ``warm_save_tokens``: the engine thread's path (the one that saves) keeps a save staging
        buffer of that many tokens ready from the start; the loader threads' paths save nothing.
        """
        return HostStagingPath(
            self.cache,
            namespace=self.namespace,
            chunk_tokens=self.chunk_tokens,
            block_size=self.block_size,
            store_deadline_s=self.settings.store_deadline_ms / 1000,
            store_queue_bytes=self.settings.store_queue_bytes,
            counters=self.counters,
            mac_key=self.settings.mac_key,
            plan=self.plan,
            warm_save_tokens=warm_save_tokens,
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Remember the per-layer KV tensors (forward order) and check them against the namespace.

        The namespace names the device and the block size; tensors on another device or with
        other blocks would file their bytes under the wrong namespace, so this worker is then
        disabled (every load a recompute, nothing stored).
        """
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        self._kv_caches = dict(kv_caches)
        self.datapath.register_kv_caches(kv_caches)
        with self._results_lock:
            paths = list(self._background_paths.values())
        for path in paths:
            path.register_kv_caches(kv_caches)
        devices = {t.device.type for t in kv_caches.values()}
        if self.spec.device_type and devices and devices != {self.spec.device_type}:
            self.disable(f"the KV cache is on {sorted(devices)}, the namespace says {self.spec.device_type}")
        if self.plan is not None:
            self._check_groups(kv_caches)
            return
        blocks = {layout.block_size_of(t) for t in kv_caches.values()}
        if blocks and blocks != {self.spec.block_size}:
            self.disable(
                f"the KV cache has blocks of {sorted(blocks)} tokens, the namespace says {self.block_size}"
            )

    def _check_groups(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Check each layer against its own group: planned, its block size, one block count."""
        assert self.plan is not None
        places = self.plan.layer_places()
        missing = sorted(set(places) - set(kv_caches))
        if missing:
            self.disable(f"the plan's layers {missing[:4]} have no KV cache")
            return
        counts = set()
        for name, t in kv_caches.items():
            place = places.get(name)
            if place is None:
                continue  # a layer of a group kvfabric does not store
            kind = self.plan.kinds[place[0]]
            if kind.type is KindType.STATE:  # [num_blocks, 1, 1, state bytes] int8, padded pages
                counts.add(int(t.shape[0]))
                continue
            want = kind.block_size
            blocks = layout.in_blocks_of(t, want)
            if blocks is None:
                got = layout.block_size_of(t)
                self.disable(f"layer {name} has blocks of {got} tokens, its group's spec says {want}")
                return
            counts.add(int(blocks.shape[0]))
        if len(counts) > 1:
            self.disable(f"the layers have different block counts {sorted(counts)}")

    def disable(self, why: str) -> None:
        """Never load or store again (the engine's KV cache does not match the namespace)."""
        if self.disabled is None:
            log.error("kvfabric worker disabled: %s", why)
            self.counters.add("worker_disabled")
        self.disabled = why

    def bind_plan(self, plan: StepPlan) -> None:
        """Receive this step's plan."""
        self._plan = plan

    def clear_plan(self) -> None:
        """Drop this step's plan (and any load state left behind)."""
        self._plan = None
        self.datapath.abandon_loads()
        self._loads_pending = False
        self._failed_reqs = set()

    def _fail_step(self, what: str) -> None:
        log.exception("kvfabric %s failed; the engine recomputes", what)
        self.counters.add(f"internal_error.{what}")
        for spec in self._sync_loads():  # background loads report their own outcome
            self._failed_reqs.add(spec.req_id)
            self._load_errors.update(_all_blocks(spec))
        self.datapath.abandon_loads()
        self.datapath.abandon_saves()
        self._loads_pending = False

    # ------------------------------------------------------------------ loads

    def start_load(self) -> None:
        """Start every load of this step; returns without waiting."""
        try:
            self._start_load()
        except Exception:
            self._fail_step("start_load_kv")

    def _start_load(self) -> None:
        self._start_loads()
        if self.plan is not None and self.plan.has_state:
            # No hook runs before a recurrent layer: its state must be in place before the
            # forward, and its saves cannot wait for layer 0's hook (layer 0 may be recurrent).
            if self._loads_pending:
                t0 = time.perf_counter()
                self._finish_loads()
                self.restore_s += time.perf_counter() - t0
            self._begin_saves()

    def _begin_saves(self) -> None:
        """Prepare this step's saves (a request whose load failed this step saves nothing)."""
        plan = self._plan
        self._saved_layers = set()
        if plan is None or not plan.saves or not self.datapath.num_layers or self.cache is None:
            return
        if self.disabled is not None:
            return
        # A request whose load failed computed this step on missing KV: saving it would poison
        # the cache. The engine recomputes it in a later step, which saves it then.
        self.datapath.begin_saves([s for s in plan.saves if s.req_id not in self._failed_reqs])

    def _start_loads(self) -> None:
        t0 = time.perf_counter()
        self._step_t0, self._save_s, self._step_loads = t0, 0.0, []
        self._step_cpu0 = time.thread_time() if stagetimes.ENABLED else 0.0
        self.datapath.abandon_loads()
        self._loads_pending, self._failed_reqs = False, set()
        self.restore_s = 0.0
        plan = self._plan
        if plan is None or not plan.loads:
            return
        for spec in plan.loads:
            if spec.background:
                self._start_background(spec)
        self._drop_null_writes()
        loads = self._sync_loads()
        if not loads or not self.datapath.num_layers:
            return
        if self.disabled is not None:
            for spec in loads:
                self._failed_reqs.add(spec.req_id)
                self._load_errors.update(self._refuse(spec))
            return
        self.datapath.start_loads(loads, time.monotonic() + self._budget(loads))
        self._loads_pending = True
        self.restore_s += time.perf_counter() - t0

    def _sync_loads(self) -> list[LoadSpec]:
        plan = self._plan
        if plan is None:
            return []
        return [spec for spec in plan.loads if not spec.background and not self._refused(spec)]

    def _refused(self, spec: LoadSpec) -> bool:
        """Whether ``spec`` must not be loaded: refused by the scheduler, or it would write block 0.

        Block 0 is vLLM's null block, shared by every request's table (hybrid models only: an
        engine with one full-attention group, like the reference engine, may use block 0).
        """
        if spec.refused:
            return True
        return self.plan is not None and any(NULL_BLOCK in ids for ids in spec.block_ids)

    def _drop_null_writes(self) -> None:
        """Report the blocks of this step's refused loads failed (the engine recomputes them)."""
        plan = self._plan
        for spec in plan.loads if plan is not None else ():
            if spec.background or not self._refused(spec):
                continue
            if not spec.refused:  # the scheduler counted its own refusals
                self.counters.add("null_block_writes_refused")
            self._failed_reqs.add(spec.req_id)
            self._load_errors.update(b for b in _all_blocks(spec) if b != NULL_BLOCK)

    def _budget(self, loads: list[LoadSpec]) -> float:
        """Seconds the loads may take (``load_deadline_ms``, or less by the cost model).

        The cost model bounds each load by the prefill it is expected to save (a hung server then
        costs at most about that); the setting is the ceiling.
        """
        budget = self.settings.load_deadline_ms / 1000
        planned = [s.deadline_s for s in loads if s.deadline_s is not None]
        if planned and len(planned) == len(loads):
            budget = min(budget, max(planned))
        return budget

    def _refuse(self, spec: LoadSpec) -> set[int]:
        """Count a load this worker will not do (namespace mismatch); return its blocks."""
        self.counters.fallback(Reason.NAMESPACE_MISMATCH, spec.whole)
        if spec.tail:
            self.counters.add(f"fallback_tail_blocks.{Reason.NAMESPACE_MISMATCH.value}", spec.tail)
        return _all_blocks(spec)

    # ------------------------------------------------------------ background loads

    def _start_background(self, spec: LoadSpec) -> None:
        """Queue one asynchronous load (its own deadline starts now).

        Never raises, and every spec is reported finished exactly once: the engine keeps the
        request waiting until then (an empty spec, or one that cannot be queued, at once).
        """
        try:
            if self._refused(spec):
                if not spec.refused:
                    self.counters.add("null_block_writes_refused")
                self._finish_background(spec.req_id, {b for b in _all_blocks(spec) if b != NULL_BLOCK}, None)
                return
            if not spec.keys:
                self._finish_background(spec.req_id, set(), None)
                return
            if self._background_pool is None:
                self._background_pool = cf.ThreadPoolExecutor(
                    BACKGROUND_LOADS, thread_name_prefix="kvfabric-load"
                )
            deadline = time.monotonic() + self._budget([spec])
            self.counters.add("background_loads")
            future = self._background_pool.submit(self._run_background, spec, deadline)
            with self._results_lock:
                self._background_running.add(future)
            future.add_done_callback(self._background_over)
        except Exception:
            log.exception("kvfabric could not queue the background load of request %s", spec.req_id)
            self.counters.add("internal_error.background_load")
            self._finish_background(spec.req_id, _all_blocks(spec), None)

    def _background_over(self, future: cf.Future[None]) -> None:
        with self._results_lock:
            self._background_running.discard(future)

    def _finish_background(self, req_id: str, errors: set[int], report: LoadReport | None) -> None:
        """Publish one background load's outcome to the engine thread (errors before the finish)."""
        with self._results_lock:
            if errors:
                self._background_errors[req_id] = errors
            if report is not None:
                self._reports.append(report)
            self._background_done.add(req_id)

    def _run_background(self, spec: LoadSpec, deadline: float) -> None:
        """Load, verify and place one request's chunks off the engine thread; then report it done."""
        errors: set[int] = set()
        report: LoadReport | None = None
        try:
            if self.disabled is not None or not self._kv_caches:
                errors = self._refuse(spec)
            else:
                path = self._background_path()
                path.start_loads([spec], deadline)
                try:
                    (res,) = path.finish_loads()
                finally:
                    path.abandon_loads()
                self._settle_device()
                errors, report = self._account(spec, res)
        except Exception:
            log.exception("kvfabric background load of request %s failed; the engine recomputes", spec.req_id)
            self.counters.add("internal_error.background_load")
            errors = _all_blocks(spec)
        stagetimes.flush("load_rpc")  # a background load has no step of its own: its line is its own
        self._finish_background(spec.req_id, errors, report)

    def _settle_device(self) -> None:
        """Wait for this thread's copies into a GPU KV cache (they may be asynchronous) to complete.

        The engine reads the blocks on its own stream once the load is reported finished; nothing
        may still be in flight on this thread's stream then.
        """
        for t in self._kv_caches.values():
            if t.device.type == "cuda":
                torch.cuda.current_stream(t.device).synchronize()
                return

    def _background_path(self) -> DataPath:
        """This loader thread's data path (made at its first load)."""
        ident = threading.get_ident()
        with self._results_lock:
            path = self._background_paths.get(ident)
        if path is None:
            path = self._background_factory()
            path.register_kv_caches(self._kv_caches)
            with self._results_lock:
                self._background_paths[ident] = path
        return path

    def take_load_results(self) -> tuple[set[str], set[str]]:
        """Return (and forget) the background loads that are over, and those of them that failed.

        For engines that take a failed load per request (vLLM with several KV cache groups): the
        request is recomputed from its start, so its failed blocks are not reported at all.
        """
        with self._results_lock:
            done, self._background_done = self._background_done, set()
            failed = {r for r in done if r in self._background_errors}
            for r in failed:
                del self._background_errors[r]
            return done, failed

    def take_finished_loads(self) -> set[str]:
        """Return (and forget) the requests whose background load is over.

        Over means nothing more is written into their blocks, and their failed blocks were already
        returned by :meth:`take_load_errors` (vLLM: finished receives, which must not precede the
        errors).
        """
        with self._results_lock:
            done = {r for r in self._background_done if r not in self._background_errors}
            self._background_done -= done
            return done

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until the step's KV is in place or known missing (the first call does the work)."""
        try:
            self._wait_for_layer_load(layer_name)
        except Exception:
            self._fail_step("wait_for_layer_load")

    def _wait_for_layer_load(self, layer_name: str) -> None:
        if not self._loads_pending:
            return
        t0 = time.perf_counter()
        self._finish_loads()
        self.restore_s += time.perf_counter() - t0

    def _finish_loads(self) -> None:
        results = self.datapath.finish_loads()
        self._loads_pending = False
        for spec, res in zip(self._sync_loads(), results, strict=True):
            errors, report = self._account(spec, res)
            if errors:
                self._failed_reqs.add(spec.req_id)
            self._load_errors.update(errors)
            with self._results_lock:
                self._reports.append(report)

    def _account(self, spec: LoadSpec, res: LoadResult) -> tuple[set[int], LoadReport]:
        """Count one finished load; return its failed blocks (none: it was whole) and its report.

        Thread-safe (the counters are): background loads account on their own thread.
        """
        errors: set[int] = set()
        failed = len(spec.keys) - res.loaded
        # Whole chunks and tail blocks are counted apart: vLLM's metrics turn them into tokens.
        whole, tail = spec.whole, spec.tail
        whole_loaded = min(res.loaded, spec.whole)
        tail_loaded = res.loaded - whole_loaded
        if spec.objects is not None:
            # A hybrid hit counts the chunks and tail blocks it spans, all or nothing (the engine
            # recomputes from the earliest failed block).
            whole, tail = spec.objects.span_chunks, spec.objects.span_tails
            whole_loaded, tail_loaded = (0, 0) if failed else (whole, tail)
        if failed:
            reason = res.reason or Reason.NOT_FOUND
            self.counters.fallback(reason, whole - whole_loaded)
            if tail - tail_loaded:
                self.counters.add(f"fallback_tail_blocks.{reason.value}", tail - tail_loaded)
            for blocks in spec.block_ids[res.loaded :]:
                errors.update(blocks)
        self.counters.add("loaded_chunks", whole_loaded)
        if tail_loaded:
            self.counters.add("loaded_tail_blocks", tail_loaded)
        tier = slowest_tier(spec.tiers[: res.loaded])
        if not spec.background:  # the step's restore timing covers the loads the step waited for
            moved = getattr(self.datapath, "spec_bytes", None)
            nbytes = moved(spec, res.loaded) if moved is not None else None
            self._step_loads.append((tier, whole_loaded, not failed, nbytes))
        report = LoadReport(
            spec.req_id, len(spec.keys), res.loaded, tier, res.reason if failed else None, res.wait_s
        )
        return errors, report

    # ------------------------------------------------------------------ saves

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Copy this layer's part of every chunk to save out of the KV cache."""
        t0 = time.perf_counter()
        try:
            self._save_kv_layer(layer_name, kv_layer)
            self._save_s += time.perf_counter() - t0
        except Exception:
            log.exception("kvfabric save_kv_layer failed; this step stores nothing")
            self.counters.add("internal_error.save_kv_layer")
            self.datapath.abandon_saves()
            self._saved_layers = set()

    def _save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        plan = self._plan
        if plan is None or not plan.saves or not self.datapath.num_layers or self.cache is None:
            return
        if self.disabled is not None:
            return
        idx = self._layer_index.get(layer_name)
        if idx is None:
            return
        if idx == 0 and not (self.plan is not None and self.plan.has_state):
            self._begin_saves()  # (with recurrent state: begun in start_load_kv)
        self._saved_layers.add(idx)
        self.datapath.save_layer(idx, kv_layer)

    def wait_for_save(self) -> None:
        """Hand this step's complete payloads to the background storer (never blocks)."""
        t_end = time.perf_counter()
        if stagetimes.ENABLED and self._step_t0 is not None and self._step_loads:
            stagetimes.add("step", t_end - self._step_t0, time.thread_time() - self._step_cpu0)
            stagetimes.flush("step")
        try:
            self._feedback = self._step_feedback(t_end)
        except Exception:
            log.exception("kvfabric step timing failed")
        try:
            self._save_state_layers()
            layers, self._saved_layers = self._saved_layers, set()
            if len(layers) != self.datapath.num_layers:
                # Some layer's hook did not run (e.g. a full CUDA-graph replay): the payloads are
                # incomplete and must never be stored.
                dropped = self.datapath.abandon_saves()
                if dropped:
                    self.counters.add("store_skipped_incomplete", dropped)
                return
            self.datapath.submit_saves()
        except Exception:
            log.exception("kvfabric wait_for_save failed; this step stores nothing")
            self.counters.add("internal_error.wait_for_save")
            self.datapath.abandon_saves()

    def _save_state_layers(self) -> None:
        """Copy the recurrent layers' checkpoints out (after the forward that wrote them)."""
        plan, gp = self._plan, self.plan
        if gp is None or not gp.has_state or plan is None or not plan.saves or self.disabled is not None:
            return
        if self.cache is None or not self.datapath.num_layers:
            return
        for kind in gp.kinds:
            if kind.type is not KindType.STATE:
                continue
            for name in kind.layer_names:
                idx = self._layer_index.get(name)
                if idx is not None:
                    self.datapath.save_layer(idx, self._kv_caches[name])
                    self._saved_layers.add(idx)

    def wait_for_stores(self, timeout: float) -> bool:
        """Wait until background stores are done (tests, shutdown); return whether they all finished."""
        return self.datapath.wait_for_stores(timeout)

    def _step_feedback(self, t_end: float) -> WorkerFeedback | None:
        plan, t0 = self._plan, self._step_t0
        self._step_t0 = None
        if plan is None or t0 is None:
            return None
        forward = t_end - t0 - self.restore_s - self._save_s
        restores = []
        geo = getattr(self.datapath, "geometry", None)
        chunks = sum(n for _, n, _, _ in self._step_loads)
        tiers = [t for t, n, _, _ in self._step_loads if t is not None and n]
        # A load that failed measured a fault, not a bandwidth (its deadline bounds what it cost).
        if chunks and tiers and geo is not None and all(ok for _, _, ok, _ in self._step_loads):
            tier = slowest_tier(tiers)
            assert tier is not None
            # The bytes really moved (a hybrid hit moves only the sliding windows' blocks).
            moved = [b for _, _, _, b in self._step_loads]
            nbytes = chunks * geo.payload_bytes
            if None not in moved:
                nbytes = sum(b for b in moved if b is not None)
            restores.append(RestoreTiming(tier, nbytes, chunks, self.restore_s))
        return WorkerFeedback(
            plan.work_tokens, plan.work_attention, forward if forward > 0 else None, restores
        )

    # ------------------------------------------------------------------ results

    def take_feedback(self) -> WorkerFeedback | None:
        """Return (and forget) the last step's feedback for the scheduler half's cost model."""
        fb, self._feedback = self._feedback, None
        return fb

    def take_load_errors(self) -> set[int]:
        """Return (and forget) the blocks whose load failed since the last call.

        Background loads' included: their requests become reportable by
        :meth:`take_finished_loads` only after this.
        """
        errors, self._load_errors = self._load_errors, set()
        with self._results_lock:
            for blocks in self._background_errors.values():
                errors |= blocks
            self._background_errors.clear()
        return errors

    def take_load_reports(self) -> list[LoadReport]:
        """Return (and forget) the load reports since the last call."""
        with self._results_lock:
            reports, self._reports = self._reports, []
        return reports

    def shutdown(self, drain_s: float = SHUTDOWN_DRAIN_S) -> None:
        """Stop background threads within ``drain_s`` seconds, every step included.

        Stores a request's last step queued are what a restarted engine hits; those still queued
        at the deadline are dropped. One deadline, taken now, bounds the wait for loads in flight and
        the stores' drain together: vLLM terminates a worker that has not exited within its grace
        (``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``), so waiting longer would only be cut short there.
        A load or store still running at the deadline is left to end within its own deadline.
        """
        deadline = time.monotonic() + drain_s

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        if self._background_pool is not None:
            with self._results_lock:
                running = list(self._background_running)
            cf.wait(running, timeout=left())
            self._background_pool.shutdown(wait=False, cancel_futures=True)
        with self._results_lock:
            paths = list(self._background_paths.values())
        for path in paths:
            path.close(left())
        self.datapath.close(left())
        if self.cache is not None:
            self.cache.close()


def _all_blocks(spec: LoadSpec) -> set[int]:
    """Every engine block a load writes (all of them fail when the load does)."""
    return {b for blocks in spec.block_ids for b in blocks}
