"""The block socket stays up for everyone whatever one client does (docs/cacheserver.md, "Same node").

- Threads cannot be started (a pod at its pids limit: a real pids cgroup where this machine lets a
  test make one, and everywhere a server whose ``Thread.start`` fails): a real server keeps handing
  out descriptors, and every engine on the node keeps loading and storing through shared memory — no
  thread is ever started per connection, so there is none to fail.
- A failure of one connection (or a bug answering it) closes that connection, never the loop.
- Connections are bounded in all and per client; one over the per-client bound is refused with a
  reason (the client raises ``CacheOverloaded``) and the others are served meanwhile and afterwards.
- One same-node process cannot deny the socket to the others: a connection silent past the
  first-request deadline is closed, and a newcomer at the total bound closes the least recently
  active connection that holds nothing; only when every connection holds something is it refused.
  A client whose idle connection was closed loads on its next call (it reconnects once).
- A client meets a server too old to know client ids and still loads.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvfabric.cacheserver.transport import blocksock
from kvfabric.cacheserver.transport.indexpub import peer_of as real_peer_of
from kvfabric.client import CacheClient, errors
from kvfabric.client._common import shm_slots
from kvfabric.client.blocks import BlockChannel
from kvfabric.rpc import blockproto as bp
from kvfabric.rpc import fdpass
from kvfabric.rpc.v1 import cache_pb2 as pb
from kvfabric.rpc.v1 import cache_pb2_grpc as pb_grpc
from kvfabric.testing.serverproc import (
    MiB,
    ServerProcess,
    cache_server,
    digest,
    nofile_site,
    payload_for,
    site_env,
    wait_until,
)

NS = digest("blocksock-limits")
NAME = "d_" + "ab" * 16
PAYLOAD = b"block bytes" * 100

# Loaded by the server process (PYTHONPATH): while the trigger file exists no thread can start, as at
# a pod's pids limit (Thread.start raises what _thread.start_new_thread raises there).
NO_THREADS_SITE = textwrap.dedent(
    """
    import os, threading
    _trigger = os.environ["KVF_TEST_NO_THREADS"]
    _start = threading.Thread.start
    def _start_unless_at_the_limit(self):
        if os.path.exists(_trigger):
            with open(_trigger + ".count", "a") as f:
                f.write(self.name + "\\n")
            raise RuntimeError("can't start new thread")
        return _start(self)
    threading.Thread.start = _start_unless_at_the_limit
    """
)


def _slot_names(target: str, keys: list[str]) -> list[str]:
    """The handle names a ShmLoad gives for ``keys`` (the raw call: no client, no holds)."""
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.CacheStub(ch)  # type: ignore[no-untyped-call]
        call = stub.ShmLoad(pb.LoadRequest(namespace=NS, keys=keys), timeout=10)
        return [slot.name for slot in shm_slots(call)]


def _fetch_raw(path: Path, names: list[str], timeout: float = 5) -> list[int]:
    """One request on a fresh connection: the status bytes (descriptors closed)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.send(bp.encode_request(names))
        msg, fds, _ = fdpass.recv_fds(s, 256, len(names))
        for fd in fds:
            os.close(fd)
        return list(msg)


def _hung_up(path: Path) -> bool:
    """Whether a request on a fresh connection is answered by the server closing it."""
    try:
        return _fetch_raw(path, [NAME], timeout=5) == []
    except ConnectionError:
        return True


def _roundtrip(target: str, tag: str, n: int = 4) -> int:
    """A fresh engine stores ``n`` blocks and loads them back through shared memory: how many came back."""
    keys = [digest(tag, i) for i in range(n)]
    payloads = [payload_for(k, 64 * 1024) for k in keys]
    with CacheClient(target, shared_memory=True) as c:
        assert c.store(NS, keys, payloads, timeout=10).accepted == n
        bufs = [memoryview(bytearray(64 * 1024)) for _ in keys]
        got = c.load_into(NS, keys, bufs, timeout=10)
        assert all(bytes(b) == p for b, p in zip(bufs[:got], payloads, strict=False))
        return got


@pytest.mark.process
def test_engines_keep_loading_through_shared_memory_while_no_thread_can_start(tmp_path: Path) -> None:
    trigger = tmp_path / "at-the-pids-limit"
    env = {"KVF_TEST_NO_THREADS": str(trigger), **site_env(tmp_path / "site", NO_THREADS_SITE)}
    with cache_server(dram_bytes=64 * MiB, local_disk_bytes=None, env=env) as srv:
        blocks = bp.block_socket_for(srv.unix_target[len("unix://") :])
        keys = [digest("warm", i) for i in range(4)]
        with CacheClient(srv.unix_target) as plain:
            assert plain.store(NS, keys, [payload_for(k, 4096) for k in keys], timeout=10).accepted == 4
        assert _roundtrip(srv.unix_target, "before") == 4  # warms the server's thread pools up
        names = _slot_names(srv.unix_target, keys)
        trigger.touch()
        try:
            # New connections while no thread can start: each is served. (Before, the first one made
            # the accept thread raise and die: every later connection waited in the backlog forever.)
            for _ in range(5):
                assert _fetch_raw(blocks, names) == [bp.FOUND] * 4
            # A new engine loads and stores through shared memory meanwhile.
            assert _roundtrip(srv.unix_target, "at-the-limit") == 4
        finally:
            trigger.unlink()
        # Threads can start again (pids freed): nothing needs a restart.
        assert _roundtrip(srv.unix_target, "after") == 4
        assert _fetch_raw(blocks, names) == [bp.FOUND] * 4
        assert "Traceback" not in srv.logs()


PIDS_CGROUP = Path("/sys/fs/cgroup/pids")


@pytest.fixture
def pids_cgroup() -> Iterator[Path]:
    """A fresh pids cgroup (v1) this test may put a server in; skipped where there is none to make."""
    if not os.access(PIDS_CGROUP / "cgroup.procs", os.W_OK):
        pytest.skip("no writable pids cgroup (v1) here: needs root and /sys/fs/cgroup/pids")
    group = PIDS_CGROUP / f"kvf-test-{os.getpid()}-{time.monotonic_ns()}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a pids cgroup: {exc}")
    try:
        yield group
    finally:
        wait_until(lambda: not (group / "cgroup.procs").read_text().strip(), 30, what="the cgroup to empty")
        group.rmdir()


@pytest.mark.process
def test_at_a_real_pids_limit_the_block_socket_serves_and_starts_no_thread(pids_cgroup: Path) -> None:
    # The fault of a pod at its pids limit, for real: the kernel refuses the server any new thread.
    with cache_server(dram_bytes=64 * MiB, local_disk_bytes=None) as srv:
        assert srv.proc is not None
        blocks = bp.block_socket_for(srv.unix_target[len("unix://") :])
        keys = [digest("pids", i) for i in range(4)]
        with CacheClient(srv.unix_target) as plain:
            assert plain.store(NS, keys, [payload_for(k, 4096) for k in keys], timeout=10).accepted == 4
        assert _roundtrip(srv.unix_target, "before") == 4
        names = _slot_names(srv.unix_target, keys)
        (pids_cgroup / "cgroup.procs").write_text(str(srv.proc.pid))
        (pids_cgroup / "pids.max").write_text((pids_cgroup / "pids.current").read_text())
        try:
            for _ in range(5):
                assert _fetch_raw(blocks, names) == [bp.FOUND] * 4
            assert _roundtrip(srv.unix_target, "at-the-limit") == 4
            # Not one thread was even asked for (the old server's accept thread tried at once, and
            # died: every later connection timed out, after the limit was lifted too).
            assert (pids_cgroup / "pids.events").read_text().split() == ["max", "0"]
        finally:
            (pids_cgroup / "pids.max").write_text("max")
        assert _roundtrip(srv.unix_target, "after") == 4


@pytest.fixture
def memfd() -> Iterator[int]:
    fd = os.memfd_create("test-block", os.MFD_CLOEXEC)
    os.write(fd, PAYLOAD)
    try:
        yield fd
    finally:
        os.close(fd)


def test_a_failure_serving_one_connection_closes_it_and_the_loop_goes_on(
    tmp_path: Path, memfd: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}

    def resolve(name: str) -> tuple[int, int] | None:
        calls["n"] += 1
        if calls["n"] <= 2:
            raise RuntimeError("a bug answering this request")
        return os.dup(memfd), len(PAYLOAD)

    accepted = {"n": 0}

    def flaky_peer_of(sock: socket.socket) -> object:
        accepted["n"] += 1
        if accepted["n"] == 1:
            raise OSError(12, "Cannot allocate memory")  # registering this connection fails
        return real_peer_of(sock)

    monkeypatch.setattr(blocksock, "peer_of", flaky_peer_of)
    beats: list[float] = []
    server = blocksock.BlockSocket(tmp_path / "b.sock", resolve)
    server.heartbeat = lambda: beats.append(time.monotonic())
    server.start()
    try:
        # The first connection cannot even be registered: it is closed, nothing else. The next two
        # hit a bug in answering: each loses its own connection only.
        for _ in range(3):
            assert _hung_up(server.path)
        assert server.last_error is not None
        assert "a bug answering this request" in server.last_error
        assert server.alive()
        with BlockChannel(server.path, client_id="polite") as polite:
            (fd,) = polite.fetch([NAME], deadline=time.monotonic() + 5)
        assert fd is not None
        assert os.pread(fd, len(PAYLOAD), 0) == PAYLOAD
        os.close(fd)
        wait_until(lambda: server.connections == 0, 5, what="connections closed")
        n = len(beats)
        wait_until(lambda: len(beats) > n, 5, what="the loop to keep turning")
    finally:
        server.close()
    assert not server.alive()


def test_connections_are_bounded_in_all_and_per_client(tmp_path: Path, memfd: int) -> None:
    limits = blocksock.BlockLimits(max_connections=4, max_connections_per_client=2)
    path = tmp_path / "b.sock"
    server = blocksock.BlockSocket(path, lambda _: (os.dup(memfd), len(PAYLOAD)), limits=limits)
    server.start()
    channels = [BlockChannel(server.path, client_id=c) for c in ("greedy", "greedy", "other-0", "other-1")]
    extra = BlockChannel(server.path, client_id="greedy")
    late = BlockChannel(server.path, client_id="late")

    def fetch(channel: BlockChannel) -> None:
        (fd,) = channel.fetch([NAME], deadline=time.monotonic() + 5)
        assert fd is not None
        os.close(fd)

    try:
        # One client, as many connections as it likes to open: the third is refused.
        fetch(channels[0])
        fetch(channels[1])
        with pytest.raises(errors.CacheOverloaded, match="too many connections from this client"):
            fetch(extra)
        # Other clients are served meanwhile, up to the total.
        fetch(channels[2])
        fetch(channels[3])
        # One more at the total takes the place of the least recently active idle connection
        # (channels[0]'s): never refused while some connection holds nothing.
        fetch(late)
        assert server.connections == 4
        # The one closed reconnects on its next fetch (closing the next idlest), transparently.
        for channel in channels:
            fetch(channel)
        assert server.connections == 4
        channels[0].close()
        wait_until(lambda: server.connections == 3, 5, what="the connection to close")
        fetch(extra)
        assert server.alive()
    finally:
        for channel in (*channels, extra, late):
            channel.close()
        server.close()


def test_a_connection_is_one_client_for_its_life(tmp_path: Path, memfd: int) -> None:
    server = blocksock.BlockSocket(tmp_path / "b.sock", lambda _: (os.dup(memfd), len(PAYLOAD)))
    server.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(5)
            s.connect(str(server.path))
            s.send(bp.encode_request([NAME], client="one"))
            msg, fds, _ = fdpass.recv_fds(s, 256, 1)
            for fd in fds:
                os.close(fd)
            assert list(msg) == [bp.FOUND]
            s.send(bp.encode_request([NAME], client="two"))
            msg, fds, _ = fdpass.recv_fds(s, 256, 1)
            assert msg[:1] == bytes([bp.BAD_REQUEST])
            assert not fds
            assert s.recv(16) == b""  # and closed
    finally:
        server.close()


def test_a_client_still_loads_from_a_server_that_knows_no_client_ids(tmp_path: Path, memfd: int) -> None:
    # An older server: a request naming a client is malformed to it (answered BAD_REQUEST, closed).
    path = tmp_path / "old.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(8)
    seen: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(bp.MAX_MESSAGE):
                    seen.append(data)
                    if b"@" in data:
                        conn.send(bytes([bp.BAD_REQUEST]) + b"bad request")
                        break
                    socket.send_fds(conn, [bytes([bp.FOUND])], [memfd])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with BlockChannel(path, client_id="new-client") as channel:
            for _ in range(2):
                (fd,) = channel.fetch([NAME], deadline=time.monotonic() + 5)
                assert fd is not None
                assert os.pread(fd, len(PAYLOAD), 0) == PAYLOAD
                os.close(fd)
        # Asked once with its id, then without on the same kind of connection, until it reconnects.
        assert [b"@" in m for m in seen] == [True, False, False]
    finally:
        listener.close()


class _CountedHolds:
    """A :class:`~kvfabric.cacheserver.transport.holdbook.Holds` over one memfd: every hold fits."""

    max_held_blocks = 64

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.held: dict[str, int] = {}

    def hold_by_name(self, name: str, budget: int) -> tuple[int, int, int] | None:
        if budget < len(PAYLOAD):
            return os.dup(self.fd), len(PAYLOAD), 0
        self.held[name] = self.held.get(name, 0) + 1
        return os.dup(self.fd), len(PAYLOAD), len(PAYLOAD)

    def release(self, name: str, times: int = 1) -> None:
        self.held[name] -= times


def _connect(path: Path, request: bytes | None = None, timeout: float = 10) -> socket.socket:
    """A connection, after one request (its answer read, descriptors closed) unless ``request`` is None."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(timeout)
    s.connect(str(path))
    if request is not None:
        try:
            s.send(request)
            _, fds, _ = fdpass.recv_fds(s, 256, bp.MAX_NAMES)
        except ConnectionError:
            return s  # refused (and closed): an attacker does not care
        for fd in fds:
            os.close(fd)
    return s


def _hold_one(path: Path, client: str) -> tuple[socket.socket, int]:
    """A connection that asked to hold one block, and the answer's status."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(5)
    s.connect(str(path))
    s.send(bp.encode_hold_request([NAME], client=client))
    msg, fds, _ = fdpass.recv_fds(s, 256, 1)
    for fd in fds:
        os.close(fd)
    return s, msg[0]


def _closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (nothing waits on it but the end; never blocks)."""
    timeout = s.gettimeout()
    s.setblocking(False)
    try:
        return s.recv(256, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        s.settimeout(timeout)


def test_at_the_total_a_newcomer_closes_the_idlest_connection_that_holds_nothing(
    tmp_path: Path, memfd: int
) -> None:
    limits = blocksock.BlockLimits(max_connections=4, hold_bytes_per_client=MiB)
    holds = _CountedHolds(memfd)
    server = blocksock.BlockSocket(
        tmp_path / "b.sock", lambda _: (os.dup(memfd), len(PAYLOAD)), holds=holds, limits=limits
    )
    server.start()
    conns: list[socket.socket] = []
    try:
        # Two connections hold a block (each its own client); half the bound may hold, no more: the
        # third asking is lent the block instead (it copies), so its connection stays closable.
        answers = []
        for i in range(3):
            s, status = _hold_one(server.path, f"holder-{i}")
            conns.append(s)
            answers.append(status)
        assert answers == [bp.FOUND, bp.FOUND, bp.LENT]
        conns.append(_connect(server.path, bp.encode_request([NAME], client="idle")))
        assert server.connections == 4
        # Full. Each newcomer takes the place of the least recently active one that holds nothing,
        # though the holders are older; the holders keep their connections and their holds.
        new = [_connect(server.path, bp.encode_request([NAME], client="new-0"))]
        wait_until(lambda: _closed_by_server(conns[2]), 5, what="the idlest connection to close")
        assert not any(_closed_by_server(s) for s in (conns[0], conns[1], conns[3]))
        new.append(_connect(server.path, bp.encode_request([NAME], client="new-1")))
        wait_until(lambda: _closed_by_server(conns[3]), 5, what="the next idlest to close")
        assert not any(_closed_by_server(s) for s in (conns[0], conns[1], *new))
        assert holds.held == {NAME: 2}
        # A holder that releases its holds may make room in turn (after those idle longer).
        conns[0].send(bp.encode_hold_request([], [NAME]))
        assert conns[0].recv(16) == bytes([bp.RELEASED])
        assert holds.held == {NAME: 1}
        new += [_connect(server.path, bp.encode_request([NAME], client=f"new-{i}")) for i in (2, 3, 4)]
        wait_until(lambda: _closed_by_server(conns[0]), 5, what="the released connection to close")
        assert not _closed_by_server(conns[1])
        assert server.connections == 4
        conns += new
        assert server.alive()
    finally:
        for s in conns:
            s.close()
        server.close()


def test_a_connection_silent_past_the_first_request_deadline_is_closed(tmp_path: Path, memfd: int) -> None:
    server = blocksock.BlockSocket(tmp_path / "b.sock", lambda _: (os.dup(memfd), len(PAYLOAD)))
    server.start()
    try:
        silent = _connect(server.path)
        talking = _connect(server.path, bp.encode_request([NAME], client="talking"))
        start = time.monotonic()
        wait_until(lambda: _closed_by_server(silent), 5, what="the silent connection to close")
        took = time.monotonic() - start
        assert blocksock.FIRST_REQUEST_SECONDS * 0.9 <= took <= blocksock.FIRST_REQUEST_SECONDS + 3.0
        # One that asked stays open, idle as it may be (it is closed only to make room).
        assert not _closed_by_server(talking)
        assert server.connections == 1
        silent.close()
        talking.close()
    finally:
        server.close()


def _ready(srv: ServerProcess) -> int:
    try:
        with urllib.request.urlopen(f"{srv.metrics_url}/readyz", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@pytest.mark.process
def test_one_process_filling_the_block_socket_with_connections_denies_no_one() -> None:
    # The default total bound (shm.max_block_connections, 1024). The attacker names a new id per
    # connection, as every connection of a peer in another pod is its own client.
    cap = 1024
    with cache_server(dram_bytes=64 * MiB, local_disk_bytes=None) as srv:
        blocks = bp.block_socket_for(srv.unix_target[len("unix://") :])
        assert _roundtrip(srv.unix_target, "before") == 4
        # A block of its own, to hold one (tiny) block on each connection that may.
        key = digest("squatter", 0)
        with CacheClient(srv.unix_target) as plain:
            assert plain.store(NS, [key], [b"x"], timeout=10).accepted == 1
        (name,) = _slot_names(srv.unix_target, [key])
        squatters: list[socket.socket] = []
        try:
            # The total's worth: connections that hold a block, that sent one request and idle since,
            # and silent ones.
            hold = [
                _connect(blocks, bp.encode_hold_request([name], client=f"hold-{i}")) for i in range(cap // 2)
            ]
            squatters += hold
            squatters += [
                _connect(blocks, bp.encode_request([name], client=f"idle-{i}")) for i in range(cap // 2 - 24)
            ]
            squatters += [_connect(blocks) for _ in range(24)]
            # A well-behaved engine loads and stores through shared memory meanwhile (before, it was
            # refused: CacheOverloaded on every shared-memory load and store).
            assert _roundtrip(srv.unix_target, "squatted") == 4
            assert _ready(srv) == 200
            # The silent ones are closed by the first-request deadline (about a second).
            wait_until(
                lambda: all(_closed_by_server(s) for s in squatters[-24:]), 5, what="the silent ones closed"
            )
            # Squatting again and again changes nothing: a newcomer always finds room.
            squatters += [
                _connect(blocks, bp.encode_request([name], client=f"again-{i}")) for i in range(cap)
            ]
            squatters += [
                _connect(blocks, bp.encode_hold_request([name], client=f"h-{i}")) for i in range(cap)
            ]
            assert _roundtrip(srv.unix_target, "squatted-again") == 4
            assert _ready(srv) == 200
            time.sleep(1.5)  # a probe of /readyz past the deadline
            assert _ready(srv) == 200
        finally:
            for s in squatters:
                s.close()
        assert _roundtrip(srv.unix_target, "after") == 4
        assert _ready(srv) == 200


@pytest.mark.process
def test_a_client_whose_idle_connection_was_closed_loads_on_its_next_call() -> None:
    cap = 1024
    with cache_server(dram_bytes=64 * MiB, local_disk_bytes=None) as srv:
        blocks = bp.block_socket_for(srv.unix_target[len("unix://") :])
        keys = [digest("evicted", i) for i in range(4)]
        payloads = [payload_for(k, 64 * 1024) for k in keys]
        # No kept mappings: its connection holds nothing between loads, so it may be closed.
        with CacheClient(srv.unix_target, shared_memory=True, mapping_cache_bytes=0) as client:
            assert client.store(NS, keys, payloads, timeout=10).accepted == 4
            assert client.load(NS, keys, timeout=10) == payloads
            kept = client._blocks._sock  # type: ignore[union-attr]
            assert kept is not None
            squatters = [_connect(blocks, bp.encode_request([NAME], client=f"squat-{i}")) for i in range(cap)]
            try:
                wait_until(lambda: _closed_by_server(kept), 5, what="the idle connection to be closed")
                # Its next call reconnects once, transparently: a load, not a miss or an error.
                assert client.load(NS, keys, timeout=10) == payloads
                bufs = [memoryview(bytearray(64 * 1024)) for _ in keys]
                assert client.load_into(NS, keys, bufs, timeout=10) == 4
                assert [bytes(b) for b in bufs] == payloads
            finally:
                for s in squatters:
                    s.close()


def _reachable_by_any_uid(sock: Path) -> None:
    """Let processes of other uids reach the socket ``sock`` (search permission on its directories)."""
    for d in sock.parents:
        if d == Path("/"):
            break
        d.chmod(d.stat().st_mode | 0o111)


# A process that keeps a request queued on every connection it opens (reading each answer, so none
# waits unsent): its connections always have a request unread. Protected as "at stake", they made
# every newcomer refused (CacheOverloaded: a failed load, not a miss) for as long as it went on.
PIPELINER = textwrap.dedent(
    """
    import os, socket, sys, time
    from kvfabric.rpc import blockproto as bp
    path, n, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    if os.geteuid() == 0:  # another tenant: another uid (tenants of one uid share its unread share)
        os.setgid(65534); os.setuid(65534)
    def connect():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(path)
        s.setblocking(False)
        return s
    conns = [connect() for _ in range(n)]
    requests = [bp.encode_request(["d_" + "1" * 32], client=f"hog{i}") for i in range(n)]
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for i, s in enumerate(conns):
            dead = False
            try:
                while True:
                    if not s.recv(64):
                        dead = True
                        break
            except BlockingIOError:
                pass
            except OSError:
                dead = True
            if dead:
                s.close()
                try:
                    conns[i] = s = connect()
                except OSError:
                    continue
            try:
                while True:
                    s.send(requests[i])
            except OSError:
                pass
    """
)


@pytest.mark.process
def test_a_process_keeping_a_request_queued_on_every_connection_refuses_no_newcomer(
    tmp_path: Path, memfd: int
) -> None:
    limits = blocksock.BlockLimits(max_connections=16, max_connections_per_client=8)
    server = blocksock.BlockSocket(
        tmp_path / "b.sock", lambda _: (os.dup(memfd), len(PAYLOAD)), limits=limits
    )
    server.start()
    _reachable_by_any_uid(server.path)
    hog = subprocess.Popen(
        [sys.executable, "-c", PIPELINER, str(server.path), "16", "20"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert hog.stdout is not None
        assert hog.stdout.readline().strip() == "ready"
        wait_until(lambda: server.connections >= 16, 10, what="the hog to fill the socket")
        outcomes = {"served": 0, "refused": 0}
        for _ in range(20):
            channel = BlockChannel(server.path)
            try:
                channel.fetch([NAME], deadline=time.monotonic() + 2)
                outcomes["served"] += 1
            except errors.CacheOverloaded:
                outcomes["refused"] += 1
            finally:
                channel.close()
        assert outcomes == {"served": 20, "refused": 0}
        assert server.alive()
    finally:
        hog.kill()
        hog.communicate()
        server.close()


# Loaded by the server process: a low descriptor limit, and without the two capabilities that exempt
# a process from the kernel's bound on descriptors in flight (a real cache pod has neither).
UNPRIVILEGED_SITE = textwrap.dedent(
    """
    import ctypes
    class _Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class _Data(ctypes.Structure):
        _fields_ = [(f, ctypes.c_uint32) for f in ("effective", "permitted", "inheritable")]
    _libc = ctypes.CDLL(None, use_errno=True)
    _header, _data = _Header(0x20080522, 0), (_Data * 2)()
    assert _libc.capget(ctypes.byref(_header), _data) == 0
    for _cap in (21, 24):  # CAP_SYS_ADMIN, CAP_SYS_RESOURCE (threads started later inherit this)
        _data[_cap // 32].effective &= ~(1 << (_cap % 32))
    assert _libc.capset(ctypes.byref(_header), _data) == 0
    """
)

# Another tenant's engine (uid argv[3]) that asks for 64 blocks again and again on many connections
# and never reads an answer; on a line on stdin it reads everything queued and prints the count of
# descriptors waiting for it.
NEVER_READS = textwrap.dedent(
    """
    import os, socket, sys
    from kvfabric.rpc import blockproto as bp
    from kvfabric.rpc import fdpass
    path, names, uid = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
    os.setgid(uid); os.setuid(uid)
    conns = []
    for i in range(40):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(path)
        s.setblocking(False)
        conns.append(s)
        for _ in range(12):
            try:
                s.send(bp.encode_request(names, client=f"never-reads-{i}"))
            except OSError:
                break
    print("sent", flush=True)
    sys.stdin.readline()
    got = 0
    for s in conns:  # what waits in its sockets now (reading one may bring the next)
        while True:
            try:
                msg, fds, _ = fdpass.recv_fds(s, 256, bp.MAX_NAMES)
            except OSError:  # BlockingIOError: nothing more waits
                break
            if not msg:
                break
            got += len(fds)
            for fd in fds:
                os.close(fd)
    print(got, flush=True)
    """
)


@pytest.mark.process
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the other tenant as another uid")
def test_answers_tenants_leave_unread_cannot_stop_the_server_passing_descriptors_to_others(
    tmp_path: Path,
) -> None:
    # The kernel charges descriptors sent and not yet received to the sending user, and past its
    # open-files limit every send carrying one fails (ETOOMANYREFS). Before, a tenant that never read
    # its answers made the server's every later load and store answer fail, every tenant's.
    env = site_env(tmp_path / "site", nofile_site(2000) + UNPRIVILEGED_SITE)
    with cache_server(dram_bytes=64 * MiB, local_disk_bytes=None, env=env) as srv:
        blocks = bp.block_socket_for(srv.unix_target[len("unix://") :])
        _reachable_by_any_uid(blocks)
        keys = [digest("never-reads", i) for i in range(bp.MAX_NAMES)]
        with CacheClient(srv.unix_target) as plain:
            assert plain.store(NS, keys, [b"x"] * len(keys), timeout=10).accepted == len(keys)
        names = _slot_names(srv.unix_target, keys)
        # Two tenants, each its own uid.
        tenants = [
            subprocess.Popen(
                [sys.executable, "-c", NEVER_READS, str(blocks), ",".join(names), str(uid)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for uid in (65534, 65533)
        ]
        got: list[int] = []
        try:
            for tenant in tenants:
                assert tenant.stdout is not None
                assert tenant.stdout.readline().strip() == "sent"
            # Every other engine stores and loads through shared memory meanwhile.
            for i in range(3):
                assert _roundtrip(srv.unix_target, f"others-{i}", n=16) == 16
            for tenant in tenants:
                assert tenant.stdin is not None
                assert tenant.stdout is not None
                tenant.stdin.write("read now\n")
                tenant.stdin.flush()
                got.append(int(tenant.stdout.readline()))
        finally:
            for tenant in tenants:
                tenant.kill()
                tenant.communicate()
        # One uid's answers unread hold at most an eighth of the bound (at least one answer's 64).
        # Before, answers were sent to it as fast as it asked, until the server's sends failed and
        # the other engine's first store above with them.
        assert max(got) <= bp.MAX_NAMES, got
        assert _roundtrip(srv.unix_target, "after", n=16) == 16
