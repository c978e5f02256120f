"""kvfabric's own step types: what an engine adapter hands the halves, and what the halves exchange.

The two halves of the connector (:mod:`kvfabric.connector.scheduler` and
:mod:`kvfabric.connector.worker`) speak only these plain dataclasses. An engine adapter translates
its own objects into them: :mod:`kvfabric.connector.vllm` for vLLM (the only module that reads
vLLM's field names) and ``kvfabric.refengine.adapter`` for the reference engine. A new vLLM release
or a new engine therefore changes one adapter, never the halves.

Per step the scheduler half turns a :class:`StepInput` into a :class:`StepPlan` (picklable: vLLM
sends it from the scheduler process to every worker), and the worker half executes the plan.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvfabric.connector.keys import RequestInputs


class Role(enum.Enum):
    """Which half of the connector an instance is (mirrors vLLM's ``KVConnectorRole``)."""

    SCHEDULER = 0
    WORKER = 1


@dataclass(frozen=True)
class RequestInfo:
    """What the scheduler half needs to know about a request when it first sees it."""

    req_id: str
    token_ids: tuple[int, ...]
    """The prompt's token ids."""
    inputs: RequestInputs = field(default_factory=RequestInputs)
    """Its other inputs that change KV (multimodal items, salt, prompt embeddings, LoRA adapter)."""


@dataclass(frozen=True)
class ScheduledRequest:
    """One request scheduled in a step."""

    req_id: str
    num_computed_tokens: int
    """Tokens whose KV is in the engine's cache before this step (computed, hit or loaded)."""
    num_scheduled_tokens: int
    """Tokens the engine computes in this step."""
    block_ids: tuple[tuple[int, ...], ...] | tuple[int, ...] | None = None
    """Blocks the engine gave the request in this step, per KV cache group (``None``: none). A flat
    tuple of ints is one group's (an engine with a single group)."""
    replaces_blocks: bool = False
    """True when ``block_ids`` is the request's whole block table (a new or a resumed request);
    False when the blocks are appended to the table it already has."""
    new_token_ids: tuple[int, ...] = ()
    """Token ids of the request beyond those the adapter passed before (vLLM: the tokens it
    generated), so the chunks and tail blocks of generated tokens can be stored too."""
    token_offset: int = 0
    """Position of ``new_token_ids[0]`` in the request's tokens (the prompt first). The half
    appends them only where they continue exactly what it knows."""
    current_block_ids: tuple[tuple[int, ...], ...] | None = None
    """The request's whole block table per group as the engine holds it now (vLLM:
    ``kv_connector_block_state.resolve_block_ids``), when the engine offers it: saves read it in
    preference to the table kept from appended ``block_ids`` (whose sliding-window positions may be
    stale: the engine frees and reuses them without telling)."""

    @property
    def group_block_ids(self) -> tuple[tuple[int, ...], ...] | None:
        """``block_ids`` per group (one group for a flat tuple)."""
        ids: tuple[Any, ...] | None = self.block_ids
        if ids is None:
            return None
        if ids and not isinstance(ids[0], tuple):
            return (tuple(int(b) for b in ids),)
        return tuple(tuple(int(b) for b in g) for g in ids)


@dataclass(frozen=True)
class StepInput:
    """What the engine scheduled in one step."""

    scheduled: tuple[ScheduledRequest, ...] = ()
    finished_req_ids: frozenset[str] = frozenset()
    """Requests that finished since the previous step."""
    state_offloads: dict[str, tuple[tuple[int, int, int], ...]] = field(default_factory=dict)
    """Per request, the recurrent-state checkpoints this step's forward writes: (group, block,
    tokens the state covers) (vLLM: ``kv_connector_block_state.boundary_state_offloads``)."""


@dataclass
class ObjectLayout:
    """Per key of a load or save spec of a hybrid model: the kind's object it is.

    ``block_ids[i]`` of the spec then lists, group after group of the kind, the engine blocks of
    each group (``stored[i] - skips[i]`` per group). An object's body holds, for every layer of its
    kind, ``stored[i]`` blocks.
    """

    kinds: list[int]
    """Index of the object's kind in the group plan."""
    stored: list[int]
    """Blocks per group the object holds."""
    skips: list[int]
    """Leading blocks (per group) of the object not written: the engine holds them already."""
    tokens: list[int]
    """Tokens the object covers (a chunk's, or one tail block's): part of its header."""
    span_chunks: int = 0
    """Load: whole chunks the hit spans (its tokens, for the loaded-token counters)."""
    span_tails: int = 0
    """Load: tail blocks the hit spans after them."""


@dataclass
class LoadSpec:
    """Load the chunks ``keys`` into the blocks ``block_ids[i]`` (skipping ``skip_blocks`` of chunk 0).

    The last ``tail`` keys are tail blocks (:func:`kvfabric.connector.keys.tail_keys`): one block
    each, ``block_ids[i] == [block]``, and they follow every whole chunk of the spec.
    """

    req_id: str
    keys: list[str]
    block_ids: list[list[int]]
    skip_blocks: int = 0
    tiers: list[str] = field(default_factory=list)
    deadline_s: float | None = None
    """How long the load may take (the cost model's expected saving); None: ``load_deadline_ms``."""
    tail: int = 0
    """Trailing keys that are single-block tail blocks, not whole chunks."""
    background: bool = False
    """Load in the background (vLLM's asynchronous load): the request is not in this step, and the
    worker reports it finished (:meth:`~kvfabric.connector.worker.WorkerHalf.take_finished_loads`)
    only once nothing more is written into its blocks."""
    objects: ObjectLayout | None = None
    """Per key, which kind's object it is and how many blocks it holds (hybrid models; ``None``:
    every key is a whole chunk or a tail block of the one full-attention group)."""
    refused: bool = False
    """Planning found the hit inconsistent with the engine's block table (a null block where a
    block must be written, or a real block no object covers): load nothing, report every block
    failed so that the engine recomputes."""

    @property
    def whole(self) -> int:
        """Leading keys that are whole chunks."""
        return len(self.keys) - self.tail


@dataclass
class SaveSpec:
    """Save the chunks ``keys``, held in the blocks ``block_ids[i]``.

    The last ``tail`` keys are single-block tail blocks (``block_ids[i] == [block]``).
    """

    req_id: str
    keys: list[str]
    block_ids: list[list[int]]
    tail: int = 0
    """Trailing keys that are single-block tail blocks, not whole chunks."""
    first_blocks: list[int] = field(default_factory=list)
    """Per key, the position in the request's sequence of its first block (for KV events)."""
    objects: ObjectLayout | None = None
    """Per key, which kind's object it is and how many blocks it holds (hybrid models)."""

    @property
    def whole(self) -> int:
        """Leading keys that are whole chunks."""
        return len(self.keys) - self.tail


@dataclass
class StepPlan:
    """Scheduler -> worker message of one step (picklable)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    work_tokens: int = 0
    """Tokens the engine computes in this step (all its requests): the cost model's regressor."""
    work_attention: float = 0.0
    """``sum t*(s + t/2)`` over the step's requests (``t`` computed after ``s`` of context)."""


@dataclass(frozen=True)
class RestoreTiming:
    """One step's restore on a worker: bytes placed, from which (slowest) tier, and seconds blocked."""

    tier: str
    nbytes: int
    chunks: int
    seconds: float


@dataclass
class WorkerFeedback:
    """Worker -> scheduler message of one step: what the step's work and restores cost (picklable).

    The scheduler half's cost model learns from it (:mod:`kvfabric.connector.costmodel`). With
    several ranks, :meth:`aggregate` keeps the slowest rank's times (the step waits for all).
    """

    work_tokens: int = 0
    work_attention: float = 0.0
    forward_s: float | None = None
    """The step's forward seconds without the connector's restore and save-copy time."""
    restores: list[RestoreTiming] = field(default_factory=list)

    def aggregate(self, other: WorkerFeedback) -> WorkerFeedback:
        """Combine two ranks' feedback of the same step."""
        fwd = [x for x in (self.forward_s, other.forward_s) if x is not None]
        by_tier: dict[tuple[str, int, int], RestoreTiming] = {}
        for r in [*self.restores, *other.restores]:
            k = (r.tier, r.nbytes, r.chunks)
            if k not in by_tier or r.seconds > by_tier[k].seconds:
                by_tier[k] = r
        return WorkerFeedback(
            max(self.work_tokens, other.work_tokens),
            max(self.work_attention, other.work_attention),
            max(fwd) if fwd else None,
            list(by_tier.values()),
        )


ConnectorMetadata = StepPlan
"""The name vLLM's API gives the per-step message (kept for readers coming from vLLM)."""
