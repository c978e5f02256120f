"""Hybrid models (vLLM's hybrid KV cache manager): the connector on vLLM-shaped duck-typed objects.

A miniature of vLLM's block manager (:mod:`hybrid_sim`) runs requests through the real
``KVFabricConnector`` (both halves) and a memory-backed cache; a "restart" is a fresh engine and
fresh connectors over the same cache. Every step checks, as recompute would compute it, every
position the step's first token attends to, and that block 0 (the null block) was never written.

Shapes as vLLM 0.32 makes them: Mistral with a sliding window (one ``SlidingWindowSpec`` group),
Gemma 3 / gpt-oss (sliding window + full, same block size), Gemma 4 (sliding window block 256, full
block 128), Llama 4 (three one-layer chunked-local groups and one full).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tests.connector.hybrid_sim import (
    ChunkedLocalAttentionSpec,
    Driver,
    Engine,
    FullAttentionSpec,
    MambaSpec,
    Req,
    SlidingWindowSpec,
    expected_checks,
    vllm_config,
)

from kvfabric.client.mappings import Lease
from kvfabric.connector import vllm as kvvllm
from kvfabric.connector.resilient import CircuitBreaker, Endpoint, ResilientCache
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.testing.memtransport import MemoryTransport

PAGE = 16 * 8 * 4  # bytes of one block of one layer (block 16, head 8, fp32): equal in every group
HEADER = 128  # a stored object's header


class LendingTransport(MemoryTransport):
    """A same-node server whose loads are lent (read-only views the worker scatters in place)."""

    lends = True

    def load_views(self, namespace: str, keys: Sequence[str], *, timeout: float) -> list[Lease]:
        self._enter("load_views", timeout)
        out = []
        for k in keys:
            data = self.blocks.get((namespace, k))
            if data is None:
                break
            if k in self.corrupt_keys:
                damaged = bytearray(data)
                damaged[len(damaged) // 2] ^= 0xFF
                data = bytes(damaged)
            out.append(Lease(memoryview(bytes(data))))
        return out


@pytest.fixture(params=["copied", "lent"])
def store(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> MemoryTransport:
    """One memory cache server that outlives every simulated vLLM process (loads copied or lent)."""
    transport = LendingTransport() if request.param == "lent" else MemoryTransport()

    def build(settings: ConnectorSettings, **_: Any) -> ResilientCache:
        cache = ResilientCache([Endpoint("m", lambda: transport, CircuitBreaker(100, 60.0))])
        cache.endpoints[0].client()  # connected: a lending server lends from the first load on
        return cache

    monkeypatch.setattr(kvvllm, "build_cache", build)
    monkeypatch.delenv("KVFABRIC_REMOTE", raising=False)
    return transport


def boot(
    specs: list[Any],
    chunk: int,
    *,
    layers: int = 2,
    blocks: int = 400,
    kernel: int = 0,
    page: int = PAGE,
    events: bool = False,
    **extra: Any,
) -> Driver:
    """Start one simulated vLLM process (engine + both connector halves); ``events``: KV events on."""
    engine = Engine(specs, layers, blocks, page, kernel)
    cfg = vllm_config(chunk, **extra)
    if events:
        cfg.kv_events_config = SimpleNamespace(enable_kv_cache_events=True)
    sched = kvvllm.KVFabricConnector(cfg, SimpleNamespace(name="SCHEDULER"), engine.config)
    worker = kvvllm.KVFabricConnector(cfg, SimpleNamespace(name="WORKER"), engine.config)
    return Driver(engine, sched, worker)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(i * 7 + seed * 13 + (i // 5)) % 97 for i in range(n)]


def counters(d: Driver) -> dict[str, int]:
    """Both halves' counters (each half has its own cache here, as in two processes)."""
    out = dict(d.sched.scheduler_half.counters.snapshot())
    for k, v in d.worker.worker_half.counters.snapshot().items():
        out[k] = out.get(k, 0) + v
    return out


def assert_checked_exactly(d: Driver, req: Req, budget: int) -> None:
    """Every step of ``req`` (run alone from its hit) checked every position it attends to."""
    layers = len(d.engine.config.kv_cache_groups[0].layer_names)
    want = expected_checks(d.engine.specs, layers, req.hit, len(req.prompt_token_ids), budget)
    assert d.engine.checked_positions == want


def load_block_ids(d: Driver) -> list[int]:
    return [b for meta in d.plans for spec in meta.loads for ids in spec.block_ids for b in ids]


# ----------------------------------------------------------------------------------- the live defect


def test_single_sliding_window_group_never_writes_block_0_and_hits_equal_recompute(
    store: MemoryTransport,
) -> None:
    """Mistral with a window: one ``SlidingWindowSpec`` group whose out-of-window positions are 0.

    Run 1 stores a 1,260-token prompt (window 128, block 16, chunk 256); after a restart run 2
    hits. The hit's loads target no block 0, the null block stays clean, and every position the
    first computed token attends to holds what recompute gives. Before the group plan the hit
    scattered whole chunks positionally, into block 0.
    """
    specs = [SlidingWindowSpec(16, PAGE, 128)]
    first = boot(specs, 256)
    first.run([Req("a", prompt(1260))], budget=2048)
    second = boot(specs, 256)
    b = Req("b", prompt(1260))
    second.run([b], budget=2048)
    # The deepest boundary below 1,259: tail blocks of 16 up to 1,248.
    assert b.hit == 1248
    assert 0 not in load_block_ids(second)
    assert second.engine.null_block_clean()
    assert_checked_exactly(second, b, budget=2048)
    # Only the window's blocks moved: cdiv(127, 16) = 8 blocks of each of 2 layers.
    blocks = sum(len(ids) for meta in second.plans for spec in meta.loads for ids in spec.block_ids)
    assert blocks == 8
    # One group: a synchronous load, whose bytes the cost model learns (only the window's).
    restored = [r for fb in second.feedback for r in fb.restores]
    assert sum(r.nbytes for r in restored) == counters(second)["loaded_bytes.sliding_window"]
    objects = [k for meta in second.plans for spec in meta.loads for k in spec.keys]
    # Objects ending at 1,248 back to 1,120: the tail blocks 1..14 of chunk 4 (1,024 + 16j); each
    # holds its one block, so 8 objects of one block, 2 layers each, plus a header each.
    assert len(objects) == 8
    assert counters(second)["loaded_bytes.sliding_window"] == 8 * (2 * PAGE + HEADER)


def test_sliding_window_saves_under_block_reuse_equal_recompute_after_restart(store: MemoryTransport) -> None:
    """Small step budget, three concurrent requests: freed window blocks are reused at once.

    Every object is read in the step that computes its span's end, so what run 2 loads after a
    restart is what recompute gives (a save of a chunk's early blocks would read another
    request's bytes).
    """
    specs = [SlidingWindowSpec(16, PAGE, 40)]
    first = boot(specs, 128, blocks=60)
    first.run([Req(f"a{i}", prompt(300 + 37 * i, seed=i)) for i in range(3)], budget=48)
    assert counters(first).get("save_null_block_skipped", 0) == 0
    assert first.saved_blocks > 0
    second = boot(specs, 128, blocks=60)
    reqs = [Req(f"b{i}", prompt(300 + 37 * i, seed=i)) for i in range(3)]
    second.run(reqs, budget=48)
    assert [r.hit for r in reqs] == [(len(r.prompt_token_ids) - 1) // 16 * 16 for r in reqs]
    assert second.engine.null_block_clean()


# ----------------------------------------------------------------------------- hybrid group shapes


def swa_full(window: int, *, swa_block: int = 16, full_block: int = 16, extra: int = 0) -> list[Any]:
    """Gemma 3 / gpt-oss (equal blocks) or Gemma 4 (sliding-window blocks twice the full ones)."""
    return [SlidingWindowSpec(swa_block, PAGE, window, extra), FullAttentionSpec(full_block, PAGE)]


def object_bytes(blocks: int, layers: int) -> int:
    return blocks * layers * PAGE + HEADER


@pytest.mark.parametrize("window", [128, 200, 300])
def test_gemma3_shape_hits_equal_recompute_and_move_only_the_window(
    store: MemoryTransport, window: int
) -> None:
    """Sliding window + full attention, block 16, chunk 256; windows that do and do not divide it.

    Run 2's hit after a restart is the deepest boundary (1,248 of 1,260 tokens), equals recompute,
    and moves exactly: the full kind every block of the hit, the sliding-window kind only the
    ``cdiv(w - 1, 16)`` blocks before it (in objects of the chunk and tail spans that hold them).
    """
    first = boot(swa_full(window), 256)
    first.run([Req("a", prompt(1260))], budget=512)
    stored = counters(first)
    # Stored per span: full every block; sliding window the trailing min(blocks, cdiv(w-1, 16)).
    keep = -(-(window - 1) // 16)
    spans = [(256, 16)] * 4 + [(16, 1)] * 14  # 4 chunks, then tail blocks 1..14 of chunk 4
    assert stored["stored_bytes.full"] == sum(object_bytes(n, 2) for _, n in spans)
    assert stored["stored_bytes.sliding_window"] == sum(object_bytes(min(n, keep), 2) for _, n in spans)
    second = boot(swa_full(window), 256)
    b = Req("b", prompt(1260))
    second.run([b], budget=512)
    assert b.hit == 1248
    got = counters(second)
    assert got["loaded_bytes.full"] == stored["stored_bytes.full"]
    # The hit at 1,248 reads positions from 1,248 - keep*16: the tail blocks after 1,024 that lie
    # there (one block each), then the trailing blocks of chunk 3 still inside the window.
    in_tails = min(keep, 14)
    in_chunk3 = keep - in_tails
    want = in_tails * object_bytes(1, 2) + (object_bytes(min(16, keep), 2) if in_chunk3 else 0)
    assert got["loaded_bytes.sliding_window"] == want
    assert got.get("null_block_writes_refused", 0) == 0
    assert 0 not in load_block_ids(second)
    assert_checked_exactly(second, b, budget=512)
    assert (got.get("loads_lent", 0) > 0) == isinstance(store, LendingTransport)
    # Two groups: the load ran in the background (vLLM takes its failure only per request).
    assert got["background_loads"] == 1


@pytest.mark.parametrize("kernel", [0, 16])
def test_gemma4_shape_per_group_block_sizes(store: MemoryTransport, kernel: int) -> None:
    """Sliding-window blocks of 32, full blocks of 16: the scheduler block is 32 (their lcm), the
    chunk is rounded up to a multiple of it, and hits land on multiples of 32. Also with the
    sliding-window layers handed over in 16-token kernel blocks."""
    specs = swa_full(100, swa_block=32, full_block=16)
    first = boot(specs, 80, kernel=kernel)  # rounded up to 96
    assert first.sched.scheduler_half.chunk_tokens == 96
    assert first.sched.scheduler_half.block_size == 32
    first.run([Req("a", prompt(1000))], budget=256)
    second = boot(specs, 80, kernel=kernel)
    assert second.worker.worker_half.disabled is None
    b = Req("b", prompt(1000))
    second.run([b], budget=256)
    assert b.hit == 992  # the largest multiple of 32 below 999
    assert counters(second).get("null_block_writes_refused", 0) == 0
    assert second.engine.null_block_clean()


@pytest.mark.parametrize("attention_chunk", [64, 96])
def test_llama4_shape_chunked_local_groups(store: MemoryTransport, attention_chunk: int) -> None:
    """Three one-layer chunked-local groups and one full group (all aliased), chunk 128.

    With ``A`` dividing the chunk nothing local is stored at chunk ends; with ``A`` = 96 the open
    attention chunk's part is. Either way the hit equals recompute.
    """
    specs = [ChunkedLocalAttentionSpec(16, PAGE, attention_chunk) for _ in range(3)] + [
        FullAttentionSpec(16, PAGE)
    ]
    first = boot(specs, 128, layers=1)
    first.run([Req("a", prompt(700))], budget=256)
    plan = first.sched.plan
    assert plan is not None
    assert [k.type.value for k in plan.kinds] == ["chunked_local", "full"]
    assert plan.kinds[0].groups == (0, 1, 2)
    second = boot(specs, 128, layers=1)
    b = Req("b", prompt(700))
    second.run([b], budget=256)
    assert b.hit == 688
    got = counters(second)
    # Local blocks loaded: those after floor(688 / A) * A, one object per tail block.
    local_blocks = (688 - 688 // attention_chunk * attention_chunk) // 16
    assert got.get("loaded_bytes.chunked_local", 0) == local_blocks * object_bytes(1, 3)
    assert second.engine.null_block_clean()


def test_a_missing_sliding_window_object_drops_the_hit_to_the_previous_valid_boundary(
    store: MemoryTransport,
) -> None:
    """Delete the sliding-window object of the deepest boundary's last span: the hit falls back to
    the boundary before it (one block less), and still equals recompute."""
    first = boot(swa_full(64), 256)
    first.run([Req("a", prompt(600))], budget=1024)
    half = first.sched.scheduler_half
    info = kvvllm.request_info_from_vllm(Req("x", prompt(600)))
    st = half._state(info)
    assert half.plan is not None
    last = half._object_key(st, hybrid_span(512, 16, 5), 0)  # tail block 5 of chunk 2 (ends at 592)
    assert store.blocks.pop((half.namespace, last), None) is not None
    second = boot(swa_full(64), 256)
    b = Req("b", prompt(600))
    second.run([b], budget=1024)
    assert b.hit == 576
    assert_checked_exactly(second, b, budget=1024)


def hybrid_span(base: int, block: int, tail: int) -> Any:
    from kvfabric.connector.hybridplan import Span

    return Span(base // 256, tail, base + (tail - 1) * block, base + tail * block)


def test_cost_model_on_keeps_a_hybrid_hit_it_has_not_measured(store: MemoryTransport) -> None:
    first = boot(swa_full(64), 128, cost_model=True)
    first.run([Req("a", prompt(500))], budget=256)
    second = boot(swa_full(64), 128, cost_model=True)
    b = Req("b", prompt(500))
    second.run([b], budget=256)
    assert b.hit == 496
    assert_checked_exactly(second, b, budget=256)


# ------------------------------------------------------------------------ guards and the interface


def test_connector_declares_hma_and_logs_its_plan(
    store: MemoryTransport, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="kvfabric")
    d = boot(swa_full(128), 256)
    assert any(c.__name__.endswith("SupportsHMA") for c in type(d.sched).__mro__)
    assert any(
        "kvfabric group plan: scheduler_block=16 groups=2; kind 0 sliding_window window=128" in r.getMessage()
        for r in caplog.records
    )
    req = Req("r", prompt(40))
    assert d.sched.request_finished_all_groups(req, ([0, 3], [1, 2])) == (False, None)


def test_a_hit_the_tables_contradict_is_refused_and_recomputed(store: MemoryTransport) -> None:
    """The scheduler plans a hit whose window position holds the null block: it loads nothing,
    counts it, and the request's load fails as a whole (two groups: vLLM takes it per request,
    in the background, and recomputes the request; block-level failures would make it raise)."""
    first = boot(swa_full(64), 128)
    first.run([Req("a", prompt(300))], budget=512)
    second = boot(swa_full(64), 128)
    sched, worker = second.sched, second.worker
    req = Req("b", prompt(300))
    ext, background = sched.get_num_new_matched_tokens(req, 0)
    assert (ext, background) == (288, True)
    # Asked again before vLLM could admit it (no load planned yet): the hit stays, in the background.
    assert sched.get_num_new_matched_tokens(req, 0) == (288, True)
    swa = [0] * 14 + [7, 0, 9, 10]  # position 15 is inside the window: the null block there is wrong
    full = list(range(20, 38))
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (swa, full)), 288)
    idle = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=None, finished_req_ids=set())
    meta = sched.build_connector_meta(idle)
    (spec,) = meta.loads
    assert spec.refused
    assert spec.background
    assert spec.keys == []
    assert counters(second)["null_block_writes_refused"] == 1
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    results = worker.get_transfer_results(set())
    assert (results.finished_recving, results.failed_recving) == ({"b"}, {"b"})
    assert worker.get_block_ids_with_load_errors() == set()
    worker.clear_connector_metadata()
    assert second.engine.null_block_clean()
    # Admitted again (vLLM recomputes it from the start): no second load, a plain recompute.
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert counters(second)["miss.retry_recomputed"] == 1


def test_a_failed_background_load_of_a_hybrid_model_is_recomputed_from_the_start(
    store: MemoryTransport,
) -> None:
    """A damaged object: the request's load fails per request (never per block: vLLM raises on
    those with several groups), vLLM recomputes the request, and the output equals recompute."""
    first = boot(swa_full(64), 128)
    first.run([Req("a", prompt(300))], budget=512)
    store.corrupt_keys = {k for (_, k) in store.blocks}
    second = boot(swa_full(64), 128)
    b = Req("b", prompt(300))
    second.run([b], budget=128)
    assert b.failed_loads == 1
    assert counters(second)["miss.retry_recomputed"] == 1
    assert_checked_exactly(second, b, budget=128)
    assert second.engine.null_block_clean()


def test_the_worker_never_writes_block_0_whatever_the_plan_says(store: MemoryTransport) -> None:
    """A load spec that targets block 0 (a planning error) is not loaded: counted, its other
    blocks reported failed, the KV cache untouched."""
    from kvfabric.connector.steps import LoadSpec, ObjectLayout, StepPlan

    d = boot([SlidingWindowSpec(16, PAGE, 64)], 128)  # one group: failures are per block
    worker = d.worker
    spec = LoadSpec(
        "r",
        ["ab" * 32],
        [[5, 0]],
        objects=ObjectLayout(kinds=[0], stored=[2], skips=[0], tokens=[32], span_chunks=0, span_tails=2),
    )
    before = {name: t.clone() for name, t in d.engine.kv.items()}
    worker.bind_connector_metadata(kvvllm.KVFabricMetadata(loads=[spec]))
    worker.start_load_kv(None)
    for name in d.engine.kv:
        worker.wait_for_layer_load(name)
    assert worker.get_block_ids_with_load_errors() == {5}
    worker.clear_connector_metadata()
    assert worker.worker_half.counters.get("null_block_writes_refused") == 1
    assert all(bool((d.engine.kv[n] == before[n]).all()) for n in before)
    assert isinstance(StepPlan(), StepPlan)


def test_resumed_requests_replace_every_groups_table(store: MemoryTransport) -> None:
    """A preempted request comes back with a new table per group: the half keeps those, not the
    appended old ones."""
    d = boot(swa_full(64), 128)
    sched = d.sched
    req = Req("r", prompt(100))
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([1, 2], [3, 4])), 0)
    cached = SimpleNamespace(
        req_ids=["r"], resumed_req_ids={"r"}, new_block_ids=[([8, 9], [10, 11])], num_computed_tokens=[0]
    )
    so = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={"r": 16},
        finished_req_ids=set(),
    )
    sched.build_connector_meta(so)
    assert sched.scheduler_half._reqs["r"].groups == [[8, 9], [10, 11]]
    cached.resumed_req_ids = set()
    cached.new_block_ids = [([12], [13])]
    sched.build_connector_meta(so)
    assert sched.scheduler_half._reqs["r"].groups == [[8, 9, 12], [10, 11, 13]]


def test_kernel_blocks_are_read_as_whole_blocks_of_their_group(store: MemoryTransport) -> None:
    """A backend may split a group's 32-token blocks into 16-token kernel blocks
    (``[num_blocks * 2, H, 16, C]``): the worker reads block ``b`` as kernel blocks ``2b, 2b+1``."""
    from kvfabric.connector import layout

    t = torch.arange(8 * 1 * 16 * 2, dtype=torch.float32).view(8, 1, 16, 2)
    view = layout.in_blocks_of(t, 32)
    assert view is not None
    assert view.shape == (4, 2, 1, 16, 2)
    assert torch.equal(view[1], t[2:4])
    assert view.data_ptr() == t.data_ptr()
    assert layout.in_blocks_of(t, 16) is t
    assert layout.in_blocks_of(t, 24) is None


@pytest.mark.parametrize("local", [256, 384, 1024])
@pytest.mark.parametrize("shape", ["gemma3", "llama4"])
def test_a_hit_behind_the_engines_own_prefix_writes_only_what_it_lacks(
    store: MemoryTransport, local: int, shape: str
) -> None:
    """vLLM already holds ``[0, L)`` (its own prefix cache, ``L`` inside a chunk or on a chunk
    end): the load starts at ``L`` (objects entered part-way), and the result equals recompute."""
    if shape == "gemma3":
        specs = swa_full(200)
    else:
        specs = [ChunkedLocalAttentionSpec(16, PAGE, 96) for _ in range(3)] + [FullAttentionSpec(16, PAGE)]
    layers = 2 if shape == "gemma3" else 1
    first = boot(specs, 256, layers=layers)
    first.run([Req("a", prompt(1260))], budget=512)
    second = boot(specs, 256, layers=layers)
    b = Req("b", prompt(1260), local=local)
    second.run([b], budget=512)
    assert b.hit == 1248
    assert counters(second).get("null_block_writes_refused", 0) == 0
    assert_checked_exactly(second, b, budget=512)
    written = [bid for meta in second.plans for spec in meta.loads for ids in spec.block_ids for bid in ids]
    full_group = len(specs) - 1
    # The full-attention group is written from L on, nothing before it.
    assert len([b_ for b_ in written if b_ in b.admitted_tables[full_group]]) == (1248 - local) // 16


def test_asynchronous_hybrid_loads_equal_recompute(store: MemoryTransport) -> None:
    """``load_async``: vLLM keeps the request waiting while the load runs on a thread; the objects
    land in every group's blocks before the request is reported finished."""
    first = boot(swa_full(200), 256)
    first.run([Req("a", prompt(1260)), Req("c", prompt(900, seed=3))], budget=512)
    second = boot(swa_full(200), 256, load_async=True)
    reqs = [Req("b", prompt(1260)), Req("d", prompt(900, seed=3))]
    second.run(reqs, budget=512)
    assert [r.hit for r in reqs] == [1248, 896]
    assert all(r.loaded for r in reqs)
    assert counters(second)["background_loads"] == 2
    # Each finishes in the one step after its load (fewer tokens left than the budget): their checks add.
    specs, n = second.engine.specs, [len(r.prompt_token_ids) for r in reqs]
    want = sum(expected_checks(specs, 2, r.hit, m, 512) for r, m in zip(reqs, n, strict=True))
    assert second.engine.checked_positions == want


# ------------------------------------------------------------- recurrent state (unit-tested only)


@pytest.fixture
def state_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan recurrent-state groups (the connector refuses them in real runs until a real model
    proves the path)."""
    from kvfabric.connector.groups import plan_from_kv_cache_config

    monkeypatch.setattr(
        kvvllm, "group_plan_from_vllm", lambda cfg, kv: plan_from_kv_cache_config(kv, allow_state=True)
    )


def qwen35_shape(state_bytes: int = 256) -> list[Any]:
    """Three gated-delta-net (recurrent) groups and one full-attention group, one layer each."""
    return [MambaSpec(16, PAGE, state_bytes) for _ in range(3)] + [FullAttentionSpec(16, PAGE)]


def test_recurrent_state_is_refused_in_real_runs(store: MemoryTransport) -> None:
    with pytest.raises(ValueError, match="recurrent"):
        boot(qwen35_shape(), 64, layers=1)


@pytest.mark.usefixtures("state_plans")
def test_state_checkpoints_restore_the_recurrent_state_at_a_handed_off_boundary(
    store: MemoryTransport,
) -> None:
    """Steps of 64 tokens end on chunk ends, where vLLM hands over the state (align mode): run 2's
    hit is the deepest such boundary (256 of 300 tokens: no state at the tail blocks after it), its
    state lands in block ``H/16 - 1`` before the forward, and the step starts from it."""
    first = boot(qwen35_shape(), 64, layers=1)
    first.run([Req("a", prompt(300))], budget=64)
    stored = counters(first)
    assert stored["stored_bytes.state"] == 4 * (3 * 256 + HEADER)  # 4 checkpoints of 3 layers
    second = boot(qwen35_shape(), 64, layers=1)
    b = Req("b", prompt(300))
    second.run([b], budget=64)
    assert b.hit == 256
    got = counters(second)
    assert got["loaded_bytes.state"] == 3 * 256 + HEADER  # one checkpoint, three layers
    assert got["loaded_bytes.full"] == 4 * (4 * PAGE + HEADER)  # four chunks of 4 blocks, 1 layer
    assert got.get("null_block_writes_refused", 0) == 0
    assert_checked_exactly(second, b, budget=64)
    assert second.engine.null_block_clean()


@pytest.mark.usefixtures("state_plans")
def test_a_missing_checkpoint_drops_the_hit_to_the_previous_one(store: MemoryTransport) -> None:
    first = boot(qwen35_shape(), 64, layers=1)
    first.run([Req("a", prompt(300))], budget=64)
    half = first.sched.scheduler_half
    st = half._state(kvvllm.request_info_from_vllm(Req("x", prompt(300))))
    from kvfabric.connector.hybridplan import Span

    assert store.blocks.pop((half.namespace, half._object_key(st, Span(3, 0, 192, 256), 0)), None)
    second = boot(qwen35_shape(), 64, layers=1)
    b = Req("b", prompt(300))
    second.run([b], budget=64)
    assert b.hit == 192
    assert_checked_exactly(second, b, budget=64)


# ------------------------------------------------------- the shapes vLLM 0.32 was seen to make


BIG_PAGE = 128 * 8 * 4  # block 128, head 8, fp32


def test_probed_gemma3_shape_block_128(store: MemoryTransport) -> None:
    """vLLM 0.32's tiny Gemma 3: window 128, both groups block 128; a finished 1,240-token request
    holds a sliding-window table like ``[0, 0, 0, 0, 0, 0, 0, 0, a, b]``; the hit is 1,152."""
    specs = [SlidingWindowSpec(128, BIG_PAGE, 128), FullAttentionSpec(128, BIG_PAGE)]
    first = boot(specs, 256, blocks=80, page=BIG_PAGE)
    a = Req("a", prompt(1240))
    first.run([a], budget=512)
    second = boot(specs, 256, blocks=80, page=BIG_PAGE)
    b = Req("b", prompt(1240))
    second.run([b], budget=512)
    swa, full = b.admitted_tables
    assert len(swa) == len(full) == 10
    assert swa[:8] == [0] * 8
    assert 0 not in swa[8:]
    assert 0 not in full
    assert b.hit == 1152
    assert_checked_exactly(second, b, budget=512)


def test_probed_gemma4_shape_sliding_256_full_128(store: MemoryTransport) -> None:
    """vLLM 0.32's tiny Gemma 4: sliding-window blocks 256, full blocks 128, equal pages; hits are
    multiples of 256 (1,024 of 1,240 tokens)."""
    specs = [SlidingWindowSpec(256, BIG_PAGE, 128), FullAttentionSpec(128, BIG_PAGE)]
    first = boot(specs, 256, blocks=80, page=BIG_PAGE)
    first.run([Req("a", prompt(1240))], budget=512)
    second = boot(specs, 256, blocks=80, page=BIG_PAGE)
    b = Req("b", prompt(1240))
    second.run([b], budget=512)
    assert b.hit == 1024
    assert counters(second).get("null_block_writes_refused", 0) == 0
    assert_checked_exactly(second, b, budget=512)


# ------------------------------------------------------------------------------ KV events per group

_VLLM_KINDS = {
    "FullAttentionSpec": "full_attention",
    "SlidingWindowSpec": "sliding_window",
    "ChunkedLocalAttentionSpec": "chunked_local_attention",
}


@pytest.fixture
def kv_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """KV events on without vLLM: its event classes are kvfabric's wire records, its spec-kind
    functions stand-ins that answer as vLLM's ``get_kv_cache_spec_kind`` / ``..._sliding_window``
    do for these spec classes (the real ones are checked inside vLLM, ``tests/vllm``)."""
    from kvfabric.connector import vllmevents
    from kvfabric.rpc import kvevents as kv

    monkeypatch.setattr(vllmevents, "_VLLM", True)
    monkeypatch.setattr(vllmevents, "BlockStored", kv.BlockStored)
    monkeypatch.setattr(vllmevents, "BlockRemoved", kv.BlockRemoved)
    monkeypatch.setattr(
        vllmevents,
        "get_kv_cache_spec_kind",
        lambda s: SimpleNamespace(value=_VLLM_KINDS[type(s).__name__]),
        raising=False,
    )
    monkeypatch.setattr(
        vllmevents,
        "get_kv_cache_spec_sliding_window",
        lambda s: getattr(s, "sliding_window", None),
        raising=False,
    )


def hashed(req: Req, hash_block: int) -> Req:
    """``req`` with vLLM's block hashes: one per ``hash_block`` tokens, chained (here: its index)."""
    req.block_hashes = [f"h{i}".encode() for i in range(len(req.prompt_token_ids) // hash_block)]  # type: ignore[attr-defined]
    return req


@pytest.mark.parametrize(("swa_block", "full_block"), [(16, 16), (32, 16)])
def test_kv_events_name_each_group_as_vllm_does_and_only_the_blocks_it_holds(
    store: MemoryTransport, kv_events: None, swa_block: int, full_block: int
) -> None:
    """Gemma 3 shape (window 200, blocks 16) and Gemma 4 shape (sliding-window blocks 32 beside 16).

    Every ``BlockStored`` carries its group's ``group_idx``, ``kv_cache_spec_kind`` and
    ``kv_cache_spec_sliding_window`` and its group's block size; per group, the blocks announced
    are exactly those its objects hold: full attention every block up to the last stored boundary,
    sliding window only the trailing ``cdiv(w - 1, B)`` blocks of each span (vLLM names a block of
    ``B`` tokens by the request's hash at its end). Each (group, block) is announced once, and a
    lookup that finds an object gone withdraws its blocks from its groups only.
    """
    from kvfabric.rpc import kvevents as kv

    d = boot(swa_full(200, swa_block=swa_block, full_block=full_block), 256, events=True)
    hash_block = min(swa_block, full_block)  # vLLM's gcd of the groups' block sizes
    d.run([hashed(Req("a", prompt(1260)), hash_block)], budget=512)
    events = d.sched.take_events()
    stored = [e for e in events if isinstance(e, kv.BlockStored)]
    assert len(stored) == len(events)
    fields = {
        (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window, e.block_size) for e in stored
    }
    assert fields == {
        (0, "sliding_window", 200, swa_block),
        (1, "full_attention", None, full_block),
    }
    step = max(swa_block, full_block)  # the scheduler block: tails are of this size
    last = (1259 // step) * step  # the last boundary stored: the prompt's whole scheduler blocks
    # Spans: whole chunks of 256, then tail blocks of `step` tokens up to `last`.
    spans = [(c * 256, c * 256 + 256) for c in range(last // 256)]
    spans += [(e - step, e) for e in range(last // 256 * 256 + step, last + 1, step)]
    keep = -(-199 // swa_block)
    want = {
        1: {t // full_block for s, e in spans for t in range(s, e, full_block)},
        0: {t // swa_block for s, e in spans for t in range(max(s, e - keep * swa_block), e, swa_block)},
    }
    for group, block in ((0, swa_block), (1, full_block)):
        mine = [e for e in stored if e.group_idx == group]
        announced = [h for e in mine for h in e.block_hashes]
        assert len(announced) == len(set(announced))  # each block once per group
        scale = block // hash_block
        assert set(announced) == {f"h{(b + 1) * scale - 1}".encode() for b in want[group]}
        for e in mine:  # chained as vLLM chains a group's blocks, tokens covering them exactly
            first = int(bytes(e.block_hashes[0])[1:]) // scale
            assert e.parent_block_hash == (f"h{first * scale - 1}".encode() if first else None)
            tokens = prompt(1260)[first * block : (first + len(e.block_hashes)) * block]
            assert list(e.token_ids) == tokens
    # The window's objects hold strictly fewer blocks than the full kind's.
    assert len(want[0]) * swa_block < len(want[1]) * full_block
    # The last sliding-window object goes (evicted): the next lookup finds it absent and withdraws
    # its one block from group 0 alone (the full group's copy of the block stays credited).
    saves = [
        (k, kind)
        for m in d.plans
        for sv in m.saves
        for k, kind in zip(sv.keys, sv.objects.kinds, strict=True)
    ]
    victim = [k for k, kind in saves if kind == 0][-1]
    ns = next(n for n, k in store.blocks if k == victim)
    del store.blocks[(ns, victim)]
    b = hashed(Req("b", prompt(1260)), hash_block)
    d.run([b], budget=512)
    assert b.hit < last
    removed = [e for e in d.sched.take_events() if isinstance(e, kv.BlockRemoved)]
    last_swa = f"h{(last // swa_block) * (swa_block // hash_block) - 1}".encode()
    assert [(list(e.block_hashes), e.medium, e.group_idx) for e in removed] == [([last_swa], "CPU", 0)]
