"""Same-node stores on the block socket: the checks of ShmStoreBegin/Commit, and nothing held behind them.

A store's begin and commit travel on the block socket, on a connection of their own (two exchanges,
no gRPC call; docs/cacheserver.md, "Store handshake"). These tests speak the wire protocol
(:mod:`kvfabric.rpc.blockproto`) to real server processes, as a hostile same-node client would, and
check that the socket refuses exactly what ``ShmStoreBegin`` refuses, that a commit that lies stores
nothing, and (in process) that a store being served never holds a load on another connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import mmap
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from kvfabric.cacheserver.engine.tiered import TieredStore
from kvfabric.cacheserver.metrics import Metrics
from kvfabric.cacheserver.service import CacheService, SharedState, block_stores
from kvfabric.cacheserver.transport import blocksock
from kvfabric.cacheserver.transport.arena import StagingArena
from kvfabric.client import CacheClient
from kvfabric.client import blocks as blocks_module
from kvfabric.client.blocks import BlockChannel, StoreBusy
from kvfabric.client.errors import CacheTimeout, CacheUnavailable, InvalidRequest
from kvfabric.connector.keys import NamespaceSpec
from kvfabric.rpc import blockproto as bp
from kvfabric.rpc import fdpass
from kvfabric.rpc.v1 import cache_pb2 as pb
from kvfabric.rpc.v1 import cache_pb2_grpc as pb_grpc
from kvfabric.testing.serverproc import (
    ServerProcess,
    cache_server,
    digest,
    make_config,
    payload_for,
    wait_until,
)

LEASE = "ab" * 16


@contextmanager
def _raw(srv: ServerProcess) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(str(bp.block_socket_for(srv.config.listen.unix_socket)))
    try:
        yield sock
    finally:
        sock.close()


def _ask(sock: socket.socket, msg: bytes, most_fds: int = bp.MAX_NAMES) -> tuple[bytes, list[int]]:
    sock.send(msg)
    data, fds, _ = fdpass.recv_fds(sock, 512, most_fds)
    return data, fds


def _counters(srv: ServerProcess) -> dict[str, object]:
    with CacheClient(srv.unix_target) as c:
        counters: dict[str, object] = c.stats(timeout=5)["counters"]
        return counters


@pytest.mark.process
def test_a_client_store_goes_over_the_block_socket_without_a_grpc_call(ns: str) -> None:
    keys = [digest("sock-store", i) for i in range(3)]
    data = [payload_for(k, 300_000 + i) for i, k in enumerate(keys)]
    with cache_server() as srv, CacheClient(srv.unix_target, shared_memory=True) as client:
        stub = client._conn.stub

        class NoShmStoreRpc:
            def __getattr__(self, name: str) -> object:
                if name.startswith("ShmStore"):
                    raise AssertionError(f"a same-node store called {name} over gRPC")
                return getattr(stub, name)

        client._conn = dataclasses.replace(client._conn, stub=NoShmStoreRpc())
        assert client.store(ns, keys, data, timeout=10).accepted == 3
        # Stored again: already present, nothing staged, still accepted.
        assert client.store(ns, keys, data, timeout=10).accepted == 3
        assert client.load(ns, keys, timeout=10) == data


@pytest.mark.process
def test_a_store_and_a_load_of_one_client_do_not_share_a_block_connection(ns: str) -> None:
    key = digest("own-connection")
    data = payload_for(key, 200_000)
    with cache_server() as srv, CacheClient(srv.unix_target, shared_memory=True) as client:
        assert client._blocks is not None
        # The loads' connection busy (a load waiting for its answer): a store still goes through,
        # so a store's begin waiting for the server can never hold this client's loads either.
        with client._blocks._lock:
            assert client.store(ns, [key], [data], timeout=5).accepted == 1
        assert client.load(ns, [key], timeout=5) == [data]


@pytest.mark.process
@pytest.mark.parametrize("case", ["payload_too_big", "too_many_keys"])
def test_the_block_socket_refuses_a_store_exactly_as_grpc_does_and_stages_nothing(ns: str, case: str) -> None:
    keys = [digest("refused", case, i) for i in range(3)]
    lengths = [4096, 4096, 4096] if case == "too_many_keys" else [4096, 2 << 20, 4096]
    overrides = {"limits.max_keys_per_request": 2, "limits.max_payload_bytes": 1 << 20}
    with cache_server(overrides=overrides) as srv:
        channel = grpc.insecure_channel(srv.unix_target)
        stub = pb_grpc.CacheStub(channel)  # type: ignore[no-untyped-call]
        with pytest.raises(grpc.RpcError) as over_grpc:
            stub.ShmStoreBegin(pb.ShmStoreBeginRequest(namespace=ns, keys=keys, lengths=lengths), timeout=10)
        channel.close()
        assert over_grpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with _raw(srv) as sock:
            msg, fds = _ask(sock, bp.encode_store_begin(ns, keys, lengths))
            assert fds == [], "a refused begin handed out staging memfds"
            assert bp.store_error(msg) == (bp.INVALID, over_grpc.value.details())
            # The connection stays open and serves the next request.
            msg, fds = _ask(sock, bp.encode_store_end(LEASE))
            assert bp.store_error(msg) == (bp.UNKNOWN_LEASE, "unknown or expired store lease")
        stats = CacheClient(srv.unix_target)
        with stats:
            got = stats.stats(timeout=5)
        assert got["arena_used_bytes"] == 0
        assert got["counters"].get("staging_memfds", {}) == {}
        with CacheClient(srv.unix_target, shared_memory=True) as client, pytest.raises(InvalidRequest):
            client.store(ns, keys, [b"x" * n for n in lengths], timeout=10)


@pytest.mark.process
def test_a_commit_that_lies_is_refused_and_stores_nothing(ns: str) -> None:
    keys = [digest("liar", i) for i in range(3)]
    n = 64 * 1024
    with cache_server() as srv, _raw(srv) as sock:
        msg, fds = _ask(sock, bp.encode_store_begin(ns, keys, [n, n, n]))
        begun = bp.parse_store_begun(msg, 3)
        assert begun is not None, msg
        lease, _, statuses = begun
        assert statuses == [bp.STAGED] * 3
        assert len(fds) == 3
        grown, mapped, honest = fds
        os.pwrite(grown, b"x" * (n + 1), 0)  # longer than it said
        writable = mmap.mmap(mapped, n, flags=mmap.MAP_SHARED)  # still mapped writable at the commit
        writable[:] = b"y" * n
        os.pwrite(honest, payload_for(keys[2], n), 0)
        # A key it did not begin: another lease id, and a lease already committed.
        msg, _ = _ask(sock, bp.encode_store_end(LEASE))
        assert bp.store_error(msg) == (bp.UNKNOWN_LEASE, "unknown or expired store lease")
        msg, _ = _ask(sock, bp.encode_store_end(lease))
        assert bp.parse_store_done(msg) == (1, 2)
        msg, _ = _ask(sock, bp.encode_store_end(lease))
        assert bp.store_error(msg) == (bp.UNKNOWN_LEASE, "unknown or expired store lease")
        writable.close()
        for fd in fds:
            os.close(fd)
        with CacheClient(srv.unix_target, shared_memory=True) as client:
            assert client.lookup(ns, keys, timeout=5).matched == 0
            assert client.lookup(ns, keys[2:], timeout=5).matched == 1
            assert client.load(ns, keys[2:], timeout=5) == [payload_for(keys[2], n)]
        assert _counters(srv)["invalid_staging"] == 2


@pytest.mark.process
def test_a_malformed_store_request_is_a_bad_request_and_closes_the_connection(ns: str) -> None:
    with cache_server() as srv:
        for bad in (
            bp.STORE_BEGIN_PREFIX + b" " + ns.upper().encode() + b" " + b"a" * 64 + b":1",
            bp.STORE_BEGIN_PREFIX + b" " + ns.encode() + b" " + b"a" * 64 + b":-1",
            bp.STORE_COMMIT_PREFIX + b" " + b"z" * 32,
        ):
            with _raw(srv) as one:
                msg, fds = _ask(one, bad)
                assert (msg[:1], fds) == (bytes([bp.BAD_REQUEST]), [])
                assert one.recv(16) == b""


def test_a_store_being_served_holds_no_load_on_another_connection(tmp_path: Path) -> None:
    block = os.memfd_create("test-block", os.MFD_CLOEXEC)
    os.write(block, b"block")
    release = threading.Event()
    started = threading.Event()
    jobs: list[Future[blocksock.StoreAnswer]] = []

    def slow_store(req: bp.StoreBegin | bp.StoreEnd, gone: object) -> Future[blocksock.StoreAnswer]:
        job: Future[blocksock.StoreAnswer] = Future()

        def finish() -> None:
            started.set()
            release.wait(30)
            job.set_result(blocksock.StoreAnswer(bp.encode_store_done(1, 0), []))

        threading.Thread(target=finish, daemon=True).start()
        jobs.append(job)
        return job

    served = blocksock.BlockSocket(tmp_path / "b.sock", lambda name: (os.dup(block), 5), stores=slow_store)
    served.start()
    storing = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    loading = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        storing.connect(str(served.path))
        loading.connect(str(served.path))
        storing.settimeout(30)
        loading.settimeout(5)
        storing.send(bp.encode_store_end(LEASE))
        assert started.wait(10)
        # The commit is still being served: loads on another connection are answered meanwhile.
        for _ in range(20):
            msg, fds = _ask(loading, bp.encode_request(["d_" + "cd" * 16]))
            assert msg == bytes([bp.FOUND])
            for fd in fds:
                os.close(fd)
        assert not jobs[0].done()
        release.set()
        msg, _, _ = fdpass.recv_fds(storing, 512, 1)
        assert bp.parse_store_done(msg) == (1, 0)
    finally:
        release.set()
        storing.close()
        loading.close()
        served.close()
        os.close(block)


def test_a_server_that_serves_no_stores_on_its_block_socket_is_stored_to_over_grpc(tmp_path: Path) -> None:
    # An older server's block socket (no store handler) answers a store request BAD_REQUEST and
    # closes: the channel says so (None), and a CacheClient stores over ShmStoreBegin/Commit.
    served = blocksock.BlockSocket(tmp_path / "b.sock", lambda name: None)
    served.start()
    try:
        with BlockChannel(served.path, client_id="c-1") as channel:
            ns, key = "ab" * 32, "cd" * 32
            assert channel.store_begin(ns, [key], [10], deadline=time.monotonic() + 5) is None
            assert channel.store_begin(ns, [key], [10], deadline=time.monotonic() + 5) is None
            # Loads still work on it: the refusal closed one connection, not the channel.
            assert channel.fetch(["d_" + "ef" * 16], deadline=time.monotonic() + 5) == [None]
    finally:
        served.close()


# --- bounded store path: a flood of abandoned stores, slots taken before queueing, no resend --------


def _staging_memfds(srv: ServerProcess) -> int:
    assert srv.proc is not None
    fd_dir = Path(f"/proc/{srv.proc.pid}/fd")
    count = 0
    for fd in os.listdir(fd_dir):
        with contextlib.suppress(OSError):
            if os.readlink(fd_dir / fd).startswith("/memfd:kvfabric-staging"):
                count += 1
    return count


@pytest.mark.process
def test_a_flood_of_abandoned_store_begins_leaves_no_lease_and_never_stalls_another_client(ns: str) -> None:
    # The hostile tenant: connect, send a begin (4 keys of 4 MiB each), hang up, 200 times, over
    # distinct client ids (the per-client bound does not stop it). Nothing it began may outlive it:
    # no lease (arena bytes), no staging memfd, and another client's store meanwhile completes or
    # is refused at once, never after waiting out its deadline.
    overrides = {
        "limits.max_concurrent_stores": 1,
        "shm.max_block_connections": 4,
        "shm.slot_lease_seconds": 30,
        "shm.prealloc_bytes": 0,  # no pooled staging: every staging memfd is a lease's
    }
    lengths = [4 << 20] * 4
    with cache_server(overrides=overrides) as srv:
        path = str(bp.block_socket_for(srv.config.listen.unix_socket))
        baseline = _staging_memfds(srv)
        stop = threading.Event()

        def flood() -> None:
            for i in range(200):
                if stop.is_set():
                    return
                keys = [digest("flood", i, j) for j in range(4)]
                with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                    s.connect(path)
                    s.send(bp.encode_store_begin(ns, keys, lengths, client=f"hostile-{i}"))

        flooding = threading.Thread(target=flood, daemon=True)
        flooding.start()
        key = digest("victim")
        stored = 0  # the victim's block: a committed staging memfd, kept as the block itself
        try:
            with CacheClient(srv.unix_target, shared_memory=True) as client:
                for _ in range(5):
                    t0 = time.monotonic()
                    with contextlib.suppress(Exception):
                        stored |= client.store(ns, [key], [payload_for(key, 100_000)], timeout=20).accepted
                    assert time.monotonic() - t0 < 10, "a store waited behind the flood"
        finally:
            flooding.join(60)
            stop.set()
        # Everything the flood began is gone well within the 30 s lease (skipped or aborted).
        deadline = time.monotonic() + 10
        while True:
            with CacheClient(srv.unix_target) as c:
                used = c.stats(timeout=5)["arena_used_bytes"]
            memfds = _staging_memfds(srv)
            if (used, memfds) == (0, baseline + stored) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert (used, memfds) == (0, baseline + stored), "abandoned store begins kept their leases"
        # And the socket still serves stores.
        with CacheClient(srv.unix_target, shared_memory=True) as client:
            assert client.store(ns, [key], [payload_for(key, 100_000)], timeout=20).accepted == 1


def test_store_requests_beyond_the_bound_are_refused_at_once_and_gone_connections_are_skipped(
    tmp_path: Path,
) -> None:
    started: list[tuple[Future[blocksock.StoreAnswer], object]] = []
    undone: list[str] = []

    def held(req: bp.StoreBegin | bp.StoreEnd, gone: object) -> Future[blocksock.StoreAnswer]:
        job: Future[blocksock.StoreAnswer] = Future()
        started.append((job, gone))
        return job

    served = blocksock.BlockSocket(
        tmp_path / "b.sock", lambda name: None, limits=blocksock.BlockLimits(max_store_jobs=2), stores=held
    )
    served.start()
    socks = [socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(4)]
    try:
        for s in socks:
            s.settimeout(5)
            s.connect(str(served.path))
        begin = bp.encode_store_begin("ab" * 32, ["cd" * 32], [10])
        for s in socks[:2]:
            s.send(begin)
        deadline = time.monotonic() + 5
        while len(started) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(started) == 2
        # Two queued: the next ones are answered busy at once, never handed to the store pool.
        for s in socks[2:]:
            msg, fds = _ask(s, begin)
            assert (bp.store_error(msg), fds) == ((bp.BUSY, "busy: too many stores queued"), [])
        assert len(started) == 2
        # A commit is not refused by it (its slot bounds it): refusing would strand its lease.
        socks[3].send(bp.encode_store_end(LEASE))
        deadline = time.monotonic() + 5
        while len(started) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(started) == 3
        # The first's client hangs up: its job sees it gone, and a begin answered for it is undone.
        socks[0].close()
        gone = started[0][1]
        assert callable(gone)
        assert gone() is True
        assert started[1][1]() is False  # type: ignore[operator]
        started[0][0].set_result(blocksock.StoreAnswer(b"x", [], lambda: undone.append("lease")))
        started[1][0].set_result(blocksock.StoreAnswer(bp.encode_store_done(1, 0), []))
        msg, _, _ = fdpass.recv_fds(socks[1], 512, 1)
        assert bp.parse_store_done(msg) == (1, 0)
        deadline = time.monotonic() + 5
        while not undone and time.monotonic() < deadline:
            time.sleep(0.01)
        assert undone == ["lease"]
        # Room again: the bound counts what is queued, not what was.
        started[2][0].set_result(blocksock.StoreAnswer(bp.encode_store_done(0, 0), []))
        msg, _, _ = fdpass.recv_fds(socks[3], 512, 1)
        socks[2].send(begin)
        deadline = time.monotonic() + 5
        while len(started) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(started) == 4
        started[3][0].set_result(blocksock.StoreAnswer(bp.encode_store_done(0, 0), []))
    finally:
        for s in socks:
            s.close()
        served.close()


def test_a_commit_with_no_store_slot_free_is_dropped_at_once_never_queued(tmp_path: Path, ns: str) -> None:
    # max_concurrent_stores=1: one pool thread, one slot. The pool busy and the slot taken, a commit
    # (over gRPC or the block socket) is answered dropped at once instead of queueing behind them.
    config = make_config(tmp_path, overrides={"limits.max_concurrent_stores": 1}, tcp=False, metrics=False)
    store = TieredStore(config)
    arena = StagingArena(config.shm.arena_bytes, 30, store.counters)
    state = SharedState(store, arena, Metrics(store, max_namespaces=8), config.limits)
    release = threading.Event()
    try:
        busy = state.store_pool.submit(release.wait, 30)
        assert state.try_store_slot()
        keys = [digest("slot", i) for i in range(2)]
        leases = [state.shm_begin(ns, keys, [4096, 4096])[0].lease_id for _ in range(2)]
        answer = block_stores(state)(bp.StoreEnd(leases[0], abort=False), lambda: False)
        assert answer.done(), "a commit queued for a store slot"
        assert answer.result().msg == bp.encode_store_done(0, 2)
        service = CacheService(state, allow_shm=True)
        context = cast("grpc.aio.ServicerContext[Any, Any]", None)
        got = asyncio.run(
            asyncio.wait_for(service.ShmStoreCommit(pb.ShmStoreCommitRequest(lease_id=leases[1]), context), 5)
        )
        assert (got.accepted, got.dropped) == (0, 2)
        # Freed on a thread of their own (not the loop's): at once, but not necessarily by now.
        deadline = time.monotonic() + 10
        while arena.used_bytes:
            assert time.monotonic() < deadline, "a dropped lease's pages were never freed"
            time.sleep(0.01)
        state.release_store_slot()
        release.set()
        busy.result(5)
        assert state.store_inflight == 0
    finally:
        release.set()
        state.close()
        arena.close()
        store.close()


def test_a_commit_whose_client_is_gone_gives_its_slot_back_even_for_an_unknown_lease(
    tmp_path: Path,
) -> None:
    # A tenant sends commits of made-up leases and hangs up before they run: each took a store slot
    # before queueing, and every one must come back, or stores end for every tenant.
    config = make_config(tmp_path, overrides={"limits.max_concurrent_stores": 2}, tcp=False, metrics=False)
    store = TieredStore(config)
    arena = StagingArena(config.shm.arena_bytes, 30, store.counters)
    state = SharedState(store, arena, Metrics(store, max_namespaces=8), config.limits)
    try:
        serve = block_stores(state)
        for i in range(5):
            answer = serve(bp.StoreEnd(f"{i:02x}" * 16, abort=False), lambda: True)
            answer.result(10)
        assert state.store_inflight == 0
        assert state.try_store_slot()
        state.release_store_slot()
    finally:
        state.close()
        arena.close()
        store.close()


def test_a_commit_whose_job_queued_but_got_no_thread_gives_its_slot_back_once(
    tmp_path: Path, ns: str
) -> None:
    # ThreadPoolExecutor.submit queues the job before it starts a thread; at a pids limit the start
    # fails and submit raises, yet the queued job still runs. The slot the commit took must come
    # back once, not twice (twice: more than max_concurrent_stores stores at once, for good).
    config = make_config(tmp_path, overrides={"limits.max_concurrent_stores": 2}, tcp=False, metrics=False)
    store = TieredStore(config)
    arena = StagingArena(config.shm.arena_bytes, 30, store.counters)
    state = SharedState(store, arena, Metrics(store, max_namespaces=8), config.limits)
    real_submit = state.store_pool.submit
    ran: list[Future[Any]] = []

    def submit_then_fail(fn: Any, *args: Any) -> Future[Any]:
        ran.append(real_submit(fn, *args))
        raise RuntimeError("can't start new thread")

    try:
        lease = state.shm_begin(ns, [digest("once", 0)], [4096])[0].lease_id
        state.store_pool.submit = submit_then_fail  # type: ignore[method-assign,assignment]
        with pytest.raises(RuntimeError):
            block_stores(state)(bp.StoreEnd(lease, abort=False), lambda: True)
        ran[0].result(10)
        assert state.store_inflight == 0
    finally:
        state.store_pool.submit = real_submit  # type: ignore[method-assign]
        state.close()
        arena.close()
        store.close()


def test_a_busy_refusal_is_a_dropped_store_not_a_failure(tmp_path: Path) -> None:
    # Too many stores queued: the server drops the request at once. The client counts its keys
    # dropped (as for a commit without a slot) and raises nothing: a CacheUnavailable would count
    # against the breaker that also guards the engine's loads and lookups, and be retried at once.
    refusal = bp.encode_store_error(bp.BUSY, "busy: too many stores queued")
    with pytest.raises(StoreBusy):
        blocks_module._raise_store_error(refusal, [])
    assert not issubclass(StoreBusy, CacheUnavailable)

    class _Busy:
        def store_begin(self, *args: Any, **kwargs: Any) -> None:
            raise StoreBusy("store refused: busy")

    with CacheClient(f"unix://{tmp_path / 'none.sock'}", shared_memory=True) as c:
        keys = [digest("busy", i) for i in range(bp.MAX_NAMES + 3)]
        payloads = [b"x" * 64 for _ in keys]
        got = c._block_store(cast("BlockChannel", _Busy()), "ab" * 32, keys, payloads, time.monotonic() + 5)
    assert got is not None
    assert (got.accepted, got.dropped) == (0, len(keys))


def _beginning_socket(tmp_path: Path, block: int, undone: list[str]) -> blocksock.BlockSocket:
    """A started block socket whose every store request is answered "begun" with one staging memfd
    (its undo appends to ``undone``), and whose answers may leave one answer's descriptors unread."""

    def begun(req: bp.StoreBegin | bp.StoreEnd, gone: object) -> Future[blocksock.StoreAnswer]:
        job: Future[blocksock.StoreAnswer] = Future()
        staging = os.memfd_create("staging", os.MFD_CLOEXEC)
        job.set_result(blocksock.StoreAnswer(b"begun", [staging], lambda: undone.append("lease")))
        return job

    served = blocksock.BlockSocket(
        tmp_path / "b.sock",
        lambda name: (os.dup(block), 0),
        limits=blocksock.BlockLimits(max_unread_fds=bp.MAX_NAMES),
        stores=begun,
    )
    served.start()
    return served


def test_a_begin_whose_staging_descriptors_would_pass_the_unread_bound_is_busy_and_its_lease_undone(
    tmp_path: Path,
) -> None:
    # Another connection of this uid holds its whole share of descriptors unread: the begin's answer
    # would add to it. It is answered busy (a dropped store, not a failure that trips the breaker),
    # its lease is aborted at once, and the connection stays.
    block = os.memfd_create("block", os.MFD_CLOEXEC)
    undone: list[str] = []
    served = _beginning_socket(tmp_path, block, undone)
    hog = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        hog.connect(str(served.path))
        hog.send(bp.encode_request(["d_" + "ab" * 16] * bp.MAX_NAMES))  # never read
        wait_until(lambda: served.unread_descriptors == bp.MAX_NAMES, 5, what="the hog's answer")
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(5)
            s.connect(str(served.path))
            msg, fds = _ask(s, bp.encode_store_begin("ab" * 32, ["cd" * 32], [10]))
            assert (bp.store_error(msg), fds) == ((bp.BUSY, "busy: too many answers unread on this node"), [])
            wait_until(lambda: undone == ["lease"], 5, what="the lease to be aborted")
            assert served.connections == 2  # still connected
        with pytest.raises(StoreBusy):
            blocks_module._raise_store_error(msg, [])
    finally:
        hog.close()
        served.close()
        os.close(block)


@pytest.mark.parametrize("then", ["client hangs up", "unread bound reached", "client never reads"])
def test_a_begin_answer_that_waited_for_room_and_never_reached_its_client_undoes_its_lease(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    # The begin's answer found its client's queue full (injected: the send would block), so it waits
    # for the client to read. Then it never reaches the client: the client hangs up, by the time it
    # can be sent the unread bound is reached (it is refused), or the client never reads and its
    # connection is dropped with the answer still waiting. Each way its lease is aborted at once,
    # exactly once; before, only an answer that failed at its first send was, and a waiting one's
    # staged pages stayed for the lease's 30 s.
    block = os.memfd_create("block", os.MFD_CLOEXEC)
    undone: list[str] = []
    hold = threading.Event()
    hold.set()
    held: list[int] = []
    real_send_fds = socket.send_fds

    def send_fds(sock: socket.socket, buffers: list[bytes], fds: list[int], *args: Any) -> int:
        if hold.is_set() and buffers == [b"begun"]:
            if not held:  # (the loop retries it on every turn: the socket is writable)
                held.append(len(fds))
            raise BlockingIOError("injected: the client's queue is full")
        return real_send_fds(sock, buffers, fds, *args)

    monkeypatch.setattr(socket, "send_fds", send_fds)
    monkeypatch.setattr(blocksock, "SEND_TIMEOUT_SECONDS", 0.3)
    served = _beginning_socket(tmp_path, block, undone)
    hog = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        client.connect(str(served.path))
        client.send(bp.encode_store_begin("ab" * 32, ["cd" * 32], [10]))
        wait_until(lambda: bool(held), 5, what="the begin's answer to wait for room")
        if then == "client hangs up":
            client.close()
        elif then == "unread bound reached":  # another connection of this uid takes the whole share
            hog.connect(str(served.path))
            hog.send(bp.encode_request(["d_" + "ab" * 16] * bp.MAX_NAMES))
            wait_until(lambda: served.unread_descriptors == bp.MAX_NAMES, 5, what="the hog's answer")
        if then != "client never reads":  # else the answer stays held until its wait times out
            hold.clear()
        wait_until(lambda: bool(undone), 5, what="the lease to be aborted")
        time.sleep(0.2)  # long enough for a second undo, if there were one
        assert undone == ["lease"]
    finally:
        hold.clear()
        hog.close()
        client.close()
        served.close()
        os.close(block)


def test_a_store_whose_connection_drops_is_not_resent(tmp_path: Path) -> None:
    # A server that reads a store request and hangs up: the client fails that store, once. A resent
    # begin would leak a lease; a resent commit would report a stored store as failed.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(tmp_path / "b.sock"))
    listener.listen(8)
    listener.settimeout(0.2)
    seen: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    seen.append(conn.recv(4096))

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        with BlockChannel(tmp_path / "b.sock", client_id="c-1") as channel:
            ns, key = "ab" * 32, "cd" * 32
            with pytest.raises(CacheUnavailable):
                channel.store_begin(ns, [key], [10], deadline=time.monotonic() + 5)
            time.sleep(0.5)  # a resend would have arrived by now
            assert [m[:5] for m in seen] == [bp.STORE_BEGIN_PREFIX]
            with pytest.raises(CacheUnavailable):
                channel.store_end(LEASE, deadline=time.monotonic() + 5)
            time.sleep(0.5)
            assert [m[:5] for m in seen] == [bp.STORE_BEGIN_PREFIX, bp.STORE_COMMIT_PREFIX]
            # A fetch is still asked again once on a fresh connection (the server may have restarted).
            with pytest.raises(CacheUnavailable):
                channel.fetch(["d_" + "ef" * 16], deadline=time.monotonic() + 5)
            time.sleep(0.5)
            assert len(seen) == 4
    finally:
        stop.set()
        server.join(5)
        listener.close()


def test_a_store_on_a_connection_the_server_closed_while_idle_goes_out_once_on_a_fresh_one(
    tmp_path: Path,
) -> None:
    # The send itself fails (the server closed the idle connection, e.g. for a newcomer): the server
    # never took the request, so it goes out once more on a fresh connection, and is served once.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(tmp_path / "b.sock"))
    listener.listen(8)
    listener.settimeout(10)
    seen: list[bytes] = []

    def serve() -> None:
        for _ in range(2):  # each connection: answer one commit, then close it while idle
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(10)
                seen.append(conn.recv(4096))
                conn.send(bp.encode_store_done(1, 0))

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        with BlockChannel(tmp_path / "b.sock", client_id="c-1") as channel:
            assert channel.store_end(LEASE, deadline=time.monotonic() + 5) == (1, 0)
            time.sleep(0.3)  # the server has closed that connection
            assert channel.store_end(LEASE, deadline=time.monotonic() + 5) == (1, 0)
        server.join(5)
        assert [m[:5] for m in seen] == [bp.STORE_COMMIT_PREFIX] * 2
    finally:
        listener.close()


@pytest.mark.process
def test_a_block_store_whose_answer_asks_for_the_description_sends_it_in_the_same_store() -> None:
    """A server that lacks an announced namespace's description says so in the begin's answer, and
    the storer describes it before the store returns: a client that stores over the block socket and
    looks up from the published table makes no other call that would carry it (a restarted server
    would stay undescribed, unseen by the operator's cache insight)."""
    specs = [NamespaceSpec("tiny-llama", rev, "float32", 2, 1, 4, 16, 32) for rev in ("rev-a", "rev-b")]
    first, last = sorted(specs, key=lambda s: s.digest())
    with (
        # One description kept: describing `last` forgets `first`, as a restart would.
        cache_server(overrides={"limits.max_described_namespaces": 1}) as srv,
        CacheClient(srv.unix_target, shared_memory=True) as client,
    ):
        stub = client._conn.stub
        described: list[str] = []

        class OnlyDescribeOverGrpc:
            def __getattr__(self, name: str) -> object:
                if name.startswith("ShmStore"):
                    raise AssertionError(f"a same-node store called {name} over gRPC")
                if name == "Describe":

                    def describe(req: Any, **kw: Any) -> object:
                        described.append(req.namespace)
                        return stub.Describe(req, **kw)

                    return describe
                return getattr(stub, name)

        client._conn = dataclasses.replace(client._conn, stub=OnlyDescribeOverGrpc())
        for spec in (first, last):
            client.announce(spec.digest(), spec.canonical().decode())
        key = digest("described-at-once")
        data = payload_for(key, 10_000)
        # The store's start describes both, in order: the server keeps `last` only.
        assert client.store(last.digest(), [key], [data], timeout=10).accepted == 1
        assert described == [first.digest(), last.digest()]
        # `first`'s begin is answered "describe": sent within this store, not at the next call.
        assert client.store(first.digest(), [key], [data], timeout=10).accepted == 1
        assert described == [first.digest(), last.digest(), first.digest()]
        assert not client.describes_pending


def _arena_after_aborts(srv: ServerProcess, within: float = 5) -> dict[str, Any]:
    """The server's stats once its arena is empty, or after ``within`` seconds (well inside a lease)."""
    deadline = time.monotonic() + within
    while True:
        with CacheClient(srv.unix_target) as c:
            got = c.stats(timeout=5)
        if got["arena_used_bytes"] == 0 or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


@pytest.mark.process
def test_a_store_whose_commit_got_no_answer_aborts_its_lease_at_once(ns: str) -> None:
    """The commit's connection went before its answer (the server may have closed it for a newcomer
    with the commit unread): the client aborts the lease on a fresh connection, so the staged pages
    go now, not when the lease expires (30 s here)."""
    overrides = {"shm.slot_lease_seconds": 30, "shm.prealloc_bytes": 0}
    key = digest("commit-lost")
    with cache_server(overrides=overrides) as srv, CacheClient(srv.unix_target, shared_memory=True) as client:
        assert client._store_blocks is not None
        channel = client._store_blocks
        real_end = channel.store_end
        lost: list[str] = []

        def store_end(lease: str, *, abort: bool = False, deadline: float) -> tuple[int, int]:
            if not abort:  # the commit is never sent: as if its connection went first
                lost.append(lease)
                raise CacheUnavailable("the block socket's connection went before the answer")
            return real_end(lease, abort=abort, deadline=deadline)

        channel.store_end = store_end  # type: ignore[method-assign]
        baseline = _staging_memfds(srv)
        with pytest.raises(CacheUnavailable):
            client.store(ns, [key], [payload_for(key, 4 << 20)], timeout=10)
        assert len(lost) == 1
        # Aborted: nothing leased, no staging memfd, well within the lease's 30 s.
        got = _arena_after_aborts(srv)
        assert got["arena_used_bytes"] == 0, "a lease whose commit got no answer was left to expire"
        assert _staging_memfds(srv) == baseline
        assert client.load(ns, [key], timeout=5) == []


@pytest.mark.process
@pytest.mark.parametrize("path", ["block-socket", "grpc"])
def test_a_store_whose_deadline_passes_after_its_write_aborts_its_lease_at_once(
    ns: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of time between the write and the commit: the client aborts the lease it will never
    commit, so the staged pages go now, not when the lease expires (30 s here). On the block socket,
    and over ShmStoreBegin/Commit (a server that serves no stores on its block socket)."""
    from kvfabric.client import _common

    overrides = {"shm.slot_lease_seconds": 30, "shm.prealloc_bytes": 0}
    key = digest("late-commit", path)
    writer = "write_staged" if path == "block-socket" else "shm_write"
    real_write = getattr(_common, writer)

    def slow_write(*args: Any) -> None:
        real_write(*args)
        time.sleep(0.6)  # past the store's 0.5 s deadline

    with cache_server(overrides=overrides) as srv, CacheClient(srv.unix_target, shared_memory=True) as client:
        baseline = _staging_memfds(srv)
        if path == "grpc":
            monkeypatch.setattr(BlockChannel, "store_begin", lambda *_a, **_k: None)  # as an older server
        monkeypatch.setattr(_common, writer, slow_write)
        with pytest.raises(CacheTimeout):
            client.store(ns, [key], [payload_for(key, 4 << 20)], timeout=0.5)
        monkeypatch.undo()
        got = _arena_after_aborts(srv)
        assert got["arena_used_bytes"] == 0, "a lease never committed was left to expire"
        assert _staging_memfds(srv) == baseline
        assert client.load(ns, [key], timeout=5) == []
