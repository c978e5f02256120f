"""The connector's vLLM API surface beyond loads and saves, on duck-typed objects (no vLLM needed).

Stats and Prometheus metrics, hit sources, logging through vLLM's handlers, transitions logged
once, KV events, start-up refusals and the zeroing shortcut. ``tests/vllm`` checks the same inside
real vLLM (its ``/metrics``, its log).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvfabric.connector import vllm as kvvllm
from kvfabric.connector import vllmevents
from kvfabric.connector.resilient import Counters, Reason
from kvfabric.connector.steps import LoadSpec, SaveSpec, StepPlan
from kvfabric.connector.vllmmetrics import (
    CounterDeltas,
    KVFabricPromMetrics,
    KVFabricStats,
    TransitionLog,
    adopt_vllm_logging,
    hit_source,
    stats_payload,
)

pytestmark = pytest.mark.unit


def test_counter_deltas_report_each_increment_once_even_when_shared() -> None:
    counters = Counters()
    a, b = CounterDeltas.of(counters), CounterDeltas.of(counters)
    assert a is b  # the scheduler and worker halves of one process share one taker
    counters.add("loaded_chunks", 3)
    assert a.take() == {"loaded_chunks": 3}
    assert b.take() == {}
    counters.add("loaded_chunks", 2)
    counters.add("lookups")
    assert b.take() == {"loaded_chunks": 2, "lookups": 1}


def test_stats_payload_derives_loaded_and_failed_tokens() -> None:
    data = stats_payload({"loaded_chunks": 2, "fallback_chunks.timeout": 1, "lookups": 4}, 256, 0.25)
    assert data["loaded_tokens"] == 512
    assert data["load_failed_tokens.timeout"] == 256
    assert data["restore_seconds"] == 0.25
    assert data["lookups"] == 4
    assert "server_suspected" not in data


def test_suspicions_of_every_endpoint_are_one_exported_counter() -> None:
    data = stats_payload({"suspect.local": 2, "suspect.remote": 1, "lookups": 4}, 256)
    assert data["server_suspected"] == 3


def test_stats_aggregate_sum_and_reduce() -> None:
    a = KVFabricStats(data={"loaded_tokens": 256, "lookups": 1})
    b = KVFabricStats(data={"loaded_tokens": 512, "restore_seconds": 0.5})
    total = a.aggregate(b)
    assert total.reduce() == {"loaded_tokens": 768, "lookups": 1, "restore_seconds": 0.5}
    assert not total.is_empty()
    total.reset()
    assert total.is_empty()
    assert kvvllm.KVFabricConnector.build_kv_connector_stats({"x": 1}).data == {"x": 1}  # type: ignore[union-attr]


def _metric_types(registry: CollectorRegistry) -> dict[type, type]:
    def bound(base: type) -> type:
        class Bound(base):  # type: ignore[misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    return {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}


def test_prometheus_metrics_count_loaded_and_failed_tokens_per_engine() -> None:
    registry = CollectorRegistry()
    prom = kvvllm.KVFabricConnector.build_prom_metrics(
        None, _metric_types(registry), ["model_name", "engine"], {0: ["tiny", 0]}
    )
    assert isinstance(prom, KVFabricPromMetrics)
    prom.observe(
        stats_payload(
            {
                "loaded_chunks": 3,
                "loaded_bytes.full": 4096,
                "loaded_bytes.sliding_window": 1024,
                "stored_bytes.sliding_window": 512,
                "null_block_writes_refused": 1,
                "fallback_chunks.unavailable": 2,
                "lookups": 5,
            },
            256,
            0.1,
        )
    )
    labels = {"model_name": "tiny", "engine": "0"}
    assert registry.get_sample_value("vllm:kvfabric_loaded_tokens_total", labels) == 768
    assert (
        registry.get_sample_value(
            "vllm:kvfabric_load_failed_tokens_total", {**labels, "reason": "unavailable"}
        )
        == 512
    )
    assert registry.get_sample_value("vllm:kvfabric_restore_seconds_total", labels) == pytest.approx(0.1)
    assert registry.get_sample_value("vllm:kvfabric_events_total", {**labels, "event": "lookups"}) == 5
    assert registry.get_sample_value("vllm:kvfabric_loaded_bytes_total", {**labels, "kind": "full"}) == 4096
    assert (
        registry.get_sample_value("vllm:kvfabric_loaded_bytes_total", {**labels, "kind": "sliding_window"})
        == 1024
    )
    assert (
        registry.get_sample_value("vllm:kvfabric_stored_bytes_total", {**labels, "kind": "sliding_window"})
        == 512
    )
    assert registry.get_sample_value("vllm:kvfabric_null_block_writes_refused_total", labels) == 1
    # Each quantity is counted once: what has a metric of its own is not an event too.
    for own in (
        "loaded_bytes.full",
        "loaded_bytes.sliding_window",
        "stored_bytes.sliding_window",
        "null_block_writes_refused",
        "loaded_tokens",
        "restore_seconds",
        "load_failed_tokens.unavailable",
    ):
        assert registry.get_sample_value("vllm:kvfabric_events_total", {**labels, "event": own}) is None, own


def test_every_failure_reason_is_exported_at_zero_before_its_first_failure() -> None:
    """Prometheus sees a failure reason's first increase only if the series existed before it."""
    registry = CollectorRegistry()
    kvvllm.KVFabricConnector.build_prom_metrics(
        None, _metric_types(registry), ["model_name", "engine"], {0: ["tiny", 0], 1: ["tiny", 1]}
    )
    for engine in ("0", "1"):
        for reason in Reason:
            labels = {"model_name": "tiny", "engine": engine, "reason": reason.value}
            assert registry.get_sample_value("vllm:kvfabric_load_failed_tokens_total", labels) == 0, labels


def test_hit_sources_name_kvfabric_tiers() -> None:
    assert hit_source("dram") == "host"
    assert hit_source("local_disk") == "disk"
    assert hit_source("shared") == "disk"
    assert hit_source(None) == "external_unspecified"


def test_transitions_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    t = TransitionLog("loads", logging.getLogger("kvfabric.test"))
    with caplog.at_level(logging.INFO, logger="kvfabric.test"):
        for reason in [None, "timeout", "timeout", "unavailable", None, None]:
            t.note(reason)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "failing (timeout)" in messages[0]
    assert "working again (after unavailable)" in messages[1]


def test_kvfabric_logs_go_through_vllms_handlers() -> None:
    vllm_logger, ours = logging.getLogger("vllm"), logging.getLogger("kvfabric.adopt-test")
    handler = logging.NullHandler()
    vllm_logger.addHandler(handler)
    try:
        assert adopt_vllm_logging("kvfabric.adopt-test")
        assert handler in ours.handlers
        assert not ours.propagate
        assert not adopt_vllm_logging("kvfabric.adopt-test")  # idempotent
    finally:
        vllm_logger.removeHandler(handler)
        ours.handlers.clear()
        ours.propagate = True


def test_expandable_segments_detected() -> None:
    assert kvvllm.expandable_segments_on({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert kvvllm.expandable_segments_on(
        {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:true"}
    )
    assert not kvvllm.expandable_segments_on({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert not kvvllm.expandable_segments_on({})


def test_recurrent_state_groups_are_refused_with_the_reason() -> None:
    class MambaSpec:
        block_size = 128
        shapes = ((3, 256), (4, 32, 32))

    class FullAttentionSpec:
        block_size = 128

    config = SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(layer_names=["l0"], kv_cache_spec=MambaSpec()),
            SimpleNamespace(layer_names=["l1"], kv_cache_spec=FullAttentionSpec()),
        ]
    )
    with pytest.raises(ValueError, match=r"recurrent \(Mamba / linear-attention\) state"):
        kvvllm.group_plan_from_vllm(SimpleNamespace(cache_config=SimpleNamespace(block_size=16)), config)
    assert kvvllm.group_plan_from_vllm(None, None) is None


def test_sleep_mode_is_declined() -> None:
    assert kvvllm.KVFabricConnector.supports_sleep_mode(None) is False


def test_loaded_blocks_are_not_zeroed() -> None:
    out = SimpleNamespace(new_block_ids_to_zero=[1, 2, 3, 4, 9])
    plan = StepPlan(loads=[LoadSpec("r", ["k0", "k1"], [[1, 2], [3, 4]])])
    kvvllm.drop_overwritten_from_zeroing(out, plan)
    assert out.new_block_ids_to_zero == [9]
    empty = SimpleNamespace(new_block_ids_to_zero=None)
    kvvllm.drop_overwritten_from_zeroing(empty, plan)
    assert empty.new_block_ids_to_zero is None


@dataclass
class _Stored:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: Any
    medium: str | None
    lora_name: Any


@dataclass
class _Removed:
    block_hashes: list[Any]
    medium: str | None


@dataclass
class _Request:
    block_hashes: list[bytes]
    all_token_ids: list[int]
    lora_request: Any = None
    prompt_token_ids: list[int] = field(default_factory=list)


def test_kv_events_announce_stored_chunks_and_tail_blocks_once_and_withdraw_missing_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vllmevents, "_VLLM", True)
    monkeypatch.setattr(vllmevents, "to_vllm", lambda e: e)
    log = vllmevents.KVEventLog(block_size=2, enabled=True)
    req = _Request([b"h0", b"h1", b"h2", b"h3", b"h4"], list(range(10)))
    # Chunks k0 and k1 (blocks 0-1, 2-3), then a tail block t4 (block 4) of the partial chunk 2.
    save = SaveSpec("r", ["k0", "k1", "t4"], [[10, 11], [12, 13], [14]], tail=1, first_blocks=[0, 2, 4])
    log.stored(req, save)
    log.stored(req, SaveSpec("r", ["k1"], [[12, 13]], first_blocks=[2]))  # already announced
    events = log.take()
    assert [e.block_hashes for e in events] == [(b"h0", b"h1"), (b"h2", b"h3"), (b"h4",)]
    assert [e.parent_block_hash for e in events] == [None, b"h1", b"h3"]
    assert events[1].token_ids == (4, 5, 6, 7)
    assert events[2].token_ids == (8, 9)
    assert {e.medium for e in events} == {"CPU"}
    assert log.take() == []
    log.found_missing(["k1", "t4", "never-announced"])
    assert [e.block_hashes for e in log.take()] == [(b"h2", b"h3"), (b"h4",)]
    log.found_missing(["k1"])
    assert log.take() == []
    # A block vLLM has not hashed (prefix caching off, or not full yet) is never announced.
    log.stored(req, SaveSpec("r", ["t5"], [[15]], tail=1, first_blocks=[5]))
    assert log.take() == []


def test_kv_events_off_without_vllms_event_config() -> None:
    log = vllmevents.KVEventLog(block_size=2, enabled=False)
    log.stored(_Request([b"h0", b"h1"], [1, 2, 3, 4]), SaveSpec("r", ["k0"], [[1, 2]], first_blocks=[0]))
    assert log.take() == []


def test_only_faults_of_the_cache_log_lookups_as_failing(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the connector's own lookup hook: a miss is the cache working; an outage is failing."""
    from tests.connector.test_connector_vllm import fake_vllm_config

    from kvfabric.connector.resilient import CircuitBreaker, Endpoint, ResilientCache
    from kvfabric.testing.memtransport import MemoryTransport

    monkeypatch.delenv("KVFABRIC_SOCKET", raising=False)
    monkeypatch.delenv("KVFABRIC_REMOTE", raising=False)
    sched = kvvllm.KVFabricConnector(fake_vllm_config(chunk_tokens=32), SimpleNamespace(name="SCHEDULER"))
    transport = MemoryTransport()
    cache = ResilientCache([Endpoint("m", lambda: transport, CircuitBreaker(100, 60.0))], retries=0)
    half = sched.scheduler_half
    half.cache, half.counters = cache, cache.counters
    outcomes = []
    with caplog.at_level(logging.INFO, logger="kvfabric"):
        for n, down in enumerate([False, False, True, True, False, False]):
            transport.down = down
            req = SimpleNamespace(
                request_id=f"r{n}", prompt_token_ids=list(range(n, n + 100)), lora_request=None
            )
            assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
            outcomes.append(half.lookup_reason(req.request_id))
    assert outcomes == [Reason.NOT_FOUND] * 2 + [Reason.UNAVAILABLE] * 2 + [Reason.NOT_FOUND] * 2
    messages = [r.getMessage() for r in caplog.records if "kvfabric lookups" in r.getMessage()]
    assert len(messages) == 2, messages  # the misses before and after log nothing
    assert "lookups failing (unavailable)" in messages[0]
    assert "lookups working again (after unavailable)" in messages[1]
    cache.close()
    sched.shutdown()


def test_a_gpu_backend_configured_on_cpu_is_named_as_the_platforms_choice() -> None:
    """vLLM's CPU platform runs its own attention whatever a model configures (Gemma 4 asks for
    TRITON_ATTN): naming the configured one made every worker disable itself."""

    def cfg(device: str, backend: str | None) -> Any:
        return SimpleNamespace(
            attention_config=SimpleNamespace(backend=backend),
            device_config=SimpleNamespace(device_type=device),
        )

    assert kvvllm.attention_backend_from_vllm(cfg("cpu", "TRITON_ATTN")).startswith("auto:cpu:")
    assert kvvllm.attention_backend_from_vllm(cfg("cpu", "CPU_ATTN")) == "CPU_ATTN"
    assert kvvllm.attention_backend_from_vllm(cfg("cuda", "TRITON_ATTN")) == "TRITON_ATTN"
