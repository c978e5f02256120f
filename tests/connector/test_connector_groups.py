"""The group plan and the hybrid lookup: plans from vLLM-shaped configs, namespaces, and a
model-based test of the boundary search against a brute-force oracle written from the storage table
(what each kind stores per span, what a hit at ``H`` over a local prefix ``L`` reads)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.connector.hybrid_sim import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
    kv_cache_config,
    vllm_config,
)

from kvfabric.connector import vllm as kvvllm
from kvfabric.connector.groups import (
    KindType,
    UnsupportedGroupsError,
    kind_key,
    plan_from_kv_cache_config,
)
from kvfabric.connector.hybridplan import Span
from kvfabric.connector.keys import NamespaceSpec
from kvfabric.connector.resilient import CircuitBreaker, Endpoint, Reason, ResilientCache
from kvfabric.connector.scheduler import SchedulerHalf
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.connector.steps import RequestInfo
from kvfabric.testing.memtransport import MemoryTransport

PAGE = 512


def test_gemma3_27b_shape_merges_identical_groups_into_one_kind() -> None:
    """One full group and five sliding-window groups of one spec: two kinds, the SWA kind's layers
    group by group (each layer keeps its own group for its block ids)."""
    specs = [FullAttentionSpec(16, PAGE)] + [SlidingWindowSpec(16, PAGE, 1024) for _ in range(5)]
    plan = plan_from_kv_cache_config(kv_cache_config(specs, 2))
    assert plan is not None
    assert [k.type for k in plan.kinds] == [KindType.FULL, KindType.SLIDING_WINDOW]
    assert plan.kinds[1].groups == (1, 2, 3, 4, 5)
    assert plan.kinds[1].layer_names[:3] == ("g1.l0", "g1.l1", "g2.l0")
    assert plan.layer_places()["g3.l1"] == (1, 5, 2)
    assert plan.scheduler_block == 16
    assert not plan.plain


def test_scheduler_block_is_the_lcm_of_the_groups_block_sizes() -> None:
    cfg = kv_cache_config([SlidingWindowSpec(256, PAGE, 512), FullAttentionSpec(128, PAGE)], 1)
    plan = plan_from_kv_cache_config(cfg)
    assert plan is not None
    assert plan.scheduler_block == 256
    assert kvvllm.block_size_from_vllm(vllm_config(256), cfg) == 256
    cfg3 = kv_cache_config([FullAttentionSpec(48, PAGE), SlidingWindowSpec(32, PAGE, 64)], 1)
    assert kvvllm.block_size_from_vllm(vllm_config(256), cfg3) == 96
    spec = kvvllm.namespace_spec_from_vllm(
        vllm_config(256), ConnectorSettings(chunk_tokens=256), 0, cfg3, plan_from_kv_cache_config(cfg3)
    )
    assert (spec.block_size, spec.chunk_tokens) == (96, 288)


def test_groups_the_plan_cannot_serve_are_refused_by_name() -> None:
    class MambaSpec:
        block_size = 128
        shapes = ((3, 256),)

    class CrossAttentionSpec:
        block_size = 16

    with pytest.raises(UnsupportedGroupsError, match="MambaSpec holds recurrent"):
        plan_from_kv_cache_config(kv_cache_config([FullAttentionSpec(16, PAGE), MambaSpec()], 1))
    with pytest.raises(UnsupportedGroupsError, match="CrossAttentionSpec is not one kvfabric knows"):
        plan_from_kv_cache_config(kv_cache_config([CrossAttentionSpec()], 1))
    # A block-outermost (packed) layout is refused for a hybrid plan, kept for a plain one.
    packed = kv_cache_config([SlidingWindowSpec(16, PAGE, 64), FullAttentionSpec(16, PAGE)], 2)
    packed.kv_cache_tensors = [
        SimpleNamespace(layers=["g0.l0", "g0.l1"], layer_stride=PAGE, block_stride=2 * PAGE)
    ]
    with pytest.raises(UnsupportedGroupsError, match="packed block-outermost"):
        plan_from_kv_cache_config(packed)
    plain = kv_cache_config([FullAttentionSpec(16, PAGE)], 2)
    plain.kv_cache_tensors = packed.kv_cache_tensors
    assert plan_from_kv_cache_config(plain) is not None
    layer_outer = kv_cache_config([SlidingWindowSpec(16, PAGE, 64), FullAttentionSpec(16, PAGE)], 2)
    layer_outer.kv_cache_tensors = [
        SimpleNamespace(layers=["g0.l0", "g0.l1"], layer_stride=PAGE * 100, block_stride=PAGE)
    ]
    assert plan_from_kv_cache_config(layer_outer) is not None
    # A group vLLM does not prefix-cache is left out, not refused.
    cfg = kv_cache_config([FullAttentionSpec(16, PAGE), CrossAttentionSpec()], 1)
    cfg.prefix_cacheable_group_ids = (0,)
    plan = plan_from_kv_cache_config(cfg)
    assert plan is not None
    assert len(plan.kinds) == 1
    assert plan.kinds[0].groups == (0,)


# The namespace the connector derived before it read the groups (one full-attention group): pinned, so
# that the hybrid work never moves an existing cache's namespace or keys.
_PLAIN_DIGEST = "cb8444d07184310e24dec426626c1ac618da42ad38a7629e6fb546cc8358bea4"


def test_a_plain_full_attention_model_keeps_its_namespace_and_keys() -> None:
    s = ConnectorSettings(chunk_tokens=256)
    cfg = kv_cache_config([FullAttentionSpec(16, PAGE)], 4)
    plan = plan_from_kv_cache_config(cfg)
    assert plan is not None
    assert plan.plain
    assert plan.namespace_field() == ""
    with_plan = kvvllm.namespace_spec_from_vllm(vllm_config(256), s, 0, cfg, plan)
    # What the connector derived before it read the groups: block size and layout from the config.
    without = kvvllm.namespace_spec_from_vllm(
        vllm_config(256), s, 0, SimpleNamespace(kv_cache_layout="LBHNC")
    )
    assert with_plan.digest() == without.digest() == _PLAIN_DIGEST
    assert "groups" not in with_plan.document()
    assert kind_key("ab" * 32, 0, plan) == "ab" * 32


def test_hybrid_manager_on_and_off_land_in_different_namespaces() -> None:
    """With the hybrid manager off, vLLM promotes sliding-window layers to one full group."""
    s = ConnectorSettings(chunk_tokens=256)
    off = kv_cache_config([FullAttentionSpec(16, PAGE)], 4)
    on = kv_cache_config([SlidingWindowSpec(16, PAGE, 128), FullAttentionSpec(16, PAGE)], 2)
    plan_on = plan_from_kv_cache_config(on)
    a = kvvllm.namespace_spec_from_vllm(vllm_config(256), s, 0, off, plan_from_kv_cache_config(off))
    b = kvvllm.namespace_spec_from_vllm(vllm_config(256), s, 0, on, plan_on)
    assert a.digest() != b.digest()
    assert b.groups.startswith("sliding_window:128+0/b16x2,full/b16x2;")
    assert len(b.groups) < 512  # a namespace description's values are short
    other_window = kv_cache_config([SlidingWindowSpec(16, PAGE, 256), FullAttentionSpec(16, PAGE)], 2)
    c = kvvllm.namespace_spec_from_vllm(
        vllm_config(256), s, 0, other_window, plan_from_kv_cache_config(other_window)
    )
    assert c.digest() != b.digest()
    assert plan_on is not None
    assert len({kind_key("ab" * 32, k, plan_on) for k in (0, 1)} | {"ab" * 32}) == 3


# --------------------------------------------------------------------- the boundary search (model)


def _stored_from(kind: dict[str, int], start: int, end: int) -> int:
    """First token a kind's object of ``[start, end)`` holds (the storage table, by hand)."""
    b = kind["block"]
    if kind["type"] == 1:  # sliding window: the trailing cdiv(w - 1 + extra, B) blocks
        return max(start, end - -(-(kind["window"] - 1 + kind["extra"]) // b) * b)
    if kind["type"] == 2:  # chunked local: the part inside the attention chunk open at its end
        return max(start, end // kind["chunk"] * kind["chunk"])
    return start


def _need_from(kind: dict[str, int], hit: int, local: int) -> int:
    """First token whose block a hit at ``hit`` writes (what vLLM's table keeps non-null)."""
    b = kind["block"]
    if kind["type"] == 1:
        return max(local, max(0, hit - kind["window"] + 1 - kind["extra"]) // b * b)
    if kind["type"] == 2:
        return max(local, hit // kind["chunk"] * kind["chunk"])
    return local


def _span_of(p: int, hit: int, chunk: int, s: int) -> tuple[int, int, int, int]:
    """The span of the boundary ``hit``'s cover that holds token ``p``: (chunk, tail, start, end)."""
    c = p // chunk
    if (c + 1) * chunk <= hit:
        return c, 0, c * chunk, (c + 1) * chunk
    j = (p - c * chunk) // s + 1
    return c, j, c * chunk + (j - 1) * s, c * chunk + j * s


def oracle(
    kinds: list[dict[str, int]], chunk: int, s: int, n: int, local: int, present: set[tuple[int, int, int]]
) -> int:
    """The deepest boundary every kind can restore: brute force over every block every kind needs."""
    top = (n - 1) // s * s
    for hit in range(top, local, -s):
        ok = True
        for k, kind in enumerate(kinds):
            for p in range(_need_from(kind, hit, local), hit, kind["block"]):
                c, j, start, end = _span_of(p, hit, chunk, s)
                if p < _stored_from(kind, start, end) or (c, j, k) not in present:
                    ok = False
                    break
            if not ok:
                break
        if ok:
            return hit
    return 0


# Hybrid and sliding-window plans (one full group keeps today's prefix lookup from chunk 0).
_KIND_SHAPES = [
    ("swa",),
    ("swa", "full"),
    ("local", "full"),
    ("swa", "local", "full"),
    ("swa", "swa2"),
]


@st.composite
def _scenarios(draw: Any) -> dict[str, Any]:
    base = draw(st.sampled_from([4, 8]))
    shape = draw(st.sampled_from(_KIND_SHAPES))
    specs: list[Any] = []
    for name in shape:
        block = base * draw(st.sampled_from([1, 2])) if name != "full" else base
        if name in ("swa", "swa2"):
            specs.append(
                SlidingWindowSpec(block, PAGE, draw(st.integers(1, 40)), draw(st.sampled_from([0, 0, 3])))
            )
        elif name == "local":
            specs.append(ChunkedLocalAttentionSpec(block, PAGE, block * draw(st.integers(1, 5))))
        else:
            specs.append(FullAttentionSpec(block, PAGE))
    return {
        "specs": specs,
        "chunk_mult": draw(st.integers(1, 4)),
        "n": draw(st.integers(1, 120)),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


@settings(max_examples=150, deadline=None)
@given(sc=_scenarios(), data=st.data())
def test_the_hybrid_lookup_finds_the_oracles_boundary(sc: dict[str, Any], data: st.DataObject) -> None:
    """For random windows, attention chunks, block sizes, chunk sizes, local prefixes and present or
    missing objects, the scheduler half's hit is the oracle's, and a hit with every object present
    costs one lookup."""
    cfg = kv_cache_config(sc["specs"], 1)
    plan = plan_from_kv_cache_config(cfg)
    assert plan is not None
    s = plan.scheduler_block
    chunk = s * sc["chunk_mult"]
    store = MemoryTransport()
    cache = ResilientCache([Endpoint("m", lambda: store, CircuitBreaker(10**6, 60.0))])
    spec = NamespaceSpec("m", "r", "float32", 2, 1, 4, s, chunk)
    half = SchedulerHalf(
        ConnectorSettings(chunk_tokens=chunk, lookup_deadline_ms=60000), spec, cache=cache, plan=plan
    )
    n = sc["n"]
    tokens = tuple((i * 5 + sc["seed"]) % 11 for i in range(n))
    info = RequestInfo("r", tokens)
    state = half._state(info)
    kinds = [
        {
            "type": {KindType.FULL: 0, KindType.SLIDING_WINDOW: 1, KindType.CHUNKED_LOCAL: 2}[k.type],
            "block": k.block_size,
            "window": k.window,
            "extra": k.extra,
            "chunk": k.attention_chunk,
        }
        for k in plan.kinds
    ]
    # Every object any boundary could read, each present or not.
    objects: list[tuple[int, int, int]] = []
    for c in range(n // chunk):
        objects += [(c, 0, k) for k in range(len(kinds))]
    for c in range(n // chunk + 1):
        tails = min(chunk // s - 1, (n - c * chunk) // s) if c * chunk < n else 0
        objects += [(c, j, k) for j in range(1, tails + 1) for k in range(len(kinds))]
    everything = data.draw(st.booleans())
    present = {o for o in objects if everything or data.draw(st.booleans())}
    for c, j, k in present:
        span = Span(
            c, j, c * chunk + (j - 1) * s if j else c * chunk, c * chunk + j * s if j else (c + 1) * chunk
        )
        store.blocks[(half.namespace, kind_key(half._span_key(state, span), k, plan))] = b"x"
    local = data.draw(st.integers(0, max(0, (n - 1) // s))) * s
    want = oracle(kinds, chunk, s, n, local, present)
    got = half.num_new_matched_tokens(info, local)
    assert (local + got if got else 0) == (want if want > local else 0)
    if everything and want > local:
        assert store.calls.count("lookup") <= 1  # none when no kind reads anything before it (w = 1)


def test_the_cost_model_can_decline_a_hybrid_hit() -> None:
    """Restores measured far slower than prefill: the hybrid hit is declined as recompute-faster
    (and reported so), not loaded."""
    from kvfabric.connector.steps import RestoreTiming, WorkerFeedback

    cfg = kv_cache_config([SlidingWindowSpec(16, PAGE, 40), FullAttentionSpec(16, PAGE)], 1)
    plan = plan_from_kv_cache_config(cfg)
    assert plan is not None
    store = MemoryTransport()
    cache = ResilientCache([Endpoint("m", lambda: store, CircuitBreaker(10**6, 60.0))])
    spec = NamespaceSpec("m", "r", "float32", 2, 1, 4, 16, 64)
    half = SchedulerHalf(
        ConnectorSettings(chunk_tokens=64, cost_model=True, lookup_deadline_ms=60000),
        spec,
        cache=cache,
        plan=plan,
    )
    info = RequestInfo("r", tuple(range(300)))
    state = half._state(info)
    for c in range(4):
        for k in range(2):
            store.blocks[(half.namespace, half._object_key(state, Span(c, 0, c * 64, (c + 1) * 64), k))] = (
                b"x"
            )
    assert half.num_new_matched_tokens(info, 0) == 256  # unmeasured: load, and so measure
    for t in (64, 128, 256, 512):
        half.observe(WorkerFeedback(t, t * t / 2, t * 1e-6, []))
    for n in (1, 2, 4):
        half.observe(WorkerFeedback(0, 0.0, None, [RestoreTiming("dram", n * 10_000, n, n * 1.0)]))
    assert half.num_new_matched_tokens(RequestInfo("r2", tuple(range(300))), 0) == 0
    assert half.lookup_reason("r2") is Reason.RECOMPUTE_FASTER
