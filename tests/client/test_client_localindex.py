"""The published index end to end over a real Unix socket: server-side publisher, client-side reader.

The publisher here resolves from a dict (the store's side is tested with real server processes in
tests/cacheserver); what is proven: answers equal the publisher's truth after every change, across
table growth; the descriptor a client receives cannot be written or resized; a table whose heartbeat
stopped is "unavailable" at once; a retired table or a refused namespace is "ask over RPC".
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.transport.indexpub import F_SEAL_FUTURE_WRITE, IndexPublisher, IndexSocket, Peer
from kvfabric.client import indexprobe, localindex
from kvfabric.client.errors import CacheUnavailable
from kvfabric.client.localindex import LocalIndex
from kvfabric.client.results import LookupResult
from kvfabric.rpc import indextable as it
from kvfabric.testing.serverproc import digest, wait_until

NS = digest("ns-a")
OTHER = digest("ns-b")


class Fabric:
    def __init__(self, tmp: Path, on_lookups: Any = None, **kw: object) -> None:
        self.truth: dict[BlockId, str] = {}
        # Described to the server: an empty namespace gets a table only then.
        self.described = {NS, OTHER}
        kw.setdefault("known", self.described.__contains__)
        self.pub = IndexPublisher(self.truth.get, **kw)  # type: ignore[arg-type]
        self.denied: set[str] = set()
        self.sock = IndexSocket(
            tmp / "cache.sock.index", self.pub, authorize=self._authorize, on_lookups=on_lookups
        )
        self.peers: list[Peer] = []
        self.sock.start()

    def _authorize(self, namespace: str, peer: Peer) -> bool:
        self.peers.append(peer)
        return namespace not in self.denied

    def put(self, ns: str, key: str, tier: str = "dram") -> None:
        bid = BlockId(ns, key)
        self.truth[bid] = tier
        self.pub.changed([bid])

    def drop(self, ns: str, key: str) -> None:
        bid = BlockId(ns, key)
        self.truth.pop(bid, None)
        self.pub.changed([bid])

    def close(self) -> None:
        self.sock.close()
        self.pub.close()


@pytest.fixture
def fabric(tmp_path: Path) -> Iterator[Fabric]:
    f = Fabric(tmp_path, initial_capacity=8)
    f.pub.start()
    yield f
    f.close()


def _raw(keys: list[str]) -> bytes:
    return bytes.fromhex("".join(keys))


@pytest.mark.parametrize("vector", [True, False], ids=["numpy-probe", "reference-probe"])
def test_answers_follow_every_change_across_growth(
    fabric: Fabric, vector: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(localindex, "VECTOR_PROBE", vector)  # a client without numpy reads as before
    reader = LocalIndex(fabric.sock.path)
    keys = [digest("k", i) for i in range(100)]
    assert reader.lookup(NS, _raw(keys)) is not None  # an empty table is an answer: nothing stored
    for i, k in enumerate(keys):
        fabric.put(NS, k, ("dram", "local_disk", "shared")[i % 3])
        got = reader.lookup(NS, _raw(keys))
        assert got is not None
        assert got.matched == i + 1, "a key published before the read is found (no false negative)"
        assert got.tiers == [fabric.truth[BlockId(NS, x)] for x in keys[: i + 1]]
    assert it.header(reader._maps[NS].words)["capacity"] >= 256  # grew from 8 slots, refetched
    assert (reader._maps[NS].slots is not None) == vector
    fabric.drop(NS, keys[50])
    got = reader.lookup(NS, _raw(keys))
    assert got is not None
    assert got.matched == 50
    other = reader.lookup(OTHER, _raw(keys))
    assert other is not None
    assert other.matched == 0, "another namespace's table never answers for this one"
    assert fabric.peers
    assert fabric.peers[0].pid == os.getpid()
    reader.close()


def test_the_descriptor_a_client_gets_is_read_only_and_sealed(fabric: Fabric) -> None:
    fabric.put(NS, digest("k", 1))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(fabric.sock.path))
        s.sendall(it.REQUEST_PREFIX + NS.encode() + b"\n")
        msg, fds, _, _ = socket.recv_fds(s, 128, 1)
    assert msg[:1] == b"\x00"
    assert len(fds) == 1
    fd = fds[0]
    try:
        size = os.fstat(fd).st_size
        with pytest.raises(PermissionError):
            mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(OSError, match="Bad file descriptor"):  # opened read-only
            os.pwrite(fd, b"\xff" * 8, 64)
        with pytest.raises(OSError, match=r"Invalid argument|Bad file descriptor|not permitted"):
            os.ftruncate(fd, 0)
        # Reopening it writable through /proc gets no write access back: the memfd is sealed
        # against writes through any new descriptor or mapping (F_SEAL_FUTURE_WRITE).
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & F_SEAL_FUTURE_WRITE
        assert seals & fcntl.F_SEAL_SEAL
        assert seals & fcntl.F_SEAL_SHRINK
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.pwrite(rw, b"\xff" * 8, 64)
            with pytest.raises(PermissionError):
                mmap.mmap(rw, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(rw)
        ro = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        assert it.lookup_prefix(memoryview(ro).cast("Q"), it.fingerprints([digest("k", 1)])) == [1]
    finally:
        os.close(fd)


def test_a_table_without_heartbeat_is_unavailable_at_once(tmp_path: Path) -> None:
    f = Fabric(tmp_path)  # heartbeat thread not started: as if the server were frozen
    try:
        f.put(NS, digest("k", 1))
        # Staleness of 2 s, not less: the lookup right after a beat must see it fresh even when a
        # busy machine delays this thread (0.2 s flaked under load).
        reader = LocalIndex(f.sock.path, stale_after_s=2.0)
        f.pub.beat()
        assert reader.lookup(NS, _raw([digest("k", 1)])) is not None
        time.sleep(2.3)
        asked = len(f.peers)
        with pytest.raises(CacheUnavailable, match="heartbeat"):
            reader.lookup(NS, _raw([digest("k", 1)]))
        # Nothing on the lookup's path asked the (possibly hung) server: any refetch is in the
        # background, at most once per interval.
        assert len(f.peers) - asked <= 1
        f.pub.beat()
        got = reader.lookup(NS, _raw([digest("k", 1)]))
        assert got is not None
        assert got.matched == 1
        reader.close()
    finally:
        f.close()


def test_a_closed_server_or_a_refused_namespace_means_ask_over_rpc(fabric: Fabric) -> None:
    fabric.put(NS, digest("k", 1))
    fabric.denied.add(OTHER)
    reader = LocalIndex(fabric.sock.path)
    assert reader.lookup(OTHER, _raw([digest("k", 1)])) is None
    assert reader.lookup(NS, _raw([digest("k", 1)])) is not None
    fabric.close()  # retires every table; the socket is gone
    assert reader.lookup(NS, _raw([digest("k", 1)])) is None
    reader.close()


def test_bad_requests_get_an_error_byte(fabric: Fabric) -> None:
    for req in (b"KVIX1 nothex\n", b"HELLO\n", it.REQUEST_PREFIX + NS.upper().encode() + b"\n"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(fabric.sock.path))
            s.sendall(req)
            msg, fds, _, _ = socket.recv_fds(s, 128, 1)
        assert msg[:1] == b"\x01"
        assert not fds


def test_the_liveness_a_load_watches_is_unknown_not_dead_for_a_grown_table(tmp_path: Path) -> None:
    # The hang watch cancels loads whose server is not alive(). A table the server replaced by a
    # bigger one is no longer stamped; it must read "unknown", never "hung", or every load in flight
    # during a growth would be cancelled on a healthy server.
    f = Fabric(tmp_path, initial_capacity=8)  # no heartbeat thread: beats are explicit
    try:
        reader = LocalIndex(f.sock.path, stale_after_s=0.2)
        f.pub.beat()
        assert reader.lookup(NS, _raw([digest("g", 0)])) is not None
        assert reader.alive(NS) is True
        for i in range(20):  # past half of 8 slots: the table grows, the mapped one is retired
            f.put(NS, digest("g", i))
        time.sleep(0.3)
        f.pub.beat()  # stamps live tables only: the one this reader mapped is not among them
        assert reader._maps[NS].words[it.W_STATE] != it.LIVE
        assert reader.alive(NS) is None
        assert reader.alive(OTHER) is None  # never mapped: unknown
        reader.close()
    finally:
        f.close()


def test_a_namespace_the_server_does_not_know_is_ask_over_rpc_until_it_holds_a_block(fabric: Fabric) -> None:
    unknown = digest("never described")
    reader = LocalIndex(fabric.sock.path, refetch_interval_s=0.0)
    try:
        assert reader.lookup(unknown, _raw([digest("u")])) is None  # refused: no table was made
        assert unknown not in fabric.pub.namespaces()
        fabric.put(unknown, digest("u"))  # its first block: now the server knows it
        got = reader.lookup(unknown, _raw([digest("u")]))
        assert got is not None
        assert got.matched == 1
    finally:
        reader.close()


def test_a_connection_evicted_for_another_is_ask_over_rpc_not_a_dead_server(fabric: Fabric) -> None:
    from kvfabric.cacheserver.transport.indexpub import MAX_CONNECTIONS_PER_PEER

    fabric.put(NS, digest("k", 1))
    reader = LocalIndex(fabric.sock.path, refetch_interval_s=0.0)
    assert reader.lookup(NS, _raw([digest("k", 1)])) is not None  # holds NS's table: the oldest
    # This process asks for as many more as one process may hold: its oldest (the reader's) goes.
    held = []
    for _ in range(MAX_CONNECTIONS_PER_PEER):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(fabric.sock.path))
        s.sendall(it.REQUEST_PREFIX + OTHER.encode() + b"\n")
        msg, fds, _, _ = socket.recv_fds(s, 128, 1)
        assert msg == b"\x00"
        os.close(fds[0])
        held.append(s)
    assert fabric.sock.evicted == 1
    # The hang watch polls alive() while loads wait: an eviction is "unknown", never "the server is
    # gone" (which would give up every load of the namespace in flight).
    assert reader.alive(NS) is None
    # The server lives: ask over RPC this once (no CacheUnavailable), then the table is fetched again.
    assert reader.lookup(NS, _raw([digest("k", 1)])) is None
    got = reader.lookup(NS, _raw([digest("k", 1)]))
    assert got is not None
    assert got.matched == 1
    for s in held:
        s.close()
    reader.close()


def test_lookups_answered_from_a_table_are_reported_to_a_server_that_counts_them(tmp_path: Path) -> None:
    counted: list[tuple[str, int, int, int]] = []

    def on_lookups(namespace: str, lookups: int, hits: int, misses: int) -> None:
        counted.append((namespace, lookups, hits, misses))

    f = Fabric(tmp_path, on_lookups=on_lookups)
    f.pub.start()
    keys = [digest("r", i) for i in range(4)]
    for k in keys[:3]:
        f.put(NS, k)
    reader = LocalIndex(f.sock.path, report_interval_s=3600)  # one batch: reported only when asked
    try:
        for n in (4, 2, 1):
            assert reader.lookup(NS, _raw(keys[:n])) is not None
        assert reader.lookup(NS, _raw([keys[3], keys[0]])) is not None  # a miss at once: 0 of 2
        assert reader.lookup(OTHER, _raw(keys)) is not None  # another table, another connection
        reader.close()  # reports what each table counted before hanging up
        wait_until(lambda: len(counted) == 2, 10, 0.01, "two reports")
        # Lookups, hit keys, missed keys: (3+2+1+0, 1+0+0+2) for NS; nothing stored in OTHER.
        assert sorted(counted) == sorted([(NS, 4, 6, 3), (OTHER, 1, 0, 4)])
    finally:
        reader.close()
        f.close()


def test_a_server_that_does_not_count_is_sent_no_report_and_keeps_the_connection(fabric: Fabric) -> None:
    # An older server took any byte on a held connection for a hang-up: its clients send none.
    fabric.put(NS, digest("k", 1))
    reader = LocalIndex(fabric.sock.path, report_interval_s=0.0)  # would report after every lookup
    try:
        assert reader.lookup(NS, _raw([digest("k", 1)])) is not None  # maps the table
        wait_until(lambda: fabric.sock.connections == 1, 10, 0.01, "the connection to be held")
        for _ in range(3):
            got = reader.lookup(NS, _raw([digest("k", 1)]))
            assert got is not None
            assert got.matched == 1
        time.sleep(0.2)  # time for the server to read (and close on) anything the reader sent
        assert fabric.sock.connections == 1
        assert reader.alive(NS) is True
    finally:
        reader.close()


@pytest.mark.parametrize(
    "junk",
    [
        b"r 1 2\n",
        b"r 1 2 3 4\n",
        b"r -1 2 3\n",
        b"x 1 2 3\n",
        b"r " + b"9" * 70,
        b"r 1 2 99999999999999999\n",
    ],
)
def test_a_malformed_report_closes_that_connection_and_counts_nothing(tmp_path: Path, junk: bytes) -> None:
    counted: list[tuple[str, int, int, int]] = []
    f = Fabric(tmp_path, on_lookups=lambda *a: counted.append(a))
    f.pub.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(f.sock.path))
            s.sendall(it.REQUEST_PREFIX + NS.encode() + b"\n")
            msg, fds, _, _ = socket.recv_fds(s, 128, 1)
            assert msg == it.REPORTS_ACCEPTED
            os.close(fds[0])
            s.sendall(it.encode_report(1, 2, 3) + junk)
            assert s.recv(16) == b""  # closed by the server
        assert counted == [(NS, 1, 2, 3)]  # the good line before the junk, and nothing after
        assert f.sock.connections == 0
    finally:
        f.close()


@given(st.integers(0, (1 << 48) - 1), st.integers(0, (1 << 48) - 1), st.integers(0, (1 << 48) - 1))
def test_a_report_line_reads_back_as_written(lookups: int, hits: int, misses: int) -> None:
    line = it.encode_report(lookups, hits, misses)
    assert line.endswith(b"\n")
    assert len(line) < it.MAX_REPORT_LINE
    assert it.parse_report(line[:-1]) == (lookups, hits, misses)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_reports_are_bounded_per_connection_by_what_rpc_lookups_could_have_done(tmp_path: Path) -> None:
    """Lines claiming more keys than their lookups could ask for, or more lookups than the connection
    could have made since the hand-out, are dropped and counted; the connection is kept."""
    counted: list[tuple[str, int, int, int]] = []
    clock = _Clock()
    truth: dict[BlockId, str] = {}
    pub = IndexPublisher(truth.get, known={NS}.__contains__)
    sock = IndexSocket(
        tmp_path / "cache.sock.index",
        pub,
        on_lookups=lambda *a: counted.append(a),
        max_keys_per_lookup=8,
        clock=clock,
    )
    pub.start()
    sock.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(sock.path))
            s.sendall(it.REQUEST_PREFIX + NS.encode() + b"\n")
            msg, fds, _, _ = socket.recv_fds(s, 128, 1)
            assert msg == it.REPORTS_ACCEPTED
            os.close(fds[0])
            initial = it.REPORT_INITIAL_LOOKUPS

            def send(*lines: tuple[int, int, int]) -> None:
                # Counted before sending: the server may read the lines before sendall returns.
                done = sum(sock.reports_dropped.values()) + len(counted)
                s.sendall(b"".join(it.encode_report(*line) for line in lines))
                wait_until(
                    lambda: sum(sock.reports_dropped.values()) + len(counted) == done + len(lines),
                    10,
                    0.005,
                    "the lines read",
                )

            send((0, (1 << 48) - 1, 0), (1, 9, 0), (initial, 8 * initial, 0), (1, 0, 0))
            assert counted == [(NS, initial, 8 * initial, 0)]  # the hand-out's allowance, no more
            assert sock.reports_dropped == {"implausible": 2, "rate": 1}
            clock.now += 1.0  # a second later: a second's worth
            rate = it.REPORT_LOOKUPS_PER_SECOND
            send((rate + 1, 0, 0), (rate, 0, 0), (1, 0, 0))
            assert counted[1:] == [(NS, rate, 0, 0)]
            assert sock.reports_dropped == {"implausible": 2, "rate": 3}
            clock.now += 3600.0  # unused budget is kept for REPORT_BURST_SECONDS only
            burst = int(rate * it.REPORT_BURST_SECONDS)
            send((burst + 1, 0, 0), (burst, 0, 0))
            assert counted[2:] == [(NS, burst, 0, 0)]
            assert sock.reports_dropped == {"implausible": 2, "rate": 4}
            assert sock.connections == 1
    finally:
        sock.close()
        pub.close()


@given(
    st.lists(
        st.tuples(
            st.floats(0, 2),
            st.integers(0, 100_000),
            st.integers(0, 10_000_000),
            st.integers(0, 10_000_000),
        ),
        max_size=40,
    )
)
def test_a_report_budget_never_admits_more_than_rpc_lookups_could_have_done(
    claims: list[tuple[float, int, int, int]],
) -> None:
    """Over any sequence of lines: admitted lookups and keys stay within the initial allowance plus
    the rate times the time elapsed, and no admitted line has more keys than its lookups could ask."""
    budget = it.ReportBudget(16, 0.0)
    now = 0.0
    lookups = keys = 0
    for advance, n, hits, misses in claims:
        now += advance
        if budget.admit(n, hits, misses, now) is None:
            assert hits + misses <= 16 * n
            lookups += n
            keys += hits + misses
        assert lookups <= it.REPORT_INITIAL_LOOKUPS + it.REPORT_LOOKUPS_PER_SECOND * now + 1e-6
        assert keys <= 16 * it.REPORT_INITIAL_LOOKUPS + it.REPORT_KEYS_PER_SECOND * now + 1e-6


@pytest.mark.parametrize("vector", [True, False], ids=["numpy-probe", "reference-probe"])
def test_a_table_retired_after_its_state_was_read_never_answers(
    fabric: Fabric, vector: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reader checks that its table is live, and the server retires it (grown) before the probe
    # reads the sequence counter: the probe then reads the old table consistently. What it finds
    # there may be gone from the new table, so the answer must come from the new one.
    monkeypatch.setattr(localindex, "VECTOR_PROBE", vector)
    reader = LocalIndex(fabric.sock.path)
    key = digest("gone-after-growth")
    fabric.put(NS, key)
    assert reader.lookup(NS, _raw([key])) == LookupResult(1, ["dram"])
    old = reader._maps[NS].words
    fresh = LocalIndex(fabric.sock.path)
    module: Any = indexprobe if vector else it
    name = "lookup_prefix"
    probe = getattr(module, name)
    calls = []

    def retired_first(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:  # the first probe: the table is retired (and the key dropped) just before it
            for i in range(64):
                fabric.put(NS, digest("growth", i))
            wait_until(lambda: old[it.W_STATE] != it.LIVE, 10, 0.01, what="the table retired")
            fabric.drop(NS, key)
            wait_until(lambda: (r := fresh.lookup(NS, _raw([key]))) is not None and r.matched == 0, 10, 0.01)
        return probe(*args)

    monkeypatch.setattr(module, name, retired_first)
    got = reader.lookup(NS, _raw([key]))
    assert got is not None
    assert got.matched == 0, "answered from the retired table"
    reader.close()
    fresh.close()


def test_lookups_and_the_hang_watchs_liveness_checks_on_other_threads_never_collide(fabric: Fabric) -> None:
    # A client's lookups (scheduler or I/O thread) and the hang watch's alive() (its own thread)
    # share the table's connection; polling it from two threads at once must never raise.
    reader = LocalIndex(fabric.sock.path)
    key = digest("shared-poll")
    fabric.put(NS, key)
    assert reader.lookup(NS, _raw([key])) == LookupResult(1, ["dram"])
    errors: list[BaseException] = []
    end = time.monotonic() + 1.5

    def spin(check: Any) -> None:
        while time.monotonic() < end:
            try:
                check()
            except BaseException as exc:  # every failure is the finding
                errors.append(exc)
                return

    threads = [
        threading.Thread(target=spin, args=(lambda: reader.alive(NS),)),
        threading.Thread(target=spin, args=(lambda: reader.lookup(NS, _raw([key]), fetch=False),)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert reader.alive(NS) is True
    reader.close()


def test_a_table_fetched_after_close_is_closed_not_kept(fabric: Fabric) -> None:
    # A start-up warm-up maps its table on an I/O thread; the client may be closed first. What
    # that fetch maps must be closed there, not installed where nobody closes it (a leaked socket).
    reader = LocalIndex(fabric.sock.path)
    key = digest("after-close")
    fabric.put(NS, key)
    reader.close()
    assert reader.lookup(NS, _raw([key])) is None
    assert reader._maps == {}
