"""The reference engine: drives the connector through vLLM's scheduler/worker call sequence.

Per request (one request per step, no batching: the point is fidelity to the call sequence and to
the arithmetic, not throughput):

scheduler: ``get_num_new_matched_tokens`` -> allocate blocks -> ``update_state_after_alloc`` ->
``build_connector_meta``; worker: ``bind_connector_metadata`` -> ``start_load_kv`` -> per layer
``wait_for_layer_load`` / ``save_kv_layer`` -> ``wait_for_save`` -> ``get_finished`` ->
``get_block_ids_with_load_errors`` -> ``clear_connector_metadata``; when the request ends,
``request_finished``. A failed load is handled like vLLM's ``kv_load_failure_policy="recompute"``:
the step's output is discarded and the request is rescheduled from the first failed block.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvfabric.connector.keys import NamespaceSpec
from kvfabric.connector.resilient import ResilientCache, build_cache
from kvfabric.connector.scheduler import SchedulerHalf
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.connector.steps import StepPlan
from kvfabric.connector.worker import WorkerHalf
from kvfabric.refengine.adapter import SchedulerConnector, WorkerConnector
from kvfabric.refengine.model import ModelConfig, RefModel


@dataclass
class Request:
    """The scheduler's view of a request (vLLM ``Request`` look-alike)."""

    request_id: str
    prompt_token_ids: list[int]
    lora_name: str | None = None
    """LoRA adapter of the request (the reference model's toy adapters), None for the base model."""


@dataclass
class KVCacheBlocks:
    """vLLM ``KVCacheBlocks`` look-alike: one KV-cache group."""

    blocks: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per KV-cache group."""
        return (self.blocks,)


@dataclass
class NewRequestData:
    """vLLM ``NewRequestData`` look-alike (fields the connector reads)."""

    req_id: str
    prompt_token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """vLLM ``CachedRequestData`` look-alike."""

    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Each request's tokens so far, prompt and generated (vLLM: ``Request.all_token_ids``)."""


@dataclass
class SchedulerOutput:
    """vLLM ``SchedulerOutput`` look-alike."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: StepPlan | None = None


@dataclass
class GenerateResult:
    """Outcome of one request."""

    output_token_ids: list[int]
    first_logits: torch.Tensor
    ttft_s: float
    hit_tokens: int
    tier: str | None
    fallback_reason: str | None
    recomputed_after_load_error: bool
    restore_s: float = 0.0
    """Seconds the prefill spent blocked restoring cached KV (part of ``ttft_s``)."""
    connector_s: float = 0.0
    """Seconds of ``ttft_s`` spent inside connector calls (lookup, metadata, hooks, restore)."""


class _TimedHooks:
    """Per-layer hooks that add the time spent in the connector to the engine's account."""

    def __init__(self, engine: Engine, worker: Any) -> None:
        self._engine, self._worker = engine, worker

    def wait_for_layer_load(self, layer_name: str) -> None:
        t0 = time.perf_counter()
        self._worker.wait_for_layer_load(layer_name)
        self._engine._connector_s += time.perf_counter() - t0

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: object = None) -> None:
        t0 = time.perf_counter()
        self._worker.save_kv_layer(layer_name, kv_layer, attn_metadata)
        self._engine._connector_s += time.perf_counter() - t0


class OutOfBlocksError(RuntimeError):
    """The prompt does not fit in the engine's KV cache."""


class Engine:
    """One model, one paged KV cache, optionally a connector (two halves, as in vLLM)."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int = 16,
        settings: ConnectorSettings | None = None,
        cache: ResilientCache | None = None,
        model: RefModel | None = None,
        kv_dtype: torch.dtype = torch.float32,
        connectors: tuple[Any, Any] | None = None,
        max_prefill_tokens: int | None = None,
    ) -> None:
        """Build the engine; with ``settings`` (and a server in them, or an explicit ``cache``) it caches.

        ``connectors`` = ``(scheduler_half, worker_half)`` drives other objects with the vLLM
        connector API instead, e.g. two ``kvfabric.connector.vllm.KVFabricConnector`` instances.
        """
        self.config = config
        self.model = model or RefModel(config)
        self.block_size = block_size
        self.max_prefill_tokens = max_prefill_tokens
        """Tokens per prefill step (vLLM's chunked prefill); None: the whole prompt in one step."""
        self.kv_caches = self.model.new_kv_caches(num_blocks, block_size, kv_dtype)
        self._free = list(range(num_blocks))
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._connector_s = 0.0
        self.scheduler_conn: SchedulerHalf | None = None
        self.worker_conn: WorkerHalf | None = None
        # What the vLLM call sequence is made on (an adapter: the engine's own, or vLLM's); the
        # halves (above) answer the engine's extras (reports, counters, restore time).
        self._sched_api: Any = None
        self._worker_api: Any = None
        if connectors is not None:
            self._sched_api, self._worker_api = connectors
            self.scheduler_conn = self._sched_api.core
            self.worker_conn = self._worker_api.core
            self._worker_api.register_kv_caches(self.kv_caches)
        elif settings is not None and settings.enabled:
            # One cache for both halves (as build_cache shares it between vLLM's halves in one
            # process); each half closes it once.
            sched_cache = cache if cache is not None else build_cache(settings)
            worker_cache = cache if cache is not None else build_cache(settings)
            spec = self.namespace_spec(config, settings, block_size, kv_dtype)
            self.scheduler_conn = SchedulerHalf(settings, spec, cache=sched_cache)
            self.worker_conn = WorkerHalf(settings, spec, cache=worker_cache)
            self._sched_api = SchedulerConnector(self.scheduler_conn)
            self._worker_api = WorkerConnector(self.worker_conn)
            self._worker_api.register_kv_caches(self.kv_caches)

    @staticmethod
    def namespace_spec(
        config: ModelConfig,
        settings: ConnectorSettings,
        block_size: int,
        kv_dtype: torch.dtype = torch.float32,
    ) -> NamespaceSpec:
        """Return the compatibility namespace of an engine with this model and settings."""
        return NamespaceSpec(
            model_id=config.name,
            model_revision=settings.model_revision or config.revision,
            kv_dtype=str(kv_dtype).removeprefix("torch."),
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            block_size=block_size,
            chunk_tokens=settings.chunk_tokens,
            tenant=settings.tenant,
            device_type="cpu",
            # Its own attention over vLLM's logical [B, H, N, 2D] layout (model.py).
            attn_backend="kvfabric-refengine",
            kv_layout="LBHNC",
        )

    def _step(
        self, so: SchedulerOutput, req: Request, start: int, n: int, table: list[int]
    ) -> tuple[torch.Tensor, set[int]]:
        sched, worker = self._sched_api, self._worker_api
        if sched is None or worker is None:
            return self.model.forward(
                req.prompt_token_ids[start : start + n], start, table, self.kv_caches, lora=req.lora_name
            ), set()
        t0 = time.perf_counter()
        so.kv_connector_metadata = sched.build_connector_meta(so)
        worker.bind_connector_metadata(so.kv_connector_metadata)
        worker.start_load_kv(None)
        self._connector_s += time.perf_counter() - t0
        try:
            logits = self.model.forward(
                req.prompt_token_ids[start : start + n],
                start,
                table,
                self.kv_caches,
                hooks=_TimedHooks(self, worker),
                lora=req.lora_name,
            )
        finally:
            t0 = time.perf_counter()
            worker.wait_for_save()
            worker.get_finished(so.finished_req_ids)
            errors = worker.get_block_ids_with_load_errors()
            # Worker -> scheduler, as vLLM carries KVConnectorOutput.kv_connector_worker_meta.
            build_meta = getattr(worker, "build_connector_worker_meta", None)
            update = getattr(sched, "update_connector_output", None)
            if build_meta is not None and update is not None:
                update(build_meta())
            worker.clear_connector_metadata()
            self._connector_s += time.perf_counter() - t0
        return logits, errors

    def generate(
        self, prompt_token_ids: Sequence[int], max_tokens: int = 1, *, lora: str | None = None
    ) -> GenerateResult:
        """Prefill ``prompt_token_ids`` and decode ``max_tokens`` tokens greedily (with adapter ``lora``)."""
        with self._lock:
            return self._generate(list(prompt_token_ids), max(1, max_tokens), lora)

    def _generate(self, prompt: list[int], max_tokens: int, lora: str | None = None) -> GenerateResult:
        if not prompt:
            raise ValueError("empty prompt")
        t0 = time.perf_counter()
        req = Request(f"req-{next(self._ids)}", prompt, lora)
        n = len(prompt)
        sched, worker = self.scheduler_conn, self.worker_conn
        ext = 0
        self._connector_s = 0.0
        if self._sched_api is not None:
            t_lookup = time.perf_counter()
            ext, _ = self._sched_api.get_num_new_matched_tokens(req, 0)
            self._connector_s += time.perf_counter() - t_lookup
        need = -(-(n + max_tokens) // self.block_size)
        if need > len(self._free):
            raise OutOfBlocksError(f"request needs {need} blocks, {len(self._free)} free")
        table, self._free = self._free[:need], self._free[need:]
        try:
            if self._sched_api is not None:
                self._sched_api.update_state_after_alloc(req, KVCacheBlocks(table), ext)
            # Prefill in steps of at most max_prefill_tokens (vLLM's chunked prefill): the first step
            # schedules the request as new (and loads), later ones as cached requests.
            step = self.max_prefill_tokens or n
            computed, hit, recomputed, restore_s = ext, ext, False, 0.0
            is_new = True
            logits = torch.empty(0)
            while computed < n:
                k = min(n - computed, step)
                if is_new:
                    so = SchedulerOutput(
                        scheduled_new_reqs=[NewRequestData(req.request_id, prompt, (table,), computed)],
                        num_scheduled_tokens={req.request_id: k},
                    )
                else:
                    so = SchedulerOutput(
                        scheduled_cached_reqs=CachedRequestData([req.request_id], set(), [None], [computed]),
                        num_scheduled_tokens={req.request_id: k},
                    )
                logits, errors = self._step(so, req, computed, k, table)
                if is_new:
                    restore_s = worker.restore_s if worker is not None else 0.0
                is_new = False
                if errors:
                    # vLLM "recompute" policy: resume from the first block whose KV did not arrive.
                    hit = min(table.index(b) for b in errors) * self.block_size
                    computed, recomputed = hit, True
                    continue
                computed += k
            first = logits.clone()
            out = [int(torch.argmax(logits))]
            ttft = time.perf_counter() - t0
            connector_s = self._connector_s
            reports = worker.take_load_reports() if worker is not None else []
            tier = next((r.tier for r in reports if r.tier), None) if hit else None
            reason = next((r.reason.value for r in reports if r.reason), None)
            if reason is None and sched is not None and ext == 0:
                lr = sched.lookup_reason(req.request_id)
                reason = lr.value if lr else None
            for i in range(max_tokens - 1):
                pos = n + i
                tokens = [*prompt, *out]
                so = SchedulerOutput(
                    scheduled_cached_reqs=CachedRequestData(
                        [req.request_id], set(), [None], [pos], {req.request_id: tokens}
                    ),
                    num_scheduled_tokens={req.request_id: 1},
                )
                step_req = Request(req.request_id, tokens, lora)
                logits, _ = self._step(so, step_req, pos, 1, table)
                out.append(int(torch.argmax(logits)))
            return GenerateResult(out, first, ttft, hit, tier, reason, recomputed, restore_s, connector_s)
        finally:
            if self._sched_api is not None:
                self._sched_api.request_finished(req, table)
            self._free.extend(table)

    def close(self) -> None:
        """Stop the connector's threads."""
        for half in (self._worker_api, self._sched_api):
            if half is not None:
                half.shutdown()
