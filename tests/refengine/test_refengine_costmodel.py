"""The cost model inside the connector, driven by the reference engine against an in-memory store.

What is proven: the worker's step timing reaches the scheduler's cost model (prefill after a cold
request, restore after a hit); a hit whose restore is expected to lose to recompute is not loaded,
is counted as ``miss.recompute-faster`` and still gives the recomputed logits; and the lookup's
deadline follows the expected prefill. Decisions are forced by feeding the model known costs, so
nothing here depends on this machine's speed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvfabric.connector.costmodel import PrefillSample, RestoreSample
from kvfabric.connector.resilient import CircuitBreaker, Endpoint, LookupOutcome, Reason, ResilientCache
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.refengine.engine import Engine
from kvfabric.refengine.model import RefModel
from kvfabric.refengine.testing import TINY, prompt
from kvfabric.testing.memtransport import MemoryTransport

CHUNK = 32
SETTINGS = ConnectorSettings(
    chunk_tokens=CHUNK, lookup_deadline_ms=500, load_deadline_ms=1000, cost_model=True
)


class Recording(MemoryTransport):
    """Remembers the deadline of every lookup."""

    def __init__(self) -> None:
        super().__init__()
        self.lookup_timeouts: list[float] = []

    def lookup(self, namespace: str, keys, *, timeout: float):  # type: ignore[no-untyped-def]
        self.lookup_timeouts.append(timeout)
        return super().lookup(namespace, keys, timeout=timeout)


def _engine(model: RefModel, store: MemoryTransport) -> Engine:
    cache = ResilientCache([Endpoint("mem", lambda: store, CircuitBreaker(5, 60.0))])
    return Engine(TINY, num_blocks=64, settings=SETTINGS, cache=cache, model=model)


def test_the_cost_model_learns_from_the_engine_and_skips_a_losing_load(tiny_model: RefModel) -> None:
    store = Recording()
    tokens = prompt(200, 11)
    e = _engine(tiny_model, store)
    assert e.scheduler_conn is not None
    assert e.worker_conn is not None
    costs = e.scheduler_conn.costs
    assert costs is not None
    costs.min_deadline_s = 0.5  # this test is about the decision, not the lookup's deadline
    cold = e.generate(tokens, 1)
    assert cold.hit_tokens == 0
    assert e.worker_conn.wait_for_stores(60)
    assert costs.prefill_seconds(0, 200) is not None, "the cold step's timing reached the scheduler"
    warm = e.generate(tokens, 1)  # restore still unmeasured: load, and so measure it
    assert warm.hit_tokens == 192
    assert costs.restore_seconds(["dram"]) is not None, "the hit's restore timing reached the scheduler"

    # Now make restoring look far slower than recomputing: the hit is skipped and recomputed.
    for chunks in (1, 6):
        costs.observe_restore(RestoreSample("dram", chunks * 16384, 10.0 * chunks), chunks)
    skipped = e.generate(tokens, 1)
    assert (skipped.hit_tokens, skipped.fallback_reason) == (0, Reason.RECOMPUTE_FASTER.value)
    assert torch.equal(skipped.first_logits, cold.first_logits)
    assert e.scheduler_conn.counters.get("miss.recompute-faster") == 1
    assert e.scheduler_conn.counters.get("miss_chunks.recompute-faster") == 6
    e.close()


def test_the_lookup_deadline_follows_the_expected_prefill(
    tiny_model: RefModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Recording()
    e = _engine(tiny_model, store)
    assert e.scheduler_conn is not None
    cache, costs = e.scheduler_conn.cache, e.scheduler_conn.costs
    assert cache is not None
    assert costs is not None
    deadlines: list[float] = []
    real = cache.lookup

    def spy(namespace: str, keys: list[str], deadline_s: float, **kw: Any) -> LookupOutcome:
        deadlines.append(deadline_s)
        return real(namespace, keys, deadline_s, **kw)

    monkeypatch.setattr(cache, "lookup", spy)
    e.generate(prompt(100, 12), 1)
    # The request's lookup gets the deadline; a tail lookup after it only what is left of it.
    assert deadlines[0] == 0.5  # nothing measured yet: the setting
    assert all(d <= deadlines[0] for d in deadlines)
    # An engine that prefills 1k tokens in ~30 ms gets ~3 ms per lookup (10 %, at least 5 ms), never
    # the 500 ms of the setting.
    costs._prefill.samples.clear()
    for t in (256, 1024, 4096):
        costs.observe_prefill(PrefillSample.single(0, t, 30e-6 * t))
    deadlines.clear()
    e.generate(prompt(1000, 13), 1)
    assert deadlines[0] == pytest.approx(0.005)
    assert all(d <= deadlines[0] for d in deadlines)
    costs._prefill.samples.clear()
    for t in (256, 1024, 4096):
        costs.observe_prefill(PrefillSample.single(0, t, 300e-6 * t))
    deadlines.clear()
    e.generate(prompt(1000, 14), 1)
    assert deadlines[0] == pytest.approx(0.1 * 300e-6 * 1000, rel=0.01)
    assert all(d <= deadlines[0] for d in deadlines)
    e.close()
