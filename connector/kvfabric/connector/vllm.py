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

import logging
from dataclasses import dataclass
from typing import Any

import torch

from kvfabric.connector.keys import NamespaceSpec
from kvfabric.connector.resilient import build_cache
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
from kvfabric.connector.worker import WorkerHalf

log = logging.getLogger(__name__)

try:  # pragma: no cover - depends on the environment
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1 as _VllmBase,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata as _VllmMetadata,
    )

    VLLM_AVAILABLE = True
except ImportError:  # vLLM is not installed (no GPU here): use the stand-ins below.
    VLLM_AVAILABLE = False

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


def request_info_from_vllm(request: Any) -> RequestInfo:
    """Translate vLLM's ``Request`` into what the scheduler half needs."""
    return RequestInfo(str(request.request_id), tuple(request.prompt_token_ids or ()))


def _first_group(block_ids: Any) -> tuple[int, ...] | None:
    # vLLM gives block ids per KV-cache group; the connector uses one group (no hybrid allocator).
    return tuple(block_ids[0]) if block_ids else None


def step_input_from_vllm(scheduler_output: Any) -> StepInput:
    """Translate vLLM's ``SchedulerOutput`` into a :class:`~kvfabric.connector.steps.StepInput`."""
    num_scheduled: dict[str, int] = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    scheduled: list[ScheduledRequest] = []
    for new in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        scheduled.append(
            ScheduledRequest(
                new.req_id,
                int(new.num_computed_tokens),
                int(num_scheduled.get(new.req_id, 0)),
                _first_group(new.block_ids),
                replaces_blocks=True,
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
                    _first_group(cached.new_block_ids[i]),
                    replaces_blocks=req_id in resumed,
                )
            )
    finished = getattr(scheduler_output, "finished_req_ids", None) or ()
    return StepInput(tuple(scheduled), frozenset(finished))


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


def namespace_spec_from_vllm(vllm_config: Any, settings: ConnectorSettings, tp_rank: int) -> NamespaceSpec:
    """Derive the compatibility namespace from vLLM's model, cache and parallel configuration."""
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    kv_dtype = str(getattr(cache, "cache_dtype", "auto"))
    if kv_dtype == "auto":
        kv_dtype = str(model.dtype).removeprefix("torch.")
    block_size = int(cache.block_size)
    chunk = settings.chunk_tokens
    if chunk % block_size:
        chunk = -(-chunk // block_size) * block_size
        log.warning(
            "chunk_tokens %d is not a multiple of block_size %d; using %d",
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
    )


class KVFabricConnector(_VllmBase):  # type: ignore[misc]
    """kvfabric as a vLLM KV connector: prefix chunks from the node's cache server, stored back async."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        """Construct one half (vLLM builds one per role); reads settings from env + extra config."""
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = getattr(vllm_config, "kv_transfer_config", None)
        extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
        settings = ConnectorSettings.load(extra)
        our_role = _role_of(role)
        rank = _tp_rank() if our_role is Role.WORKER else 0
        spec = namespace_spec_from_vllm(vllm_config, settings, rank)
        if spec.chunk_tokens != settings.chunk_tokens:
            settings = settings.model_copy(update={"chunk_tokens": spec.chunk_tokens})
        rank0 = namespace_spec_from_vllm(vllm_config, settings, 0)
        self.settings = settings
        cache = build_cache(settings)
        self._scheduler: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        self._half: SchedulerHalf | WorkerHalf
        if our_role is Role.SCHEDULER:
            self._half = self._scheduler = SchedulerHalf(settings, rank0, cache=cache)
        else:
            self._half = self._worker = WorkerHalf(settings, spec, cache=cache)
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

    # ---------------- scheduler side ----------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Return external prefix tokens available beyond ``num_computed_tokens`` (synchronous load)."""
        if getattr(request, "lora_request", None) is not None:
            return 0, False  # LoRA adapters are not part of the namespace yet: never share their KV
        info = request_info_from_vllm(request)
        return self.scheduler_half.num_new_matched_tokens(info, num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Remember the blocks the hit must fill."""
        ids = _first_group(blocks.get_block_ids()) if blocks is not None else None
        self.scheduler_half.update_state_after_alloc(
            request_info_from_vllm(request), ids, num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVFabricMetadata:
        """Build this step's load/save specs."""
        half = self.scheduler_half
        if half.cache is None:
            return KVFabricMetadata()
        plan = half.build_plan(step_input_from_vllm(scheduler_output))
        return KVFabricMetadata(loads=plan.loads, saves=plan.saves)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Free blocks at once: saves copied them out during the step."""
        self.scheduler_half.request_finished(str(request.request_id))
        return False, None

    # ---------------- worker side ----------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Remember the per-layer KV tensors."""
        self.worker_half.register_kv_caches(kv_caches)

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
        """Report nothing pending (loads are synchronous, saves hold no blocks)."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks vLLM must recompute (``kv_load_failure_policy="recompute"``)."""
        return self.worker_half.take_load_errors()

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
