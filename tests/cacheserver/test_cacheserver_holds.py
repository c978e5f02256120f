"""Held blocks: clients keep mappings across loads, and the DRAM budget still counts every byte.

A client that keeps a block mapped keeps its pages alive after the server evicts or deletes it, so
the server holds such blocks (docs/performance.md, "Kept mappings"). These tests pin down what that
promises:

- the DRAM tier's used bytes are always the resident blocks plus the retired held ones (a model of
  the tier under every sequence of puts, deletes, evictions, holds and releases);
- a retired block is never named again, and its descriptor stays open until the last release;
- eviction passes over held blocks while unheld ones remain, and holds never pass their share;
- through a real server: a connection's holds are released when it closes, kill -9 of the client
  included, and no connection can release another's.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfabric.cacheserver.engine.dram import HELD_SHARE, DramTier
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.transport.holdbook import HoldBook
from kvfabric.client import CacheClient
from kvfabric.client._common import shm_slots
from kvfabric.client.blocks import close_all
from kvfabric.rpc import blockproto as bp
from kvfabric.rpc import fdpass
from kvfabric.rpc.v1 import cache_pb2 as pb
from kvfabric.rpc.v1 import cache_pb2_grpc as pb_grpc
from kvfabric.testing.serverproc import (
    MiB,
    cache_server,
    digest,
    nofile_site,
    payload_for,
    site_env,
    wait_until,
)

NS = digest("holds")
PAGE = 4096


def bid(i: object) -> BlockId:
    return BlockId.parse(NS, digest(i))


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


class DramHolds(RuleBasedStateMachine):
    """The DRAM tier against a model: what is resident, what is held how often, what is retired."""

    def __init__(self) -> None:
        super().__init__()
        self.tier = DramTier(8 * PAGE, high_watermark=1.0, low_watermark=0.5)
        self.resident: dict[int, str] = {}  # key -> block name
        self.sizes: dict[str, int] = {}  # name -> charged bytes
        self.holds: dict[str, int] = {}  # name -> times held
        self.retired: dict[str, int] = {}  # name -> its descriptor, kept open by the tier
        self.names_ever: set[str] = set()

    def _name(self, key: int) -> str | None:
        blk = self.tier.slot(bid(key))
        return None if blk is None else blk.name

    def _sync_resident(self) -> None:
        # Puts may evict (LRU order is the tier's own business); learn what left, and check it.
        for key, name in list(self.resident.items()):
            if self._name(key) != name:
                del self.resident[key]
                self._left(name)

    def _left(self, name: str) -> None:
        if name in self.holds:
            blk_fd = self.tier._retired[name].fd
            self.retired[name] = blk_fd

    @rule(key=st.integers(0, 5), pages=st.integers(1, 3))
    def put(self, key: int, pages: int) -> None:
        old = self.resident.get(key)
        if self.tier.put(bid(key), b"x" * (pages * PAGE - 1)):
            name = self._name(key)
            assert name is not None
            assert name not in self.names_ever  # names are never reused
            self.names_ever.add(name)
            self.sizes[name] = pages * PAGE
            self.resident[key] = name
            if old is not None:
                self._left(old)
        self._sync_resident()

    @rule(key=st.integers(0, 5))
    def delete(self, key: int) -> None:
        name = self.resident.pop(key, None)
        assert self.tier.delete(bid(key)) == (name is not None)
        if name is not None:
            self._left(name)

    @rule(target_pages=st.integers(0, 8))
    def evict(self, target_pages: int) -> None:
        unheld_before = {k for k, n in self.resident.items() if n not in self.holds}
        gone = self.tier.evict(target_pages * PAGE)
        for b in gone:
            key = next(k for k in self.resident if bid(k) == b)
            # Never a held block while an unheld one was resident.
            assert self.resident[key] not in self.holds or not unheld_before
        self._sync_resident()

    @rule(key=st.integers(0, 5), budget_pages=st.integers(0, 4))
    def hold(self, key: int, budget_pages: int) -> None:
        name = self.resident.get(key)
        got = self.tier.hold_by_name(name or "d_" + "0" * 32, budget_pages * PAGE)
        if name is None:
            assert got is None
            return
        assert got is not None
        fd, _length, held = got
        os.close(fd)
        # The caller's own budget always applies; the tier's share only to a block not held yet.
        fits = self.sizes[name] <= budget_pages * PAGE and (
            name in self.holds
            or sum(self.sizes[n] for n in self.holds) + self.sizes[name] <= self.tier.max_held_bytes
        )
        assert held == (self.sizes[name] if fits else 0)
        if held:
            self.holds[name] = self.holds.get(name, 0) + 1

    @precondition(lambda self: self.holds)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        # Drawn by position in insertion order, not from the names: block names are random, so a
        # strategy built from them would differ when hypothesis replays the same choices.
        name = list(self.holds)[data.draw(st.integers(0, len(self.holds) - 1))]
        self.tier.release(name)
        self.holds[name] -= 1
        if not self.holds[name]:
            del self.holds[name]
            fd = self.retired.pop(name, None)
            if fd is not None:
                assert not _fd_open(fd) or fd in self._live_fds()  # closed (or the number reused)

    def _live_fds(self) -> set[int]:
        return {b.fd for b in self.tier._index.values()} | {b.fd for b in self.tier._retired.values()}

    @invariant()
    def used_bytes_are_resident_plus_retired(self) -> None:
        resident = sum(self.sizes[n] for n in self.resident.values())
        retired = sum(self.sizes[n] for n in self.retired)
        assert self.tier.usage().used_bytes == resident + retired
        assert self.tier.retired_bytes == retired
        assert self.tier.held_bytes == sum(self.sizes[n] for n in self.holds)
        assert self.tier.held_bytes <= self.tier.max_held_bytes == int(8 * PAGE * HELD_SHARE)

    @invariant()
    def retired_blocks_are_never_named_and_stay_open(self) -> None:
        for name, fd in self.retired.items():
            assert self.tier.dup_by_name(name) is None
            assert self.tier.hold_by_name(name, 1 << 30) is None
            assert _fd_open(fd)


TestDramHolds = DramHolds.TestCase
TestDramHolds.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class ClientHolds(RuleBasedStateMachine):
    """The block socket's hold books over a real DRAM tier, against a model.

    Clients hold through several connections each; blocks come and go (puts, deletes, evictions);
    connections release, close and reopen. Invariants: every client's bytes and blocks, and the
    tier's held bytes and blocks, equal the model's and never pass their caps; and the tier never
    keeps more descriptors open than its cap, so the unheld share stays for other engines.
    """

    BYTES_PER_CLIENT = 8 * PAGE
    BLOCKS_PER_CLIENT = 2
    HOLDING_CONNECTIONS = 3
    CLIENTS = ("a", "b", "c")

    def __init__(self) -> None:
        super().__init__()
        self.tier = DramTier(64 * PAGE, high_watermark=1.0, low_watermark=0.5)
        # A descriptor cap of 10 blocks, 3 of them holdable: three clients could hold 6 by their own
        # budgets, and tiny blocks would pass any byte budget.
        self.tier.max_blocks = 10
        self.tier.max_held_blocks = 3
        # Six connections, three of which may hold at once (the block socket passes half its bound).
        self.book = HoldBook(
            self.tier, self.BYTES_PER_CLIENT, self.BLOCKS_PER_CLIENT, self.HOLDING_CONNECTIONS
        )
        self.resident: dict[int, str] = {}
        self.sizes: dict[str, int] = {}
        self.conns: dict[int, str] = {}  # open connection -> its client
        self.holds: dict[int, dict[str, int]] = {}  # connection -> name -> times

    def _sync_resident(self) -> None:
        for key, name in list(self.resident.items()):
            blk = self.tier.slot(bid(key))
            if blk is None or blk.name != name:
                del self.resident[key]

    def _client_names(self, client: str) -> set[str]:
        return {n for conn, c in self.conns.items() if c == client for n in self.holds[conn]}

    def _all_held(self) -> set[str]:
        return {n for names in self.holds.values() for n in names}

    @rule(key=st.integers(0, 7), pages=st.integers(1, 2))
    def put(self, key: int, pages: int) -> None:
        if self.tier.put(bid(key), b"x" * (pages * PAGE)):
            blk = self.tier.slot(bid(key))
            assert blk is not None
            self.sizes[blk.name] = pages * PAGE
            self.resident[key] = blk.name
        self._sync_resident()

    @rule(key=st.integers(0, 7))
    def delete(self, key: int) -> None:
        name = self.resident.pop(key, None)
        assert self.tier.delete(bid(key)) == (name is not None)

    @rule(target_pages=st.integers(0, 32))
    def evict(self, target_pages: int) -> None:
        self.tier.evict(target_pages * PAGE)
        self._sync_resident()

    def _opened(self, conn: int) -> None:
        """Connection ``conn`` (of client ``conn % 3``), opened again if it was closed."""
        if conn not in self.conns:
            client = self.CLIENTS[conn % len(self.CLIENTS)]
            self.book.open(conn, client)
            self.conns[conn] = client
            self.holds[conn] = {}

    @rule(conn=st.integers(0, 5), key=st.integers(0, 7))
    def hold(self, conn: int, key: int) -> None:
        self._opened(conn)
        name = self.resident.get(key)
        got = self.book.hold(conn, name or "d_" + "0" * 32)
        if name is None:
            assert got is None
            return
        assert got is not None
        os.close(got[0])
        size = self.sizes[name]
        mine = self._client_names(self.conns[conn])
        mine_bytes = sum(self.sizes[n] for n in mine)
        if name in mine:
            client_ok = True
        else:
            client_ok = len(mine) < self.BLOCKS_PER_CLIENT and mine_bytes + size <= self.BYTES_PER_CLIENT
        everyone = self._all_held()
        tier_ok = name in everyone or (
            len(everyone) < self.tier.max_held_blocks
            and sum(self.sizes[n] for n in everyone) + size <= self.tier.max_held_bytes
        )
        holding = sum(1 for names in self.holds.values() if names)
        conn_ok = bool(self.holds[conn]) or holding < self.HOLDING_CONNECTIONS
        assert got[2] == (size if client_ok and tier_ok and conn_ok else 0)
        if got[2]:
            self.holds[conn][name] = self.holds[conn].get(name, 0) + 1

    @rule(conn=st.integers(0, 5), data=st.data())
    def release(self, conn: int, data: st.DataObject) -> None:
        self._opened(conn)
        # Its own holds, or any name at all (another connection's: refused, nothing released).
        # By position in insertion order (block names are random; see DramHolds.release).
        names = [*self.sizes, "d_" + "1" * 32]
        name = names[data.draw(st.integers(0, len(names) - 1))]
        mine = self.holds[conn]
        assert self.book.release(conn, name) == (name in mine)
        if name in mine:
            mine[name] -= 1
            if not mine[name]:
                del mine[name]

    @rule(conn=st.integers(0, 5))
    def close(self, conn: int) -> None:
        self.book.close(conn)
        self.conns.pop(conn, None)
        self.holds.pop(conn, None)

    @invariant()
    def books_equal_the_model_and_stay_within_their_caps(self) -> None:
        for client in self.CLIENTS:
            names = self._client_names(client)
            used = (sum(self.sizes[n] for n in names), len(names))
            assert self.book.usage(client) == used
            assert used[0] <= self.BYTES_PER_CLIENT
            assert used[1] <= self.BLOCKS_PER_CLIENT
        everyone = self._all_held()
        assert self.tier.held_blocks == len(everyone) <= self.tier.max_held_blocks
        # Connections holding something (never closed to admit a newcomer) stay within their bound.
        holding = {conn for conn, names in self.holds.items() if names}
        assert self.book.holding_connections == len(holding) <= self.HOLDING_CONNECTIONS
        assert all(self.book.holding(conn) == (conn in holding) for conn in range(6))
        assert self.tier.held_bytes == sum(self.sizes[n] for n in everyone) <= self.tier.max_held_bytes

    @invariant()
    def holds_never_take_the_descriptors_other_engines_need(self) -> None:
        # Open blocks (resident plus retired-but-held) stay within the cap: a put always finds an
        # unheld block to evict, and at least half of the cap is never held.
        open_blocks = self.tier.usage().blocks + len(self.tier._retired)
        assert open_blocks <= self.tier.max_blocks


TestClientHolds = ClientHolds.TestCase
TestClientHolds.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)


# --- through a real server ---------------------------------------------------------------------------


def _hold(
    path: Path, names: list[str], release: Sequence[str] = (), client: str | None = None
) -> tuple[socket.socket, bytes, list[int]]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(str(path))
    s.send(bp.encode_hold_request(names, list(release), client))
    msg, fds, _ = fdpass.recv_fds(s, 256, max(1, len(names)))
    return s, msg, fds


def _dram(c: CacheClient) -> dict[str, int]:
    dram: dict[str, int] = c.stats(timeout=10)["tiers"]["dram"]
    return dram


@pytest.mark.process
def test_holds_end_with_their_connection_even_when_the_client_is_killed(tmp_path: Path) -> None:
    keys = [digest("hk", i) for i in range(4)]
    payloads = [payload_for(k, 1 * MiB) for k in keys]
    with cache_server(dram_bytes=64 * MiB) as srv, CacheClient(srv.unix_target, shared_memory=True) as c:
        assert c.store(NS, keys, payloads, timeout=30).accepted == 4
        # A client process loads every block with kept mappings, then dies by SIGKILL.
        script = textwrap.dedent(
            f"""
            import sys, time
            from kvfabric.client import CacheClient
            c = CacheClient({srv.unix_target!r}, shared_memory=True)
            bufs = [memoryview(bytearray({MiB})) for _ in range(4)]
            assert c.load_into({NS!r}, {keys!r}, bufs, timeout=30) == 4
            print("loaded", flush=True)
            time.sleep(600)
            """
        )
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "loaded"
            assert _dram(c)["held_bytes"] == 4 * MiB
            used = _dram(c)["used_bytes"]
            # Deleted while held: gone for every client at once, still charged while mapped.
            assert c.delete(NS, keys[:2], timeout=10) == 2
            assert c.lookup(NS, keys, timeout=5).matched == 0
            assert _dram(c)["retired_held_bytes"] == 2 * MiB
            assert _dram(c)["used_bytes"] == used
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            # The kernel closed its connection: every hold is released, the retired bytes freed.
            wait_until(lambda: _dram(c)["held_bytes"] == 0, 10, what="holds released")
            assert _dram(c)["retired_held_bytes"] == 0
            assert _dram(c)["used_bytes"] == used - 2 * MiB
        finally:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.mark.process
def test_a_connection_cannot_release_another_ones_holds_and_budgets_are_per_client() -> None:
    keys = [digest("hb", i) for i in range(3)]
    payloads = [payload_for(k, 1 * MiB) for k in keys]
    overrides = {"shm.hold_bytes_per_client": 2 * MiB}
    with (
        cache_server(dram_bytes=64 * MiB, overrides=overrides) as srv,
        CacheClient(srv.unix_target, shared_memory=True) as c,
    ):
        assert c.store(NS, keys, payloads, timeout=30).accepted == 3
        blocks = bp.block_socket_for(srv.unix_target[len("unix://") :])
        slots = _slot_names(srv.unix_target, keys)
        owner, msg, fds = _hold(blocks, slots, client="a")
        close_all(fds)
        # The budget of 2 MiB: two blocks held, the third lent (sent, not held).
        assert list(msg) == [bp.FOUND, bp.FOUND, bp.LENT]
        assert _dram(c)["held_bytes"] == 2 * MiB
        # A second connection of the same client: the budget is the client's, spent already, and
        # the first connection's holds are not its to release.
        again, answer, _ = _hold(blocks, [], release=slots, client="a")
        assert answer == bytes([bp.RELEASED])
        assert _dram(c)["held_bytes"] == 2 * MiB
        assert _ask(again, slots[2:]) == [bp.LENT]  # another connection buys the client nothing
        assert _ask(again, slots[:1]) == [bp.FOUND]  # held by the client already: costs nothing more
        # Another client has its own budget; blocks others hold cost it the same.
        other, msg, fds = _hold(blocks, slots, client="b")
        close_all(fds)
        assert list(msg) == [bp.FOUND, bp.FOUND, bp.LENT]
        assert _dram(c)["held_bytes"] == 2 * MiB  # the same two blocks, held by both clients
        owner.send(bp.encode_hold_request([], slots[:1]))
        assert owner.recv(16) == bytes([bp.RELEASED])
        assert _dram(c)["held_bytes"] == 2 * MiB  # others still hold both
        other.close()
        again.close()
        wait_until(lambda: _dram(c)["held_bytes"] == 1 * MiB, 10, what="their holds released")
        owner.close()
        wait_until(lambda: _dram(c)["held_bytes"] == 0, 10, what="holds released")


def _ask(sock: socket.socket, names: list[str]) -> list[int]:
    sock.send(bp.encode_hold_request(names))
    msg, fds, _ = fdpass.recv_fds(sock, 256, len(names))
    close_all(fds)
    return list(msg)


def _slot_names(target: str, keys: list[str]) -> list[str]:
    """The handle names a ShmLoad gives for ``keys`` (the raw call: no client, no holds)."""
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.CacheStub(ch)  # type: ignore[no-untyped-call]
        call = stub.ShmLoad(pb.LoadRequest(namespace=NS, keys=keys), timeout=10)
        return [slot.name for slot in shm_slots(call)]


def test_holds_above_the_low_watermark_make_a_put_evict_only_the_room_it_needs() -> None:
    # Low watermark 0.25, holds of 3 pages: eviction can never get down to 2 pages, so a put that
    # needs one page must evict one block, not every unheld one.
    tier = DramTier(8 * PAGE, high_watermark=1.0, low_watermark=0.25)
    for i in range(8):
        assert tier.put(bid(i), b"x" * PAGE)
    for i in range(3):
        blk = tier.slot(bid(i))
        assert blk is not None
        got = tier.hold_by_name(blk.name, 1 << 30)
        assert got is not None
        os.close(got[0])
    assert tier.put(bid("new"), b"y" * PAGE)
    assert tier.usage().blocks == 8  # one unheld block went, not all five
    assert all(tier.slot(bid(i)) is not None for i in range(3))


def test_a_hold_whose_descriptor_cannot_be_duplicated_is_not_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DramTier(8 * PAGE)
    assert tier.put(bid("d"), b"x" * PAGE)
    blk = tier.slot(bid("d"))
    assert blk is not None

    def emfile(_fd: int) -> int:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(os, "dup", emfile)
    with pytest.raises(OSError, match="Too many open files"):
        tier.hold_by_name(blk.name, 1 << 30)
    monkeypatch.undo()
    assert tier.held_bytes == 0  # nothing held: the block stays evictable
    assert tier.evict(0) == [bid("d")]


# --- many tiny held blocks against the descriptor cap, through a real server ------------------------

NOFILE = 600
"""The server's descriptor limit in the next test: a DRAM cap of 300 blocks, 150 of them holdable."""


@pytest.mark.process
@pytest.mark.parametrize("one_id_per_connection", [False, True], ids=["one-client", "an-id-per-connection"])
def test_a_greedy_client_holding_tiny_blocks_leaves_other_engines_the_descriptors_they_need(
    tmp_path: Path, one_id_per_connection: bool
) -> None:
    env = site_env(tmp_path / "site", nofile_site(NOFILE))
    with (
        cache_server(dram_bytes=64 * MiB, local_disk_bytes=None, env=env) as srv,
        CacheClient(srv.unix_target) as plain,
    ):
        blocks = bp.block_socket_for(srv.unix_target[len("unix://") :])
        # The greedy client: ten connections, each keeping every tiny block it loads. Without ids
        # (as the client of the report) they are one client here, by their process id; with an id
        # each, ten clients as far as the server can tell.
        # Each connection is opened right before its first request: the server closes one that
        # stays silent past its first-request deadline (a round takes longer than that under load).
        greedy: list[tuple[socket.socket, str | None]] = []
        held = lent = 0
        try:
            for r in range(10):
                keys = [digest("greedy", r, i) for i in range(60)]
                plain.store(NS, keys, [payload_for(k, PAGE) for k in keys], timeout=30)
                names = _slot_names(srv.unix_target, keys)
                if not names:
                    continue  # nothing of this round stayed resident
                if len(greedy) < 10:
                    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                    conn.connect(str(blocks))
                    greedy.append((conn, f"greedy-{len(greedy)}" if one_id_per_connection else None))
                s, client = greedy[-1]  # round r uses connection r, as a fresh one
                ask = names[:64]
                s.send(bp.encode_hold_request(ask, client=client) if client else bp.encode_hold_request(ask))
                msg, fds, _ = fdpass.recv_fds(s, 256, 64)
                close_all(fds)
                held += msg.count(bytes([bp.FOUND]))
                lent += msg.count(bytes([bp.LENT]))
            dram = _dram(plain)
            # Another engine stores 100 tiny blocks and loads them back through shared memory.
            other_keys = [digest("other", i) for i in range(100)]
            other_payloads = [payload_for(k, PAGE) for k in other_keys]
            with CacheClient(srv.unix_target, shared_memory=True) as other:
                stored = other.store(NS, other_keys, other_payloads, timeout=30).accepted
                bufs = [memoryview(bytearray(PAGE)) for _ in other_keys]
                loaded = other.load_into(NS, other_keys, bufs, timeout=30)
            print(  # the numbers docs/security.md quotes
                f"greedy held {held} blocks (lent {lent}), server: {dram.get('held_blocks')} held of "
                f"{dram.get('max_blocks')}; the other engine stored {stored}/100, loaded {loaded}/100"
            )
            assert dram["held_blocks"] == held
            assert dram["max_blocks"] == NOFILE // 2
            share = dram["max_held_blocks"]  # 150: all clients together
            assert held <= (share if one_id_per_connection else share // 4)  # a client: a quarter
            assert lent > 0
            assert (stored, loaded) == (100, 100)
            assert [bytes(b) for b in bufs] == other_payloads
        finally:
            for s, _ in greedy:
                s.close()
        wait_until(lambda: _dram(plain)["held_blocks"] == 0, 10, what="holds released")


@pytest.mark.process
def test_a_client_whose_holds_are_refused_copies_and_loads_every_block() -> None:
    keys = [digest("refused", i) for i in range(10)]
    payloads = [payload_for(k, PAGE) for k in keys]
    overrides = {"shm.hold_blocks_per_client": 2}
    with (
        cache_server(dram_bytes=64 * MiB, local_disk_bytes=None, overrides=overrides) as srv,
        CacheClient(srv.unix_target, shared_memory=True) as c,
    ):
        assert c.store(NS, keys, payloads, timeout=30).accepted == 10
        for _ in range(3):
            bufs = [memoryview(bytearray(PAGE)) for _ in keys]
            assert c.load_into(NS, keys, bufs, timeout=30) == 10
            assert [bytes(b) for b in bufs] == payloads
            # Two blocks held (kept mapped), the other eight lent and copied: never more.
            assert _dram(c)["held_blocks"] <= 2
        assert _dram(c)["held_blocks"] == 2
