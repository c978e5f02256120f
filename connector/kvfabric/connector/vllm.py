"""The vLLM KV connector (``KVConnectorBase_V1``, vLLM 0.33) of kvfabric.

Load it with::

    --kv-transfer-config '{"kv_connector":"KVFabricConnector",
                           "kv_connector_module_path":"kvfabric.connector.vllm",
                           "kv_role":"kv_both","kv_load_failure_policy":"recompute"}'

``kv_connector_extra_config`` may override any :class:`~kvfabric.connector.settings.ConnectorSettings`
field (``{"chunk_tokens": 512}``); everything else comes from the ``KVFABRIC_*`` environment the
operator injects.

vLLM is imported conditionally: without it this module still imports and :class:`KVFabricConnector`
still works on duck-typed arguments (its base is then a small stand-in), which is how the tests on
machines without a GPU exercise it.

This is the only module that reads vLLM's objects. It translates them into kvfabric's own step
types (:mod:`kvfabric.connector.steps`) and drives the engine-agnostic halves,
:class:`~kvfabric.connector.scheduler.SchedulerHalf` and :class:`~kvfabric.connector.worker.WorkerHalf`:
vLLM's ``Request`` becomes a :class:`~kvfabric.connector.steps.RequestInfo`, its ``SchedulerOutput`` a
:class:`~kvfabric.connector.steps.StepInput`, and the :class:`~kvfabric.connector.steps.StepPlan` the
scheduler half builds travels to the workers as :class:`KVFabricMetadata`. Differences between vLLM
releases are absorbed here (see :func:`step_input_from_vllm`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from kvfabric.connector.groups import GroupPlan, plan_from_kv_cache_config
from kvfabric.connector.keys import MultiModalSpan, NamespaceSpec, RequestInputs
from kvfabric.connector.nodefeed import node_residency_for
from kvfabric.connector.resilient import Reason, build_cache
from kvfabric.connector.scheduler import SchedulerHalf
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.connector.steps import (
    RequestInfo,
    Role,
    ScheduledRequest,
    StepInput,
    StepPlan,
    WorkerFeedback,
)
from kvfabric.connector.vllmevents import KVEventLog, group_tags, hash_block_size_of
from kvfabric.connector.vllmmetrics import (
    CounterDeltas,
    KVFabricPromMetrics,
    KVFabricStats,
    TransitionLog,
    adopt_vllm_logging,
    hit_source,
    stats_payload,
)
from kvfabric.connector.worker import WorkerHalf

# Lookup outcomes that mean the cache is at fault (logged once per outage, as "failing").
_FAILURE_REASONS = frozenset({Reason.TIMEOUT, Reason.UNAVAILABLE, Reason.CORRUPT, Reason.NAMESPACE_MISMATCH})

log = logging.getLogger(__name__)

try:  # pragma: no cover - depends on the environment
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1 as _VllmBase,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata as _VllmMetadata,
    )

    VLLM_AVAILABLE = True
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource as _CacheHitSource
    except ImportError:  # vLLM < 0.32: hits are not split by source
        _CacheHitSource = None
except ImportError:  # vLLM is not installed (no GPU here): use the stand-ins below.
    VLLM_AVAILABLE = False
    _CacheHitSource = None

    class _VllmMetadata:  # type: ignore[no-redef]
        """Stand-in for ``KVConnectorMetadata``."""

    class _VllmBase:  # type: ignore[no-redef]
        """Stand-in for ``KVConnectorBase_V1``: the non-abstract bookkeeping the connector relies on."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            self._vllm_config = vllm_config
            self._role = role
            self._kv_cache_config = kv_cache_config
            self._connector_metadata: Any = None

        @property
        def role(self) -> Any:
            return self._role

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self) -> Any:
            return self._connector_metadata

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None


try:  # pragma: no cover - depends on the environment (vLLM >= 0.32)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorTransferResults as _TransferResults,
    )
except ImportError:

    @dataclass
    class _TransferResults:  # type: ignore[no-redef]
        """Stand-in for ``KVConnectorTransferResults``."""

        finished_sending: set[str] = dataclasses.field(default_factory=set)
        finished_recving: set[str] = dataclasses.field(default_factory=set)
        failed_recving: set[str] = dataclasses.field(default_factory=set)


try:  # pragma: no cover - depends on the environment
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA as _SupportsHMA
except ImportError:

    class _SupportsHMA:  # type: ignore[no-redef]
        """Stand-in for ``SupportsHMA`` (vLLM keeps its hybrid KV cache manager on for such connectors)."""


try:  # pragma: no cover - depends on the environment (vLLM >= 0.33 has worker -> scheduler metadata)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorWorkerMetadata as _VllmWorkerMetadata,
    )
except ImportError:

    class _VllmWorkerMetadata:  # type: ignore[no-redef]
        """Stand-in for ``KVConnectorWorkerMetadata``."""


@dataclass
class KVFabricMetadata(StepPlan, _VllmMetadata):  # type: ignore[misc]
    """The connector's per-step plan, typed as vLLM's ``KVConnectorMetadata``."""


@dataclass
class KVFabricWorkerMetadata(WorkerFeedback, _VllmWorkerMetadata):  # type: ignore[misc]
    """The worker's step timing for the scheduler's cost model, typed as ``KVConnectorWorkerMetadata``."""

    def aggregate(self, other: WorkerFeedback) -> KVFabricWorkerMetadata:
        """Combine the ranks' feedback of one step (vLLM calls this across workers)."""
        both = WorkerFeedback.aggregate(self, other)
        return KVFabricWorkerMetadata(both.work_tokens, both.work_attention, both.forward_s, both.restores)


def _mm_spans(request: Any) -> tuple[MultiModalSpan, ...]:
    features = getattr(request, "mm_features", None)
    if features:  # vLLM >= 0.11: MultiModalFeatureSpec(identifier, mm_position=PlaceholderRange)
        spans = [
            MultiModalSpan(str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length))
            for f in features
        ]
    else:  # older releases: parallel lists
        hashes = getattr(request, "mm_hashes", None) or ()
        positions = getattr(request, "mm_positions", None) or ()
        spans = [
            MultiModalSpan(str(h), int(p.offset), int(p.length))
            for h, p in zip(hashes, positions, strict=False)
        ]
    return tuple(sorted(spans, key=lambda m: m.offset))


def _lora(request: Any) -> tuple[str, ...] | None:
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return None
    # The name alone is what vLLM hashes; the id and the path make another adapter loaded under a
    # reused name a miss rather than a wrong hit.
    return (
        str(getattr(lora, "lora_name", "")),
        str(getattr(lora, "lora_int_id", "")),
        str(getattr(lora, "lora_path", "") or ""),
    )


def request_info_from_vllm(request: Any) -> RequestInfo:
    """Translate vLLM's ``Request`` into what the scheduler half needs.

    Besides the token ids: multimodal items (``mm_features``, or ``mm_hashes``/``mm_positions`` on
    older releases), ``cache_salt``, ``prompt_embeds`` and ``lora_request`` (see
    :class:`~kvfabric.connector.keys.RequestInputs`).
    """
    token_ids = request.prompt_token_ids
    embeds = getattr(request, "prompt_embeds", None)
    embeds_view: memoryview | None = None
    row_bytes = 0
    if embeds is not None:
        flat = embeds.detach().contiguous().cpu()
        row_bytes = int(flat.shape[-1]) * flat.element_size()
        embeds_view = memoryview(flat.reshape(-1).view(torch.uint8).numpy())
        if token_ids is None:  # an embeddings-only prompt: the chunk keys rest on the embeddings
            token_ids = [0] * int(flat.shape[0])
    salt = getattr(request, "cache_salt", None)
    inputs = RequestInputs(
        mm=_mm_spans(request),
        cache_salt=str(salt) if salt is not None else None,
        lora=_lora(request),
        prompt_embeds=embeds_view,
        prompt_embeds_row_bytes=row_bytes,
    )
    return RequestInfo(str(request.request_id), tuple(token_ids or ()), inputs)


def _all_groups(block_ids: Any) -> tuple[tuple[int, ...], ...] | None:
    """VLLM's block ids per KV cache group (``tuple[list[int], ...]``), as plain tuples."""
    if not block_ids:
        return None
    return tuple(tuple(int(b) for b in group) for group in block_ids)


def _current_tables(scheduler_output: Any) -> Any:
    """The lookup of the scheduler's current tables (``kv_connector_block_state``, vLLM >= 0.32).

    ``get_block_ids`` (None for a request it does not cover), else ``resolve_block_ids``; None
    when the scheduler output has no block state.
    """
    state = getattr(scheduler_output, "kv_connector_block_state", None)
    for name in ("get_block_ids", "resolve_block_ids"):
        lookup = getattr(state, name, None)
        if callable(lookup):
            return lookup
    return None


def _resolved(resolve: Any, req_id: str) -> tuple[tuple[int, ...], ...] | None:
    if resolve is None:
        return None
    try:
        return _all_groups(resolve(req_id))
    except Exception:  # a request the state does not know: keep the appended table
        return None


def step_input_from_vllm(scheduler_output: Any) -> StepInput:
    """Translate vLLM's ``SchedulerOutput`` into a :class:`~kvfabric.connector.steps.StepInput`.

    Block ids of every KV cache group; with ``kv_connector_block_state`` (scheduler side, vLLM
    0.32+) also each request's current table, which saves of sliding-window groups read.
    """
    num_scheduled: dict[str, int] = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    resolve = _current_tables(scheduler_output)
    scheduled: list[ScheduledRequest] = []
    for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        scheduled.append(
            ScheduledRequest(
                new.req_id,
                int(new.num_computed_tokens),
                int(num_scheduled.get(new.req_id, 0)),
                _all_groups(new.block_ids),
                replaces_blocks=True,
                current_block_ids=_resolved(resolve, new.req_id),
            )
        )
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if cached is not None:
        # vLLM < 0.2x had no resumed_req_ids (it sent whole block lists for resumed requests).
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, req_id in enumerate(cached.req_ids):
            scheduled.append(
                ScheduledRequest(
                    req_id,
                    int(cached.num_computed_tokens[i]),
                    int(num_scheduled.get(req_id, 0)),
                    _all_groups(cached.new_block_ids[i]),
                    replaces_blocks=req_id in resumed,
                    current_block_ids=_resolved(resolve, req_id),
                )
            )
    finished = getattr(scheduler_output, "finished_req_ids", None) or ()
    state = getattr(scheduler_output, "kv_connector_block_state", None)
    offloads = getattr(state, "boundary_state_offloads", None) or {}
    states = {
        str(req_id): tuple((int(g), int(b), int(t)) for g, b, t in items)
        for req_id, items in offloads.items()
    }
    return StepInput(tuple(scheduled), frozenset(finished), states)


def drop_overwritten_from_zeroing(scheduler_output: Any, plan: StepPlan) -> None:
    """Remove from ``new_block_ids_to_zero`` the blocks this step's loads overwrite whole.

    vLLM 0.32 allows this of a synchronous-read connector: the load writes every byte of those
    blocks before the forward reads them (a failed load is recomputed, which writes them too), so
    zeroing them first is wasted work. The one sanctioned mutation of ``scheduler_output``.
    """
    zero = getattr(scheduler_output, "new_block_ids_to_zero", None)
    if not zero or not plan.loads:
        return
    loaded = {b for spec in plan.loads for blocks in spec.block_ids for b in blocks}
    zero[:] = [b for b in zero if b not in loaded]


def _role_of(role: Any) -> Role:
    # vLLM's KVConnectorRole and ours share member names and values.
    name = getattr(role, "name", str(role)).upper()
    return Role.SCHEDULER if "SCHEDULER" in name else Role.WORKER


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (scheduler process) or no vLLM: rank 0
        return 0


def _platform() -> Any:
    try:
        from vllm.platforms import current_platform

        return current_platform
    except Exception:  # no vLLM (tests on duck-typed configs)
        return None


def device_type_from_vllm(vllm_config: Any) -> str:
    """The device the KV cache lives on, as vLLM reports it (``cuda``, ``cpu``, ``xpu``, ``rocm``...)."""
    device_config = getattr(vllm_config, "device_config", None)
    device = getattr(device_config, "device_type", None) or getattr(_platform(), "device_type", None)
    return str(device) if device else "unknown"


def _enum_name(value: Any) -> str:
    return str(getattr(value, "name", value))


def attention_backend_from_vllm(vllm_config: Any) -> str:
    """The attention backend vLLM runs, from its configuration (identical in both halves).

    An explicit choice (``--attention-backend``, ``attention_config.backend``; older releases:
    ``VLLM_ATTENTION_BACKEND``) is named as such. Otherwise vLLM picks one per platform, GPU
    generation and release, from model facts that are already in the namespace; then the name says
    ``auto`` and where, e.g. ``auto:cuda:sm90:vllm-0.33.0``. The worker checks the name against the
    backend its attention layers really use (:meth:`KVFabricConnector.register_kv_caches`).

    On the CPU platform a configured backend that is not a CPU one is ignored by vLLM (it logs
    "Cannot use ... backend on CPU" and runs its own): some models configure one regardless (Gemma 4
    asks for ``TRITON_ATTN``), so the name is then the platform's automatic choice.
    """
    attention_config = getattr(vllm_config, "attention_config", None)
    backend = getattr(attention_config, "backend", None) or os.environ.get("VLLM_ATTENTION_BACKEND")
    device = device_type_from_vllm(vllm_config)
    if backend:
        name = _enum_name(backend)
        if device != "cpu" or name.startswith(("CPU_", "AMX_")):
            return name
    platform = _platform()
    where = [device]
    try:
        capability = platform.get_device_capability() if platform is not None else None
    except Exception:  # no device visible in this process
        capability = None
    if capability is not None:
        where.append(f"sm{capability.major}{capability.minor}")
    try:
        import vllm

        where.append(f"vllm-{vllm.__version__}")
    except Exception:  # no vLLM
        where.append("vllm-none")
    return "auto:" + ":".join(where)


def kv_layout_from_vllm(vllm_config: Any, kv_cache_config: Any = None) -> str:
    """The KV-cache layout vLLM resolved.

    0.33: the engine core resolves it once and hands it to every worker in the ``KVCacheConfig``
    (``kv_cache_config.kv_cache_layout``, e.g. ``LBHNC``), which both halves receive, so they agree
    even if a worker process adopts the layout after its connector was built; then
    ``cache_config.kv_cache_layout``; older releases: ``NHD``/``HND`` from ``get_kv_cache_layout()``.
    """
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        vllm_config.cache_config, "kv_cache_layout", None
    )
    if layout:
        return _enum_name(layout)
    try:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        return _enum_name(get_kv_cache_layout())
    except Exception:  # no vLLM, or a release without it
        return os.environ.get("VLLM_KV_CACHE_LAYOUT") or "default"


def block_size_from_vllm(vllm_config: Any, kv_cache_config: Any = None) -> int:
    """The scheduler block: the least common multiple of the KV cache groups' block sizes.

    Every group's own block size when vLLM passes the ``KVCacheConfig`` (groups can differ:
    Gemma 4's sliding-window layers 256, its full-attention layers 128); else ``cache_config``'s.
    """
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    sizes = [int(getattr(getattr(g, "kv_cache_spec", None), "block_size", 0) or 0) for g in groups]
    sizes = [b for b in sizes if b > 0]
    return math.lcm(*sizes) if sizes else int(vllm_config.cache_config.block_size)


def group_plan_from_vllm(vllm_config: Any, kv_cache_config: Any = None) -> GroupPlan | None:
    """The group plan of ``kv_cache_config`` (None without groups).

    Raises, naming the reason, for groups kvfabric cannot store
    (:class:`~kvfabric.connector.groups.UnsupportedGroupsError`).
    """
    fallback = int(getattr(getattr(vllm_config, "cache_config", None), "block_size", 0) or 0)
    return plan_from_kv_cache_config(kv_cache_config, fallback_block_size=fallback)


def attention_backends_of_layers(vllm_config: Any, layer_names: list[str]) -> set[str]:
    """Names of the attention backends that vLLM's layers ``layer_names`` really use (worker only).

    Empty when they cannot be found (no vLLM, or a release that moved the helpers).
    """
    try:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)
        return {str(layer.get_attn_backend().get_name()) for layer in layers.values()}
    except Exception:
        return set()


def namespace_spec_from_vllm(
    vllm_config: Any,
    settings: ConnectorSettings,
    tp_rank: int,
    kv_cache_config: Any = None,
    plan: GroupPlan | None = None,
) -> NamespaceSpec:
    """Derive the compatibility namespace from what vLLM reports it uses.

    Model, cache and parallel configuration, device, attention backend and KV-cache layout; for a
    hybrid or sliding-window model the group plan (``plan``). ``chunk_tokens`` is rounded up to a
    multiple of the scheduler block.
    """
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    kv_dtype = str(getattr(cache, "cache_dtype", "auto"))
    if kv_dtype == "auto":
        kv_dtype = str(model.dtype).removeprefix("torch.")
    block_size = block_size_from_vllm(vllm_config, kv_cache_config)
    chunk = settings.chunk_tokens
    if chunk % block_size:
        chunk = -(-chunk // block_size) * block_size
        log.warning(
            "chunk_tokens %d is not a multiple of the scheduler block %d; using %d",
            settings.chunk_tokens,
            block_size,
            chunk,
        )
    return NamespaceSpec(
        model_id=str(model.model),
        model_revision=str(getattr(model, "revision", None) or settings.model_revision or ""),
        kv_dtype=kv_dtype,
        num_layers=int(model.get_num_layers(parallel)),
        num_kv_heads=int(model.get_num_kv_heads(parallel)),
        head_dim=int(model.get_head_size()),
        block_size=block_size,
        chunk_tokens=chunk,
        tp_size=int(getattr(parallel, "tensor_parallel_size", 1)),
        tp_rank=tp_rank,
        tenant=settings.tenant,
        device_type=device_type_from_vllm(vllm_config),
        attn_backend=attention_backend_from_vllm(vllm_config),
        kv_layout=kv_layout_from_vllm(vllm_config, kv_cache_config),
        groups=plan.namespace_field() if plan is not None else "",
    )


EXPANDABLE_SEGMENTS_REASON = (
    "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True: vLLM 0.33 refuses any KV connector with "
    "it unless its cumem allocator is on, and kvfabric's saves and loads address KV blocks by their "
    "memory; unset it (or set expandable_segments:False)"
)


def expandable_segments_on(environ: dict[str, str] | None = None) -> bool:
    """Whether ``PYTORCH_CUDA_ALLOC_CONF`` turns on expandable segments (vLLM 0.33 refuses it)."""
    conf = (environ if environ is not None else dict(os.environ)).get("PYTORCH_CUDA_ALLOC_CONF", "")
    opts = dict(part.split(":", 1) for part in conf.replace(" ", "").split(",") if ":" in part)
    return opts.get("expandable_segments", "").lower() == "true"


class KVFabricConnector(_VllmBase, _SupportsHMA):  # type: ignore[misc]
    """kvfabric as a vLLM KV connector: prefix chunks from the node's cache server, stored back async.

    ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on. Each KV cache group's blocks are
    stored as the group plan says (:mod:`kvfabric.connector.groups`): full attention whole,
    sliding-window and chunked-local layers only what a later hit needs.
    """

    # Hits are attributed per request by get_external_cache_hit_sources; this is vLLM's fallback.
    if _CacheHitSource is not None:
        _cache_hit_source = _CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        """Construct one half (vLLM builds one per role); reads settings from env + extra config.

        Refuses (``ValueError``) a model whose KV cache groups the plan cannot serve (recurrent
        state, unknown specs) and warns about expandable segments, both at start-up, naming the
        reason.
        """
        super().__init__(vllm_config, role, kv_cache_config)
        adopt_vllm_logging()
        plan = group_plan_from_vllm(vllm_config, kv_cache_config)
        if plan is not None:
            log.info("kvfabric group plan: %s", plan.describe())
        if expandable_segments_on():
            log.warning("kvfabric: %s", EXPANDABLE_SEGMENTS_REASON)
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
        settings = ConnectorSettings.load(extra)
        our_role = _role_of(role)
        rank = _tp_rank() if our_role is Role.WORKER else 0
        spec = namespace_spec_from_vllm(vllm_config, settings, rank, kv_cache_config, plan)
        if spec.chunk_tokens != settings.chunk_tokens:
            settings = settings.model_copy(update={"chunk_tokens": spec.chunk_tokens})
        rank0 = namespace_spec_from_vllm(vllm_config, settings, 0, kv_cache_config, plan)
        self.plan = plan
        self._per_request_failures = plan is not None and plan.request_level_failures
        """vLLM takes this model's failed loads only per request (``GroupPlan.request_level_failures``)."""
        self.settings = settings
        self._vllm_config = vllm_config
        cache = build_cache(settings)
        self._scheduler: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        self._half: SchedulerHalf | WorkerHalf
        if our_role is Role.SCHEDULER:
            self._half = self._scheduler = SchedulerHalf(settings, rank0, cache=cache, plan=plan)
        else:
            self._half = self._worker = WorkerHalf(settings, spec, cache=cache, plan=plan)
        self._deltas = CounterDeltas.of(self._half.counters)
        events_cfg = getattr(vllm_config, "kv_events_config", None)
        tags = group_tags(kv_cache_config)
        self._events = KVEventLog(
            spec.block_size,
            bool(getattr(events_cfg, "enable_kv_cache_events", False)),
            # The scheduler announces what its node's cache server holds (docs/routing.md), in this
            # model's KV cache groups only.
            follow=partial(node_residency_for, settings.socket, self._half.namespace, groups=tags)
            if our_role is Role.SCHEDULER
            else None,
            plan=plan,
            tags=tags,
            hash_block_size=hash_block_size_of(kv_cache_config, spec.block_size),
        )
        self._requests: dict[str, Any] = {}  # vLLM's Request objects of the requests in flight
        # Scheduler: req_id -> how many of its token ids the half has been given.
        self._known_tokens: dict[str, int] = {}
        self._lookups = TransitionLog("lookups", log)
        self._loads_state = TransitionLog("loads", log)
        log.info(
            "kvfabric connector (%s) namespace=%s pool=%s socket=%s remote=%s",
            our_role.name.lower(),
            self._half.namespace[:16],
            settings.pool or "-",
            settings.socket,
            settings.remote,
        )

    @property
    def core(self) -> SchedulerHalf | WorkerHalf:
        """The vLLM-agnostic half this instance drives."""
        return self._half

    @property
    def scheduler_half(self) -> SchedulerHalf:
        """The scheduler half (only on the scheduler role)."""
        if self._scheduler is None:
            raise RuntimeError("not the scheduler-side connector")
        return self._scheduler

    @property
    def worker_half(self) -> WorkerHalf:
        """The worker half (only on the worker role)."""
        if self._worker is None:
            raise RuntimeError("not the worker-side connector")
        return self._worker

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache is best-effort: vLLM never waits for this connector to deliver KV."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """Accept any layout: gather/scatter index the block dimension of whatever vLLM allocates."""
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Return True: ``wait_for_layer_load`` really blocks, so its hook must run."""
        return True

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """Return False: the worker keeps the KV tensors vLLM registered, which sleep mode remaps."""
        return False

    # ---------------- statistics (vLLM's stats, logs and /metrics) ----------------

    def get_kv_connector_stats(self) -> KVFabricStats | None:
        """This step's counter deltas (both roles; vLLM sums workers and the scheduler)."""
        restore = 0.0
        if self._worker is not None:
            restore = self._worker.restore_s
            for report in self._worker.take_load_reports():
                self._loads_state.note(report.reason.value if report.reason else None)
        data = stats_payload(self._deltas.take(), self.settings.chunk_tokens, restore, self._half.block_size)
        return KVFabricStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVFabricStats | None:
        """Rebuild the stats vLLM shipped between processes."""
        return KVFabricStats(data=dict(data)) if data is not None else KVFabricStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVFabricPromMetrics:
        """Register kvfabric's metrics in vLLM's ``/metrics`` (``vllm:kvfabric_*``)."""
        return KVFabricPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---------------- scheduler side ----------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Return external prefix tokens available beyond ``num_computed_tokens`` (synchronous load)."""
        half = self.scheduler_half
        info = request_info_from_vllm(request)
        self._requests.setdefault(info.req_id, request)
        lookups = half.counters.get("lookups")
        hit = half.num_new_matched_tokens(info, num_computed_tokens)
        # Asynchronous loads: vLLM then keeps the request waiting, unscheduled, until get_finished
        # reports its load over; the other requests keep stepping meanwhile. With several KV cache
        # groups always: vLLM takes their failures only per request, for background loads.
        per_request = self._per_request_failures
        background = half.load_in_background(
            info.req_id, (self.settings.load_async or per_request) and hit > 0
        )
        if per_request and hit > 0 and not background:
            # A retry after a failed background load: a synchronous one could not report failing.
            half.drop_hit(info.req_id)
            hit = 0
        if half.counters.get("lookups") > lookups:  # a lookup really ran (not skipped as too short)
            reason = half.lookup_reason(info.req_id)
            # Only faults of the cache count as failing: a miss, or a hit the cost model declined
            # as slower than recompute, is the cache working.
            failed = reason is not None and reason in _FAILURE_REASONS
            self._lookups.note(reason.value if failed and reason is not None else None)
        if self._events.enabled and num_computed_tokens == 0:
            self._events.found_missing(half.absent_keys(info.req_id))
        return hit, background

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        """Attribute the hit to kvfabric's slowest tier among its chunks (vLLM's "outermost")."""
        if num_external_tokens <= 0:
            return {}
        if _CacheHitSource is None:
            return {}
        source = _CacheHitSource(hit_source(self.scheduler_half.hit_tier(str(request.request_id))))
        return {source: num_external_tokens}

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Remember the blocks (every group's) the hit must fill."""
        ids = _all_groups(blocks.get_block_ids()) if blocks is not None else None
        self.scheduler_half.update_state_after_alloc(
            request_info_from_vllm(request), ids, num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVFabricMetadata:
        """Build this step's load/save specs."""
        half = self.scheduler_half
        if half.cache is None:
            return KVFabricMetadata()
        plan = half.build_plan(self._with_generated_tokens(step_input_from_vllm(scheduler_output)))
        drop_overwritten_from_zeroing(scheduler_output, plan)
        if self._events.enabled:
            for save in plan.saves:
                request = self._requests.get(save.req_id)
                if request is not None:
                    self._events.stored(request, save)
        return KVFabricMetadata(loads=plan.loads, saves=plan.saves)

    def _with_generated_tokens(self, step: StepInput) -> StepInput:
        """Hand the half the token ids each scheduled request generated since the last step.

        From vLLM's ``Request.all_token_ids`` (prompt + accepted outputs; placeholders of
        asynchronous scheduling and unverified draft tokens are not in it), so generated tokens'
        chunks and blocks are stored too. Prompt-embedding requests are left out (their token ids
        are not what the model saw).
        """
        if not self.settings.tail:
            return step
        scheduled = []
        for sr in step.scheduled:
            request = self._requests.get(sr.req_id)
            ids = getattr(request, "all_token_ids", None)
            prompt = getattr(request, "prompt_token_ids", None)
            if ids is None or prompt is None or getattr(request, "prompt_embeds", None) is not None:
                scheduled.append(sr)
                continue
            known = self._known_tokens.get(sr.req_id, len(prompt))
            total = len(ids)
            if total > known:
                self._known_tokens[sr.req_id] = total
                sr_new = dataclasses.replace(sr, new_token_ids=tuple(ids[known:total]), token_offset=known)
                scheduled.append(sr_new)
                continue
            scheduled.append(sr)
        return dataclasses.replace(step, scheduled=tuple(scheduled))

    def take_events(self) -> list[Any]:
        """KV events (``BlockStored``/``BlockRemoved``, medium ``CPU``) since the last step."""
        return self._events.take()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Free blocks at once: saves copied them out during the step."""
        self.scheduler_half.request_finished(str(request.request_id))
        self._requests.pop(str(request.request_id), None)
        self._known_tokens.pop(str(request.request_id), None)
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``'s finish (every group's blocks): free them at once, as :meth:`request_finished`."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    # ---------------- worker side ----------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Remember the per-layer KV tensors; check the namespace against what the layers really use.

        The worker half checks device and block size against the tensors. Here the attention
        backends of the layers are compared with the namespace's: if the namespace names a backend
        the layers do not use, this worker never loads or stores (its bytes would be filed under
        the wrong backend).
        """
        half = self.worker_half
        half.register_kv_caches(kv_caches)
        real = attention_backends_of_layers(self._vllm_config, list(kv_caches))
        declared = half.spec.attn_backend
        log.info("kvfabric worker: attention backends %s, namespace says %s", sorted(real), declared)
        if real and not declared.startswith("auto:") and real != {declared}:
            half.disable(f"the layers use attention backends {sorted(real)}, the namespace says {declared}")

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Bind this step's metadata (base bookkeeping + the worker half's plan)."""
        super().bind_connector_metadata(connector_metadata)
        self.worker_half.bind_plan(connector_metadata)

    def clear_connector_metadata(self) -> None:
        """Clear this step's metadata."""
        super().clear_connector_metadata()
        self.worker_half.clear_plan()

    def handle_preemptions(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: no save ever references engine blocks after its step (both signatures)."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start this step's loads."""
        self.worker_half.start_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait (bounded) for the loads, then scatter this layer."""
        self.worker_half.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Copy this layer's finished chunks out."""
        self.worker_half.save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        """Submit this step's stores to the background storer."""
        self.worker_half.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Report the requests whose asynchronous load is over (saves hold no blocks).

        A load with failed blocks is reported only after :meth:`get_block_ids_with_load_errors`
        returned them (vLLM 0.32 asks for the finished ones first, in the same step).
        """
        if self._worker is None:
            return None, None
        return None, self._worker.take_finished_loads() or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """Finished background loads (vLLM >= 0.32); with several KV cache groups also the failed ones.

        vLLM takes a hybrid model's failed load only per request (``failed_recving``: it recomputes
        the request from its start); block-level failures (``get_block_ids_with_load_errors``) it
        refuses with several groups. A failed request is also finished (vLLM's contract).
        """
        if self._worker is None:
            return _TransferResults()
        if self._per_request_failures:
            done, failed = self._worker.take_load_results()
            return _TransferResults(finished_recving=done, failed_recving=failed)
        return _TransferResults(finished_recving=self._worker.take_finished_loads())

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks vLLM must recompute (``kv_load_failure_policy="recompute"``).

        Never any with several KV cache groups (vLLM raises on them): those loads all run in the
        background and fail per request (:meth:`get_transfer_results`).
        """
        errors = self.worker_half.take_load_errors()
        if errors and self._per_request_failures:
            log.error("kvfabric: %d failed blocks outside a background load cannot be reported", len(errors))
            self.worker_half.counters.add("internal_error.unreportable_load_errors")
            return set()
        return errors

    def build_connector_worker_meta(self) -> KVFabricWorkerMetadata | None:
        """The step's forward and restore timing, for the scheduler half's cost model."""
        if self._worker is None:
            return None
        fb = self._worker.take_feedback()
        if fb is None:
            return None
        return KVFabricWorkerMetadata(fb.work_tokens, fb.work_attention, fb.forward_s, fb.restores)

    def update_connector_output(self, connector_output: Any) -> None:
        """Feed the workers' step timing (``kv_connector_worker_meta``) to the cost model."""
        if self._scheduler is None:
            return
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, WorkerFeedback):
            self._scheduler.observe(meta)

    def shutdown(self) -> None:
        """Stop background threads and close the transports."""
        self._half.shutdown()
