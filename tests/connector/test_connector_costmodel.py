"""The load-versus-recompute cost model: fits, plans and deadlines, on synthetic measurements."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvfabric.connector.costmodel import CostModel, Plan, PrefillSample, RestoreSample, least_squares

CHUNK = 256
CHUNK_BYTES = 2048 * CHUNK  # the reference engine's bench preset: 2 KiB of KV per token


def _engine(alpha: float, beta: float, gamma: float) -> list[PrefillSample]:
    """Exact steps of an engine whose prefill costs alpha*t + beta*t*(s + t/2) + gamma."""
    out = []
    for start, tokens in ((0, 512), (0, 2048), (1024, 1024), (0, 8192), (4096, 300), (0, 16384)):
        secs = alpha * tokens + beta * tokens * (start + tokens / 2) + gamma
        out.append(PrefillSample.single(start, tokens, secs))
    return out


def _model(alpha: float = 30e-6, beta: float = 1e-9, gamma: float = 0.002, **kw: float) -> CostModel:
    m = CostModel(chunk_tokens=CHUNK, **kw)  # type: ignore[arg-type]
    for s in _engine(alpha, beta, gamma):
        m.observe_prefill(s)
    return m


def _restore(m: CostModel, tier: str, gbps: float, overhead_s: float) -> None:
    for chunks in (4, 16, 64):
        nbytes = chunks * CHUNK_BYTES
        m.observe_restore(RestoreSample(tier, nbytes, overhead_s + nbytes / (gbps * 1e9)), chunks)


def test_least_squares_solves_and_refuses_singular_systems() -> None:
    sol = least_squares([[1, 0], [0, 1], [1, 1]], [2, 3, 5])
    assert sol is not None
    assert sol == pytest.approx([2, 3])
    assert least_squares([[1, 2], [2, 4]], [1, 2]) is None
    assert least_squares([], []) is None


@settings(deadline=None)
@given(
    alpha=st.floats(1e-7, 1e-3),
    beta=st.floats(0, 1e-8),
    gamma=st.floats(0, 0.05),
)
def test_the_prefill_fit_recovers_an_exact_engine(alpha: float, beta: float, gamma: float) -> None:
    m = _model(alpha, beta, gamma)
    for start, tokens in ((0, 1000), (2000, 5000), (0, 30000)):
        want = alpha * tokens + beta * tokens * (start + tokens / 2) + gamma
        got = m.prefill_seconds(start, tokens)
        assert got == pytest.approx(want, rel=1e-4, abs=1e-9)


def test_unmeasured_costs_mean_load_everything() -> None:
    m = CostModel(chunk_tokens=CHUNK)
    assert m.plan(["dram"] * 8) == Plan(8, None)
    assert m.lookup_deadline(4096, 0.1) == 0.1
    _model()  # prefill known, restore not:
    m2 = _model()
    assert m2.plan(["dram"] * 8).chunks == 8


def test_a_slow_tier_is_skipped_on_short_prompts_and_loaded_on_long_ones() -> None:
    # Restore has a fixed 20 ms cost: recompute of 1k tokens (~32 ms here) barely beats it, while at
    # 16k tokens attention makes recompute superlinear and the load wins by far.
    m = _model(alpha=25e-6, beta=1e-9)
    _restore(m, "local_disk", gbps=0.5, overhead_s=0.030)
    short = m.plan(["local_disk"] * 4)
    assert short == Plan(0, "recompute_faster")
    long = m.plan(["local_disk"] * 64)
    assert long.chunks == 64
    assert long.reason is None
    assert long.expected_saved_s is not None
    assert long.expected_restore_s is not None
    assert long.expected_saved_s > long.expected_restore_s


def test_only_the_prefix_that_beats_recompute_is_loaded() -> None:
    # DRAM restores far faster than recompute; the shared volume is slower than recompute.
    m = _model(alpha=20e-6, beta=0.0, gamma=0.0)
    _restore(m, "dram", gbps=10, overhead_s=0.0005)
    _restore(m, "shared", gbps=0.01, overhead_s=0.0)
    plan = m.plan(["dram"] * 10 + ["shared"] * 20)
    assert plan.chunks == 10


def test_chunks_the_engine_already_has_save_nothing() -> None:
    m = _model(alpha=20e-6, beta=0.0, gamma=0.0)
    _restore(m, "dram", gbps=10, overhead_s=0.0005)
    full = m.plan(["dram"] * 8)
    partial = m.plan(["dram"] * 8, computed=6 * CHUNK)
    assert full.chunks == partial.chunks == 8
    assert partial.expected_saved_s is not None
    assert full.expected_saved_s is not None
    assert partial.expected_saved_s < full.expected_saved_s / 3


@pytest.mark.parametrize("measured", [False, True])
def test_a_hit_within_the_engines_own_prefix_is_never_recompute_faster(measured: bool) -> None:
    # A hybrid model's hit may end inside the chunk after the engine's prefix: no whole chunk is left
    # to weigh, and the model, measured or not, must not call that a skip (it did, unmeasured).
    m = _model() if measured else CostModel(chunk_tokens=CHUNK)
    if measured:
        _restore(m, "dram", gbps=0.001, overhead_s=1.0)  # restores that would lose to recompute
    assert m.plan(["dram"] * 2, computed=2 * CHUNK) == Plan(2, None)
    assert m.plan(["dram"], computed=3 * CHUNK) == Plan(1, None)


def test_a_tail_is_weighed_by_its_bytes_and_by_the_fixed_cost_only_when_loaded_alone() -> None:
    m = CostModel(chunk_tokens=CHUNK)
    assert m.tail_worth_loading(0, 64, "dram", alone=True)  # unmeasured: load, and so measure
    m = _model(alpha=20e-6, beta=0.0, gamma=0.0)  # 64 tokens: 1.28 ms of prefill
    _restore(m, "dram", gbps=10, overhead_s=0.005)  # 64 tokens' bytes: 13 us, and 5 ms per load
    assert not m.tail_worth_loading(0, 64, "dram", alone=True)
    assert m.tail_worth_loading(CHUNK, 64, "dram", alone=False)  # behind loaded chunks: bytes only
    assert m.tail_worth_loading(0, 64, "local_disk", alone=True)  # a tier never measured
    # Nothing beyond the engine's own prefix: nothing to weigh, never a skip.
    assert m.tail_worth_loading(0, 64, "dram", alone=True, computed=64)


def test_a_skipped_tier_is_still_measured_now_and_then() -> None:
    m = _model(alpha=25e-6, beta=1e-9, explore_every=4)
    _restore(m, "shared", gbps=0.01, overhead_s=0.05)
    plans = [m.plan(["shared"] * 2) for _ in range(8)]
    assert [p.explore for p in plans] == [False, False, False, True] * 2
    assert all(p.chunks == (2 if p.explore else 0) for p in plans)


@settings(deadline=None)
@given(
    tiers=st.lists(st.sampled_from(["dram", "local_disk", "shared"]), min_size=1, max_size=40),
    computed_chunks=st.integers(0, 39),
)
def test_a_planned_load_is_always_expected_to_win(tiers: list[str], computed_chunks: int) -> None:
    m = _model(alpha=25e-6, beta=1e-9, explore_every=0)
    _restore(m, "dram", gbps=5, overhead_s=0.001)
    _restore(m, "local_disk", gbps=0.4, overhead_s=0.01)
    _restore(m, "shared", gbps=0.05, overhead_s=0.02)
    computed = min(computed_chunks, len(tiers) - 1) * CHUNK
    plan = m.plan(tiers, computed=computed)
    assert 0 <= plan.chunks <= len(tiers)
    if plan.chunks:
        assert plan.expected_saved_s is not None
        assert plan.expected_restore_s is not None
        assert plan.expected_saved_s > plan.expected_restore_s
    else:
        assert plan.reason == "recompute_faster"


@settings(deadline=None)
@given(
    alpha=st.floats(1e-7, 1e-3),
    beta=st.floats(0, 1e-8),
    gamma=st.floats(0, 0.05),
    rates=st.lists(st.tuples(st.floats(0.001, 50), st.floats(0, 0.1)), min_size=3, max_size=3),
    tiers=st.lists(st.sampled_from(["dram", "local_disk", "shared"]), min_size=1, max_size=40),
    computed_chunks=st.integers(0, 40),
)
def test_a_hit_is_never_skipped_where_the_models_own_costs_say_loading_wins(
    alpha: float,
    beta: float,
    gamma: float,
    rates: list[tuple[float, float]],
    tiers: list[str],
    computed_chunks: int,
) -> None:
    # The default is on: a skip must never turn a hit into a recompute the model itself expects to
    # be slower. For every prefix the plan could load, by the model's own predictions: a skip means
    # none saves more than it costs, and a load takes the prefix that gains the most.
    m = _model(alpha, beta, gamma, explore_every=0)
    for tier, (gbps, overhead) in zip(["dram", "local_disk", "shared"], rates, strict=True):
        _restore(m, tier, gbps=gbps, overhead_s=overhead)
    computed = min(computed_chunks, len(tiers)) * CHUNK
    first = computed // CHUNK
    gains = {}
    for k in range(first + 1, len(tiers) + 1):
        recompute = m.prefill_seconds(computed, k * CHUNK - computed)
        fixed = m.prefill_seconds(computed, 0)  # the per-step constant: paid either way
        restore = m.restore_seconds(tiers[first:k])
        assert recompute is not None
        assert fixed is not None
        assert restore is not None
        gains[k] = (recompute - fixed) - restore
    plan = m.plan(tiers, computed=computed)
    if not gains:  # every matched chunk is in the engine already: nothing to weigh, never a skip
        assert plan == Plan(len(tiers), None)
        return
    eps = 1e-9 * (1 + max(abs(g) for g in gains.values()))
    if plan.chunks == 0:
        assert plan.reason == "recompute_faster"
        assert all(g <= eps for g in gains.values())
    else:
        assert gains[plan.chunks] > 0
        assert gains[plan.chunks] >= max(gains.values()) - eps


def test_deadlines_follow_the_expected_prefill() -> None:
    m = _model(alpha=30e-6, beta=0.0, gamma=0.0, lookup_fraction=0.1, min_deadline_s=0.002)
    # 1k tokens: ~30 ms of prefill -> a 3 ms lookup budget; tiny prompts get the floor; huge ones
    # the configured ceiling.
    assert m.lookup_deadline(1024, 0.1) == pytest.approx(0.1 * 30e-6 * 1024)
    assert m.lookup_deadline(16, 0.1) == 0.002
    assert m.lookup_deadline(1_000_000, 0.1) == 0.1
    _restore(m, "dram", gbps=5, overhead_s=0.001)
    plan = m.plan(["dram"] * 16)
    assert plan.expected_saved_s is not None
    assert plan.expected_restore_s is not None
    assert m.load_deadline(plan, 2.0) == pytest.approx(
        max(plan.expected_saved_s, 2 * plan.expected_restore_s)
    )
    assert m.load_deadline(plan, 0.001) == 0.001  # the setting stays the ceiling
    assert m.load_deadline(Plan(4, None), 2.0) == 2.0


def test_garbage_samples_are_ignored() -> None:
    m = CostModel(chunk_tokens=CHUNK)
    m.observe_prefill(PrefillSample(0, 0.0, 1.0))
    m.observe_prefill(PrefillSample(10, 5.0, float("nan")))
    m.observe_prefill(PrefillSample(10, 5.0, -1.0))
    m.observe_restore(RestoreSample("dram", 0, 1.0), 1)
    assert m.prefill_seconds(0, 100) is None
    assert m.plan(["dram"]) == Plan(1, None)


def test_worker_feedback_of_several_ranks_keeps_the_slowest() -> None:
    from kvfabric.connector.steps import RestoreTiming
    from kvfabric.connector.vllm import KVFabricWorkerMetadata

    a = KVFabricWorkerMetadata(100, 5.0, 0.010, [RestoreTiming("dram", 4096, 2, 0.001)])
    b = KVFabricWorkerMetadata(100, 5.0, 0.012, [RestoreTiming("dram", 4096, 2, 0.003)])
    both = a.aggregate(b)
    assert isinstance(both, KVFabricWorkerMetadata)
    assert both.forward_s == 0.012
    assert both.restores == [RestoreTiming("dram", 4096, 2, 0.003)]
    assert KVFabricWorkerMetadata(1, 1.0, None, []).aggregate(a).forward_s == 0.010
