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

from types import SimpleNamespace
from typing import Any

import pytest
from tests.connector.hybrid_sim import Driver, Engine, Req, SlidingWindowSpec, vllm_config

from kvfabric.connector import vllm as kvvllm
from kvfabric.connector.resilient import CircuitBreaker, Endpoint, ResilientCache
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.testing.memtransport import MemoryTransport

PAGE = 16 * 8 * 4  # bytes of one block of one layer (block 16, head 8, fp32): equal in every group
HEADER = 128  # a stored object's header


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> MemoryTransport:
    """One memory cache server that outlives every simulated vLLM process."""
    transport = MemoryTransport()

    def build(settings: ConnectorSettings, **_: Any) -> ResilientCache:
        return ResilientCache([Endpoint("m", lambda: transport, CircuitBreaker(100, 60.0))])

    monkeypatch.setattr(kvvllm, "build_cache", build)
    monkeypatch.delenv("KVFABRIC_REMOTE", raising=False)
    return transport


def boot(specs: list[Any], chunk: int, *, layers: int = 2, blocks: int = 400, **extra: Any) -> Driver:
    """Start one simulated vLLM process (engine + both connector halves)."""
    engine = Engine(specs, layers, blocks, PAGE)
    cfg = vllm_config(chunk, **extra)
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
    assert second.engine.checked_positions > 0
    # Only the window's blocks moved: cdiv(127, 16) = 8 blocks of each of 2 layers.
    blocks = sum(len(ids) for meta in second.plans for spec in meta.loads for ids in spec.block_ids)
    assert blocks == 8
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
