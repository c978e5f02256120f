"""The scheduler half of the connector: which prefix chunks to load, which finished chunks to save.

Engine-agnostic: it reads only :mod:`kvfabric.connector.steps` types. Per request:

1. :meth:`SchedulerHalf.num_new_matched_tokens` hashes the prompt's whole chunks and asks the cache
   for the longest stored prefix; it reports whole chunks only, never the whole prompt, and nothing
   below ``min_hit_tokens``. With ``cost_model`` on, it reports only the leading chunks whose
   restore is expected to beat recomputing them (:mod:`kvfabric.connector.costmodel`, fed by the
   workers' :class:`~kvfabric.connector.steps.WorkerFeedback` through :meth:`SchedulerHalf.observe`),
   and the lookup's deadline is a fraction of the prompt's expected prefill time
   (``lookup_deadline_ms`` is the ceiling).
2. :meth:`SchedulerHalf.update_state_after_alloc` remembers which blocks the hit must fill.
3. :meth:`SchedulerHalf.build_plan` turns that into load specs, and every chunk the step completes
   and the cache lacks into save specs (a :class:`~kvfabric.connector.steps.StepPlan`).

The only I/O is the lookup, through the resilient cache (never raises, bounded by its deadline).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvfabric.connector import keys as keyslib
from kvfabric.connector import layout
from kvfabric.connector.costmodel import CostModel, PrefillSample, RestoreSample
from kvfabric.connector.resilient import Counters, LookupOutcome, Reason, ResilientCache
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.connector.steps import (
    LoadSpec,
    RequestInfo,
    Role,
    SaveSpec,
    ScheduledRequest,
    StepInput,
    StepPlan,
    WorkerFeedback,
)

log = logging.getLogger(__name__)

# Order used to name the "source tier" of a hit: the slowest tier involved bounds its speed.
TIER_ORDER = {"dram": 0, "local_disk": 1, "shared": 2, "object": 3}


def slowest_tier(tiers: Sequence[str]) -> str | None:
    """Return the slowest of ``tiers`` (``None`` for none)."""
    return max(tiers, key=lambda t: TIER_ORDER.get(t, 4)) if tiers else None


@dataclass
class _ReqState:
    token_ids: list[int]
    keys: list[str]
    inputs: keyslib.RequestInputs = field(default_factory=keyslib.RequestInputs)
    prompt_len: int = 0
    tokens_frozen: bool = False  # new token ids that did not continue the known ones: stop extending
    hit_tokens: int = 0
    matched_chunks: int = 0
    tiers: list[str] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    saved_chunks: int = 0
    pending_load: tuple[int, int] | None = None  # token range [start, end) to load
    progress: int = 0  # tokens computed as of the last step
    last_reason: Reason | None = None
    load_deadline_s: float | None = None  # from the cost model: no longer than the expected saving
    # No lost tail: the tail blocks found behind the matched whole chunks (of chunk tail_chunk) and
    # the tail blocks of the request's partial last chunk (saved_tail_chunk) saved so far.
    tail_chunk: int = -1
    matched_tail: int = 0
    tail_tiers: list[str] = field(default_factory=list)
    saved_tail_chunk: int = -1
    saved_tail: int = 0
    tail_keys: dict[int, list[str]] = field(default_factory=dict)
    # Keys the last lookup found absent (chunks past the matched ones, tail blocks past the found
    # tail): what KV events withdraw. Empty when the lookup failed (absence unknown).
    absent: list[str] = field(default_factory=list)
    background: bool = False  # the engine waits for this request's load (asynchronous load)
    had_background: bool = False  # it already had one (a retry loads synchronously)


def keyed_spec(spec: keyslib.NamespaceSpec, settings: ConnectorSettings) -> keyslib.NamespaceSpec:
    """Return ``spec`` naming the payload key: its fingerprint and its scope.

    The fingerprint is ``layout.key_id`` (keyed: nobody without the key computes it, and it gives
    nothing of the key away); with the scope, each consumer namespace of a pool has namespaces of
    its own.
    """
    key = settings.key
    return dataclasses.replace(spec, payload_key_id=layout.key_id(key.mac_key), key_scope=key.scope)


def usable_cache(
    cache: ResilientCache | None, settings: ConnectorSettings, counters: Counters
) -> ResilientCache | None:
    """Return ``cache``, or None (closed) when the configured payload key is unusable.

    Every request then recomputes: nothing is sealed or trusted under a key another consumer could
    have (a key file that failed never means the public key).
    """
    if settings.key.usable:
        return cache
    counters.add("payload_key_unusable")
    if cache is not None:
        cache.close()
    return None


class SchedulerHalf:
    """Plans each step's loads and saves from lookups in the cache (one instance per scheduler)."""

    role = Role.SCHEDULER

    def __init__(
        self,
        settings: ConnectorSettings,
        spec: keyslib.NamespaceSpec,
        *,
        cache: ResilientCache | None = None,
    ) -> None:
        """Create the half for the namespace ``spec`` (the namespace of TP rank 0).

        A worker rank that lacks a chunk found here reports a load error for it and the engine
        recomputes.
        """
        if spec.chunk_tokens != settings.chunk_tokens:
            raise ValueError("spec.chunk_tokens must equal settings.chunk_tokens")
        self.settings = settings
        spec = keyed_spec(spec, settings)
        self.spec = spec
        self.namespace = spec.digest()
        self.key_chain = keyslib.chain_namespace(self.namespace, settings.key.chain_key)
        """What the chunk keys chain from (``keys.chain_namespace``): keyed for a scope key."""
        self.chunk_tokens = spec.chunk_tokens
        self.block_size = spec.block_size
        self.counters = cache.counters if cache is not None else Counters()
        self.cache = usable_cache(cache, settings, self.counters)
        if self.cache is not None:
            # The server exports what the namespace stands for (pool status: namespaces in use).
            self.cache.describe(self.namespace, spec.canonical().decode())
        self._reqs: dict[str, _ReqState] = {}
        self.costs: CostModel | None = (
            CostModel(chunk_tokens=self.chunk_tokens) if settings.cost_model else None
        )

    def chunk_keys(self, request: RequestInfo) -> list[str]:
        """Return the chained keys of ``request``'s whole chunks under this namespace."""
        return keyslib.chunk_keys(self.key_chain, request.token_ids, self.chunk_tokens, inputs=request.inputs)

    def _state(self, request: RequestInfo) -> _ReqState:
        st = self._reqs.get(request.req_id)
        if st is None:
            st = _ReqState(
                list(request.token_ids), self.chunk_keys(request), request.inputs, len(request.token_ids)
            )
            self._reqs[request.req_id] = st
        return st

    def _tail_keys(self, st: _ReqState, chunk: int) -> list[str]:
        """The tail-block keys of chunk ``chunk`` of the request (as many as its tokens cover)."""
        keys = st.tail_keys.get(chunk)
        if keys is None:
            keys = keyslib.tail_keys(
                self.key_chain,
                st.token_ids,
                self.chunk_tokens,
                self.block_size,
                chunk=chunk,
                parent=st.keys[chunk - 1] if chunk > 0 else None,
                inputs=st.inputs,
            )
            st.tail_keys[chunk] = keys
        return keys

    def num_new_matched_tokens(self, request: RequestInfo, num_computed_tokens: int) -> int:
        """Return the tokens the cache can add beyond ``num_computed_tokens``.

        Whole chunks, then (``tail`` on) the longest stored tail of the next chunk, in whole blocks.

        Never raises: any failure is "no hit" (the engine recomputes).
        """
        try:
            return self._num_new_matched_tokens(request, num_computed_tokens)
        except Exception:
            log.exception("lookup for request %s failed", request.req_id)
            self.counters.add("internal_error.lookup")
            st = self._reqs.get(request.req_id)
            if st is not None:
                st.hit_tokens, st.matched_chunks, st.pending_load = 0, 0, None
                st.matched_tail, st.tail_chunk = 0, -1
            return 0

    def _num_new_matched_tokens(self, request: RequestInfo, num_computed_tokens: int) -> int:
        if self.cache is None:
            return 0
        st = self._state(request)
        n = len(st.token_ids)
        loadable = keyslib.num_loadable_chunks(n, self.chunk_tokens)
        # At least one prompt token is always computed; a hit ends on a block boundary.
        ceiling_tokens = ((n - 1) // self.block_size) * self.block_size if n > 0 else 0
        if not self.settings.tail:
            ceiling_tokens = loadable * self.chunk_tokens
        st.matched_tail, st.tail_chunk, st.tail_tiers, st.absent = 0, -1, [], []
        if ceiling_tokens == 0 or ceiling_tokens <= num_computed_tokens:
            st.hit_tokens, st.matched_chunks = 0, 0
            return 0
        ceiling = self.settings.lookup_deadline_ms / 1000
        deadline = self.costs.lookup_deadline(n, ceiling) if self.costs else ceiling
        started = time.monotonic()
        if loadable:
            outcome = self.cache.lookup(self.namespace, st.keys[:loadable], deadline)
        else:
            outcome = LookupOutcome(0, [], Reason.NOT_FOUND)
        st.matched_chunks, st.tiers, st.last_reason = outcome.matched, outcome.tiers, outcome.reason
        st.absent = st.keys[outcome.matched : loadable] if outcome.reason in (None, Reason.NOT_FOUND) else []
        if self.costs is not None and outcome.reason is None and outcome.matched:
            plan = self.costs.plan(outcome.tiers[: outcome.matched], computed=num_computed_tokens)
            if plan.chunks < outcome.matched:
                skipped = outcome.matched - plan.chunks
                st.matched_chunks = plan.chunks
                if not plan.chunks:
                    st.last_reason = Reason.RECOMPUTE_FASTER
                    self.counters.miss(Reason.RECOMPUTE_FASTER, skipped)
                else:
                    self.counters.add(f"miss_chunks.{Reason.RECOMPUTE_FASTER.value}", skipped)
            if plan.explore:
                self.counters.add("cost_model_explore")
            st.load_deadline_s = (
                self.costs.load_deadline(plan, self.settings.load_deadline_ms / 1000) if plan.chunks else None
            )
        # With the cost model a tail is probed only behind a kept chunk: a tail-only hit is short,
        # and the model has no say on it.
        if (
            self.settings.tail
            and st.matched_chunks == outcome.matched
            and (self.costs is None or st.matched_chunks > 0)
        ):
            self._lookup_tail(st, outcome, deadline - (time.monotonic() - started))
        hit = st.matched_chunks * self.chunk_tokens + st.matched_tail * self.block_size
        if st.last_reason is not None and st.last_reason is not Reason.RECOMPUTE_FASTER:
            self.counters.miss(st.last_reason, loadable)
        elif st.last_reason is Reason.RECOMPUTE_FASTER:
            pass
        elif hit < self.settings.min_hit_tokens:
            self.counters.add("miss.below_min_hit_tokens")
            hit = 0
        st.hit_tokens = hit
        self.counters.add("lookups")
        if hit <= num_computed_tokens:
            return 0
        self.counters.add("hit_tokens", hit - num_computed_tokens)
        if st.matched_tail:
            self.counters.add("tail_hit_blocks", st.matched_tail)
        return hit - num_computed_tokens

    def _lookup_tail(self, st: _ReqState, outcome: LookupOutcome, budget_s: float) -> None:
        """Find the longest stored tail of the chunk after the matched whole chunks (one lookup).

        Only where the whole-chunk lookup worked (found all it could, or stopped at a missing
        chunk) and the cost model kept every chunk it found: a tail is usable only behind a prefix
        that is in the engine's cache. A failed tail lookup costs the tail, never the whole hit.
        """
        if outcome.reason not in (None, Reason.NOT_FOUND):
            return
        m, n = st.matched_chunks, len(st.token_ids)
        room = min(
            self.chunk_tokens // self.block_size - 1, (n - 1 - m * self.chunk_tokens) // self.block_size
        )
        if room <= 0 or budget_s <= 0 or self.cache is None:
            return
        keys = self._tail_keys(st, m)[:room]
        if not keys:
            return
        self.counters.add("tail_lookups")
        tail = self.cache.lookup(self.namespace, keys, budget_s)
        if tail.reason in (None, Reason.NOT_FOUND):
            st.absent += keys[tail.matched :]
        if tail.reason is None and tail.matched:
            st.tail_chunk, st.matched_tail, st.tail_tiers = m, tail.matched, list(tail.tiers)
            if st.last_reason is Reason.NOT_FOUND:
                st.last_reason = None  # the tail is a hit
        elif tail.reason is not None and tail.reason is not Reason.NOT_FOUND:
            self.counters.add(f"tail_lookup_failed.{tail.reason.value}")

    def update_state_after_alloc(
        self, request: RequestInfo, block_ids: Sequence[int] | None, num_external_tokens: int
    ) -> None:
        """Remember the request's blocks and, if ``num_external_tokens`` > 0, the range to load."""
        st = self._state(request)
        if block_ids is not None:
            st.block_ids = list(block_ids)
        if num_external_tokens > 0 and st.hit_tokens > 0:
            st.pending_load = (st.hit_tokens - num_external_tokens, st.hit_tokens)

    def _chunk_blocks(self, st: _ReqState, chunk: int) -> list[int]:
        bpc = self.chunk_tokens // self.block_size
        return st.block_ids[chunk * bpc : (chunk + 1) * bpc]

    def build_plan(self, step: StepInput) -> StepPlan:
        """Turn this step's allocations into load and save specs; resets per-step state.

        May raise: once the engine was told that tokens will be loaded, silently loading nothing
        would be wrong.
        """
        plan = StepPlan()
        if self.cache is None:
            return plan
        progress: dict[str, int] = {}
        scheduled: dict[str, int] = {}
        for s in step.scheduled:
            st = self._reqs.get(s.req_id)
            if st is None:
                continue
            if s.block_ids is not None:
                if s.replaces_blocks:
                    st.block_ids = list(s.block_ids)
                else:
                    st.block_ids.extend(s.block_ids)
            if s.new_token_ids:
                self._extend_tokens(st, s)
            progress[s.req_id] = s.num_computed_tokens
            scheduled[s.req_id] = s.num_scheduled_tokens
        for req_id, computed in progress.items():
            self._plan_request(plan, req_id, self._reqs[req_id], computed, scheduled[req_id])
        # Asynchronous loads: the engine allocated the blocks and waits for them, unscheduled. The
        # spec goes to the worker even when empty: only the worker's report releases the request.
        for req_id, st in self._reqs.items():
            if st.background and st.pending_load is not None and req_id not in progress:
                start, end = st.pending_load
                st.pending_load = None
                spec = self._load_spec(req_id, st, start, end)
                spec.background = True
                plan.loads.append(spec)
                # As if computed: when the engine schedules it with fewer tokens (a failed load),
                # the roll-back below re-saves what it recomputes.
                st.progress = end
        # The step's work, for the cost model: the worker times the forward and sends both back.
        for s in step.scheduled:
            t = s.num_scheduled_tokens
            plan.work_tokens += t
            plan.work_attention += t * (s.num_computed_tokens + t / 2)
        for req_id in step.finished_req_ids:
            self._reqs.pop(req_id, None)
        return plan

    def _extend_tokens(self, st: _ReqState, s: ScheduledRequest) -> None:
        """Append the tokens the engine generated (only where they continue the known ones)."""
        if st.tokens_frozen:
            return
        if s.token_offset != len(st.token_ids) or not self.settings.tail:
            # Not a continuation (or generated tokens are not stored): never guess which tokens
            # a position holds; this request stores nothing past what it knows.
            st.tokens_frozen = s.token_offset != len(st.token_ids)
            return
        before = len(st.token_ids)
        st.token_ids.extend(s.new_token_ids)
        st.keys = keyslib.extend_chunk_keys(
            self.key_chain, st.token_ids, self.chunk_tokens, st.keys, inputs=st.inputs
        )
        # Tail keys computed while the partial chunk had fewer tokens cover fewer blocks.
        st.tail_keys.pop(before // self.chunk_tokens, None)

    def _plan_request(
        self, plan: StepPlan, req_id: str, st: _ReqState, computed: int, scheduled: int
    ) -> None:
        bpc = self.chunk_tokens // self.block_size
        n = len(st.token_ids)
        if computed < st.progress:
            # The engine rolled the request back (a failed load, preemption): chunks past the
            # new position were never stored intact, so they must be saved again.
            st.saved_chunks = min(st.saved_chunks, computed // self.chunk_tokens)
            st.matched_chunks = min(st.matched_chunks, computed // self.chunk_tokens)
            st.saved_tail = min(st.saved_tail, self._blocks_in_chunk(computed, st.saved_tail_chunk))
            if st.tail_chunk >= 0:
                st.matched_tail = min(st.matched_tail, self._blocks_in_chunk(computed, st.tail_chunk))
        if st.pending_load is not None:
            start, end = st.pending_load
            st.pending_load = None
            spec = self._load_spec(req_id, st, start, end)
            if spec.keys:
                plan.loads.append(spec)
        done = min(computed + scheduled, n)
        complete = keyslib.num_whole_chunks(done, self.chunk_tokens)
        begin = max(st.saved_chunks, st.matched_chunks)
        todo = [c for c in range(begin, complete) if len(self._chunk_blocks(st, c)) == bpc]
        keys = [st.keys[c] for c in todo]
        blocks = [self._chunk_blocks(st, c) for c in todo]
        firsts = [c * bpc for c in todo]
        tail: list[int] = []
        if self.settings.tail and done >= st.prompt_len:
            # From the step that completes the prompt on: the partial last chunk, cut to whole
            # blocks, is stored as tail blocks (each once, those the cache did not already give
            # us), in the step that computes them, while the engine holds the blocks. During
            # decoding each block of generated tokens is stored as it fills (the request may end
            # at any step); when its chunk is whole, the chunk is stored whole as well.
            q = done // self.chunk_tokens
            if st.saved_tail_chunk != q:
                st.saved_tail_chunk, st.saved_tail = q, 0
            have = self._blocks_in_chunk(done, q)
            begin_t = max(st.saved_tail, st.matched_tail if st.tail_chunk == q else 0)
            first_block = q * bpc
            tail = [j for j in range(begin_t, have) if first_block + j < len(st.block_ids)]
            if tail:
                tkeys = self._tail_keys(st, q)
                keys += [tkeys[j] for j in tail]
                blocks += [[st.block_ids[first_block + j]] for j in tail]
                firsts += [first_block + j for j in tail]
                self.counters.add("tail_saved_blocks", len(tail))
            st.saved_tail = max(st.saved_tail, have)
        if keys:
            plan.saves.append(SaveSpec(req_id, keys, blocks, tail=len(tail), first_blocks=firsts))
        st.saved_chunks = max(st.saved_chunks, complete)
        st.progress = done

    def _blocks_in_chunk(self, tokens: int, chunk: int) -> int:
        """Whole blocks of chunk ``chunk`` inside the first ``tokens`` tokens."""
        return max(0, tokens - chunk * self.chunk_tokens) // self.block_size

    def _load_spec(self, req_id: str, st: _ReqState, start: int, end: int) -> LoadSpec:
        """The keys and destination blocks of the hit's token range ``[start, end)``.

        Whole chunks first (the first one may be partly in the engine's own prefix cache already:
        ``skip_blocks``), then the tail blocks behind them; ``start`` is on a block boundary.
        """
        whole_end = min(end, st.matched_chunks * self.chunk_tokens)
        keys: list[str] = []
        blocks: list[list[int]] = []
        tiers: list[str] = []
        skip = 0
        if start < whole_end:
            first, last = start // self.chunk_tokens, whole_end // self.chunk_tokens
            skip = (start - first * self.chunk_tokens) // self.block_size
            blocks = [self._chunk_blocks(st, c) for c in range(first, last)]
            if blocks:
                blocks[0] = blocks[0][skip:]
            keys, tiers = st.keys[first:last], st.tiers[first:last]
        tail = 0
        if st.matched_tail and st.tail_chunk == st.matched_chunks and end > whole_end:
            base = st.tail_chunk * self.chunk_tokens
            t_first = max(0, start - base) // self.block_size
            t_last = min(st.matched_tail, (end - base) // self.block_size)
            tkeys = self._tail_keys(st, st.tail_chunk)
            first_block = st.tail_chunk * (self.chunk_tokens // self.block_size)
            for j in range(t_first, t_last):
                keys.append(tkeys[j])
                blocks.append([st.block_ids[first_block + j]])
                tiers.append(st.tail_tiers[j] if j < len(st.tail_tiers) else "")
                tail += 1
        return LoadSpec(req_id, keys, blocks, skip, tiers, st.load_deadline_s, tail=tail)

    def observe(self, feedback: WorkerFeedback | None) -> None:
        """Learn from one step's worker feedback (vLLM: ``update_connector_output``)."""
        if feedback is None or self.costs is None:
            return
        if feedback.forward_s is not None and feedback.work_tokens > 0:
            self.costs.observe_prefill(
                PrefillSample(feedback.work_tokens, feedback.work_attention, feedback.forward_s)
            )
        for r in feedback.restores:
            self.costs.observe_restore(RestoreSample(r.tier, r.nbytes, r.seconds), r.chunks)

    def request_finished(self, req_id: str) -> None:
        """Forget the request. Saves copy blocks out during the step, so blocks can be freed now."""
        self._reqs.pop(req_id, None)

    def load_in_background(self, req_id: str, wanted: bool = True) -> bool:
        """Decide whether the engine loads this request's hit asynchronously (it waits, unscheduled).

        At most once per request: a load that fails from its first block sends the request back to
        the engine's lookup, and a second asynchronous load of a chunk that keeps failing (another
        pool's key, a disabled worker) would loop; the retry loads synchronously, and a failed
        synchronous load is recomputed in the same step.
        """
        st = self._reqs.get(req_id)
        if st is None:
            return False
        st.background = wanted and not st.had_background
        st.had_background |= st.background
        return st.background

    def absent_keys(self, req_id: str) -> list[str]:
        """Keys the request's last lookup found absent (none known if it failed or never ran)."""
        st = self._reqs.get(req_id)
        return list(st.absent) if st is not None else []

    def hit_tier(self, req_id: str) -> str | None:
        """Return the slowest tier among the request's hit chunks (``None`` without a hit)."""
        st = self._reqs.get(req_id)
        if st is None or not st.hit_tokens:
            return None
        return slowest_tier(st.tiers[: st.matched_chunks] + st.tail_tiers[: st.matched_tail])

    def lookup_reason(self, req_id: str) -> Reason | None:
        """Return why the last lookup for the request found nothing (``None`` after a hit)."""
        st = self._reqs.get(req_id)
        return st.last_reason if st is not None else None

    def shutdown(self) -> None:
        """Close the cache (the worker half closes its own)."""
        if self.cache is not None:
            self.cache.close()
