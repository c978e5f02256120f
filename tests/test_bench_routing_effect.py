"""The pure parts of ``kvfabric bench routing``'s routing effect: workload, scoring, picking, GPU cache."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from kvfabric.bench.routingeffect import (
    CHUNK_BLOCKS,
    GpuCache,
    block_hashes,
    chunk_meta,
    pick,
    prefix_score,
    workload,
)
from kvfabric.rpc.kvevents import BlockRemoved, BlockStored
from kvfabric.testing.routerindex import RouterIndexModel


@given(st.integers(1, 8), st.integers(1, 6), st.integers(0, 1000))
def test_the_workload_replays_every_round_of_every_conversation_in_order(
    convs: int, rounds: int, seed: int
) -> None:
    reqs = workload(convs, rounds, seed)
    assert len(reqs) == convs * rounds
    for c in range(convs):
        mine = [r for r in reqs if r.conv == c]
        assert [r.round for r in mine] == list(range(rounds))
        for before, after in itertools.pairwise(mine):
            assert after.chunks[: len(before.chunks)] == before.chunks  # the history only grows
            assert 1 <= len(after.chunks) - len(before.chunks) <= 3
        assert mine[0].chunks[0] == "sys"
    assert reqs == workload(convs, rounds, seed)


def test_prefix_score_stops_at_the_first_block_no_tier_holds_and_takes_the_best_tier() -> None:
    weights = {"gpu": 1.0, "cpu": 0.8, "storage": 0.4}
    tiers = {1: {"storage", "cpu"}, 2: {"storage"}, 4: {"gpu"}}
    assert prefix_score([1, 2, 3, 4], tiers, weights) == (0.8 + 0.4) / 4
    assert prefix_score([3, 1], tiers, weights) == 0.0
    assert prefix_score([], tiers, weights) == 0.0


def test_pick_weighs_the_prefix_twice_the_queue_and_breaks_ties_by_load() -> None:
    load = {"a": 3, "b": 1, "c": 0}
    # A full prefix hit beats an idle endpoint; a small edge does not beat a busy queue.
    assert pick({"a": 1.0, "b": 0.0, "c": 0.0}, {"a": 2, "b": 0, "c": 0}, load) == "a"
    assert pick({"a": 0.3, "b": 0.0, "c": 0.0}, {"a": 2, "b": 0, "c": 0}, load) == "c"
    assert pick({"a": 0.0, "b": 0.0, "c": 0.0}, {"a": 0, "b": 0, "c": 0}, load) == "c"


def test_the_gpu_cache_publishes_what_a_router_indexes_exactly() -> None:
    gpu = GpuCache(capacity=3)
    router = RouterIndexModel("llm-d")
    for prompt in [("sys", "a1", "a2"), ("sys", "b1"), ("sys", "a1", "a2", "a3")]:
        router.apply("e", gpu.run(prompt))
    assert list(gpu.chunks) == ["a1", "a2", "a3"]  # least recently used first out
    want = {("gpu", h) for c in gpu.chunks for h in block_hashes(c)}
    assert router.entries("e") == want
    assert router.violations.total() == 0


def test_chunk_metas_chain_blocks_and_never_collide() -> None:
    a, b = chunk_meta("x1", None), chunk_meta("x2", "x1")
    assert b.parent_block_hash == a.block_hashes[-1]
    assert len(a.block_hashes) == CHUNK_BLOCKS
    assert not set(a.block_hashes) & set(b.block_hashes)
    events = GpuCache(1).run(("x1", "x2"))
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockRemoved]
