"""Staging memfds allocated ahead of the stores (the arena's pool): off the begin's path, within the budget.

``ShmStoreBegin`` hands out staging memfds whose pages the server allocated; a thread of the arena
allocates them ahead of time (docs/cacheserver.md, "Store handshake"). The unit tests count where
the allocations happen and check the budget against a model of the arena without a pool: the pool
must never cost a store its room, never exceed the budget, and never hand out a memfd twice. The
process test counts the same through a real server's stats.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import cast

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.stats import Counters
from kvfabric.cacheserver.engine.tiered import TieredStore
from kvfabric.cacheserver.transport import arena as arena_mod
from kvfabric.cacheserver.transport.arena import StagingArena
from kvfabric.cacheserver.transport.stagingpool import charge
from kvfabric.client import CacheClient
from kvfabric.client.blocks import close_all
from kvfabric.testing.serverproc import MiB, cache_server, digest, payload_for

NS = digest("staging-pool")
KiB = 1024


def _bids(tag: str, n: int) -> list[BlockId]:
    return [BlockId(NS, digest(tag, i)) for i in range(n)]


def _wait(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class _Store:
    """What a commit needs of the store: takes the sealed memfd as the block."""

    def __init__(self) -> None:
        self.blocks: list[int] = []

    def put_sealed(self, _bid: BlockId, fd: int, _length: int) -> bool:
        self.blocks.append(fd)
        return True


def test_a_begin_the_pool_can_serve_allocates_nothing_on_its_thread_and_the_pool_refills(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    allocations: list[int] = []  # the thread of every staging allocation
    real = arena_mod._allocated_memfd

    def counted(length: int) -> int | None:
        allocations.append(threading.get_ident())
        return real(length)

    monkeypatch.setattr(arena_mod, "_allocated_memfd", counted)
    counters = Counters()
    size, n = 256 * KiB, 4
    arena = StagingArena(64 * MiB, 30.0, counters, prealloc_bytes=8 * MiB)
    me = threading.get_ident()
    kept: list[int] = []
    try:
        # The first begin of a length has nothing ahead: it allocates for itself.
        first = arena.begin(_bids("first", n), [size] * n, [False] * n)
        assert allocations.count(me) == n
        _wait(lambda: arena.pooled_bytes == n * size, "the pool to fill")
        assert arena.used_bytes == n * size  # the lease's, the pool counted apart
        assert counters.get("staging_memfds", "allocated_on_begin") == n
        for name in first.names:
            got = arena.dup_by_name(name)
            assert got is not None
            kept.append(got[0])
        # The next begin of that length is served from the pool: no allocation on its thread.
        second = arena.begin(_bids("second", n), [size] * n, [False] * n)
        assert second.dropped == 0
        assert allocations.count(me) == n, "a begin the pool could serve allocated on its own thread"
        assert counters.get("staging_memfds", "preallocated") == n
        inodes = {os.fstat(fd).st_ino for fd in kept}
        for name in second.names:
            got = arena.dup_by_name(name)
            assert got is not None
            kept.append(got[0])
            st_ = os.fstat(got[0])
            assert st_.st_blocks * 512 >= size, "handed out with its pages allocated"
            assert st_.st_ino not in inodes, "a memfd handed out twice"
        # ... and the pool fills again, on its own thread.
        _wait(lambda: arena.pooled_bytes == n * size, "the pool to refill")
        assert len(allocations) == 3 * n
        assert allocations.count(me) == n
        assert arena.used_bytes == 2 * n * size
        assert arena.abort(first.lease_id) == (0, n)
        assert arena.abort(second.lease_id) == (0, n)
        # Aborted: emptied as ever, even the memfds that came from the pool.
        assert [(os.fstat(fd).st_size, os.fstat(fd).st_blocks) for fd in kept] == [(0, 0)] * len(kept)
        assert arena.used_bytes == 0
    finally:
        arena.close()
        close_all(kept)
    assert (arena.used_bytes, arena.pooled_bytes) == (0, 0)


_LENGTHS = st.sampled_from([1, 3000, 4096, 5 * 4096, 12 * 4096, 16 * 4096])
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("begin"), st.lists(_LENGTHS, min_size=1, max_size=6)),
        st.tuples(st.just("commit"), st.integers(0, 7)),
        st.tuples(st.just("abort"), st.integers(0, 7)),
        st.tuples(st.just("quarantine"), st.integers(0, 7)),
        st.tuples(st.just("refill"), st.just(0)),
    ),
    max_size=30,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_OPS, prealloc_pages=st.integers(0, 16))
# The pool holds another length's memfds where a begin needs room: it must close them first.
@example(ops=[("begin", [16 * 4096]), ("refill", 0), ("begin", [12 * 4096] * 4)], prealloc_pages=16)
def test_the_pool_never_costs_a_store_its_room_exceeds_the_budget_or_hands_a_memfd_out_twice(
    ops: list[tuple[str, object]], prealloc_pages: int
) -> None:
    """Against a model of the arena without a pool: the same keys staged, the same dropped, the same bytes."""
    budget = 64 * 4096
    arena = StagingArena(
        budget, 30.0, Counters(), prealloc_bytes=prealloc_pages * 4096, prealloc_thread=False
    )
    store = _Store()
    leases: list[tuple[str, int]] = []  # open leases: (id, charge)
    model_used = 0  # leased + quarantined, as the arena without a pool would count
    seen: list[int] = []  # a dup of every memfd ever handed out (kept open: inodes stay unique)
    inodes: set[int] = set()
    serial = 0
    try:
        for op, arg in ops:
            if op == "begin":
                lengths = cast(list[int], arg)
                bids = [BlockId(NS, digest("model", serial, i)) for i in range(len(lengths))]
                serial += 1
                res = arena.begin(bids, lengths, [False] * len(lengths))
                want_names, lease_charge = [], 0
                for n in lengths:
                    fits = model_used + lease_charge + charge(n) <= budget
                    want_names.append(fits)
                    lease_charge += charge(n) if fits else 0
                assert [bool(x) for x in res.names] == want_names, "the pool changed what was staged"
                model_used += lease_charge
                for name, n in zip(res.names, lengths, strict=True):
                    if name:
                        got = arena.dup_by_name(name)
                        assert got is not None
                        seen.append(got[0])
                        st_ = os.fstat(got[0])
                        assert st_.st_ino not in inodes, "a memfd handed out twice"
                        inodes.add(st_.st_ino)
                        assert (st_.st_size, st_.st_blocks * 512 >= n) == (n, True)
                leases.append((res.lease_id, lease_charge))
            elif op == "refill":
                arena.refill()
            elif leases:
                lease_id, lease_charge = leases.pop(cast(int, arg) % len(leases))
                if op == "commit":
                    arena.commit(lease_id, cast(TieredStore, store))
                    model_used -= lease_charge
                elif op == "abort":
                    arena.abort(lease_id)
                    model_used -= lease_charge
                else:  # the client sealed every staging memfd against shrinking, then gave up
                    import fcntl

                    lease = arena._leases[lease_id]
                    for slot in lease.slots:
                        fcntl.fcntl(slot.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
                    arena.abort(lease_id)
            assert arena.used_bytes == model_used
            pooled = arena.pooled_bytes
            assert pooled <= arena.pool.max_bytes <= budget // 4
            assert arena.used_bytes + pooled <= budget
            assert pooled == sum(charge(n) for n, fds in arena.pool._fds.items() for _ in fds)
            for n, fds in arena.pool._fds.items():
                for fd in fds:
                    st_ = os.fstat(fd)
                    assert st_.st_ino not in inodes, "a pooled memfd was handed out before"
                    assert (st_.st_size, st_.st_blocks * 512 >= n) == (n, True)
    finally:
        arena.close()
        close_all(seen)
        close_all(store.blocks)
    assert arena.pooled_bytes == 0
    assert arena.used_bytes == arena.quarantined_bytes


def test_a_begin_that_cannot_fit_even_without_the_pool_leaves_the_pool_alone() -> None:
    # Any tenant can ask for a key larger than the room left: emptying the pool for it would cost
    # every later store its allocation ahead and still drop the key.
    arena = StagingArena(64 * 4096, 30.0, Counters(), prealloc_bytes=16 * 4096, prealloc_thread=False)
    try:
        small = arena.begin(_bids("small", 1), [4 * 4096], [False])
        arena.refill()
        pooled = arena.pooled_bytes
        assert pooled > 0
        held = arena.begin(_bids("held", 1), [32 * 4096], [False])
        assert held.names[0]
        pooled = arena.pooled_bytes
        big = arena.begin(_bids("big", 1), [40 * 4096], [False])
        assert (big.names[0], big.dropped) == ("", 1)
        assert arena.pooled_bytes == pooled, "the pool was emptied for a key that never fitted"
        arena.abort(small.lease_id)
        arena.abort(held.lease_id)
    finally:
        arena.close()


@pytest.mark.process
def test_a_servers_second_store_of_a_length_takes_staging_allocated_ahead() -> None:
    size, n = 1 * MiB, 4
    with cache_server(dram_bytes=64 * MiB) as s, CacheClient(s.unix_target, shared_memory=True) as c:

        def stats() -> dict[str, object]:
            return c.stats(timeout=10)

        def staged(how: str) -> int:
            counts = cast(dict[str, dict[str, int]], stats()["counters"]).get("staging_memfds", {})
            return counts.get(how, 0)

        keys = [[digest("round", r, i) for i in range(n)] for r in range(3)]
        assert stats()["arena_pooled_bytes"] == 0, "nothing is allocated before a store asked"
        for r, round_keys in enumerate(keys):
            payloads = [payload_for(k, size) for k in round_keys]
            assert c.store(NS, round_keys, payloads, timeout=30).accepted == n
            # The first store allocated at its begin; every later one took what the pool held.
            assert (staged("allocated_on_begin"), staged("preallocated")) == (n, r * n)
            _wait(lambda: stats()["arena_pooled_bytes"] == n * size, "the pool to fill")
            assert stats()["arena_used_bytes"] == 0
        for round_keys in keys:
            assert c.load(NS, round_keys, timeout=30) == [payload_for(k, size) for k in round_keys]
