"""Save staging is reused across steps whose saves differ in size, and what is stored is still exact.

A fresh staging buffer costs the engine's step a page fault and zeroing per 4 KiB (the copy out of
the KV cache is on the step's thread); a chat's steps save a different number of chunks each time.
Against a real cache-server process: steps of 4, 2, 3 and 1 chunks allocate one buffer (none when
the buffer was made ready as the KV cache was registered: the engine's first request pays no page
faults for its save), and every stored payload equals the chunk gathered and sealed on its own (no
byte of an earlier, larger save rides along).
"""

from __future__ import annotations

import time

import pytest
import torch

from kvfabric.client import CacheClient
from kvfabric.connector import layout
from kvfabric.connector.hostpath import HostStagingPath
from kvfabric.connector.keys import NamespaceSpec
from kvfabric.connector.resilient import build_cache
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.connector.steps import SaveSpec, StepPlan
from kvfabric.connector.worker import WorkerHalf
from kvfabric.testing.serverproc import MiB, cache_server, digest

pytestmark = pytest.mark.process  # a real cache-server process

BLOCK, CHUNK, LAYERS, NBLOCKS = 16, 64, 2, 64
SPEC = NamespaceSpec("m", "r", "float32", LAYERS, 1, 64, BLOCK, CHUNK)


@pytest.mark.parametrize("warm_tokens", [0, 4 * CHUNK])
def test_steps_saving_fewer_chunks_reuse_the_staging_and_store_exact_payloads(warm_tokens: int) -> None:
    """Without a warm buffer the first save allocates the one buffer; with one, no step allocates."""
    torch.manual_seed(0)
    kv = {f"layer{i}": torch.rand(NBLOCKS, 1, BLOCK, 128) for i in range(LAYERS)}
    with cache_server(dram_bytes=64 * MiB) as srv:
        settings = ConnectorSettings(
            socket=str(srv.config.listen.unix_socket),
            chunk_tokens=CHUNK,
            save_staging_warm_tokens=warm_tokens,
        )
        cache = build_cache(settings, shared=False)
        assert cache is not None
        w = WorkerHalf(settings, SPEC, cache=cache)
        try:
            w.register_kv_caches(kv)
            path = w.datapath
            assert isinstance(path, HostStagingPath)
            geo = path.geometry
            assert geo is not None
            if warm_tokens:
                _wait_warm(path, 4 * geo.payload_bytes)
            stored: list[tuple[str, list[int]]] = []
            for step, n in enumerate([4, 2, 3, 1]):
                keys = [digest("staging", step, i) for i in range(n)]
                # Different blocks every step: a stale byte of an earlier save would show.
                blocks = [[(7 * step + 4 * i + b) % NBLOCKS for b in range(CHUNK // BLOCK)] for i in range(n)]
                w.bind_plan(StepPlan(saves=[SaveSpec(f"r{step}", keys, blocks)]))
                for name, layer in kv.items():
                    w.save_kv_layer(name, layer)
                w.wait_for_save()
                w.clear_plan()
                assert w.wait_for_stores(30)
                stored += list(zip(keys, blocks, strict=True))
            assert w.counters.get("store_accepted") == 10
            assert path.save_staging_allocated == (0 if warm_tokens else 1), (
                "a step allocated staging while a kept (or warm) buffer fit"
            )
            with CacheClient(srv.unix_target, shared_memory=True) as c:
                got = c.load(path.namespace, [k for k, _ in stored], timeout=30)
            assert len(got) == len(stored)
            for (key, ids), payload in zip(stored, got, strict=True):
                want = bytearray(geo.payload_bytes)
                for i, name in enumerate(kv):
                    layout.gather_chunks(geo, i, kv[name], [ids], want)
                layout.seal(want, namespace=path.namespace, key=key, num_tokens=CHUNK, num_layers=LAYERS)
                assert payload == bytes(want), f"chunk {key[:8]} stored other bytes than its own"
        finally:
            w.shutdown()
            cache.close()


def _wait_warm(path: HostStagingPath, size: int) -> None:
    """Wait until the warm save staging buffer (``size`` bytes) is ready."""
    deadline = time.monotonic() + 30
    while path.save_staging_warmed != size:
        assert time.monotonic() < deadline, f"no warm staging buffer of {size} bytes"
        time.sleep(0.01)


def test_the_warm_staging_buffer_stays_within_the_save_memory_bound() -> None:
    """A warm buffer larger than half of ``store_queue_bytes`` (the engine's save memory) is cut to half."""
    kv = {f"layer{i}": torch.rand(NBLOCKS, 1, BLOCK, 128) for i in range(LAYERS)}
    with cache_server(dram_bytes=64 * MiB) as srv:
        settings = ConnectorSettings(
            socket=str(srv.config.listen.unix_socket),
            chunk_tokens=CHUNK,
            save_staging_warm_tokens=1 << 20,
            store_queue_bytes=1 * MiB,
        )
        cache = build_cache(settings, shared=False)
        assert cache is not None
        w = WorkerHalf(settings, SPEC, cache=cache)
        try:
            w.register_kv_caches(kv)
            path = w.datapath
            assert isinstance(path, HostStagingPath)
            _wait_warm(path, MiB // 2)
        finally:
            w.shutdown()
            cache.close()
