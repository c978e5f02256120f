"""Same-node isolation: an engine process on the node gets exactly the blocks it asked for, read-only.

Against a real cache-server process and real clients (docs/security.md, "Same node"). The server
keeps every DRAM block and every store staging area in memfds only it holds; clients receive sealed
descriptors over the block socket. These tests play the hostile engine: they try to write, shrink,
map writable and punch holes in what they received, keep writing their staging memfd after the
commit, trade names they were never given, read the server's descriptors as another uid, and unlink
the socket through the read-only mount consumers get.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvfabric.client import CacheClient
from kvfabric.client.blocks import BlockChannel, close_all
from kvfabric.client.errors import CacheTimeout
from kvfabric.rpc import blockproto as bp
from kvfabric.rpc.v1 import cache_pb2 as pb
from kvfabric.rpc.v1 import cache_pb2_grpc as pb_grpc
from kvfabric.testing.mountns import run_in_private_mount_namespace
from kvfabric.testing.serverproc import (
    MiB,
    ServerProcess,
    cache_server,
    digest,
    open_descriptors,
    payload_for,
)

pytestmark = pytest.mark.process

NS = digest("same-node")
FALLOC_FL_PUNCH_HOLE_KEEP_SIZE = 0x02 | 0x01


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProcess]:
    with cache_server(dram_bytes=64 * MiB) as s:
        yield s


def _blocks(srv: ServerProcess) -> BlockChannel:
    return BlockChannel(bp.block_socket_for(srv.config.listen.unix_socket))


def _stub(ch: grpc.Channel) -> pb_grpc.CacheStub:
    return pb_grpc.CacheStub(ch)  # type: ignore[no-untyped-call]


def _store(srv: ServerProcess, key: str, payload: bytes) -> None:
    with CacheClient(srv.unix_target, shared_memory=True) as c:
        assert c.store(NS, [key], [payload], timeout=10).accepted == 1


def _load_fd(srv: ServerProcess, key: str) -> tuple[int, int]:
    """What an engine receives for a load: the block's descriptor and its length."""
    with grpc.insecure_channel(srv.unix_target) as ch:
        slots = list(_stub(ch).ShmLoad(pb.LoadRequest(namespace=NS, keys=[key]), timeout=10))
    assert len(slots) == 1
    with _blocks(srv) as chan:
        fd = chan.fetch([slots[0].name], deadline=time.monotonic() + 10)[0]
    assert fd is not None
    return fd, slots[0].length


def _punch_hole(fd: int, length: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE_KEEP_SIZE, 0, length) == 0:
        return 0
    return ctypes.get_errno()


def test_a_loaded_block_cannot_be_written_shrunk_mapped_writable_or_punched(srv: ServerProcess) -> None:
    key = digest("sealed")
    payload = payload_for(key, 1 * MiB)
    _store(srv, key, payload)
    fd, length = _load_fd(srv, key)
    try:
        assert length == len(payload)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"poison", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 10)  # a shrunk file would SIGBUS every mapping of it
        with pytest.raises(PermissionError):
            mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        assert _punch_hole(fd, 4096) == 1  # EPERM
        # Reopening the descriptor through /proc for writing gets no further.
        rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            with pytest.raises(PermissionError):
                os.pwrite(rw, b"poison", 0)
        finally:
            os.close(rw)
    finally:
        os.close(fd)
    # Every other engine still loads the exact bytes that were stored.
    with CacheClient(srv.unix_target, shared_memory=True) as c:
        assert c.load(NS, [key], timeout=10) == [payload]


def test_staging_written_after_the_commit_or_mapped_through_it_never_reaches_a_block(
    srv: ServerProcess,
) -> None:
    keys = [digest("stage", i) for i in range(3)]
    size = 256 * 1024
    with grpc.insecure_channel(srv.unix_target) as ch:
        stub = _stub(ch)
        before = _counter(srv, "invalid_staging")
        resp = stub.ShmStoreBegin(
            pb.ShmStoreBeginRequest(namespace=NS, keys=keys, lengths=[size] * 3), timeout=10
        )
        with _blocks(srv) as chan:
            fds = chan.fetch([s.name for s in resp.slots], deadline=time.monotonic() + 10)
        assert all(fd is not None for fd in fds)
        kept, mapped, shrunk = (fd for fd in fds if fd is not None)
        for fd, key in zip((kept, mapped, shrunk), keys, strict=True):
            os.pwrite(fd, payload_for(key, size), 0)
        # The hostile client keeps a writable mapping of one memfd and truncates another.
        mapping = mmap.mmap(mapped, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        os.ftruncate(shrunk, size // 2)
        done = stub.ShmStoreCommit(pb.ShmStoreCommitRequest(lease_id=resp.lease_id), timeout=10)
        assert (done.accepted, done.dropped) == (1, 2)
        assert _counter(srv, "invalid_staging") - before == 2
        # The committed one was sealed first: the descriptor the client kept writes nothing more.
        with pytest.raises(PermissionError):
            os.pwrite(kept, b"poison", 0)
        # The refused memfds are no block's, and the server freed their pages on the way out (the
        # client's mapping would fault now: its own doing, the product's client never maps staging).
        mapping.close()
        assert [os.fstat(fd).st_size for fd in (mapped, shrunk)] == [0, 0]
        close_all([kept, mapped, shrunk])
    with CacheClient(srv.unix_target, shared_memory=True) as c:
        assert c.load(NS, keys[:1], timeout=10) == [payload_for(keys[0], size)]
        assert c.lookup(NS, keys[1:2], timeout=10).matched == 0
        assert c.lookup(NS, keys[2:3], timeout=10).matched == 0
        assert c.health(timeout=5), "the server keeps serving"


def test_a_committed_store_is_the_servers_own_staging_memfd_not_a_copy(srv: ServerProcess) -> None:
    """The commit puts the staging memfd itself into DRAM; its pages were the server's before any write.

    The server allocates the staging pages (so they are charged to its memory cgroup, not the
    engine's) before it names them, and the block a load hands out afterwards is that same memfd:
    no second allocation, no second copy of the payload.
    """
    key = digest("adopted")
    size = 1 * MiB + 123
    payload = payload_for(key, size)
    with grpc.insecure_channel(srv.unix_target) as ch:
        stub = _stub(ch)
        resp = stub.ShmStoreBegin(
            pb.ShmStoreBeginRequest(namespace=NS, keys=[key], lengths=[size]), timeout=10
        )
        with _blocks(srv) as chan:
            (staging,) = chan.fetch([resp.slots[0].name], deadline=time.monotonic() + 10)
        assert staging is not None
        try:
            # Every page exists before the client writes a byte: allocated by the server.
            assert os.fstat(staging).st_blocks * 512 >= size
            os.pwrite(staging, payload, 0)
            done = stub.ShmStoreCommit(pb.ShmStoreCommitRequest(lease_id=resp.lease_id), timeout=10)
            assert (done.accepted, done.dropped) == (1, 0)
            loaded, length = _load_fd(srv, key)
            try:
                assert length == size
                same = os.fstat(loaded), os.fstat(staging)
                assert (same[0].st_dev, same[0].st_ino) == (same[1].st_dev, same[1].st_ino)
                assert os.pread(loaded, size + 1, 0) == payload
            finally:
                os.close(loaded)
            with pytest.raises(PermissionError):
                os.pwrite(staging, b"poison", 0)
        finally:
            os.close(staging)
    with CacheClient(srv.unix_target, shared_memory=True) as c:
        assert c.load(NS, [key], timeout=10) == [payload]


def _counter(srv: ServerProcess, name: str) -> int:
    with CacheClient(srv.unix_target) as c:
        counters = c.stats(timeout=5)["counters"]
    return sum(v for k, v in counters.items() if k == name or k.startswith(name + "."))


def test_names_never_handed_out_and_malformed_requests_get_nothing(srv: ServerProcess) -> None:
    key = digest("guess")
    _store(srv, key, payload_for(key, 4096))
    # Well-formed names nobody issued: gone, not a descriptor of some block.
    forged = [f"d_{os.urandom(16).hex()}", f"s_{os.urandom(16).hex()}"]
    with _blocks(srv) as chan:
        assert chan.fetch(forged, deadline=time.monotonic() + 5) == [None, None]
    # Anything else is refused and the connection closed; the server keeps serving.
    for bad in (b"KVBK1 ../../etc/passwd", b"GET d_" + b"0" * 32, b"KVBK1", b"KVBK1 " + b"d_0 " * 200):
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(5)
            s.connect(str(bp.block_socket_for(srv.config.listen.unix_socket)))
            s.send(bad)
            msg, fds, _, _ = socket.recv_fds(s, 64, 4)
            assert fds == []
            assert msg[:1] == bytes([bp.BAD_REQUEST]), bad
            assert s.recv(16) == b"", "the connection is closed after a bad request"
    with CacheClient(srv.unix_target, shared_memory=True) as c:
        assert c.load(NS, [key], timeout=10) == [payload_for(key, 4096)]


def test_no_block_is_a_file_and_another_uid_cannot_take_the_servers_descriptors(
    srv: ServerProcess,
) -> None:
    key = digest("no-files")
    _store(srv, key, payload_for(key, 64 * 1024))
    sock = srv.config.listen.unix_socket
    # The directory consumers mount holds the server's four sockets and nothing else.
    here = {p.name for p in sock.parent.iterdir() if p.name.startswith(sock.name)}
    assert here == {sock.name, sock.name + ".index", sock.name + ".blocks", sock.name + ".residency"}
    assert all(stat_is_socket(sock.parent / n) for n in here)
    # The hand-over socket (which gives a successor every block) is elsewhere: a directory only the
    # server's uid may enter, and a socket only it may connect to.
    handover_dir = srv.config.handover.socket_dir
    assert handover_dir is not None
    assert handover_dir.resolve() != sock.parent.resolve()
    assert stat.S_IMODE(handover_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((handover_dir / f"{sock.name}.handover").stat().st_mode) == 0o600
    assert srv.proc is not None
    pid = srv.proc.pid
    memfds = _memfds_of(pid)
    assert memfds, "DRAM blocks are memfds of the server process"
    # A process of another user cannot open them through /proc (ptrace access is denied).
    probe = textwrap.dedent(
        f"""
        import os, sys
        os.setgid(65534); os.setuid(65534)
        denied = 0
        for fd in {memfds!r}:
            try:
                os.close(os.open("/proc/{pid}/fd/" + fd, os.O_RDONLY))
            except PermissionError:
                denied += 1
                continue
            except FileNotFoundError:
                continue  # evicted meanwhile
            sys.exit("opened the server's descriptor " + fd)
        print("denied", denied)
        """
    )
    if os.geteuid() != 0:
        pytest.skip("needs root to run the probe as another uid")
    cmd = [sys.executable, "-c", probe]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("denied")
    assert int(out.stdout.split()[1]) >= 1, "no descriptor was even tried"


def _memfds_of(pid: int) -> list[str]:
    """The descriptor numbers of ``pid`` that are memfds (the server opens and closes others meanwhile)."""
    fd_dir = f"/proc/{pid}/fd"
    out = []
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except FileNotFoundError:
            continue  # closed between the listing and the readlink (a socket, a disk read)
        if target.startswith("/memfd:"):
            out.append(fd)
    return out


def stat_is_socket(path: Path) -> bool:
    import stat

    return stat.S_ISSOCK(path.lstat().st_mode)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_through_the_read_only_mount_consumers_get_a_root_client_loads_but_cannot_replace_the_socket(
    srv: ServerProcess, tmp_path: Path
) -> None:
    key = digest("ro-mount")
    payload = payload_for(key, 128 * 1024)
    _store(srv, key, payload)
    host_dir = srv.config.listen.unix_socket.parent
    mnt = tmp_path / "run"
    mnt.mkdir()
    sock = mnt / srv.config.listen.unix_socket.name
    # As the webhook mounts it: the pool's host directory, read-only, in the consumer's namespace.
    client = textwrap.dedent(
        f"""
        import os, socket, sys
        from kvfabric.client import CacheClient
        with CacheClient("unix://{sock}", shared_memory=True) as c:
            assert c.load({NS!r}, [{key!r}], timeout=10) == [{payload!r}], "load through the mount"
        for victim in ("{sock}", "{sock}.blocks", "{sock}.index", "{sock}.residency"):
            try:
                os.unlink(victim)
            except OSError as exc:
                assert exc.errno == 30, exc  # EROFS, even for root
            else:
                sys.exit("unlinked " + victim)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.bind("{mnt}/impostor.sock")
        except OSError as exc:
            assert exc.errno == 30, exc
        else:
            sys.exit("bound an impostor socket")
        print("ok")
        """
    )
    script = tmp_path / "client.py"
    script.write_text(client)
    cmd = f"mount --bind {host_dir} {mnt} && mount -o remount,bind,ro {mnt} && exec {sys.executable} {script}"
    out = run_in_private_mount_namespace(cmd)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "ok"
    with contextlib.suppress(OSError):
        mnt.rmdir()
    assert srv.config.listen.unix_socket.is_socket()


def test_a_fetch_that_fails_half_way_closes_every_descriptor_it_already_received(tmp_path: Path) -> None:
    # A block socket that answers the first batch of 64 names with 64 descriptors and then hangs.
    path = tmp_path / "b.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(1)
    spare = os.memfd_create("spare")
    names = [f"d_{i:032x}" for i in range(bp.MAX_NAMES + 1)]

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(bp.MAX_MESSAGE)
            socket.send_fds(conn, [bytes([bp.FOUND]) * bp.MAX_NAMES], [spare] * bp.MAX_NAMES)
            conn.recv(bp.MAX_MESSAGE)  # the second batch is never answered
            time.sleep(1)

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    before = open_descriptors()
    try:
        with BlockChannel(path) as chan, pytest.raises(CacheTimeout):
            chan.fetch(names, deadline=time.monotonic() + 0.5)
        th.join(5)  # the fake server's end of the connection is closed too
        # New descriptors only: one closed meanwhile on another thread is no leak.
        leaked = {fd: what for fd, what in open_descriptors().items() if before.get(fd) != what}
        assert leaked == {}, "descriptors of the first batch leaked"
    finally:
        listener.close()
        os.close(spare)


def test_blocks_and_stagings_get_half_and_a_quarter_of_the_descriptor_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import resource

    from kvfabric.cacheserver.engine.dram import DramTier
    from kvfabric.cacheserver.engine.stats import Counters
    from kvfabric.cacheserver.transport.arena import StagingArena

    # A process whose limit is 4096 and cannot be raised: the caps are that limit's shares.
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (4096, 4096))
    tier = DramTier(1 << 30)
    arena = StagingArena(64 * 4096, 30.0, Counters())
    try:
        assert tier.max_blocks == 2048
        assert arena.max_slots == 1024
    finally:
        arena.close()


def test_many_tiny_blocks_or_stagings_cannot_take_every_descriptor() -> None:
    from kvfabric.cacheserver.engine.dram import DramTier
    from kvfabric.cacheserver.engine.ids import BlockId
    from kvfabric.cacheserver.engine.stats import Counters
    from kvfabric.cacheserver.transport.arena import StagingArena

    tier = DramTier(1 << 30)
    tier.max_blocks = 3  # as if the process could spare only 3 descriptors for blocks
    bids = [BlockId(NS, digest("tiny", i)) for i in range(5)]
    for b in bids:
        assert tier.put(b, b"x")
    assert tier.usage().blocks == 3, "more blocks (descriptors) than the tier may hold"
    assert [tier.contains(b) for b in bids] == [False, False, True, True, True], "LRU first"
    tier.discard_all()
    # Staging: each slot costs at least a page of the budget, and their number is capped.
    arena = StagingArena(64 * 4096, 30.0, Counters())
    res = arena.begin(bids * 40, [1] * 200, [False] * 200)
    assert sum(1 for n in res.names if n) == 64
    assert res.dropped == 136
    arena.abort(res.lease_id)
    arena.max_slots = 10
    res = arena.begin(bids * 4, [1] * 20, [False] * 20)
    assert sum(1 for n in res.names if n) == 10
    arena.close()
    assert arena.used_bytes == 0


def _stats(srv: ServerProcess) -> dict[str, object]:
    with CacheClient(srv.unix_target) as c:
        return c.stats(timeout=5)


def _begin_and_dup(
    stub: pb_grpc.CacheStub, srv: ServerProcess, keys: list[str], size: int
) -> tuple[str, int]:
    """A hostile engine's first half of a store: take a staging memfd and keep a dup of it."""
    resp = stub.ShmStoreBegin(
        pb.ShmStoreBeginRequest(namespace=NS, keys=keys, lengths=[size] * len(keys)), timeout=10
    )
    assert [bool(sl.name) for sl in resp.slots] == [True], "the arena has room for this staging"
    with _blocks(srv) as chan:
        (fd,) = chan.fetch([resp.slots[0].name], deadline=time.monotonic() + 10)
    assert fd is not None
    assert os.fstat(fd).st_blocks * 512 >= size, "the server allocated the pages"
    return resp.lease_id, fd


@pytest.mark.parametrize("how", ["abort", "expire", "refused_commit"])
def test_an_abandoned_staging_memfd_a_client_kept_pins_no_server_memory(how: str) -> None:
    """Abort, lease expiry and a refused commit free the staging pages, even those a client still holds.

    The server allocated them (charged to its memory cgroup), so the arena's budget is what bounds
    them: were they freed from the budget but kept alive by the client's dup, a client could pin
    unbounded server memory by repeating begin -> dup -> abandon.
    """
    size = 4 * MiB
    rounds = 8  # twice the arena
    lease = 1.0 if how == "expire" else 60.0
    overrides = {"shm.arena_bytes": 16 * MiB, "shm.slot_lease_seconds": lease}
    kept: list[int] = []
    with (
        cache_server(dram_bytes=64 * MiB, overrides=overrides) as s,
        grpc.insecure_channel(s.unix_target) as ch,
    ):
        stub = _stub(ch)
        try:
            for i in range(rounds):
                key = digest("abandoned", how, i)
                lease_id, fd = _begin_and_dup(stub, s, [key], size)
                kept.append(fd)
                if how == "abort":
                    stub.ShmStoreCommit(pb.ShmStoreCommitRequest(lease_id=lease_id, abort=True), timeout=10)
                elif how == "refused_commit":
                    os.ftruncate(fd, size // 2)  # refused: the wrong size
                    done = stub.ShmStoreCommit(pb.ShmStoreCommitRequest(lease_id=lease_id), timeout=10)
                    assert (done.accepted, done.dropped) == (0, 1)
                else:
                    deadline = time.monotonic() + 15
                    while _stats(s)["arena_used_bytes"] and time.monotonic() < deadline:
                        time.sleep(0.2)
                # Freed: the client's copy is empty, its pages gone, and the budget is back.
                st = os.fstat(fd)
                assert (st.st_size, st.st_blocks) == (0, 0), f"round {i}: the client's dup still pins pages"
                assert _stats(s)["arena_used_bytes"] == 0
            assert sum(os.fstat(fd).st_blocks for fd in kept) == 0
            assert _stats(s)["arena_quarantined_bytes"] == 0
        finally:
            close_all(kept)
        assert s.proc is not None
        assert s.proc.poll() is None, "the server is alive"


def test_staging_a_client_sealed_and_abandoned_stays_charged_to_the_arena_so_memory_stays_bounded() -> None:
    """A client that seals its staging memfd against shrinking keeps its pages: the arena keeps them charged.

    The server cannot free such pages, so it never gives their budget back (quarantined, counted in
    ``arena_quarantined_bytes``): repeated, the client fills the arena and further stores are dropped
    (engines recompute), but the server's memory stays bounded by the arena size.
    """
    size = 4 * MiB
    arena = 16 * MiB
    kept: list[int] = []
    with (
        cache_server(dram_bytes=64 * MiB, overrides={"shm.arena_bytes": arena}) as s,
        grpc.insecure_channel(s.unix_target) as ch,
    ):
        stub = _stub(ch)
        try:
            for i in range(arena // size):
                lease_id, fd = _begin_and_dup(stub, s, [digest("sealed", i)], size)
                kept.append(fd)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
                stub.ShmStoreCommit(pb.ShmStoreCommitRequest(lease_id=lease_id, abort=True), timeout=10)
                stats = _stats(s)
                assert (stats["arena_quarantined_bytes"], stats["arena_used_bytes"]) == ((i + 1) * size,) * 2
            # The arena is full of quarantined staging: every further store is dropped, none pins more.
            for i in range(4):
                resp = stub.ShmStoreBegin(
                    pb.ShmStoreBeginRequest(namespace=NS, keys=[digest("more", i)], lengths=[size]),
                    timeout=10,
                )
                assert ([sl.name for sl in resp.slots], resp.dropped) == ([""], 1)
            assert sum(os.fstat(fd).st_blocks * 512 for fd in kept) == arena
            assert _counter(s, "quarantined_staging") == arena
            with urllib.request.urlopen(s.metrics_url + "/metrics", timeout=10) as r:
                exported = [
                    ln for ln in r.read().decode().splitlines() if ln.startswith("kvfabric_arena_quarantined")
                ]
            assert [float(ln.split()[-1]) for ln in exported] == [arena], exported
            with CacheClient(s.unix_target, shared_memory=True) as c:
                key = digest("honest")
                assert c.store(NS, [key], [payload_for(key, size)], timeout=10).accepted == 0
                assert c.lookup(NS, [key], timeout=10).matched == 0
        finally:
            close_all(kept)
        assert s.proc is not None
        assert s.proc.poll() is None, "the server is alive"
