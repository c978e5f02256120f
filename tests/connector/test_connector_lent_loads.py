"""Lent loads: payloads verified and scattered in the sealed mapping itself, and every lease let go.

What is promised (kvfabric.connector.hostpath, docs/performance.md "Restores in place"):

- a same-node load whose blocks are lent places exactly the verified payload (no staging copy);
- every lease is released: after the scatter, after a damaged payload (a miss, as on the staging
  path), and, for a call given up at its deadline, when that call ends; a lease never outlives
  its use, or the server would keep the block held and charged to this client;
- a load given up at its deadline places nothing it had not verified by then, and a later load is
  unaffected;
- a verified payload is placed while the next one is still being verified (the engine's copies
  overlap the loader's verification).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator, Sequence

import pytest
import torch

from kvfabric.client.mappings import Lease
from kvfabric.client.results import LookupResult, StoreResult
from kvfabric.connector import layout
from kvfabric.connector.hostpath import HostStagingPath
from kvfabric.connector.keys import NamespaceSpec
from kvfabric.connector.resilient import CircuitBreaker, Endpoint, ResilientCache
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.connector.steps import LoadSpec, StepPlan
from kvfabric.connector.worker import WorkerHalf
from kvfabric.testing.serverproc import wait_until

pytestmark = pytest.mark.unit

BLOCK, CHUNK, LAYERS = 4, 8, 2
SPEC = NamespaceSpec("m", "r", "float32", LAYERS, 1, 2, BLOCK, CHUNK)
NS = SPEC.digest()
KEY_A, KEY_B, KEY_C = "a" * 64, "b" * 64, "c" * 64


def kv_caches() -> dict[str, torch.Tensor]:
    return {f"layer{i}": torch.zeros(8, 1, BLOCK, 4) for i in range(LAYERS)}


def payload(geo: layout.ChunkGeometry, key: str, value: float) -> bytes:
    buf = geo.new_payload()
    for layer in range(LAYERS):
        geo.layer_view(buf, layer).fill_(value)
    layout.seal(buf, namespace=NS, key=key, num_tokens=CHUNK, num_layers=LAYERS)
    return bytes(buf)


class Lender:
    """A same-node transport that lends read-only views and counts the leases still out.

    Its load of ``KEY_A`` ignores the deadline: it returns its leases only when ``release_a`` is set.
    """

    lends = True

    def __init__(self, blocks: dict[str, bytes]) -> None:
        self.blocks = blocks
        self.out = 0
        self.lent = 0
        self.lock = threading.Lock()
        self.release_a = threading.Event()
        self.a_started = threading.Event()
        self.a_returned = threading.Event()
        self.copied = 0

    def _lease(self, data: bytes) -> Lease:
        with self.lock:
            self.out += 1
            self.lent += 1
        lent = bytearray(data)

        def give_back() -> None:
            # What the bytes of a released lease may become (the block evicted, its memory reused):
            # a scatter after the release would place this garbage.
            lent[:] = b"\xee" * len(lent)
            with self.lock:
                self.out -= 1

        return Lease(memoryview(lent).toreadonly(), give_back)

    def load_views(self, namespace: str, keys: Sequence[str], *, timeout: float) -> list[Lease]:
        if keys[0] == KEY_A:
            self.a_started.set()
            self.release_a.wait(30)  # far past the deadline
            self.a_returned.set()
        return [self._lease(self.blocks[k]) for k in keys if k in self.blocks]

    def lookup(self, namespace: str, keys: Sequence[str], *, timeout: float) -> LookupResult:
        return LookupResult(0, [])

    def load_into(
        self, namespace: str, keys: Sequence[str], buffers: Sequence[memoryview], *, timeout: float
    ) -> int:
        self.copied += 1
        raise AssertionError("a lending transport is not asked to copy")

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
def worker() -> Iterator[tuple[WorkerHalf, dict[str, torch.Tensor], Lender]]:
    kv = kv_caches()
    geo = layout.ChunkGeometry.from_kv_caches(kv, block_size=BLOCK, chunk_tokens=CHUNK)
    bad = bytearray(payload(geo, KEY_C, 3.0))
    bad[-1] ^= 0xFF  # damaged after sealing
    transport = Lender({KEY_A: payload(geo, KEY_A, 1.0), KEY_B: payload(geo, KEY_B, 2.0), KEY_C: bytes(bad)})
    cache = ResilientCache([Endpoint("lender", lambda: transport, CircuitBreaker(100, 60.0))], retries=0)
    cache.endpoints[0].client()  # connected: the path lends from the first load on
    w = WorkerHalf(ConnectorSettings(chunk_tokens=CHUNK, load_deadline_ms=1000), SPEC, cache=cache)
    w.register_kv_caches(kv)
    yield w, kv, transport
    transport.release_a.set()
    w.shutdown()


def step(w: WorkerHalf, key: str, blocks: list[int]) -> set[int]:
    w.bind_plan(StepPlan(loads=[LoadSpec("r", [key], [blocks])]))
    w.start_load()
    for name in ("layer0", "layer1"):
        w.wait_for_layer_load(name)
    assert isinstance(w.datapath, HostStagingPath)
    errors = w.take_load_errors()
    w.clear_plan()
    return errors


def test_a_lent_load_places_the_verified_payload_and_lets_every_lease_go(
    worker: tuple[WorkerHalf, dict[str, torch.Tensor], Lender],
) -> None:
    w, kv, transport = worker
    assert step(w, KEY_B, [4, 5]) == set()
    for layer in kv.values():
        assert torch.equal(layer[4:6], torch.full_like(layer[4:6], 2.0))
        assert torch.equal(layer[0:4], torch.zeros_like(layer[0:4])), "only the load's blocks changed"
    assert w.counters.get("loads_lent") == 1
    assert transport.lent == 1
    assert transport.out == 0, "a lease outlived the scatter"
    assert transport.copied == 0


def test_a_damaged_lent_payload_is_recomputed_and_its_lease_let_go(
    worker: tuple[WorkerHalf, dict[str, torch.Tensor], Lender],
) -> None:
    w, kv, transport = worker
    assert step(w, KEY_C, [2, 3]) == {2, 3}
    assert w.counters.get("fallback_chunks.corrupt") == 1
    for layer in kv.values():
        assert torch.equal(layer, torch.zeros_like(layer)), "a damaged payload reached the KV cache"
    assert transport.out == 0


def test_the_leases_of_a_load_given_up_at_its_deadline_are_let_go_when_its_call_ends(
    worker: tuple[WorkerHalf, dict[str, torch.Tensor], Lender],
) -> None:
    w, kv, transport = worker
    assert step(w, KEY_A, [0, 1]) == {0, 1}
    assert transport.a_started.is_set()
    assert w.counters.get("fallback_chunks.timeout") == 1
    # The next step's load is lent and placed while A's call still runs.
    assert step(w, KEY_B, [4, 5]) == set()
    transport.release_a.set()
    assert transport.a_returned.wait(10)
    wait_until(lambda: transport.out == 0, 10, what="the abandoned call's leases to be let go")
    assert transport.lent == 2
    for layer in kv.values():
        assert torch.equal(layer[0:2], torch.zeros_like(layer[0:2])), "the abandoned load was placed"
        assert torch.equal(layer[4:6], torch.full_like(layer[4:6], 2.0))


def _same(transport: Lender) -> Lender:
    return transport


class Copier(Lender):
    """The same blocks, copied into the caller's staging buffers (the path without kept mappings)."""

    lends = False

    def load_into(
        self, namespace: str, keys: Sequence[str], buffers: Sequence[memoryview], *, timeout: float
    ) -> int:
        self.copied += 1
        n = 0
        for key, buf in zip(keys, buffers, strict=False):
            if key not in self.blocks:
                break
            buf[: len(self.blocks[key])] = self.blocks[key]
            n += 1
        return n


def test_lent_and_staged_loads_place_the_same_bytes_with_a_partial_first_chunk_and_a_tail() -> None:
    kv0 = kv_caches()
    geo = layout.ChunkGeometry.from_kv_caches(kv0, block_size=BLOCK, chunk_tokens=CHUNK)
    tail_geo = layout.ChunkGeometry(geo.layers, 1, BLOCK)
    keys = ["1" * 64, "2" * 64, "3" * 64]
    blocks: dict[str, bytes] = {}
    value = 0.0
    for i, key in enumerate(keys):
        g = tail_geo if i == 2 else geo
        buf = g.new_payload()
        for layer in range(LAYERS):
            view = g.layer_view(buf, layer)
            view.copy_(torch.arange(view.numel(), dtype=torch.float32).view_as(view) + value)
            value += 1000.0
        layout.seal(buf, namespace=NS, key=key, num_tokens=g.chunk_tokens, num_layers=LAYERS)
        blocks[key] = bytes(buf)
    # Chunk 0's first block is in the engine's own prefix cache already; chunk 1 whole; one tail block.
    spec = LoadSpec("r", keys, [[1], [5, 2], [7]], skip_blocks=1, tail=1)
    placed = []
    for transport in (Lender(blocks), Copier(blocks)):
        kv = kv_caches()
        cache = ResilientCache(
            [Endpoint("t", functools.partial(_same, transport), CircuitBreaker(100, 60.0))], retries=0
        )
        cache.endpoints[0].client()
        w = WorkerHalf(ConnectorSettings(chunk_tokens=CHUNK, load_deadline_ms=5000), SPEC, cache=cache)
        try:
            w.register_kv_caches(kv)
            w.bind_plan(StepPlan(loads=[spec]))
            w.start_load()
            for name in kv:
                w.wait_for_layer_load(name)
            assert w.take_load_errors() == set()
            w.clear_plan()
            assert w.counters.get("loads_lent") == (1 if transport.lends else 0)
            assert transport.out == 0
        finally:
            w.shutdown()
        placed.append(kv)
    lent, staged = placed
    for name in lent:
        assert torch.equal(lent[name], staged[name]), f"{name}: the lent load placed other bytes"
        assert torch.equal(lent[name][0], torch.zeros_like(lent[name][0])), "the skipped block was written"
        assert lent[name][1].abs().sum() > 0


def test_a_lent_payload_of_another_size_is_a_miss_and_its_lease_let_go() -> None:
    kv = kv_caches()
    geo = layout.ChunkGeometry.from_kv_caches(kv, block_size=BLOCK, chunk_tokens=CHUNK)
    transport = Lender({KEY_B: payload(geo, KEY_B, 2.0) + b"\0" * 64})
    cache = ResilientCache(
        [Endpoint("t", functools.partial(_same, transport), CircuitBreaker(100, 60.0))], retries=0
    )
    cache.endpoints[0].client()
    w = WorkerHalf(ConnectorSettings(chunk_tokens=CHUNK, load_deadline_ms=5000), SPEC, cache=cache)
    try:
        w.register_kv_caches(kv)
        assert step(w, KEY_B, [4, 5]) == {4, 5}
        assert w.counters.get("fallback_chunks.corrupt") == 1
        assert transport.out == 0
        for layer in kv.values():
            assert torch.equal(layer, torch.zeros_like(layer))
    finally:
        w.shutdown()


def test_from_an_endpoint_that_does_not_lend_load_views_loads_into_buffers_of_its_own() -> None:
    # The remote endpoint, after the local one failed: each payload lands in a fresh buffer that
    # only its lease owns, never in memory another load uses.
    geo = layout.ChunkGeometry.from_kv_caches(kv_caches(), block_size=BLOCK, chunk_tokens=CHUNK)
    blocks = {KEY_A: payload(geo, KEY_A, 1.0), KEY_B: payload(geo, KEY_B, 2.0)}
    transport = Copier(blocks)
    cache = ResilientCache(
        [Endpoint("t", functools.partial(_same, transport), CircuitBreaker(100, 60.0))], retries=0
    )
    size = geo.payload_bytes
    first = cache.load_views(NS, [KEY_A, KEY_B, KEY_C], [size] * 3, time.monotonic() + 5)
    second = cache.load_views(NS, [KEY_B], [size], time.monotonic() + 5)
    assert [bytes(x.view) for x in first.leases] == [blocks[KEY_A], blocks[KEY_B]]
    assert first.reason is not None  # KEY_C is not there
    assert [bytes(x.view) for x in second.leases] == [blocks[KEY_B]]
    assert all(x.view.obj is not y.view.obj for x in first.leases for y in second.leases)
    assert transport.copied == 2


KEY_D = "d" * 64


def _two_payload_step(
    w: WorkerHalf,
    kv: dict[str, torch.Tensor],
    transport: Lender,
    monkeypatch: pytest.MonkeyPatch,
    hold_s: float,
) -> tuple[set[int], list[bool]]:
    """Load B then D; D's verification waits (up to ``hold_s``) for B to be placed first.

    Returns the step's load errors and, per verification of D, whether B was in place by then.
    """
    geo = layout.ChunkGeometry.from_kv_caches(kv, block_size=BLOCK, chunk_tokens=CHUNK)
    transport.blocks[KEY_D] = payload(geo, KEY_D, 4.0)
    placed_b = threading.Event()
    seen: list[bool] = []
    verify, scatter = layout.verify, layout.scatter_payload

    def slow_verify(payload: bytes | memoryview, **kw: object) -> None:
        if kw["key"] == KEY_D:
            seen.append(placed_b.wait(hold_s))
        verify(payload, **kw)  # type: ignore[arg-type]

    def spy_scatter(
        geometry: layout.ChunkGeometry,
        kvs: Sequence[torch.Tensor],
        p: memoryview,
        ids: Sequence[int],
        **kw: int,
    ) -> None:
        scatter(geometry, kvs, p, ids, **kw)
        if ids[0] == 4:
            placed_b.set()

    monkeypatch.setattr(layout, "verify", slow_verify)
    monkeypatch.setattr(layout, "scatter_payload", spy_scatter)
    w.bind_plan(StepPlan(loads=[LoadSpec("r", [KEY_B, KEY_D], [[4, 5], [6, 7]])]))
    w.start_load()
    for name in kv:
        w.wait_for_layer_load(name)
    errors = w.take_load_errors()
    w.clear_plan()
    return errors, seen


def test_a_lent_payload_is_placed_while_the_next_is_still_being_verified(
    worker: tuple[WorkerHalf, dict[str, torch.Tensor], Lender], monkeypatch: pytest.MonkeyPatch
) -> None:
    w, kv, transport = worker
    errors, seen = _two_payload_step(w, kv, transport, monkeypatch, hold_s=0.5)
    assert errors == set()
    assert seen == [True], "the engine waited for every payload's verification before placing the first"
    for layer in kv.values():
        assert torch.equal(layer[4:6], torch.full_like(layer[4:6], 2.0))
        assert torch.equal(layer[6:8], torch.full_like(layer[6:8], 4.0))
    assert transport.out == 0


def test_a_lent_load_cut_by_its_deadline_keeps_the_payloads_verified_and_placed_before_it(
    worker: tuple[WorkerHalf, dict[str, torch.Tensor], Lender], monkeypatch: pytest.MonkeyPatch
) -> None:
    w, kv, transport = worker
    geo = layout.ChunkGeometry.from_kv_caches(kv, block_size=BLOCK, chunk_tokens=CHUNK)
    transport.blocks[KEY_D] = payload(geo, KEY_D, 4.0)
    verify = layout.verify

    def slow_verify(payload: bytes | memoryview, **kw: object) -> None:
        if kw["key"] == KEY_D:
            time.sleep(1.5)  # past the step's 1 s deadline
        verify(payload, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(layout, "verify", slow_verify)
    w.bind_plan(StepPlan(loads=[LoadSpec("r", [KEY_B, KEY_D], [[4, 5], [6, 7]])]))
    w.start_load()
    for name in kv:
        w.wait_for_layer_load(name)
    assert w.take_load_errors() == {6, 7}, "B, verified and placed before the deadline, is a hit"
    w.clear_plan()
    assert w.counters.get("fallback_chunks.timeout") == 1
    for layer in kv.values():
        assert torch.equal(layer[4:6], torch.full_like(layer[4:6], 2.0))
        assert torch.equal(layer[6:8], torch.zeros_like(layer[6:8])), "a payload verified late was placed"
    wait_until(lambda: transport.out == 0, 10, what="the late payload's lease to be let go")
