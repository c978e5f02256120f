"""No lost tail: a prompt's partial last chunk is stored as tail blocks and reused by the next round.

Keys (hypothesis): tail keys never collide with chunk keys or with each other across lengths,
tokens, chunks and prefixes. Scheduler: round 2's hit covers round 1's tail blocks; a tail of other
tokens or behind another prefix is never matched, nor more of it than was stored; a whole chunk
stored later supersedes the tail. Worker: a tail load writes exactly the tail's blocks.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.connector.costmodel import PrefillSample, RestoreSample
from kvfabric.connector.keys import NamespaceSpec, RequestInputs, chunk_keys, tail_keys
from kvfabric.connector.resilient import CircuitBreaker, Endpoint, ResilientCache
from kvfabric.connector.scheduler import SchedulerHalf
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.connector.steps import RequestInfo, ScheduledRequest, StepInput, StepPlan
from kvfabric.connector.worker import WorkerHalf
from kvfabric.rpc import kvevents as kv
from kvfabric.testing.memtransport import MemoryTransport

BLOCK, CHUNK = 4, 16
BPC = CHUNK // BLOCK
SPEC = NamespaceSpec("m", "r", "float32", 2, 1, 4, BLOCK, CHUNK)
NS = SPEC.digest()


def _all_keys(tokens: list[int], inputs: RequestInputs | None = None) -> dict[str, tuple[str, int, int]]:
    """Every chunk key and every tail key of ``tokens``: key -> (kind, chunk, length in blocks)."""
    whole = chunk_keys(NS, tokens, CHUNK, inputs=inputs)
    out: dict[str, tuple[str, int, int]] = {}
    for c, k in enumerate(whole):
        assert k not in out
        out[k] = ("chunk", c, BPC)
    for c in range(len(whole) + 1):
        parent = whole[c - 1] if c > 0 else None
        for j, k in enumerate(tail_keys(NS, tokens, CHUNK, BLOCK, chunk=c, parent=parent, inputs=inputs), 1):
            assert k not in out, "a tail key equals another key of the same prompt"
            out[k] = ("tail", c, j)
    return out


@settings(max_examples=200, deadline=None)
@given(
    a=st.lists(st.integers(0, 3), min_size=0, max_size=3 * CHUNK),
    b=st.lists(st.integers(0, 3), min_size=0, max_size=3 * CHUNK),
)
def test_tail_and_chunk_keys_never_collide_across_lengths_and_tokens(a: list[int], b: list[int]) -> None:
    """Two prompts share a key iff it names the same span (kind, chunk, length) of the same tokens.

    Tiny vocabularies make equal prefixes, equal blocks at other positions and tails that are
    prefixes of other tails common; a key may be shared only where the tokens it covers from the
    start of the prompt are equal, and never between a tail and a whole chunk.
    """
    ka, kb = _all_keys(a), _all_keys(b)
    for key, (kind, c, j) in ka.items():
        end = c * CHUNK + j * BLOCK
        assert len(a) >= end
        same_span = len(b) >= end and a[:end] == b[:end]
        # A key is shared exactly when it names the same span of the same leading tokens.
        assert (key in kb) == same_span, (kind, c, j)
        if key in kb:
            assert kb[key] == (kind, c, j), "a tail key equals a chunk key or a tail of another length"


def test_tail_keys_depend_on_inputs_and_namespace() -> None:
    tokens = list(range(CHUNK + 2 * BLOCK))
    plain = tail_keys(NS, tokens, CHUNK, BLOCK, chunk=1, parent=chunk_keys(NS, tokens, CHUNK)[0])
    assert len(plain) == 2
    lora = RequestInputs(lora=("a", "1", "/a"))
    with_lora = tail_keys(
        NS, tokens, CHUNK, BLOCK, chunk=1, parent=chunk_keys(NS, tokens, CHUNK, inputs=lora)[0], inputs=lora
    )
    assert not set(plain) & set(with_lora)
    other_ns = NamespaceSpec("m", "r2", "float32", 2, 1, 4, BLOCK, CHUNK).digest()
    assert tail_keys(NS, tokens[:BLOCK], CHUNK, BLOCK, chunk=0, parent=None) != tail_keys(
        other_ns, tokens[:BLOCK], CHUNK, BLOCK, chunk=0, parent=None
    )
    # A tail is shorter than its chunk: a chunk with all its blocks is cached whole.
    assert len(tail_keys(NS, tokens, CHUNK, BLOCK, chunk=0, parent=None)) == BPC - 1


# ---------------------------------------------------------------------------------------- scheduler


def _half(store: MemoryTransport, *, tail: bool = True, cost_model: bool = False) -> SchedulerHalf:
    cache = ResilientCache([Endpoint("m", lambda: store, CircuitBreaker(100, 60.0))])
    # Generous deadline: a timed-out lookup on a loaded machine is a correct miss these tests do not model.
    cfg = ConnectorSettings(chunk_tokens=CHUNK, tail=tail, lookup_deadline_ms=30000, cost_model=cost_model)
    return SchedulerHalf(cfg, SPEC, cache=cache)


def _run(
    half: SchedulerHalf, store: MemoryTransport, req: RequestInfo, step: int = 1000
) -> tuple[int, StepPlan]:
    """Look up, allocate and prefill ``req`` in steps of ``step``; every save lands in ``store``.

    Returns the hit and the first step's plan.
    """
    n = len(req.token_ids)
    ext = half.num_new_matched_tokens(req, 0)
    table = list(range(100, 100 + -(-n // BLOCK)))
    half.update_state_after_alloc(req, table, ext)
    computed, first, first_plan = ext, True, StepPlan()
    while computed < n:
        k = min(step, n - computed)
        plan = half.build_plan(
            StepInput((ScheduledRequest(req.req_id, computed, k, tuple(table) if first else None, first),))
        )
        if first:
            first_plan = plan
        for spec in plan.saves:
            for key in spec.keys:
                store.blocks[(half.namespace, key)] = b"x"
        computed, first = computed + k, False
    half.request_finished(req.req_id)
    return ext, first_plan


def test_round_two_hit_covers_round_one_tail_blocks() -> None:
    store = MemoryTransport()
    half = _half(store)
    round1 = list(range(1, 2 * CHUNK + 3 * BLOCK + 2))  # 2 chunks + 3 whole blocks + 2 tokens
    assert _run(half, store, RequestInfo("r1", tuple(round1)), step=7)[0] == 0
    assert half.counters.get("tail_saved_blocks") == 3
    round2 = [*round1, 900, 901, *range(50, 80)]
    hit, plan = _run(half, store, RequestInfo("r2", tuple(round2)))
    assert hit == 2 * CHUNK + 3 * BLOCK
    (load,) = plan.loads
    # Two whole chunks into their blocks, then the three tail blocks, each into its one block.
    assert load.whole == 2
    assert load.tail == 3
    table = list(range(100, 100 + -(-len(round2) // BLOCK)))
    assert load.block_ids == [table[0:4], table[4:8], [table[8]], [table[9]], [table[10]]]
    assert half.counters.get("tail_hit_blocks") == 3


def test_without_the_feature_round_two_reuses_whole_chunks_only() -> None:
    store = MemoryTransport()
    half = _half(store, tail=False)
    round1 = list(range(1, 2 * CHUNK + 3 * BLOCK + 2))
    _run(half, store, RequestInfo("r1", tuple(round1)))
    hit, _ = _run(half, store, RequestInfo("r2", (*round1, *range(50, 80))))
    assert hit == 2 * CHUNK
    assert half.counters.get("tail_saved_blocks") == 0


def test_the_same_prompt_again_hits_its_tail_but_keeps_a_token_to_compute() -> None:
    store = MemoryTransport()
    half = _half(store)
    p = tuple(range(1, CHUNK + 2 * BLOCK + 1))  # one chunk and exactly two blocks
    _run(half, store, RequestInfo("a", p))
    # The last token is always computed: the second block cannot be loaded whole.
    assert _run(half, store, RequestInfo("b", p))[0] == CHUNK + BLOCK
    short = tuple(range(1, 2 * BLOCK + 1))  # no whole chunk at all: a tail of chunk 0
    _run(half, store, RequestInfo("c", short))
    assert _run(half, store, RequestInfo("d", (*short, 7)))[0] == 2 * BLOCK


@pytest.mark.parametrize("restore_loses", [False, True])
def test_with_the_cost_model_a_tail_only_hit_is_weighed_not_dropped(restore_loses: bool) -> None:
    # With the cost model on, every tail-only hit used to be dropped unweighed (no whole chunk kept,
    # so the tail was never looked up); now the tail is looked up and weighed like a chunk: loaded
    # unless the model's own costs say its restore loses to recomputing it.
    store = MemoryTransport()
    half = _half(store, cost_model=True)
    assert half.costs is not None
    if restore_loses:
        for start, tokens in ((0, 8), (0, 32), (8, 16)):  # 1 ms per token of prefill
            half.costs.observe_prefill(PrefillSample.single(start, tokens, tokens * 1e-3))
        for chunks in (1, 4):  # and a second per load, whatever its size
            half.costs.observe_restore(RestoreSample("dram", chunks * 4096, 1.0 + chunks * 1e-6), chunks)
    short = tuple(range(1, 2 * BLOCK + 1))  # no whole chunk: a tail of chunk 0
    _run(half, store, RequestInfo("a", short))
    hit, _ = _run(half, store, RequestInfo("b", (*short, 7)))
    if restore_loses:
        assert hit == 0
        assert half.counters.get("tail_skipped_blocks.recompute-faster") == 2
        assert half.counters.get("miss.recompute-faster") == 1
    else:
        assert hit == 2 * BLOCK
        assert half.counters.get("tail_hit_blocks") == 2


@settings(max_examples=60, deadline=None)
@given(
    whole=st.integers(0, 2),
    stored=st.integers(1, BPC - 1),
    differ_at=st.integers(0, BPC * BLOCK),
    extra=st.integers(1, 2 * CHUNK),
)
def test_a_tail_of_other_tokens_or_length_is_never_matched(
    whole: int, stored: int, differ_at: int, extra: int
) -> None:
    """The hit never covers a token the stored tail does not commit to.

    Round 1 stores ``whole`` chunks and a tail of ``stored`` blocks. Round 2 agrees with it up to
    ``differ_at`` tokens into the tail chunk and then differs: the hit is the whole chunks plus the
    tail blocks that lie entirely before the difference, never more than were stored.
    """
    store = MemoryTransport()
    half = _half(store)
    base = list(range(10, 10 + whole * CHUNK + stored * BLOCK))
    _run(half, store, RequestInfo("r1", tuple(base)))
    tail_start = whole * CHUNK
    cut = min(tail_start + differ_at, len(base))
    round2 = [*base[:cut], *(t + 5000 for t in range(extra))]  # token ids round 1 never had
    hit, _ = _run(half, store, RequestInfo("r2", tuple(round2)))
    agree_blocks = (cut - tail_start) // BLOCK
    room = (len(round2) - 1 - tail_start) // BLOCK
    assert hit == tail_start + min(stored, agree_blocks, room) * BLOCK


def test_a_whole_chunk_stored_later_supersedes_the_tail() -> None:
    store = MemoryTransport()
    half = _half(store)
    round1 = tuple(range(1, CHUNK + 2 * BLOCK + 2))
    _run(half, store, RequestInfo("r1", round1))
    round2 = (*round1, *range(500, 500 + CHUNK))  # completes chunk 1: stored whole
    hit2, _ = _run(half, store, RequestInfo("r2", round2))
    assert hit2 == CHUNK + 2 * BLOCK
    round3 = (*round2, *range(900, 905))
    hit3, plan = _run(half, store, RequestInfo("r3", round3))
    assert hit3 >= 2 * CHUNK
    (load,) = plan.loads
    ckeys = chunk_keys(half.namespace, round3, CHUNK)
    # Chunk 1 comes from its whole payload, not from round 1's tail blocks (still stored).
    assert load.keys[:2] == ckeys[:2]
    old_tail = tail_keys(half.namespace, round1, CHUNK, BLOCK, chunk=1, parent=ckeys[0])
    assert all((half.namespace, k) in store.blocks for k in old_tail)
    assert not set(load.keys) & set(old_tail)


def test_a_rolled_back_prompt_saves_its_tail_again() -> None:
    """A failed load or a preemption after the tail was saved: the recomputed tail is saved again."""
    store = MemoryTransport()
    half = _half(store)
    p = tuple(range(1, CHUNK + BLOCK + 2))
    req = RequestInfo("r", p)
    half.num_new_matched_tokens(req, 0)
    table = tuple(range(100, 100 + -(-len(p) // BLOCK)))
    half.update_state_after_alloc(req, table, 0)
    first = half.build_plan(StepInput((ScheduledRequest("r", 0, len(p), table, True),)))
    assert first.saves[0].tail == 1
    # The worker dropped that step's saves (its load failed); the engine recomputes from token 0.
    again = half.build_plan(StepInput((ScheduledRequest("r", 0, len(p), table, True),)))
    assert [(s.keys, s.tail) for s in again.saves] == [(s.keys, s.tail) for s in first.saves]


# ---------------------------------------------------------------------------------------- worker


def test_a_tail_load_writes_exactly_the_tail_blocks() -> None:
    """Save a chunk and a two-block tail, wipe the KV cache, load them into other blocks: the
    destination blocks hold the saved bytes, every other block is untouched."""
    store = MemoryTransport()
    spec = NamespaceSpec("m", "r", "float32", 2, 1, 4, BLOCK, CHUNK)
    cache = ResilientCache([Endpoint("m", lambda: store, CircuitBreaker(100, 60.0))])
    worker = WorkerHalf(ConnectorSettings(chunk_tokens=CHUNK), spec, cache=cache)
    gen = torch.Generator().manual_seed(0)
    kv = {f"l{i}": torch.randn(16, 1, BLOCK, 8, generator=gen) for i in range(2)}
    worker.register_kv_caches(kv)
    sched = _half(MemoryTransport())
    p = tuple(range(1, CHUNK + 2 * BLOCK + 3))
    req = RequestInfo("r", p)
    sched.num_new_matched_tokens(req, 0)
    src = tuple(range(0, 7))
    sched.update_state_after_alloc(req, src, 0)
    plan = sched.build_plan(StepInput((ScheduledRequest("r", 0, len(p), src, True),)))
    assert plan.saves[0].tail == 2
    saved = {name: t.clone() for name, t in kv.items()}
    worker.bind_plan(plan)
    worker.start_load()
    for name, t in kv.items():
        worker.save_kv_layer(name, t)
    worker.wait_for_save()
    assert worker.wait_for_stores(30)
    worker.clear_plan()
    assert len(store.blocks) == 3

    for t in kv.values():
        t.fill_(-1.0)
    sched2 = SchedulerHalf(ConnectorSettings(chunk_tokens=CHUNK, lookup_deadline_ms=30000), SPEC, cache=cache)
    req2 = RequestInfo("r2", (*p, 77))
    assert sched2.num_new_matched_tokens(req2, 0) == CHUNK + 2 * BLOCK
    dst = (8, 9, 10, 11, 12, 13, 14)
    sched2.update_state_after_alloc(req2, dst, CHUNK + 2 * BLOCK)
    plan2 = sched2.build_plan(StepInput((ScheduledRequest("r2", CHUNK + 2 * BLOCK, 4, dst, True),)))
    worker.bind_plan(plan2)
    worker.start_load()
    worker.wait_for_layer_load("l0")
    assert worker.take_load_errors() == set()
    assert worker.counters.get("loaded_tail_blocks") == 2
    for name, t in kv.items():
        # Chunk 0 (blocks 0-3) -> 8-11; tail blocks 4, 5 -> 12, 13.
        assert torch.equal(t[8:14], saved[name][0:6]), name
        untouched = [b for b in range(16) if b not in range(8, 14)]
        assert bool((t[untouched] == -1.0).all()), f"{name}: a load wrote outside its blocks"
    worker.clear_plan()
    worker.shutdown()
    sched2.shutdown()
    sched.shutdown()


def test_stats_count_tail_tokens_at_block_size() -> None:
    from kvfabric.connector.vllmmetrics import stats_payload

    data = stats_payload(
        {"loaded_chunks": 2, "loaded_tail_blocks": 3, "fallback_tail_blocks.timeout": 1}, 256, 0.0, 16
    )
    assert data["loaded_tokens"] == 2 * 256 + 3 * 16
    assert data["load_failed_tokens.timeout"] == 16


# ---------------------------------------------------------------------------------------- generated tokens


def _prefill_and_decode(
    half: SchedulerHalf,
    store: MemoryTransport,
    req_id: str,
    prompt: list[int],
    outputs: list[int],
    offset_bug: int = 0,
) -> list[tuple[str, list[int], int]]:
    """Prefill ``prompt``, then decode: each step feeds the token sampled before it (the last
    sampled token is never fed). Every save lands in ``store``; returns (key, blocks, step end)."""
    n = len(prompt)
    req = RequestInfo(req_id, tuple(prompt))
    half.num_new_matched_tokens(req, 0)
    table = tuple(range(100, 100 + -(-(n + len(outputs)) // BLOCK)))
    half.update_state_after_alloc(req, table, 0)
    saved: list[tuple[str, list[int], int]] = []
    steps = [ScheduledRequest(req_id, 0, n, table, True)]
    for i, t in enumerate(outputs[:-1]):
        offset = n + i + (offset_bug if i == 3 else 0)
        steps.append(ScheduledRequest(req_id, n + i, 1, None, False, (t,), offset))
    for s in steps:
        plan = half.build_plan(StepInput((s,)))
        for spec in plan.saves:
            for key, blocks in zip(spec.keys, spec.block_ids, strict=True):
                store.blocks[(half.namespace, key)] = b"x"
                saved.append((key, blocks, s.num_computed_tokens + s.num_scheduled_tokens))
    half.request_finished(req_id)
    return saved


def test_generated_tokens_are_stored_as_chunks_and_tail_blocks() -> None:
    """Round 1's answer is stored too: round 2 (prompt, answer, new message) reuses every whole
    block whose KV round 1 computed, and every stored key is the key of exactly its tokens."""
    store = MemoryTransport()
    half = _half(store)
    prompt = list(range(1, CHUNK + BLOCK + 2))  # 21 tokens
    outputs = list(range(700, 700 + CHUNK + 2 * BLOCK))  # 24 generated; 23 fed: KV of 44 tokens
    saved = _prefill_and_decode(half, store, "r1", prompt, outputs)
    tokens = [*prompt, *outputs]
    ckeys = chunk_keys(half.namespace, tokens, CHUNK)
    table = list(range(100, 100 + -(-len(tokens) // BLOCK)))
    for key, blocks, done in saved:
        if key in ckeys:
            c = ckeys.index(key)
            assert blocks == table[c * BPC : (c + 1) * BPC]
            assert (c + 1) * CHUNK <= done, "a chunk is saved once its KV is computed"
            continue
        c = done // CHUNK
        tkeys = tail_keys(half.namespace, tokens, CHUNK, BLOCK, chunk=c, parent=ckeys[c - 1] if c else None)
        j = tkeys.index(key)  # raises if the key is not the tail key of these tokens
        assert blocks == [table[c * BPC + j]]
        assert c * CHUNK + (j + 1) * BLOCK <= done, "a tail block is saved once its KV is computed"
    assert len({k for k, _, _ in saved}) == len(saved), "a key is saved twice"
    computed = len(prompt) + len(outputs) - 1
    round2 = (*tokens, *range(900, 920))
    hit, _ = _run(half, store, RequestInfo("r2", round2))
    assert hit == computed // BLOCK * BLOCK == 2 * CHUNK + 3 * BLOCK


def test_generated_tokens_that_do_not_continue_the_known_ones_are_never_stored() -> None:
    """An adapter that loses track of positions: from then on nothing generated is stored."""
    store = MemoryTransport()
    half = _half(store)
    prompt = list(range(1, CHUNK + 2))  # 17 tokens
    outputs = list(range(700, 700 + 2 * CHUNK))
    saved = _prefill_and_decode(half, store, "r1", prompt, outputs, offset_bug=1)
    tokens = [*prompt, *outputs]
    ckeys = chunk_keys(half.namespace, tokens, CHUNK)
    # Before the bad step: the generated tokens of positions 17..19 were taken, nothing after.
    assert all(done <= len(prompt) + 3 for _, _, done in saved)
    assert {k for k, _, _ in saved} <= {
        ckeys[0],
        *tail_keys(half.namespace, tokens, CHUNK, BLOCK, chunk=1, parent=ckeys[0]),
    }


def test_without_the_feature_generated_tokens_are_not_stored() -> None:
    store = MemoryTransport()
    half = _half(store, tail=False)
    prompt = list(range(1, CHUNK + 2))
    saved = _prefill_and_decode(half, store, "r1", prompt, list(range(700, 700 + 2 * CHUNK)))
    assert [k for k, _, _ in saved] == chunk_keys(half.namespace, prompt, CHUNK)


def test_vllm_adapter_hands_the_half_each_generated_token_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``vllm.py`` passes ``Request.all_token_ids`` beyond what it passed before, with its position."""
    from tests.connector.test_connector_vllm import fake_vllm_config

    from kvfabric.connector import vllm as kvvllm

    monkeypatch.delenv("KVFABRIC_SOCKET", raising=False)
    monkeypatch.delenv("KVFABRIC_REMOTE", raising=False)
    sched = kvvllm.KVFabricConnector(fake_vllm_config(chunk_tokens=32), SimpleNamespace(name="SCHEDULER"))
    req = SimpleNamespace(
        request_id="r", prompt_token_ids=[1, 2, 3], all_token_ids=[1, 2, 3], lora_request=None
    )
    embeds = SimpleNamespace(
        request_id="e",
        prompt_token_ids=[0, 0],
        all_token_ids=[0, 0],
        lora_request=None,
        prompt_embeds=object(),
    )
    for r in (req, embeds):
        sched._requests[r.request_id] = r
    step = StepInput((ScheduledRequest("r", 0, 3), ScheduledRequest("e", 0, 2)))
    assert sched._with_generated_tokens(step).scheduled == step.scheduled  # nothing generated yet
    req.all_token_ids += [7, 8]
    embeds.all_token_ids += [5]
    out = sched._with_generated_tokens(StepInput((ScheduledRequest("r", 3, 1), ScheduledRequest("e", 2, 1))))
    assert (out.scheduled[0].new_token_ids, out.scheduled[0].token_offset) == ((7, 8), 3)
    assert out.scheduled[1].new_token_ids == ()  # prompt embeddings: not the model's token ids
    again = sched._with_generated_tokens(StepInput((ScheduledRequest("r", 4, 1),)))
    assert again.scheduled[0].new_token_ids == ()
    sched.request_finished(req, [])
    assert "r" not in sched._known_tokens
    sched.shutdown()


@settings(max_examples=120, deadline=None)
@given(
    prompt1=st.lists(st.integers(0, 2), min_size=1, max_size=3 * CHUNK),
    generated=st.lists(st.integers(0, 2), min_size=1, max_size=2 * CHUNK),
    step=st.integers(1, 3 * CHUNK),
    keep=st.integers(0, 5 * CHUNK),
    extra=st.lists(st.integers(0, 2), min_size=1, max_size=2 * CHUNK),
)
def test_every_loaded_key_holds_the_kv_of_exactly_the_tokens_it_is_loaded_for(
    prompt1: list[int], generated: list[int], step: int, keep: int, extra: list[int]
) -> None:
    """Never a wrong answer, at the scheduler: round 1 prefills (in steps) and decodes; each saved
    key records the tokens whose KV it holds (everything before its span's end). Round 2 shares any
    prefix of round 1's tokens (tiny vocabulary: many accidental agreements). Every key round 2
    loads holds the KV of exactly round 2's tokens up to the end of the span it fills, and the hit
    is every whole block round 1 stored that round 2 agrees with."""
    store = MemoryTransport()
    half = _half(store)
    n = len(prompt1)
    tokens1 = [*prompt1, *generated]
    req = RequestInfo("r1", tuple(prompt1))
    half.num_new_matched_tokens(req, 0)
    table = tuple(range(-(-len(tokens1) // BLOCK)))
    half.update_state_after_alloc(req, table, 0)
    content: dict[str, tuple[int, ...]] = {}
    steps, computed, first = [], 0, True
    while computed < n:
        k = min(step, n - computed)
        steps.append(ScheduledRequest("r1", computed, k, table if first else None, first))
        computed, first = computed + k, False
    for i, t in enumerate(generated[:-1]):
        steps.append(ScheduledRequest("r1", n + i, 1, None, False, (t,), n + i))
    for s in steps:
        for spec in half.build_plan(StepInput((s,))).saves:
            for key, blocks in zip(spec.keys, spec.block_ids, strict=True):
                end = (max(blocks) + 1) * BLOCK  # the span ends with its last block
                assert end <= s.num_computed_tokens + s.num_scheduled_tokens
                content[key] = tuple(tokens1[:end])
                store.blocks[(half.namespace, key)] = b"x"
    half.request_finished("r1")
    computed1 = n + len(generated) - 1

    round2 = [*tokens1[: min(keep, len(tokens1))], *extra]
    req2 = RequestInfo("r2", tuple(round2))
    hit = half.num_new_matched_tokens(req2, 0)
    table2 = tuple(range(1000, 1000 + -(-len(round2) // BLOCK)))
    half.update_state_after_alloc(req2, table2, hit)
    plan = half.build_plan(StepInput((ScheduledRequest("r2", hit, len(round2) - hit, table2, True),)))
    covered = 0
    for load in plan.loads:
        for key, blocks in zip(load.keys, load.block_ids, strict=True):
            end = (table2.index(max(blocks)) + 1) * BLOCK
            assert content[key] == tuple(round2[:end]), "a key loaded for tokens it does not hold"
            covered = end
    assert covered == hit
    agree = next((i for i, (a, b) in enumerate(zip(tokens1, round2, strict=False)) if a != b), None)
    agree = min(len(tokens1), len(round2)) if agree is None else agree
    best = min(agree, computed1, len(round2) - 1) // BLOCK * BLOCK
    # Everything stored that agrees is reused, except a prefix that ends inside a chunk round 1
    # stored whole (tail blocks exist only where round 1's chunk was partial).
    whole_stored = computed1 // CHUNK * CHUNK
    assert hit <= best
    if best <= whole_stored and best % CHUNK:
        assert hit >= best // CHUNK * CHUNK
    else:
        assert hit == best


# ------------------------------------------------------------------------------------------ KV events


def _index(h: bytes | int) -> int:
    """The block index in a test hash ``b"h<i>"``."""
    assert isinstance(h, bytes)
    return int(h[1:])


def test_every_stored_block_is_announced_by_the_hash_of_exactly_that_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """KV events cover the tail blocks and generated tokens kvfabric stores, not only prompt chunks.

    A request's saves, replayed into the event log with vLLM's per-block hashes, announce exactly
    the blocks stored: every whole block of prompt and output, each under its own hash (block
    ``i``'s hash names block ``i``'s tokens). Round 2's lookup then withdraws exactly the announced
    tail blocks it found gone.
    """
    from kvfabric.connector import vllmevents

    monkeypatch.setattr(vllmevents, "_VLLM", True)
    monkeypatch.setattr(vllmevents, "to_vllm", lambda e: e)
    store = MemoryTransport()
    half = _half(store)
    log = vllmevents.KVEventLog(BLOCK, enabled=True)
    prompt = list(range(1, CHUNK + 2 * BLOCK + 2))  # a chunk, two whole blocks and 1 token
    output = list(range(700, 700 + CHUNK))  # generated: completes chunk 1 and fills 2 blocks more
    tokens = [*prompt, *output]
    req = SimpleNamespace(
        block_hashes=[f"h{i}".encode() for i in range(len(tokens) // BLOCK)],
        all_token_ids=tokens,
        lora_request=None,
    )
    info = RequestInfo("r1", tuple(prompt))
    assert half.num_new_matched_tokens(info, 0) == 0
    table = list(range(100, 100 + -(-len(tokens) // BLOCK)))
    half.update_state_after_alloc(info, table, 0)
    steps = [ScheduledRequest("r1", 0, len(prompt), tuple(table), True)]
    for i, t in enumerate(output[:-1]):  # decode: each step computes the token generated before it
        at = len(prompt) + i
        steps.append(ScheduledRequest("r1", at, 1, None, False, new_token_ids=(t,), token_offset=at))
    for sr in steps:
        for save in half.build_plan(StepInput((sr,))).saves:
            for key, first, blocks in zip(save.keys, save.first_blocks, save.block_ids, strict=True):
                assert blocks == table[first : first + len(blocks)], "first_blocks names the saved blocks"
                store.blocks[(half.namespace, key)] = b"x"
            log.stored(req, save)
    announced = [e for e in log.take() if isinstance(e, kv.BlockStored)]
    kv_tokens = len(tokens) - 1  # the last output token has no KV yet
    whole_blocks = kv_tokens // BLOCK
    covered = sorted({h for e in announced for h in e.block_hashes}, key=_index)
    assert covered == [f"h{i}".encode() for i in range(whole_blocks)], (
        "every stored block, generated ones included"
    )
    for e in announced:
        first = _index(e.block_hashes[0])
        assert list(e.token_ids) == tokens[first * BLOCK : (first + len(e.block_hashes)) * BLOCK]
        assert e.parent_block_hash == (f"h{first - 1}".encode() if first else None)
    half.request_finished("r1")
    _t0, t1, t2 = tail_keys(NS, tokens, CHUNK, BLOCK, chunk=1, parent=chunk_keys(NS, tokens, CHUNK)[0])
    # Tail blocks 2 and 3 of chunk 1 leave the cache; chunk 1 (stored whole when the output
    # completed it) still holds their blocks.
    for k in (t1, t2):
        del store.blocks[(half.namespace, k)]
    r2 = RequestInfo("r2", (*prompt[: CHUNK + 2 * BLOCK], 9999, *range(3000, 3000 + CHUNK)))
    assert half.num_new_matched_tokens(r2, 0) == CHUNK + BLOCK  # chunk 0 and tail block 1
    log.found_missing(half.absent_keys("r2"))
    assert log.take() == [], "block 5 is still held by chunk 1: nothing is withdrawn"
    # Then chunk 1 goes too: a continuation of round 1 finds it absent, and tail blocks 2 and 3.
    del store.blocks[(half.namespace, chunk_keys(NS, tokens, CHUNK)[1])]
    r3 = RequestInfo("r3", (*tokens, *range(4000, 4000 + CHUNK)))
    assert half.num_new_matched_tokens(r3, 0) == CHUNK + BLOCK
    log.found_missing(half.absent_keys("r3"))
    removed = log.take()
    assert all(isinstance(e, kv.BlockRemoved) for e in removed)
    # Block 4 is still held by tail block 1; blocks 5-7 by nothing kvfabric holds any more, each
    # withdrawn exactly once.
    assert sorted(h for e in removed for h in e.block_hashes) == [b"h5", b"h6", b"h7"]
