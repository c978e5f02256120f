"""The reference engine + connector against an in-memory store: fast checks of the logic.

The same properties are checked against real cache-server processes in test_refengine_server.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from kvfabric.connector import layout
from kvfabric.connector.resilient import CircuitBreaker, Endpoint, ResilientCache
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.connector.steps import RequestInfo
from kvfabric.refengine.engine import Engine
from kvfabric.refengine.model import RefModel
from kvfabric.refengine.testing import TINY, prompt
from kvfabric.testing.memtransport import MemoryTransport

# These tests check what a load does; whether to load is the cost model's (test_refengine_costmodel.py).
SETTINGS = ConnectorSettings(chunk_tokens=32, lookup_deadline_ms=200, load_deadline_ms=300, cost_model=False)


@pytest.fixture
def store() -> Iterator[MemoryTransport]:
    t = MemoryTransport()
    yield t
    t.release.set()


def engine(model: RefModel, store: MemoryTransport, settings: ConnectorSettings = SETTINGS) -> Engine:
    cache = ResilientCache([Endpoint("mem", lambda: store, CircuitBreaker(2, 60.0))])
    return Engine(TINY, num_blocks=64, settings=settings, cache=cache, model=model)


def baseline(model: RefModel, tokens: list[int], max_tokens: int = 3) -> tuple[torch.Tensor, list[int]]:
    e = Engine(TINY, num_blocks=64, model=model)
    r = e.generate(tokens, max_tokens)
    return r.first_logits, r.output_token_ids


def warm(model: RefModel, store: MemoryTransport, tokens: list[int]) -> None:
    e = engine(model, store)
    r = e.generate(tokens, 1)
    assert r.hit_tokens == 0
    assert e.worker_conn is not None
    assert e.worker_conn.wait_for_stores(60)
    e.close()


def test_loaded_prefix_gives_recomputed_logits(tiny_model: RefModel, store: MemoryTransport) -> None:
    tokens = prompt(200, 1)
    ref_logits, ref_out = baseline(tiny_model, tokens)
    warm(tiny_model, store, tokens)
    assert len(store.blocks) == 6  # 200 tokens -> 6 whole chunks of 32
    e = engine(tiny_model, store)
    r = e.generate(tokens, 3)
    assert (r.hit_tokens, r.tier, r.fallback_reason) == (192, "dram", None)
    assert (r.first_logits - ref_logits).abs().max().item() <= 1e-5
    assert r.output_token_ids == ref_out
    e.close()


def test_partial_prefix_hit(tiny_model: RefModel, store: MemoryTransport) -> None:
    shared = prompt(100, 2)
    warm(tiny_model, store, shared)
    tokens = shared[:80] + prompt(90, 3)  # diverges inside chunk 2
    e = engine(tiny_model, store)
    r = e.generate(tokens, 2)
    assert r.hit_tokens == 64
    ref_logits, ref_out = baseline(tiny_model, tokens, 2)
    assert (r.first_logits - ref_logits).abs().max().item() <= 1e-5
    assert r.output_token_ids == ref_out
    e.close()


def test_corrupt_chunk_is_recomputed_from_there(tiny_model: RefModel, store: MemoryTransport) -> None:
    tokens = prompt(200, 4)
    warm(tiny_model, store, tokens)
    e = engine(tiny_model, store)
    assert e.scheduler_conn is not None
    bad = e.scheduler_conn.chunk_keys(RequestInfo("x", tuple(tokens)))[3]
    store.corrupt_keys.add(bad)
    r = e.generate(tokens, 2)
    assert r.recomputed_after_load_error
    assert (r.hit_tokens, r.fallback_reason) == (96, "corrupt")  # the three intact chunks are used
    ref_logits, ref_out = baseline(tiny_model, tokens, 2)
    assert (r.first_logits - ref_logits).abs().max().item() <= 1e-5
    assert r.output_token_ids == ref_out
    assert e.worker_conn is not None
    assert e.worker_conn.counters.get("fallback_chunks.corrupt") == 3
    e.close()


def test_foreign_namespace_payload_is_never_loaded(tiny_model: RefModel, store: MemoryTransport) -> None:
    tokens = prompt(100, 5)
    warm(tiny_model, store, tokens)
    e = engine(tiny_model, store)
    assert e.worker_conn is not None
    ns = e.worker_conn.namespace
    # A payload sealed for another namespace placed under this namespace's key (a buggy or hostile
    # server): the header check turns it into a miss.
    for (space, key), data in list(store.blocks.items()):
        buf = bytearray(data)
        layout.seal(buf, namespace="f" * 64, key=key, num_tokens=32, num_layers=TINY.num_layers)
        store.blocks[(space, key)] = bytes(buf)
        assert space == ns
    r = e.generate(tokens, 1)
    assert (r.hit_tokens, r.fallback_reason) == (0, "namespace-mismatch")
    ref_logits, _ = baseline(tiny_model, tokens, 1)
    assert (r.first_logits - ref_logits).abs().max().item() <= 1e-5
    e.close()


def test_revision_or_dtype_change_is_a_miss(tiny_model: RefModel, store: MemoryTransport) -> None:
    tokens = prompt(100, 6)
    warm(tiny_model, store, tokens)
    other = engine(tiny_model, store, SETTINGS.model_copy(update={"model_revision": "other"}))
    r = other.generate(tokens, 1)
    assert (r.hit_tokens, r.fallback_reason) == (0, "not-found")
    other.close()


def test_hung_store_costs_at_most_the_deadline(tiny_model: RefModel, store: MemoryTransport) -> None:
    tokens = prompt(100, 7)
    warm(tiny_model, store, tokens)
    e = engine(tiny_model, store)
    store.hang.set()
    r = e.generate(tokens, 2)
    assert (r.hit_tokens, r.fallback_reason) == (0, "timeout")
    ref_logits, ref_out = baseline(tiny_model, tokens, 2)
    assert (r.first_logits - ref_logits).abs().max().item() <= 1e-5
    assert r.output_token_ids == ref_out
    e.close()


def test_load_that_hangs_after_a_hit_is_recomputed(tiny_model: RefModel, store: MemoryTransport) -> None:
    tokens = prompt(100, 8)
    warm(tiny_model, store, tokens)
    e = engine(tiny_model, store)
    original = store.load_into

    def hang_load(*args: object, **kwargs: object) -> int:
        threading.Event().wait(5)  # longer than the 300 ms load deadline
        return 0

    store.load_into = hang_load  # type: ignore[method-assign]
    r = e.generate(tokens, 2)
    store.load_into = original  # type: ignore[method-assign]
    assert r.recomputed_after_load_error
    assert (r.hit_tokens, r.fallback_reason) == (0, "timeout")
    ref_logits, ref_out = baseline(tiny_model, tokens, 2)
    assert (r.first_logits - ref_logits).abs().max().item() <= 1e-5
    assert r.output_token_ids == ref_out
    e.close()


def test_connector_bug_during_restore_is_a_recompute(
    tiny_model: RefModel, store: MemoryTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = prompt(100, 9)
    warm(tiny_model, store, tokens)
    e = engine(tiny_model, store)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected scatter bug")

    monkeypatch.setattr(layout, "scatter_chunks", broken)
    r = e.generate(tokens, 2)
    assert r.recomputed_after_load_error
    assert r.hit_tokens == 0
    ref_logits, ref_out = baseline(tiny_model, tokens, 2)
    assert (r.first_logits - ref_logits).abs().max().item() <= 1e-5
    assert r.output_token_ids == ref_out
    assert e.worker_conn is not None
    assert e.worker_conn.counters.get("internal_error.wait_for_layer_load") == 1
    e.close()


def test_incomplete_layer_saves_are_never_stored(tiny_model: RefModel, store: MemoryTransport) -> None:
    e = engine(tiny_model, store)
    assert e.worker_conn is not None
    worker = e.worker_conn
    original = worker._save_kv_layer
    last = tiny_model.layer_names[-1]

    def skip_last(layer_name: str, *args: object, **kwargs: object) -> None:
        if layer_name != last:  # as if a CUDA-graph replay skipped the hook of the last layer
            original(layer_name, *args, **kwargs)  # type: ignore[arg-type]

    worker._save_kv_layer = skip_last  # type: ignore[method-assign]
    e.generate(prompt(100, 10), 1)
    assert worker.wait_for_stores(60)
    assert store.blocks == {}
    assert worker.counters.get("store_skipped_incomplete") == 3
    e.close()


def test_chunked_prefill_saves_every_chunk_and_loads_them(
    tiny_model: RefModel, store: MemoryTransport
) -> None:
    """Prefill in steps that do not line up with chunks (vLLM's chunked prefill), store and load."""
    tokens = prompt(230, 12)
    ref_logits, ref_out = baseline(tiny_model, tokens, 3)
    cache = ResilientCache([Endpoint("mem", lambda: store, CircuitBreaker(2, 60.0))])
    writer = Engine(
        TINY, num_blocks=64, settings=SETTINGS, cache=cache, model=tiny_model, max_prefill_tokens=40
    )
    cold = writer.generate(tokens, 3)
    assert writer.worker_conn is not None
    assert writer.worker_conn.wait_for_stores(60)
    writer.close()
    assert len(store.blocks) == 7  # every whole chunk, completed across six steps
    assert (cold.first_logits - ref_logits).abs().max().item() <= 1e-5
    cache = ResilientCache([Endpoint("mem", lambda: store, CircuitBreaker(2, 60.0))])
    reader = Engine(
        TINY, num_blocks=64, settings=SETTINGS, cache=cache, model=tiny_model, max_prefill_tokens=16
    )
    assert reader.scheduler_conn is not None
    keys = reader.scheduler_conn.chunk_keys(RequestInfo("x", tuple(tokens)))
    store.corrupt_keys.add(keys[5])  # the load breaks at chunk 5: chunks 0-4 are used
    warm = reader.generate(tokens, 3)
    assert (warm.hit_tokens, warm.fallback_reason, warm.recomputed_after_load_error) == (160, "corrupt", True)
    assert (warm.first_logits - ref_logits).abs().max().item() <= 1e-5
    assert warm.output_token_ids == ref_out
    reader.close()


def test_lora_request_hits_for_its_adapter_and_misses_for_another(
    tiny_model: RefModel, store: MemoryTransport
) -> None:
    """Issue 9.4: LoRA requests are cached (no longer bypassed) and never share another adapter's KV."""
    tokens = prompt(200, 13)
    ref_sql = Engine(TINY, num_blocks=64, model=tiny_model).generate(tokens, 2, lora="sql")
    ref_chat = Engine(TINY, num_blocks=64, model=tiny_model).generate(tokens, 2, lora="chat")
    ref_base, _ = baseline(tiny_model, tokens, 2)
    assert (ref_sql.first_logits - ref_base).abs().max().item() > 1e-3  # the adapter changes the KV
    e = engine(tiny_model, store)
    assert e.generate(tokens, 1, lora="sql").hit_tokens == 0
    assert e.worker_conn is not None
    assert e.worker_conn.wait_for_stores(60)
    e.close()
    for lora, ref, hit in (("sql", ref_sql, 192), ("chat", ref_chat, 0), (None, None, 0)):
        e = engine(tiny_model, store)
        r = e.generate(tokens, 2, lora=lora)
        assert r.hit_tokens == hit, lora
        if hit == 0:
            assert r.fallback_reason == "not-found"
        want = ref.first_logits if ref is not None else ref_base
        assert (r.first_logits - want).abs().max().item() <= 1e-5
        if ref is not None:
            assert r.output_token_ids == ref.output_token_ids
        assert e.worker_conn is not None
        assert e.worker_conn.wait_for_stores(60)
        e.close()
