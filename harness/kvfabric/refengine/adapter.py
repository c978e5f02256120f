"""The reference engine's connector adapter: its objects -> kvfabric's step types -> the two halves.

The same pattern as :mod:`kvfabric.connector.vllm` (which does it for vLLM's objects): the engine
calls the KV connector v1 sequence on :class:`SchedulerConnector` and :class:`WorkerConnector`, and
they translate the engine's own request and scheduler-output types into
:mod:`kvfabric.connector.steps` before calling :class:`~kvfabric.connector.scheduler.SchedulerHalf`
and :class:`~kvfabric.connector.worker.WorkerHalf`. Nothing here decides anything.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from kvfabric.connector.keys import RequestInputs
from kvfabric.connector.scheduler import SchedulerHalf
from kvfabric.connector.steps import RequestInfo, ScheduledRequest, StepInput, StepPlan, WorkerFeedback
from kvfabric.connector.worker import WorkerHalf

if TYPE_CHECKING:
    from kvfabric.refengine.engine import KVCacheBlocks, Request, SchedulerOutput


def request_info(request: Request) -> RequestInfo:
    """The scheduler half's view of a reference-engine request (its adapter is in the key chain)."""
    lora = None if request.lora_name is None else ("refengine-lora", request.lora_name)
    return RequestInfo(request.request_id, tuple(request.prompt_token_ids), RequestInputs(lora=lora))


def step_input(so: SchedulerOutput) -> StepInput:
    """Translate the engine's scheduler output (one KV-cache group) into a step input."""
    scheduled = [
        ScheduledRequest(
            new.req_id,
            new.num_computed_tokens,
            so.num_scheduled_tokens.get(new.req_id, 0),
            tuple(new.block_ids[0]) if new.block_ids else None,
            replaces_blocks=True,
        )
        for new in so.scheduled_new_reqs
    ]
    cached = so.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        ids = cached.new_block_ids[i]
        scheduled.append(
            ScheduledRequest(
                req_id,
                cached.num_computed_tokens[i],
                so.num_scheduled_tokens.get(req_id, 0),
                tuple(ids[0]) if ids else None,
                replaces_blocks=req_id in cached.resumed_req_ids,
            )
        )
    return StepInput(tuple(scheduled), frozenset(so.finished_req_ids))


class SchedulerConnector:
    """The scheduler-side calls of the connector API, for the reference engine."""

    def __init__(self, half: SchedulerHalf) -> None:
        """Drive ``half``."""
        self.core = half
        self._known: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """External tokens beyond ``num_computed_tokens``; loads are synchronous."""
        self._known.setdefault(request.request_id, len(request.prompt_token_ids))
        return self.core.num_new_matched_tokens(request_info(request), num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Hand the request's blocks to the half."""
        self.core.update_state_after_alloc(
            request_info(request), blocks.get_block_ids()[0], num_external_tokens
        )

    def build_connector_meta(self, so: SchedulerOutput) -> StepPlan:
        """This step's plan (with the tokens each request generated, as ``vllm.py`` passes them)."""
        step = step_input(so)
        tokens = so.scheduled_cached_reqs.all_token_ids
        scheduled = []
        for sr in step.scheduled:
            ids = tokens.get(sr.req_id)
            known = self._known.get(sr.req_id)
            if ids is not None and known is not None and len(ids) > known:
                self._known[sr.req_id] = len(ids)
                scheduled.append(
                    dataclasses.replace(sr, new_token_ids=tuple(ids[known:]), token_offset=known)
                )
                continue
            scheduled.append(sr)
        return self.core.build_plan(StepInput(tuple(scheduled), step.finished_req_ids))

    def update_connector_output(self, feedback: WorkerFeedback | None) -> None:
        """The workers' report of the step (vLLM: ``KVConnectorOutput``): feeds the cost model."""
        self.core.observe(feedback)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; its blocks may be freed at once."""
        self.core.request_finished(request.request_id)
        self._known.pop(request.request_id, None)
        return False, None

    def shutdown(self) -> None:
        """Close the half."""
        self.core.shutdown()


class WorkerConnector:
    """The worker-side calls of the connector API, for the reference engine."""

    def __init__(self, half: WorkerHalf) -> None:
        """Drive ``half``."""
        self.core = half

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Hand the KV tensors to the half."""
        self.core.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, plan: StepPlan) -> None:
        """This step's plan."""
        self.core.bind_plan(plan)

    def start_load_kv(self, forward_context: object = None) -> None:
        """Start the step's loads."""
        self.core.start_load()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for the step's loads (the first call)."""
        self.core.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: object = None) -> None:
        """Copy the layer's finished chunks out."""
        self.core.save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        """Submit the step's stores."""
        self.core.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Nothing is ever pending."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks to recompute."""
        return self.core.take_load_errors()

    def build_connector_worker_meta(self) -> WorkerFeedback | None:
        """The step's timing for the scheduler's cost model (vLLM: ``KVConnectorWorkerMetadata``)."""
        return self.core.take_feedback()

    def clear_connector_metadata(self) -> None:
        """End of step."""
        self.core.clear_plan()

    def shutdown(self) -> None:
        """Close the half."""
        self.core.shutdown()
