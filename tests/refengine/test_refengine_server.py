"""Cached KV equals recomputed KV through real cache-server processes, for every tier, and faults
(killed, frozen, corrupt, foreign namespace) never fail a request: the engine recomputes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvfabric.client import CacheClient
from kvfabric.connector.settings import ConnectorSettings
from kvfabric.refengine.engine import Engine, GenerateResult
from kvfabric.refengine.model import RefModel
from kvfabric.refengine.testing import TINY, prompt
from kvfabric.testing.memtransport import CacheServerProcess, block_files
from kvfabric.testing.serverproc import temp_dir

pytestmark = pytest.mark.process  # real processes (test level, see kvfabric.testing.levels)

CHUNK = 32
LOOKUP_MS, LOAD_MS = 300, 1000
TOL = 1e-5


def settings_for(server: CacheServerProcess, **update: object) -> ConnectorSettings:
    base = ConnectorSettings(
        socket=str(server.socket),
        shared_memory=True,
        chunk_tokens=CHUNK,
        lookup_deadline_ms=LOOKUP_MS,
        load_deadline_ms=LOAD_MS,
        breaker_failures=2,
        # These tests check what a load does; whether to load is the cost model's
        # (test_refengine_costmodel.py).
        cost_model=False,
    )
    return base.model_copy(update=update)


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A short directory instead of pytest's: the servers' sockets (and their hand-over sockets, the
    longest) live in it, and Unix socket paths are limited to 107 bytes, which pytest's
    ``/tmp/pytest-of-<user>/pytest-<run>/<test name>0`` exceeds once the run counter grows."""
    with temp_dir() as work:
        yield work


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Callable[..., CacheServerProcess]]:
    started: list[CacheServerProcess] = []

    def start(name: str, **kwargs: object) -> CacheServerProcess:
        s = CacheServerProcess(tmp_path, name=name, **kwargs).start()  # type: ignore[arg-type]
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


def run_engine(model: RefModel, settings: ConnectorSettings | None, tokens: list[int], max_tokens: int = 2,
               kv_dtype: torch.dtype = torch.float32) -> GenerateResult:  # fmt: skip
    e = Engine(TINY, num_blocks=64, settings=settings, model=model, kv_dtype=kv_dtype)
    try:
        r = e.generate(tokens, max_tokens)
        if e.worker_conn is not None:
            assert e.worker_conn.wait_for_stores(60)
        return r
    finally:
        e.close()


def assert_same(r: GenerateResult, ref: GenerateResult) -> None:
    diff = (r.first_logits - ref.first_logits).abs().max().item()
    assert diff <= TOL, f"max abs logit diff {diff}"
    assert r.output_token_ids == ref.output_token_ids


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_dram_hit_and_partial_hit(tiny_model: RefModel, servers: Callable[..., CacheServerProcess]) -> None:
    srv = servers("a")
    tokens = prompt(230, 11)
    ref = run_engine(tiny_model, None, tokens)
    cold = run_engine(tiny_model, settings_for(srv), tokens)
    assert (cold.hit_tokens, cold.fallback_reason) == (0, "not-found")
    assert_same(cold, ref)
    warm = run_engine(tiny_model, settings_for(srv), tokens)
    assert (warm.hit_tokens, warm.tier, warm.fallback_reason) == (224, "dram", None)
    assert_same(warm, ref)
    # A prompt sharing 100 tokens: three whole chunks hit, the rest is computed.
    other = tokens[:100] + prompt(60, 12)
    part = run_engine(tiny_model, settings_for(srv), other)
    assert (part.hit_tokens, part.tier) == (96, "dram")
    assert_same(part, run_engine(tiny_model, None, other))


def test_local_disk_hit_after_restart(tiny_model: RefModel, servers: Callable[..., CacheServerProcess],
                                      tmp_path: Path) -> None:  # fmt: skip
    disk = tmp_path / "node-disk"
    first = servers("first", local_disk=disk)
    tokens = prompt(200, 13)
    run_engine(tiny_model, settings_for(first), tokens)
    wait_until(lambda: len(block_files(disk)) >= 6, "write-back of 6 chunks to local disk")
    first.stop()
    # A new server process on the same local disk (fresh DRAM): the blocks come from disk.
    second = servers("second", local_disk=disk)
    warm = run_engine(tiny_model, settings_for(second), tokens)
    assert (warm.hit_tokens, warm.tier) == (192, "local_disk")
    assert_same(warm, run_engine(tiny_model, None, tokens))


def test_prefix_stored_by_another_process_loads_through_another_server(
    tiny_model: RefModel, servers: Callable[..., CacheServerProcess], tmp_path: Path
) -> None:
    shared = tmp_path / "shared-volume"
    node_a = servers("node-a", shared=shared)
    node_b = servers("node-b", shared=shared)
    tokens = prompt(300, 14)
    # The prefix is computed by a separate engine process ("pod" on node A) through the CLI.
    env = {**os.environ, **node_a.settings_env(), "KVFABRIC_CHUNK_TOKENS": str(CHUNK)}
    proc = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli.main", "engine", "run", "--preset", "tiny", "--max-tokens", "2"],
        input=json.dumps(tokens) + "\n",
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["hit_tokens"] == 0
    wait_until(lambda: len(block_files(shared)) >= 9, "write-back of 9 chunks to the shared volume")
    probe = CacheClient(node_b.unix_target, shared_memory=True)
    try:
        eng = Engine(TINY, num_blocks=64, settings=settings_for(node_b), model=tiny_model)
        assert eng.scheduler_conn is not None
        ns = eng.scheduler_conn.namespace
        eng.close()
        from kvfabric.connector.keys import chunk_keys

        keys = chunk_keys(ns, tokens, CHUNK)
        wait_until(lambda: probe.lookup(ns, keys, timeout=2).matched == 9, "node B to see node A's chunks")
    finally:
        probe.close()
    warm = run_engine(tiny_model, settings_for(node_b), tokens)
    assert (warm.hit_tokens, warm.tier) == (288, "shared")
    ref = run_engine(tiny_model, None, tokens)
    assert_same(warm, ref)
    assert line["output_token_ids"] == ref.output_token_ids


def test_killed_server_never_fails_a_request(
    tiny_model: RefModel, servers: Callable[..., CacheServerProcess]
) -> None:
    srv = servers("k")
    tokens = prompt(150, 15)
    run_engine(tiny_model, settings_for(srv), tokens)
    srv.kill()
    ref = run_engine(tiny_model, None, tokens)
    for _ in range(3):  # the breaker opens on the way; every request still succeeds
        r = run_engine(tiny_model, settings_for(srv), tokens)
        assert (r.hit_tokens, r.fallback_reason) == (0, "unavailable")
        assert_same(r, ref)


def test_frozen_server_costs_at_most_the_deadline(
    tiny_model: RefModel, servers: Callable[..., CacheServerProcess]
) -> None:
    srv = servers("f")
    tokens = prompt(150, 16)
    run_engine(tiny_model, settings_for(srv), tokens)
    ref = run_engine(tiny_model, None, tokens)
    srv.freeze()
    try:
        e = Engine(TINY, num_blocks=64, settings=settings_for(srv), model=tiny_model)
        t0 = time.monotonic()
        r = e.generate(tokens, 2)
        elapsed = time.monotonic() - t0
        assert (r.hit_tokens, r.fallback_reason) == (0, "timeout")
        assert_same(r, ref)
        # Bounded by the lookup deadline plus the recompute itself (ratio to a baseline of the same
        # run, with slack for a loaded CI machine); without enforcement this call would hang.
        assert elapsed < LOOKUP_MS / 1000 + 10 * ref.ttft_s + 2.0
        assert e.scheduler_conn is not None
        assert e.scheduler_conn.counters.get("miss.timeout") == 1
        # Stores to the frozen server are abandoned at their deadline, never block the engine.
        e.close()
    finally:
        srv.thaw()


def test_corrupt_block_on_disk_is_a_miss(tiny_model: RefModel, servers: Callable[..., CacheServerProcess],
                                         tmp_path: Path) -> None:  # fmt: skip
    disk = tmp_path / "disk-c"
    first = servers("c1", local_disk=disk)
    tokens = prompt(200, 17)
    run_engine(tiny_model, settings_for(first), tokens)
    wait_until(lambda: len(block_files(disk)) >= 6, "write-back to local disk")
    first.stop()
    for f in block_files(disk):  # flip one payload byte in every block
        data = bytearray(f.read_bytes())
        data[-100] ^= 0xFF
        f.write_bytes(bytes(data))
    second = servers("c2", local_disk=disk)
    r = run_engine(tiny_model, settings_for(second), tokens)
    assert r.hit_tokens == 0
    # The server found the damage itself when it read the block (it answers the load as a miss, hence
    # "not-found"; the recompute then stores fresh blocks under the same names).
    assert r.fallback_reason in {"not-found", "corrupt"}
    with CacheClient(second.unix_target, shared_memory=True) as c:
        assert c.stats(timeout=5)["counters"]["checksum_failures"]["local_disk"] >= 1
    assert_same(r, run_engine(tiny_model, None, tokens))


def test_corrupt_payload_served_is_detected(
    tiny_model: RefModel, servers: Callable[..., CacheServerProcess]
) -> None:
    srv = servers("p")
    tokens = prompt(200, 18)
    run_engine(tiny_model, settings_for(srv), tokens)
    # Let the write-back settle first, so that the replacement below is the only copy.
    disk = srv.local_disk
    assert disk is not None
    wait_until(lambda: len(block_files(disk)) >= 6, "write-back to local disk")
    e = Engine(TINY, num_blocks=64, settings=settings_for(srv), model=tiny_model)
    assert e.worker_conn is not None
    ns = e.worker_conn.namespace
    from kvfabric.connector.keys import chunk_keys

    keys = chunk_keys(ns, tokens, CHUNK)
    c = CacheClient(srv.unix_target, shared_memory=True)
    try:
        good = c.load(ns, keys[2:3], timeout=5)[0]
        bad = bytearray(good)
        bad[-7] ^= 0x55
        c.delete(ns, keys[2:3], timeout=5)
        # A deleted key takes no store for the delete margin (engine/ordering.py): wait it out.
        wait_until(
            lambda: c.store(ns, keys[2:3], [bytes(bad)], timeout=5).accepted == 1,
            timeout=60,
            what="the store after the delete margin",
        )
        assert c.load(ns, keys[2:3], timeout=5)[0] == bytes(bad)
    finally:
        c.close()
    r = e.generate(tokens, 2)
    e.close()
    assert (r.hit_tokens, r.fallback_reason, r.recomputed_after_load_error) == (64, "corrupt", True)
    assert_same(r, run_engine(tiny_model, None, tokens))


def test_namespace_mismatch_is_a_miss(
    tiny_model: RefModel, servers: Callable[..., CacheServerProcess]
) -> None:
    srv = servers("n")
    tokens = prompt(200, 19)
    run_engine(tiny_model, settings_for(srv), tokens)
    other_rev = run_engine(tiny_model, settings_for(srv, model_revision="seed-0-finetuned"), tokens)
    assert (other_rev.hit_tokens, other_rev.fallback_reason) == (0, "not-found")
    assert_same(other_rev, run_engine(tiny_model, None, tokens))
    bf16 = run_engine(tiny_model, settings_for(srv), tokens, kv_dtype=torch.bfloat16)
    assert (bf16.hit_tokens, bf16.fallback_reason) == (0, "not-found")
    assert_same(bf16, run_engine(tiny_model, None, tokens, kv_dtype=torch.bfloat16))
