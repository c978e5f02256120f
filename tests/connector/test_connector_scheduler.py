"""The scheduler half's plans against a model: what a chunked prefill loads and saves."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from kvfabric.connector.keys import NamespaceSpec, num_loadable_chunks, num_whole_chunks, tail_keys
from kvfabric.connector.resilient import CircuitBreaker, Endpoint, LookupOutcome, ResilientCache
from kvfabric.connector.scheduler import SchedulerHalf
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.connector.steps import RequestInfo, ScheduledRequest, StepInput
from kvfabric.testing.memtransport import MemoryTransport

BLOCK, CHUNK = 4, 8
BPC = CHUNK // BLOCK
SPEC = NamespaceSpec("m", "r", "float32", 2, 1, 4, BLOCK, CHUNK)


@settings(max_examples=80, deadline=None)
@given(
    n_tokens=st.integers(1, 80),
    stored=st.integers(0, 10),
    steps=st.lists(st.integers(1, 24), min_size=1, max_size=40),
    rollback=st.one_of(st.none(), st.integers(0, 79)),
)
def test_chunked_prefill_loads_the_hit_and_saves_every_other_whole_chunk_once(
    n_tokens: int, stored: int, steps: list[int], rollback: int | None
) -> None:
    store = MemoryTransport()
    cache = ResilientCache([Endpoint("m", lambda: store, CircuitBreaker(100, 60.0))])
    # A generous lookup deadline: on a loaded machine the in-memory lookup's thread hop can take
    # longer than the default 100 ms, and a timed-out lookup is a (correct) miss this test does not model.
    half = SchedulerHalf(ConnectorSettings(chunk_tokens=CHUNK, lookup_deadline_ms=30000), SPEC, cache=cache)
    req = RequestInfo("r", tuple(range(100, 100 + n_tokens)))
    keys = half.chunk_keys(req)
    for key in keys[:stored]:
        store.blocks[(half.namespace, key)] = b"x"
    hit_chunks = min(stored, num_loadable_chunks(n_tokens, CHUNK))
    ext = half.num_new_matched_tokens(req, 0)
    assert ext == hit_chunks * CHUNK
    table = list(range(1000, 1000 + -(-n_tokens // BLOCK)))
    half.update_state_after_alloc(req, table, ext)

    tkeys = tail_keys(
        half.namespace,
        req.token_ids,
        CHUNK,
        BLOCK,
        chunk=n_tokens // CHUNK,
        parent=keys[n_tokens // CHUNK - 1] if n_tokens >= CHUNK else None,
    )
    saved: list[int] = []
    saved_tail: list[int] = []
    computed, first = ext, True
    rolled = False
    for size in steps:
        if computed >= n_tokens:
            break
        if rollback is not None and not rolled and not first and rollback < computed:
            # A failed load or a preemption: the engine recomputes from ``rollback``.
            computed, rolled = rollback, True
            saved = [c for c in saved if c < rollback // CHUNK]
            saved_tail = [j for j in saved_tail if (n_tokens // CHUNK) * CHUNK + (j + 1) * BLOCK <= rollback]
        k = min(size, n_tokens - computed)
        blocks = tuple(table) if first else None
        plan = half.build_plan(
            StepInput((ScheduledRequest("r", computed, k, blocks, replaces_blocks=first),))
        )
        if first:
            assert [(ls.keys, ls.block_ids) for ls in plan.loads] == (
                [(keys[:hit_chunks], [table[c * BPC : (c + 1) * BPC] for c in range(hit_chunks)])]
                if hit_chunks
                else []
            )
        else:
            assert plan.loads == []
        for spec in plan.saves:
            # No lost tail: the prompt's partial chunk goes out as tail blocks in the step that
            # completes the prompt (and again after a rollback past them), each with its one block.
            for key, blocks_of in zip(spec.keys[spec.whole :], spec.block_ids[spec.whole :], strict=True):
                j = tkeys.index(key)
                assert computed + k == n_tokens, "a tail is saved when the prompt is complete"
                assert blocks_of == [table[(n_tokens // CHUNK) * BPC + j]]
                assert j not in saved_tail, "a tail block is saved twice"
                saved_tail.append(j)
            for key, blocks_of in zip(spec.keys[: spec.whole], spec.block_ids[: spec.whole], strict=True):
                c = keys.index(key)
                assert blocks_of == table[c * BPC : (c + 1) * BPC]
                assert (c + 1) * CHUNK <= computed + k, "a chunk is saved only once it is complete"
                assert c >= hit_chunks or rolled, "a chunk the cache already holds is not saved again"
                assert c not in saved, "a chunk is saved twice"
                saved.append(c)
        computed += k
        first = False
    whole = num_whole_chunks(min(computed, n_tokens), CHUNK)
    # Every whole chunk from the hit on is saved exactly once; after a rollback to token r the
    # chunks from r on are saved again (the engine recomputed them), the loaded ones included.
    begin = min(hit_chunks, rollback // CHUNK) if rolled and rollback is not None else hit_chunks
    assert sorted(saved) == list(range(begin, whole))
    assert sorted(saved_tail) == (list(range(len(tkeys))) if computed >= n_tokens else [])
    cache.close()


def test_the_scheduler_looks_up_with_the_digests_of_the_keys_it_asks_for() -> None:
    """The keys' digests go with the lookup (no hex decoding per lookup), and they are the keys'."""
    asked: list[tuple[list[str], bytes | None]] = []

    class Spy(ResilientCache):
        def lookup(
            self, namespace: str, keys: Sequence[str], deadline_s: float, *, raw: bytes | None = None
        ) -> LookupOutcome:
            asked.append((list(keys), raw))
            return super().lookup(namespace, keys, deadline_s, raw=raw)

    store = MemoryTransport()
    cache = Spy([Endpoint("m", lambda: store, CircuitBreaker(100, 60.0))])
    half = SchedulerHalf(ConnectorSettings(chunk_tokens=CHUNK, lookup_deadline_ms=30000), SPEC, cache=cache)
    for n in (3 * CHUNK + 1, 5 * CHUNK + 2):
        req = RequestInfo(f"r{n}", tuple(range(7, 7 + n)))
        keys = half.chunk_keys(req)
        store.blocks[(half.namespace, keys[0])] = b"x"
        assert half.num_new_matched_tokens(req, 0) == CHUNK
        assert half.num_new_matched_tokens(req, 0) == CHUNK  # a waiting request, looked up again
    chunks = [(keys, raw) for keys, raw in asked if raw is not None]  # (tail lookups send none)
    assert [len(keys) for keys, _ in chunks] == [3, 3, 5, 5]
    for keys, raw in chunks:
        assert raw == bytes.fromhex("".join(keys))
