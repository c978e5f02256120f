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
from typing import Any

from kvfabric.connector import hybridplan as hp
from kvfabric.connector import keys as keyslib
from kvfabric.connector import layout, stagetimes
from kvfabric.connector.costmodel import CostModel, PrefillSample, RestoreSample
from kvfabric.connector.groups import GroupPlan, KindType, cdiv, kind_key
from kvfabric.connector.resilient import Counters, LookupOutcome, Reason, ResilientCache
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.connector.steps import (
    LoadSpec,
    ObjectLayout,
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


def _raw_keys(st: _ReqState) -> bytes:
    """The request's chunk keys as digests: decoded once (a waiting request is looked up every step)."""
    if len(st.raw) != 32 * len(st.keys):
        st.raw = bytes.fromhex("".join(st.keys))
    return st.raw


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
    # Hybrid models: the block table per KV cache group (groups[0] is block_ids), the tokens up to
    # which objects were planned, and the tier of each object the hit reads.
    groups: list[list[int]] = field(default_factory=list)
    planned_to: int = 0
    key_tiers: dict[str, str] = field(default_factory=dict)
    raw: bytes = b""  # the keys' digests, concatenated (decoded once per request: _raw_keys)


def per_group(block_ids: Sequence[Sequence[int]] | Sequence[int] | None) -> list[list[int]] | None:
    """Block ids per KV cache group; a flat sequence of ints is one group's."""
    if block_ids is None:
        return None
    ids: list[Any] = list(block_ids)
    if ids and not isinstance(ids[0], (list, tuple)):
        return [[int(b) for b in ids]]
    return [[int(b) for b in g] for g in ids]


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
        plan: GroupPlan | None = None,
    ) -> None:
        """Create the half for the namespace ``spec`` (the namespace of TP rank 0).

        A worker rank that lacks a chunk found here reports a load error for it and the engine
        recomputes. ``plan``: the model's KV cache groups; a hybrid or sliding-window plan stores
        one object per kind (:mod:`kvfabric.connector.hybridplan`), a plain one (or none) whole
        chunks of its one group.
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
        self.plan: GroupPlan | None = plan if plan is not None and not plan.plain else None
        """The group plan of a hybrid or sliding-window model (None: one full-attention group)."""
        if self.plan is not None and self.plan.scheduler_block != self.block_size:
            raise ValueError(
                f"spec.block_size {self.block_size} is not the plan's scheduler block "
                f"{self.plan.scheduler_block}"
            )
        self.counters = cache.counters if cache is not None else Counters()
        self.cache = usable_cache(cache, settings, self.counters)
        if self.cache is not None:
            # The server exports what the namespace stands for (pool status: namespaces in use).
            self.cache.describe(self.namespace, spec.canonical().decode(), lookups=True)
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
            with stagetimes.stage("lookup"):
                hit = self._num_new_matched_tokens(request, num_computed_tokens)
            # The scheduler may live in another process than the worker: its line is its own.
            stagetimes.flush("lookup")
            return hit
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
        if self.plan is not None:
            return self._hybrid_lookup(st, num_computed_tokens, ceiling_tokens)
        ceiling = self.settings.lookup_deadline_ms / 1000
        deadline = self.costs.lookup_deadline(n, ceiling) if self.costs else ceiling
        started = time.monotonic()
        if loadable:
            outcome = self.cache.lookup(
                self.namespace, st.keys[:loadable], deadline, raw=_raw_keys(st)[: 32 * loadable]
            )
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
        if self.settings.tail and st.matched_chunks == outcome.matched:
            self._lookup_tail(st, outcome, deadline - (time.monotonic() - started))
            if self.costs is not None and st.matched_tail:
                self._weigh_tail(st, num_computed_tokens)
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

    # ------------------------------------------------------------ hybrid models

    def _set_groups(self, st: _ReqState, groups: list[list[int]]) -> None:
        st.groups = groups
        st.block_ids = groups[0] if groups else []

    def _extend_groups(self, st: _ReqState, groups: list[list[int]]) -> None:
        """Append a step's newly allocated blocks to each group's table."""
        tables = st.groups + [[] for _ in range(len(groups) - len(st.groups))]
        for table, new in zip(tables, groups, strict=False):
            table.extend(new)
        self._set_groups(st, tables)

    def _span_key(self, st: _ReqState, span: hp.Span) -> str:
        """The chunk key (whole chunk) or tail key (tail block) of ``span``."""
        if span.tail == 0:
            return st.keys[span.chunk]
        return self._tail_keys(st, span.chunk)[span.tail - 1]

    def _object_key(self, st: _ReqState, span: hp.Span, kind: int) -> str:
        assert self.plan is not None
        return kind_key(self._span_key(st, span), kind, self.plan)

    def _needed_keys(self, st: _ReqState, hit: int, local: int) -> list[str]:
        assert self.plan is not None
        needs = hp.needed_objects(self.plan, hit, local, self.chunk_tokens, self.block_size)
        return [self._object_key(st, n.span, n.kind) for n in needs]

    def _hybrid_lookup(self, st: _ReqState, local: int, ceiling_tokens: int) -> int:
        """The deepest boundary every kind can restore (hybrid models); see :mod:`hybridplan`.

        Candidates are tried largest first; the keys a candidate needs that are not known yet are
        asked in one lookup (prefix semantics: the first absent key is learnt absent too), so an
        all-present hit costs one lookup and each further one rules a key out.
        """
        assert self.cache is not None
        c, s = self.chunk_tokens, self.block_size
        cands = hp.candidates(local, ceiling_tokens, c, s, tails=self.settings.tail)
        ceiling = self.settings.lookup_deadline_ms / 1000
        deadline = time.monotonic() + (
            self.costs.lookup_deadline(len(st.token_ids), ceiling) if self.costs else ceiling
        )
        present: dict[str, bool] = {}
        tiers: dict[str, str] = {}
        reason: Reason | None = None
        missing_chunk: int | None = None  # a whole full-attention chunk known absent
        hit, hit_keys = 0, []
        asked = False
        for h in cands:
            if missing_chunk is not None and h // c > missing_chunk:
                continue
            keys = self._needed_keys(st, h, local)
            if any(present.get(k) is False for k in keys):
                continue
            unknown = list(dict.fromkeys(k for k in keys if k not in present))
            if unknown:
                budget = deadline - time.monotonic()
                if budget <= 0:
                    reason = Reason.TIMEOUT
                    break
                out = self.cache.lookup(self.namespace, unknown, budget)
                asked = True
                if out.reason not in (None, Reason.NOT_FOUND):
                    reason = out.reason
                    break
                for i, k in enumerate(unknown[: out.matched]):
                    present[k] = True
                    tiers[k] = out.tiers[i] if i < len(out.tiers) else ""
                if out.matched < len(unknown):
                    absent = unknown[out.matched]
                    present[absent] = False
                    missing_chunk = self._absent_full_chunk(st, h, local, absent, missing_chunk)
                    continue
            hit, hit_keys = h, keys
            break
        declined = False
        if hit and self.costs is not None and reason is None:
            hit, hit_keys = self._cost_cap(st, local, hit, hit_keys, present=present, tiers=tiers)
            declined = hit == 0
        st.key_tiers = {k: tiers.get(k, "") for k in hit_keys}
        # What KV events withdraw: the objects the lookups found absent (none known if one failed).
        st.absent = [k for k, here in present.items() if not here] if reason is None else []
        st.last_reason = reason if reason is not None else (None if hit else Reason.NOT_FOUND)
        if declined:
            st.last_reason = Reason.RECOMPUTE_FASTER  # (counted by the cost cap)
        st.matched_chunks, st.tail_chunk = hit // c, hit // c
        st.matched_tail = (hit % c) // s
        if asked:
            self.counters.add("lookups")
        if reason is not None:
            self.counters.miss(reason, max(1, ceiling_tokens // c))
            hit = 0
        elif hit and hit < self.settings.min_hit_tokens:
            self.counters.add("miss.below_min_hit_tokens")
            hit = 0
        elif st.last_reason is Reason.NOT_FOUND:
            self.counters.miss(Reason.NOT_FOUND, max(1, ceiling_tokens // c))
        st.hit_tokens = hit
        if hit <= local:
            st.hit_tokens = 0
            return 0
        self.counters.add("hit_tokens", hit - local)
        return hit - local

    def _absent_full_chunk(
        self, st: _ReqState, hit: int, local: int, key: str, known: int | None
    ) -> int | None:
        """If ``key`` is a full-attention kind's whole chunk, its index: no later boundary can hold."""
        assert self.plan is not None
        for need in hp.needed_objects(self.plan, hit, local, self.chunk_tokens, self.block_size):
            full = need.span.tail == 0 and self.plan.kinds[need.kind].type is KindType.FULL
            if full and self._object_key(st, need.span, need.kind) == key:
                return need.span.chunk if known is None else min(known, need.span.chunk)
        return known

    def _cost_cap(
        self,
        st: _ReqState,
        local: int,
        hit: int,
        keys: list[str],
        *,
        present: dict[str, bool],
        tiers: dict[str, str],
    ) -> tuple[int, list[str]]:
        """Shorten a hybrid hit to what the cost model expects to be worth loading (whole chunks)."""
        assert self.costs is not None
        c = self.chunk_tokens
        slowest = slowest_tier([tiers.get(k, "") for k in keys]) or "dram"
        plan = self.costs.plan([slowest] * (hit // c), computed=local)
        if plan.explore:
            self.counters.add("cost_model_explore")
        if plan.chunks >= hit // c:
            st.load_deadline_s = self.costs.load_deadline(plan, self.settings.load_deadline_ms / 1000)
            return hit, keys
        cap = plan.chunks * c
        for h in hp.candidates(local, cap, c, self.block_size, tails=False):
            kept = self._needed_keys(st, h, local)
            if all(present.get(k, False) for k in kept):
                self.counters.add(f"miss_chunks.{Reason.RECOMPUTE_FASTER.value}", (hit - h) // c)
                st.load_deadline_s = self.costs.load_deadline(plan, self.settings.load_deadline_ms / 1000)
                return h, kept
        self.counters.miss(Reason.RECOMPUTE_FASTER, max(1, (hit - local) // c))
        return 0, []

    def _any_load_spec(self, req_id: str, st: _ReqState, start: int, end: int) -> LoadSpec:
        if self.plan is not None:
            return self._hybrid_load_spec(req_id, st, start, end)
        return self._load_spec(req_id, st, start, end)

    def _hybrid_load_spec(self, req_id: str, st: _ReqState, start: int, end: int) -> LoadSpec:
        """The objects of the hit ``[start, end)`` and the blocks they write (never block 0).

        A hit the block tables contradict loads nothing: every block of it is reported failed
        (``null_block_writes_refused``) and the engine recomputes.
        """
        assert self.plan is not None
        c, s = self.chunk_tokens, self.block_size
        loads, why = hp.load_objects(self.plan, end, start, c, s, tables=st.groups)
        if why is not None:
            log.warning("kvfabric: hit of request %s refused (%s); the engine recomputes", req_id, why)
            self.counters.add("null_block_writes_refused")
            real = sorted(
                {
                    b
                    for kind in self.plan.kinds
                    for g in kind.groups
                    if g < len(st.groups)
                    for b in st.groups[g][start // kind.block_size : cdiv(end, kind.block_size)]
                    if b != hp.NULL_BLOCK
                }
            )
            return LoadSpec(req_id, [], [real], refused=True)
        keys = [self._object_key(st, o.span, o.kind) for o in loads]
        objects = ObjectLayout(
            kinds=[o.kind for o in loads],
            stored=[o.stored for o in loads],
            skips=[o.skip for o in loads],
            tokens=[o.span.end - o.span.start for o in loads],
            span_chunks=(end // c) - (start // c),
            span_tails=(end % c) // s,
        )
        return LoadSpec(
            req_id,
            keys,
            [list(o.block_ids) for o in loads],
            tiers=[st.key_tiers.get(k, "") for k in keys],
            deadline_s=st.load_deadline_s,
            objects=objects,
        )

    def _plan_hybrid(
        self,
        plan: StepPlan,
        req_id: str,
        st: _ReqState,
        computed: int,
        scheduled: int,
        *,
        states: dict[tuple[int, int], int] | None = None,
    ) -> None:
        """Load the pending hit; save every object whose span ends in this step's tokens.

        Only in the step that computes a span's end: the sliding-window and local blocks it reads
        are alive then, and may belong to another request in any later step.
        """
        assert self.plan is not None
        if computed < st.progress:
            st.planned_to = min(st.planned_to, computed)  # rolled back: what it recomputes is saved
        if st.pending_load is not None:
            start, end = st.pending_load
            st.pending_load = None
            spec = self._hybrid_load_spec(req_id, st, start, end)
            if spec.keys or spec.refused:
                plan.loads.append(spec)
        n = len(st.token_ids)
        done = min(computed + scheduled, n)
        lo = max(computed, st.planned_to)
        spans = self._spans_ending_in(st, lo, done)
        if spans:
            saves, dropped = hp.save_objects(self.plan, spans, st.groups, states)
            if dropped:
                self.counters.add("save_null_block_skipped", dropped)
            if saves:
                keys = [self._object_key(st, o.span, o.kind) for o in saves]
                objects = ObjectLayout(
                    kinds=[o.kind for o in saves],
                    stored=[o.stored for o in saves],
                    skips=[0] * len(saves),
                    tokens=[o.span.end - o.span.start for o in saves],
                )
                tails = sum(1 for o in saves if o.span.tail)
                if tails:
                    self.counters.add("tail_saved_blocks", tails)
                plan.saves.append(
                    SaveSpec(
                        req_id,
                        keys,
                        [list(o.block_ids) for o in saves],
                        first_blocks=[o.span.start // self.block_size for o in saves],
                        objects=objects,
                    )
                )
        st.planned_to = max(st.planned_to, done)
        st.progress = done

    def _spans_ending_in(self, st: _ReqState, lo: int, hi: int) -> list[hp.Span]:
        """Spans whose end is in ``(lo, hi]``.

        Whole chunks, and (``tail`` on) the tail blocks of chunks that are not whole in the prompt.
        """
        c, s = self.chunk_tokens, self.block_size
        spans: list[hp.Span] = []
        for chunk in range(lo // c, hi // c + 1):
            start = chunk * c
            if lo < start + c <= hi and chunk < len(st.keys):
                spans.append(hp.Span(chunk, 0, start, start + c))
            if not self.settings.tail or start + c <= st.prompt_len:
                continue
            for j in range(1, c // s):
                end = start + j * s
                if lo < end <= hi and j <= len(self._tail_keys(st, chunk)):
                    spans.append(hp.Span(chunk, j, end - s, end))
        return spans

    def _weigh_tail(self, st: _ReqState, num_computed_tokens: int) -> None:
        """Keep a tail hit only where the cost model expects its restore to beat recomputing it.

        A tail-only hit is short, so its load's fixed cost may exceed the prefill it saves; behind
        loaded chunks only its bytes count. Unmeasured, it is loaded (and so measured).
        """
        assert self.costs is not None
        start = st.matched_chunks * self.chunk_tokens
        slowest = slowest_tier(st.tail_tiers) or "dram"
        worth = self.costs.tail_worth_loading(
            start,
            st.matched_tail * self.block_size,
            slowest,
            alone=st.matched_chunks == 0,
            computed=num_computed_tokens,
        )
        if worth:
            return
        self.counters.add(f"tail_skipped_blocks.{Reason.RECOMPUTE_FASTER.value}", st.matched_tail)
        st.matched_tail, st.tail_chunk, st.tail_tiers = 0, -1, []
        if st.matched_chunks == 0:
            st.last_reason = Reason.RECOMPUTE_FASTER
            self.counters.miss(Reason.RECOMPUTE_FASTER, 1)

    def _lookup_tail(self, st: _ReqState, outcome: LookupOutcome, budget_s: float) -> None:
        """Find the longest stored tail of the chunk after the matched whole chunks (one lookup).

        Only where the whole-chunk lookup worked (found all it could, or stopped at a missing
        chunk) and the cost model kept every chunk it found: a tail is usable only behind a prefix
        that is in the engine's cache. A failed tail lookup costs the tail, never the whole hit.
        With the cost model, :meth:`_weigh_tail` then decides whether the tail is worth its load.
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
        self,
        request: RequestInfo,
        block_ids: Sequence[Sequence[int]] | Sequence[int] | None,
        num_external_tokens: int,
    ) -> None:
        """Remember the request's blocks and, if ``num_external_tokens`` > 0, the range to load.

        ``block_ids``: per KV cache group, or one group's as a flat sequence.
        """
        st = self._state(request)
        groups = per_group(block_ids)
        if groups is not None:
            self._set_groups(st, groups)
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
            groups = per_group(s.group_block_ids)
            if groups is not None:
                if s.replaces_blocks:
                    self._set_groups(st, groups)
                else:
                    self._extend_groups(st, groups)
            if s.current_block_ids is not None and self.plan is not None:
                # The engine's current table: no stale ids at positions it freed and reused.
                self._set_groups(st, [list(g) for g in s.current_block_ids])
            if s.new_token_ids:
                self._extend_tokens(st, s)
            progress[s.req_id] = s.num_computed_tokens
            scheduled[s.req_id] = s.num_scheduled_tokens
        for req_id, computed in progress.items():
            if self.plan is not None:
                states = {(g, t): b for g, b, t in step.state_offloads.get(req_id, ())}
                self._plan_hybrid(
                    plan, req_id, self._reqs[req_id], computed, scheduled[req_id], states=states
                )
            else:
                self._plan_request(plan, req_id, self._reqs[req_id], computed, scheduled[req_id])
        # Asynchronous loads: the engine allocated the blocks and waits for them, unscheduled. The
        # spec goes to the worker even when empty: only the worker's report releases the request.
        for req_id, st in self._reqs.items():
            if st.background and st.pending_load is not None and req_id not in progress:
                start, end = st.pending_load
                st.pending_load = None
                spec = self._any_load_spec(req_id, st, start, end)
                spec.background = True
                st.had_background = True
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

    def drop_hit(self, req_id: str) -> None:
        """Forget the request's hit: it is recomputed.

        A retry after a failed background load of a model whose failures vLLM takes only per
        request (a synchronous retry could not report failing).
        """
        st = self._reqs.get(req_id)
        if st is not None and st.hit_tokens:
            self.counters.add("miss.retry_recomputed")
            st.hit_tokens, st.pending_load = 0, None

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
        # Only a load that was planned counts: vLLM may ask again before it admits the request.
        st.background = wanted and not st.had_background
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
        if self.plan is not None:
            return slowest_tier(list(st.key_tiers.values()))
        return slowest_tier(st.tiers[: st.matched_chunks] + st.tail_tiers[: st.matched_tail])

    def lookup_reason(self, req_id: str) -> Reason | None:
        """Return why the last lookup for the request found nothing (``None`` after a hit)."""
        st = self._reqs.get(req_id)
        return st.last_reason if st is not None else None

    def shutdown(self) -> None:
        """Close the cache (the worker half closes its own)."""
        if self.cache is not None:
            self.cache.close()
