"""The worker half's loads own their memory: a transport call abandoned at its deadline can never
write into memory that a later load owns (issue 9, defect 2)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest
import torch

from kvfabric.client.results import LookupResult, StoreResult
from kvfabric.connector import layout
from kvfabric.connector.hostpath import HostStagingPath
from kvfabric.connector.keys import NamespaceSpec
from kvfabric.connector.resilient import CircuitBreaker, Endpoint, ResilientCache
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.connector.steps import LoadSpec, SaveSpec, StepPlan
from kvfabric.connector.worker import WorkerHalf

BLOCK, CHUNK, LAYERS = 4, 8, 2
SPEC = NamespaceSpec("m", "r", "float32", LAYERS, 1, 2, BLOCK, CHUNK)
NS = SPEC.digest()
KEY_A, KEY_B = "a" * 64, "b" * 64


def kv_caches() -> dict[str, torch.Tensor]:
    return {f"layer{i}": torch.zeros(8, 1, BLOCK, 4) for i in range(LAYERS)}


def payload(geo: layout.ChunkGeometry, key: str, value: float) -> bytes:
    buf = geo.new_payload()
    for layer in range(LAYERS):
        geo.layer_view(buf, layer).fill_(value)
    layout.seal(buf, namespace=NS, key=key, num_tokens=CHUNK, num_layers=LAYERS)
    return bytes(buf)


class LateWriter:
    """A transport whose load of ``KEY_A`` ignores its deadline and writes long after it.

    The late write is released by the load of ``KEY_B`` in the next step, after B's bytes landed,
    so it hits whatever memory A's call was given at the worst moment: after B arrived, before
    B is verified and scattered.
    """

    def __init__(self, blocks: dict[str, bytes]) -> None:
        self.blocks = blocks
        self.release_a = threading.Event()
        self.a_started = threading.Event()
        self.a_written = threading.Event()

    def lookup(self, namespace: str, keys: Sequence[str], *, timeout: float) -> LookupResult:
        return LookupResult(0, [])

    def load_into(
        self, namespace: str, keys: Sequence[str], buffers: Sequence[memoryview], *, timeout: float
    ) -> int:
        key = keys[0]
        if key == KEY_A:
            self.a_started.set()
            self.release_a.wait(30)  # far past the deadline
            buffers[0][:] = self.blocks[KEY_A]
            self.a_written.set()
            return 1
        buffers[0][:] = self.blocks[key]
        self.release_a.set()
        if self.a_started.is_set():
            self.a_written.wait(30)
        return 1

    def store(
        self,
        namespace: str,
        keys: Sequence[str],
        payloads: Sequence[bytes | bytearray | memoryview],
        *,
        timeout: float,
    ) -> StoreResult:
        return StoreResult(0, len(keys))

    def close(self) -> None:
        pass


@pytest.fixture
def worker() -> Iterator[tuple[WorkerHalf, dict[str, torch.Tensor], LateWriter]]:
    kv = kv_caches()
    geo = layout.ChunkGeometry.from_kv_caches(kv, block_size=BLOCK, chunk_tokens=CHUNK)
    transport = LateWriter({KEY_A: payload(geo, KEY_A, 1.0), KEY_B: payload(geo, KEY_B, 2.0)})
    cache = ResilientCache([Endpoint("late", lambda: transport, CircuitBreaker(100, 60.0))], retries=0)
    # Long enough that A's call surely starts before its deadline, even on a busy machine.
    settings = ConnectorSettings(chunk_tokens=CHUNK, load_deadline_ms=1000)
    w = WorkerHalf(settings, SPEC, cache=cache)
    w.register_kv_caches(kv)
    yield w, kv, transport
    transport.release_a.set()
    w.shutdown()


def step(w: WorkerHalf, key: str, blocks: list[int]) -> set[int]:
    w.bind_plan(StepPlan(loads=[LoadSpec("r", [key], [blocks])]))
    w.start_load()
    for name in ("layer0", "layer1"):
        w.wait_for_layer_load(name)
    # The engine's wait and the loader thread's wait end at the same deadline, in either order.
    # Take the order that exposed the bug: the loader thread has given up on the transport call
    # (its own work is done) before the step ends, while the call itself still runs.
    assert isinstance(w.datapath, HostStagingPath)
    w.datapath._loader().submit(lambda: None).result(30)
    errors = w.take_load_errors()
    w.clear_plan()
    return errors


def test_abandoned_load_never_writes_into_the_next_loads_memory(
    worker: tuple[WorkerHalf, dict[str, torch.Tensor], LateWriter],
) -> None:
    w, kv, transport = worker
    # Step N: A's load passes its deadline; its transport call is abandoned, not finished.
    assert step(w, KEY_A, [0, 1]) == {0, 1}
    assert transport.a_started.is_set()
    assert w.counters.get("fallback_chunks.timeout") == 1
    # Step N+1 loads B into other blocks. A's late write lands while B's load is in flight.
    assert step(w, KEY_B, [4, 5]) == set()
    assert transport.a_written.is_set()
    for layer in kv.values():
        assert torch.equal(layer[4:6], torch.full_like(layer[4:6], 2.0)), "step N+1's KV is not B's payload"
        assert torch.equal(layer[0:2], torch.zeros_like(layer[0:2])), (
            "the abandoned load reached the KV cache"
        )
    assert w.counters.get("loaded_chunks") == 1


@pytest.mark.parametrize(
    ("device_type", "block_size"), [("cuda", BLOCK), ("cpu", 2 * BLOCK)], ids=["device", "block-size"]
)
def test_a_kv_cache_that_does_not_match_the_namespace_disables_the_worker(
    device_type: str, block_size: int
) -> None:
    """Tensors on another device, or with other blocks, than the namespace says are never loaded
    into or stored from: their bytes would be filed under the wrong namespace."""
    import dataclasses

    spec = dataclasses.replace(SPEC, device_type=device_type, block_size=block_size)
    kv = kv_caches()
    geo = layout.ChunkGeometry.from_kv_caches(kv, block_size=BLOCK, chunk_tokens=CHUNK)
    transport = LateWriter({KEY_B: payload(geo, KEY_B, 2.0)})
    cache = ResilientCache([Endpoint("t", lambda: transport, CircuitBreaker(100, 60.0))], retries=0)
    w = WorkerHalf(ConnectorSettings(chunk_tokens=CHUNK), spec, cache=cache)
    w.register_kv_caches(kv)
    assert w.disabled is not None
    transport.a_written.set()
    assert step(w, KEY_B, [4, 5]) == {4, 5}
    for layer in kv.values():
        assert torch.equal(layer, torch.zeros_like(layer))
    w.bind_plan(StepPlan(saves=[SaveSpec("r", [KEY_B], [[4, 5]])]))
    for name, layer in kv.items():
        w.save_kv_layer(name, layer)
    w.wait_for_save()
    assert w.wait_for_stores(30)
    assert w.counters.get("store_accepted") + w.counters.get("store_dropped") == 0
    w.clear_plan()
    w.shutdown()
