"""A delete racing the local-disk write-back, through the real server's gRPC API, from both clients.

The local disk is made slow by its configured fault hook (``tiers.local_disk.faults``: the code that
ships, never patched): ``write_delay_seconds`` sleeps after the temp file is written and before the
commit (a write-back in flight), ``rename_delay_seconds`` sleeps inside the commit, after the rename
and before the index learns of it (a delete arriving then waits for the commit). Each test waits for
an observable on-disk state (a temp file, a renamed block file) instead of guessing timings, then
checks what the Unix-socket (shm) client and the TCP client see: right after the delete, after the
write-back finished, and after a restart (DRAM gone: only what the disk really holds).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfabric.client import CacheClient
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, payload_for, wait_until

pytestmark = [pytest.mark.process, pytest.mark.slow]

NS = digest("delete-vs-writeback")
SIZE = 64 * 1024


def _local(srv: ServerProcess) -> Path:
    disk = srv.config.tiers.local_disk
    assert disk is not None
    return disk.path


def _tmp_files(srv: ServerProcess) -> list[Path]:
    return list((_local(srv) / "tmp").rglob("*.tmp"))


def _block_files(srv: ServerProcess, key: str) -> list[Path]:
    return [p for p in (_local(srv) / "buckets").rglob("*.blk") if key in p.name]


def _counter(c: CacheClient, name: str) -> int:
    value: Any = c.stats(timeout=5)["counters"].get(name, {})
    return int(value.get("local_disk", 0)) if isinstance(value, dict) else 0


def _drain(c: CacheClient) -> None:
    wait_until(lambda: c.stats(timeout=5)["writeback_pending_bytes"] == 0, what="write-backs finished")


def _absent(clients: tuple[CacheClient, ...], key: str) -> None:
    for c in clients:
        assert c.lookup(NS, [key], timeout=5).matched == 0, "a deleted key is never found by a lookup"
        assert c.load(NS, [key], timeout=10) == [], "a deleted key is a miss"


def _serves(clients: tuple[CacheClient, ...], key: str, payload: bytes, tier: str | None = None) -> None:
    # ``tier``: where the first lookup finds it (the first load promotes a disk hit into DRAM).
    for i, c in enumerate(clients):
        got = c.lookup(NS, [key], timeout=5)
        assert got.matched == 1
        if tier is not None and i == 0:
            assert got.tiers == [tier]
        assert c.load(NS, [key], timeout=10) == [payload]


def _clients(srv: ServerProcess) -> tuple[CacheClient, CacheClient]:
    shm = CacheClient(srv.unix_target, shared_memory=True)
    tcp = CacheClient(srv.tcp_target)
    assert shm.uses_shm
    assert not tcp.uses_shm
    return shm, tcp


@pytest.fixture
def slow_commit() -> Iterator[ServerProcess]:
    """A server whose local-disk write-backs sleep 4 s before committing (two write-back workers)."""
    slow = {
        "tiers.local_disk.faults": {"write_delay_seconds": 4.0},
        "tiers.local_disk.min_free_fraction": 0.0,
    }
    with cache_server(dram_bytes=16 * MiB, overrides=slow) as srv:
        yield srv


def test_delete_while_the_write_back_is_in_flight_or_queued_and_a_store_after_it(
    slow_commit: ServerProcess,
) -> None:
    srv = slow_commit
    inflight, queued, fill1, fill2, again = (digest("dw", n) for n in range(5))
    shm, tcp = _clients(srv)
    both = (shm, tcp)
    with shm, tcp:
        # 1. In flight: its temp file is written, the write-back sleeps before its commit.
        assert tcp.store(NS, [inflight], [payload_for(inflight, SIZE)], timeout=10).accepted == 1
        wait_until(lambda: len(_tmp_files(srv)) == 1, what="the write-back's temp file")
        assert shm.delete(NS, [inflight], timeout=10) == 1
        _absent(both, inflight)  # right after the delete, while the write-back is still asleep
        _drain(tcp)
        _absent(both, inflight)  # and after it woke up and tried to commit
        assert _counter(tcp, "writes_superseded") == 1, "the write-back reached its commit after the delete"
        assert not _block_files(srv, inflight)
        assert not _tmp_files(srv)

        # 2. Queued: both write-back workers are asleep on two other keys, this key's job waits.
        fillers = [payload_for(fill1, SIZE), payload_for(fill2, SIZE)]
        assert shm.store(NS, [fill1, fill2], fillers, timeout=10).accepted == 2
        wait_until(lambda: len(_tmp_files(srv)) == 2, what="both workers busy")
        dropped = _counter(tcp, "dropped_writebacks")
        assert tcp.store(NS, [queued], [payload_for(queued, SIZE)], timeout=10).accepted == 1
        assert tcp.delete(NS, [queued], timeout=10) == 1
        _absent(both, queued)
        _drain(shm)
        _absent(both, queued)
        assert _counter(tcp, "writes_superseded") == 1, "the queued write-back never got as far as a commit"
        assert _counter(tcp, "dropped_writebacks") == dropped + 1, "it was refused when it started"
        assert not _block_files(srv, queued)

        # 3. Store A, delete during A's write-back, store B: the new generation wins everywhere.
        a, b = payload_for(again, SIZE, salt=b"A"), payload_for(again, SIZE, salt=b"B")
        assert shm.store(NS, [again], [a], timeout=10).accepted == 1
        wait_until(lambda: len(_tmp_files(srv)) == 1, what="A's temp file")
        assert tcp.delete(NS, [again], timeout=10) == 1
        _absent(both, again)
        # Within the delete margin the key stays deleted (engine/ordering.py); then B is taken.
        assert tcp.store(NS, [again], [b], timeout=10).accepted == 0
        wait_until(lambda: tcp.store(NS, [again], [b], timeout=10).accepted == 1, what="B after the margin")
        _serves(both, again, b, "dram")
        _drain(shm)
        _serves(both, again, b, "dram")
        assert _counter(tcp, "writes_superseded") == 2, "A's write-back was superseded, B's landed"
        _serves(both, fill1, fillers[0])
    srv.restart()  # DRAM is gone: what follows is what the local disk really holds
    shm, tcp = _clients(srv)
    both = (shm, tcp)
    with shm, tcp:
        _absent(both, inflight)
        _absent(both, queued)
        _serves(both, again, b, "local_disk")
        _serves(both, fill2, fillers[1], "local_disk")


def test_delete_during_the_write_backs_rename_waits_for_it_then_removes_it() -> None:
    # The rename has happened, the index does not know yet (the commit sleeps under the tier's commit
    # lock): a delete now must still leave nothing behind — not in the index, not on disk.
    slow = {
        "tiers.local_disk.faults": {"rename_delay_seconds": 3.0},
        "tiers.local_disk.min_free_fraction": 0.0,
    }
    key, other = digest("dr", 0), digest("dr", 1)
    with cache_server(dram_bytes=16 * MiB, overrides=slow) as srv:
        shm, tcp = _clients(srv)
        both = (shm, tcp)
        with shm, tcp:
            assert shm.store(NS, [key], [payload_for(key, SIZE)], timeout=10).accepted == 1
            wait_until(lambda: _block_files(srv, key), what="the renamed block file")
            assert tcp.lookup(NS, [key], timeout=5).tiers == ["dram"], "the index has not learnt of it yet"
            assert shm.delete(NS, [key], timeout=10) == 1
            _absent(both, key)
            assert not _block_files(srv, key), "the delete removed the copy the commit had just renamed"
            _drain(tcp)
            _absent(both, key)
            # A store after the delete commits normally (a newer generation).
            assert tcp.store(NS, [other], [payload_for(other, SIZE)], timeout=10).accepted == 1
            _drain(tcp)
            assert _block_files(srv, other)
        srv.restart()
        shm, tcp = _clients(srv)
        both = (shm, tcp)
        with shm, tcp:
            _absent(both, key)
            _serves(both, other, payload_for(other, SIZE), "local_disk")
