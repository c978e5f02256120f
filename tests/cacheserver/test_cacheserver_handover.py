"""Hand-over of DRAM from a running server to its successor on the same node (rollouts stay warm).

Promises (docs/cacheserver.md, "Hand-over"), each tested here against real sockets, and the first
against two real server processes:

* a successor takes over every DRAM block and every socket path; clients see DRAM hits, never a miss
  or a wrong byte, and the predecessor's exit removes nothing of the successor's;
* what the successor serves after a hand-over is exactly what the predecessor would have served:
  latest stores, no deleted key (a model-based test over random stores, overwrites and deletes,
  with a successor whose DRAM may be smaller);
* while frozen the predecessor writes nothing: a store is dropped, a delete refused (UNAVAILABLE over
  gRPC), and a store in flight when the freeze begins is waited for and handed over;
* the freeze quiesces tiers that change storage on their own threads (the object store) once the
  write-backs landed, and a tier that cannot quiesce calls the hand-over off (resumed, serving);
* the successor takes changes only once the predecessor released (``published`` is answered after
  the predecessor stopped serving), and a predecessor that handed over never thaws;
* a successor that goes away mid-hand-over leaves the predecessor serving (stores accepted again);
* only the server's own uid can ask for a hand-over.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfabric.cacheserver.config import ServerConfig
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.tiered import HandingOver, TieredStore
from kvfabric.cacheserver.transport.handover import (
    BEGIN,
    HandoverFailed,
    HandoverOffer,
    handover_socket_for,
    receive,
)
from kvfabric.cacheserver.transport.socketfile import SocketFile
from kvfabric.client import CacheClient
from kvfabric.client.errors import CacheError, CacheUnavailable
from kvfabric.rpc.blockproto import block_socket_for
from kvfabric.rpc.indextable import index_socket_for
from kvfabric.testing.serverproc import (
    MiB,
    cache_server,
    digest,
    make_config,
    payload_for,
    wait_until,
)

T = TypeVar("T")
FREEZING = "a successor asked for a hand-over: freezing"
NS = digest("handover")
SIZE = 256 * 1024


def _bid(i: int) -> BlockId:
    return BlockId(NS, digest("key", i))


def _config(work: Path, dram_bytes: int = 64 * MiB) -> ServerConfig:
    return make_config(work, dram_bytes=dram_bytes, tcp=False, metrics=False)


@pytest.fixture
def work(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    # Short: a Unix socket path has at most 107 bytes.
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="kvho-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def _offered(work: Path, **offer: Any) -> Iterator[tuple[TieredStore, Path, threading.Event]]:
    """A started predecessor store offering itself on a real hand-over socket: ``(store, path, done)``."""
    a = TieredStore(_config(work))
    a.start()
    path = handover_socket_for(work / "srv.sock")
    done = threading.Event()
    ho = HandoverOffer(path, a, done.set, **offer)
    ho.start()
    try:
        yield a, path, done
    finally:
        ho.close()
        a.close()


class _Handover:
    """A predecessor store offering itself on a real socket, and the successor's side of it."""

    def __init__(self, a: TieredStore, path: Path) -> None:
        self.done = threading.Event()
        self.offer = HandoverOffer(path, a, self._retire, freeze_timeout=10)
        self.offer.start()
        self.path = path

    def _retire(self) -> None:
        # What the server does on "done": stop serving (nothing here), then release.
        self.done.set()
        self.offer.release()

    def to(self, b: TieredStore) -> int:
        inbound = receive(self.path, timeout=10)
        assert inbound is not None
        b.learn(inbound.last_gen, inbound.tombstones)
        b.start()
        blocks, inbound.blocks = inbound.blocks, []
        n = b.adopt(blocks)
        inbound.commit()
        inbound.published()
        assert self.done.wait(10)
        return n


# --- model-based: the successor serves what the predecessor would have --------------------------------

ops = st.lists(
    st.tuples(st.sampled_from(["put", "put", "delete"]), st.integers(0, 7), st.integers(0, 3)),
    min_size=1,
    max_size=25,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, small_successor=st.booleans())
def test_the_successor_serves_exactly_the_latest_stores_and_no_deleted_key(
    work: Path, ops: list[tuple[str, int, int]], small_successor: bool
) -> None:
    case = work / f"c{time.monotonic_ns()}"
    case.mkdir()
    a = TieredStore(_config(case))
    a.start()
    model: dict[BlockId, bytes] = {}
    for op, i, v in ops:
        bid = _bid(i)
        if op == "put":
            data = payload_for(f"{i}-{v}", SIZE)
            if a.put(bid, data):
                model[bid] = data
        else:
            a.delete(bid)
            model.pop(bid, None)
    a_last, a_tomb_list = a.generations.export()
    a_tombs = dict(a_tomb_list)
    ho = _Handover(a, handover_socket_for(case / "srv.sock"))
    # A successor with room for 2 blocks adopts the most recent ones; the rest it reads from disk.
    b = TieredStore(_config(case, dram_bytes=(2 * SIZE) if small_successor else 64 * MiB))
    try:
        adopted = ho.to(b)
        a.close(handed_over=True)
        ho.offer.close()
        assert adopted <= len(model)
        # Every delete the predecessor knew, the successor knows (a store inside a delete's margin
        # is refused there too).
        for bid, gen in a_tombs.items():
            assert b.generations.deleted_at(bid) >= gen
        if not small_successor:
            assert adopted == len(model)  # every DRAM block, nothing re-read
            assert all(b.dram.contains(bid) for bid in model), "served from the adopted DRAM blocks"
        for i in range(8):
            bid = _bid(i)
            payload = b.open_block(bid)
            if bid in model:
                assert payload is not None, f"key {i} was lost in the hand-over"
                with payload:
                    assert payload.read() == model[bid]
            else:
                assert payload is None, f"key {i} was deleted (or never stored) but is served"
        # The successor's clock is past the predecessor's: its next store of a key wins over the old copy.
        if model:
            bid = next(iter(model))
            assert b.put(bid, b"newer") or b.generations.deleted_at(bid)
            new_gen = b.dram.generation(bid)
            assert new_gen is not None
            assert new_gen > a_last
    finally:
        b.close()


# --- the freeze -----------------------------------------------------------------------------------------


def test_a_frozen_store_drops_stores_refuses_deletes_and_waits_for_a_store_in_flight(work: Path) -> None:
    a = TieredStore(_config(work))
    a.start()
    try:
        in_fill = threading.Event()
        release = threading.Event()

        def slow_fill(fd: int) -> None:
            in_fill.set()
            assert release.wait(10)
            os.pwrite(fd, b"x" * 4096, 0)

        put = threading.Thread(target=lambda: a.put_with(_bid(1), 4096, slow_fill))
        put.start()
        assert in_fill.wait(5)
        frozen: list[bool] = []
        freezer = threading.Thread(target=lambda: frozen.append(a.freeze(10)))
        freezer.start()
        time.sleep(0.3)
        assert not frozen, "the freeze returned while a store was still being written"
        release.set()
        put.join(5)
        freezer.join(10)
        assert frozen == [True]
        snap = a.export()
        assert [b for b, *_ in snap.blocks] == [_bid(1)], "the store in flight is handed over"
        assert not a.put(_bid(2), b"y" * 4096), "a store while frozen is dropped"
        assert a.open_block(_bid(2)) is None
        with pytest.raises(HandingOver):
            a.delete(_bid(1))
        assert a.open_block(_bid(1)) is not None
        a.thaw()
        assert a.put(_bid(2), b"y" * 4096)
        assert a.delete(_bid(1))
    finally:
        a.close()


class _Quiescing:
    """A real backing tier (delegated to) that records the hand-over's quiesce and resume calls."""

    def __init__(self, tier: Any, events: list[tuple[str, Any]], *, refuse: bool) -> None:
        self._tier = tier
        self._events = events
        self._refuse = refuse
        self.store: TieredStore | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tier, name)

    def quiesce(self, timeout: float) -> bool:
        assert self.store is not None
        # What the store promises a quiescing tier: its own write-backs settled first.
        self._events.append(("quiesce", self.store.flush(0)))
        return not self._refuse

    def resume(self) -> None:
        self._events.append(("resume", None))


@pytest.mark.parametrize("refuse", [False, True], ids=["quiesced", "cannot-quiesce"])
def test_the_freeze_quiesces_tiers_with_threads_of_their_own_and_the_thaw_resumes_them(
    work: Path, refuse: bool
) -> None:
    # The object-store tier changes storage on its own threads (uploads, expiry, rescans): a freeze
    # that did not quiesce it would let the predecessor write while the successor scans.
    from kvfabric.cacheserver.engine.tiers import build_backing_tiers

    events: list[tuple[str, Any]] = []
    wrapped: list[_Quiescing] = []

    def backing(ctx: Any) -> list[Any]:
        wrapped.extend(_Quiescing(t, events, refuse=refuse) for t in build_backing_tiers(ctx))
        return list(wrapped)

    a = TieredStore(_config(work), backing=backing)
    assert wrapped, "the test needs a backing tier to wrap"
    for w in wrapped:
        w.store = a
    a.start()
    try:
        for i in range(4):
            assert a.put(_bid(i), payload_for(str(i), SIZE))  # write-backs queued to the disk tier
        assert a.freeze(10) is not refuse
        if refuse:
            # A tier that cannot quiesce calls the hand-over off: the store thawed and serves on.
            assert events == [("quiesce", True), ("resume", None)]
            assert not a.frozen
            assert a.put(_bid(9), b"z" * 4096)
            return
        assert events == [("quiesce", True)] * len(wrapped), "quiesced once the write-backs landed"
        a.thaw()
        assert events[len(wrapped) :] == [("resume", None)] * len(wrapped)
        assert a.put(_bid(9), b"z" * 4096)
    finally:
        a.close()


def test_a_successor_that_goes_away_mid_hand_over_leaves_the_predecessor_serving(work: Path) -> None:
    with _offered(work, freeze_timeout=5) as (a, path, done):
        for i in range(3):
            assert a.put(_bid(i), payload_for(str(i), SIZE))
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.connect(str(path))
            s.sendall(BEGIN)
            s.settimeout(5)
            assert b'"head"' in s.recv(1 << 16)
            wait_until(lambda: a.frozen, 5, what="the predecessor to freeze")
        # Gone without "done": the predecessor thaws and takes stores again.
        wait_until(lambda: not a.frozen, 5, what="the predecessor to thaw")
        assert a.put(_bid(9), b"z" * 4096)
        assert not done.is_set()
        # And a later successor still gets everything.
        b = TieredStore(_config(work))
        try:
            inbound = receive(path, timeout=10)
            assert inbound is not None
            assert {bid for bid, *_ in inbound.blocks} == {_bid(0), _bid(1), _bid(2), _bid(9)}
            inbound.close()
        finally:
            b.close()


def test_the_successor_hears_published_answered_only_once_the_predecessor_released(work: Path) -> None:
    # The successor thaws (takes deletes) when published() returns: that must not happen while the
    # predecessor still answers calls, or a delete taken here could be contradicted there.
    a = TieredStore(_config(work))
    a.start()
    path = handover_socket_for(work / "srv.sock")
    retired = threading.Event()
    offer = HandoverOffer(path, a, retired.set, freeze_timeout=10)  # released by hand, below
    offer.start()
    b = TieredStore(_config(work / "b"))
    try:
        assert a.put(_bid(1), payload_for("1", SIZE))
        inbound = receive(path, timeout=10)
        assert inbound is not None
        b.learn(inbound.last_gen, inbound.tombstones)
        b.start()
        blocks, inbound.blocks = inbound.blocks, []
        assert b.adopt(blocks) == 1
        inbound.commit()
        answered = threading.Event()

        def publish() -> None:
            inbound.published(timeout=10)
            answered.set()

        waiter = threading.Thread(target=publish)
        waiter.start()
        assert retired.wait(5), "the predecessor retires on 'published'"
        time.sleep(0.5)
        assert not answered.is_set(), "published() returned while the predecessor still serves"
        offer.release()
        waiter.join(5)
        assert answered.is_set(), "published() returns once the predecessor released"
        assert a.frozen, "a predecessor that handed over never thaws"
    finally:
        offer.close()
        b.close()
        a.close()


@pytest.mark.process
def test_only_the_servers_own_uid_can_ask_for_a_hand_over(work: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to run a peer as another uid")
    work.chmod(0o755)
    with _offered(work, freeze_timeout=5) as (a, path, _done):
        assert a.put(_bid(0), b"secret" * 1000)
        assert path.stat().st_mode & 0o777 == 0o600
        pid = os.fork()
        if pid == 0:  # the child: another user asks for the store
            code = 0
            try:
                os.setgid(65534)
                os.setuid(65534)
                with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                    try:
                        s.connect(str(path))
                        code = 3  # connected at all: the socket's mode failed to keep it out
                    except PermissionError:
                        code = 0
            except BaseException:
                code = 4
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        # Even a socket left open by mistake: the peer's uid (SO_PEERCRED) is checked before anything.
        path.chmod(0o666)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.setgid(65534)
                os.setuid(65534)
                with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                    s.connect(str(path))
                    s.settimeout(5)
                    try:
                        s.sendall(BEGIN)
                        code = 0 if s.recv(1 << 16) == b"" else 3  # closed, nothing sent
                    except (BrokenPipeError, ConnectionResetError):
                        code = 0  # closed before it could even ask
            except BaseException:
                code = 4
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not a.frozen
        assert a.put(_bid(1), b"ok" * 1000)


def test_a_predecessor_that_cannot_freeze_in_time_makes_the_successor_refuse_to_serve(work: Path) -> None:
    release = threading.Event()

    def stuck_fill(fd: int) -> None:
        assert release.wait(10)
        os.pwrite(fd, b"s" * 4096, 0)

    with _offered(work, freeze_timeout=0.3) as (a, path, _done):
        put = threading.Thread(target=lambda: a.put_with(_bid(1), 4096, stuck_fill))
        put.start()
        try:
            with pytest.raises(HandoverFailed, match="aborted"):
                receive(path, timeout=10)
            wait_until(lambda: not a.frozen, 5, what="the predecessor to serve on")
        finally:
            release.set()
            put.join(5)
        assert a.open_block(_bid(1)) is not None
        assert a.put(_bid(2), b"t" * 4096)


def test_a_successor_too_slow_to_take_over_is_refused_and_the_predecessor_thaws(work: Path) -> None:
    with _offered(work, freeze_timeout=5, successor_timeout=0.5) as (a, path, done):
        assert a.put(_bid(0), payload_for("0", SIZE))
        inbound = receive(path, timeout=10)
        assert inbound is not None
        assert a.frozen
        wait_until(lambda: not a.frozen, 5, what="the predecessor to give up on its successor")
        # The successor's "done" comes too late: the predecessor serves on, so the successor must not.
        with pytest.raises(HandoverFailed, match="still serving"):
            inbound.commit(timeout=2)
        inbound.close()
        assert not done.is_set()
        assert a.put(_bid(1), b"u" * 4096)


def test_a_socket_file_is_removed_only_by_the_listener_that_still_owns_it(work: Path) -> None:
    path = work / "s.sock"
    files = []
    for _ in range(2):
        f = SocketFile(path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(f.bound))
        s.listen(1)
        f.publish()
        files.append((f, s))
    (old, old_sock), (new, new_sock) = files
    old.remove()  # the predecessor's exit
    assert path.exists(), "the successor's socket survives its predecessor's exit"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect(str(path))
        conn, _ = new_sock.accept()
        conn.close()
    new.remove()
    assert not path.exists()
    assert sorted(p.name for p in work.iterdir()) == []
    old_sock.close()
    new_sock.close()


# --- two real server processes ----------------------------------------------------------------------------


def _ino(path: Path) -> int:
    return path.stat().st_ino


@pytest.mark.process
def test_a_successor_process_takes_over_dram_and_the_sockets_and_the_predecessor_exit_leaves_them() -> None:
    n = 12
    keys = [digest("proc", i) for i in range(n)]
    payloads = [payload_for(k, SIZE) for k in keys]
    with cache_server(dram_bytes=64 * MiB) as a:
        c = CacheClient(a.unix_target, shared_memory=True)
        try:
            assert c.store(NS, keys, payloads, timeout=10).accepted == n
            assert c.lookup(NS, keys, timeout=5).tiers == ["dram"] * n
            sock = a.config.listen.unix_socket
            before = {p: _ino(p) for p in (sock, block_socket_for(sock), index_socket_for(sock))}

            # A client connecting at any moment of the hand-over finds a listening socket on every path.
            missing: list[str] = []
            probing = threading.Event()
            probing.set()

            def probe() -> None:
                kinds = {sock: socket.SOCK_STREAM, block_socket_for(sock): socket.SOCK_SEQPACKET}
                while probing.is_set():
                    for path, kind in kinds.items():
                        with socket.socket(socket.AF_UNIX, kind) as s:
                            try:
                                s.connect(str(path))
                            except OSError as exc:
                                missing.append(f"{path.name}: {exc!r}")
                    time.sleep(0.001)

            prober = threading.Thread(target=probe)
            prober.start()
            b = a.successor()
            try:
                b.start_beside()
            finally:
                probing.clear()
                prober.join(5)
            try:
                assert not missing, f"a client found no socket during the hand-over: {missing[:5]}"
                after = {p: _ino(p) for p in before}
                assert all(after[p] != before[p] for p in before), "every socket path is the successor's"
                assert a.proc is not None
                assert a.proc.poll() is None, "the predecessor idles until terminated"
                records = [r.get("message") for r in a.log_records()]
                assert "handed over to the successor" in records

                # The client's connection to A closed; the next calls reach B, and B has A's DRAM.
                got = wait_until(
                    lambda: (r := _quiet(lambda: c.lookup(NS, keys, timeout=5))) and r.matched == n and r,
                    10,
                    what="lookups answered by the successor",
                )
                assert got.tiers == ["dram"] * n, "DRAM blocks survive the hand-over in DRAM"
                assert c.load(NS, keys, timeout=10) == payloads
                stats = c.stats(timeout=5)
                assert stats["counters"]["adopted_blocks"]["dram"] == n
                assert stats["counters"].get("hits", {}).get("local_disk", 0) == 0, "nothing was re-read"

                # The predecessor's exit (the rollout deletes its pod) removes nothing of B's.
                a.stop()
                assert a.proc is not None
                assert a.proc.returncode == 0
                assert {p: _ino(p) for p in before} == after
                assert c.load(NS, keys, timeout=10) == payloads
                assert c.store(NS, [digest("new")], [b"n" * 4096], timeout=10).accepted == 1
            finally:
                b.stop()
            assert not sock.exists(), "the last server's own stop removes its socket"
        finally:
            c.close()


@pytest.mark.process
def test_deletes_during_the_hand_over_are_refused_with_unavailable_and_work_on_the_successor() -> None:
    # The predecessor's freeze waits for slow write-backs (2 s each), so the delete lands while frozen.
    slow = {
        "tiers.local_disk.faults": {"write_delay_seconds": 2.0},
        "tiers.local_disk.min_free_fraction": 0.0,
    }
    key = digest("to-delete")
    others = [digest("queued", i) for i in range(6)]
    with cache_server(dram_bytes=64 * MiB, overrides=slow) as a:
        c = CacheClient(a.unix_target)
        try:
            # Six more write-backs queue behind it on two workers: about 6 s for the freeze to wait.
            stored = c.store(NS, [key, *others], [b"d" * 4096] * 7, timeout=10)
            assert stored.accepted == 7
            b = a.successor()
            b.start_process()
            wait_until(
                lambda: FREEZING in [r.get("message") for r in a.log_records()],
                20,
                what="the predecessor to freeze",
            )
            with pytest.raises(CacheUnavailable, match="handing over") as err:
                c.delete(NS, [key], timeout=5)
            cause = err.value.__cause__
            assert isinstance(cause, grpc.RpcError)
            assert cause.code() == grpc.StatusCode.UNAVAILABLE
            try:
                b.wait_own_ready(timeout=60)
                deleted = wait_until(
                    lambda: _retry_delete(c, key), 20, what="the delete to be accepted by the successor"
                )
                assert deleted == 1
                assert c.load(NS, [key], timeout=5) == []
            finally:
                a.kill(signal.SIGTERM)
                b.stop()
        finally:
            c.close()


def _quiet(fn: Callable[[], T]) -> T | None:
    """``fn()``, or None while the client is still reconnecting to the successor."""
    try:
        return fn()
    except CacheError:
        return None


def _retry_delete(c: CacheClient, key: str) -> int | None:
    try:
        return c.delete(NS, [key], timeout=5) or None
    except CacheError:
        return None
