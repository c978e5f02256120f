"""A load's blocks not mapped yet are fetched together: one block-socket exchange per 64, not per block.

What is promised (kvfabric.client.blocks, docs/performance.md "A real vLLM hit, stage by stage"):

- the first load of blocks the server names together (resident in DRAM) fetches them all in one
  exchange, or ``ceil(n / 64)`` (one message carries at most ``MAX_NAMES`` descriptors), or as
  many as the mapping budget takes to hold them all: for every load API (lent, copied, bytes);
- a block the server cannot lend any more (deleted between the naming and the fetch) is a miss for
  that block and those after it: the prefix up to it still loads, with exactly its bytes, and what
  was fetched past it is closed and its holds released (the server's and the client's books equal);
- a batch failing half-way (a block shorter than named) closes every descriptor it received,
  releases its holds and leaves nothing lent; the descriptors were close-on-exec from their arrival;
- a batch the kernel truncates (this process out of descriptors: ``MSG_CTRUNC``) is
  ``CacheUnavailable`` and leaks nothing, and a hung server is ``CacheTimeout`` at the deadline.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from kvfabric.client import CacheClient, errors
from kvfabric.client import blocks as blocks_mod
from kvfabric.client._common import shm_slots
from kvfabric.client.blocks import BlockChannel, BlockRef
from kvfabric.client.mappings import charged
from kvfabric.rpc import blockproto as bp
from kvfabric.rpc.v1 import cache_pb2 as pb
from kvfabric.rpc.v1 import cache_pb2_grpc as pb_grpc
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, payload_for, temp_dir

NS = digest("batched-fetch")
SIZE = 64 * 1024 + 17  # not a page multiple: holds are charged page-rounded


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProcess]:
    with cache_server(dram_bytes=128 * MiB) as s:
        yield s


def _stored(srv: ServerProcess, tag: str, n: int, size: int = SIZE) -> tuple[list[str], list[bytes]]:
    keys = [digest(tag, i) for i in range(n)]
    payloads = [payload_for(k, size) for k in keys]
    with CacheClient(srv.unix_target, shared_memory=True) as writer:
        assert writer.store(NS, keys, payloads, timeout=30).accepted == n
    return keys, payloads


@pytest.fixture
def exchanges(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every request message sent on a block socket by this process, in order."""
    sent: list[bytes] = []
    real = blocks_mod.BlockChannel._exchange

    def counted(
        self: BlockChannel,
        request: Callable[[str | None], bytes],
        most_fds: int,
        deadline: float,
        **kwargs: Any,
    ) -> tuple[bytes, list[int]]:
        def build(client: str | None) -> bytes:
            msg = request(client)
            if not bp.is_store_request(msg):  # the tests count what loads send
                sent.append(msg)
            return msg

        return real(self, build, most_fds, deadline, **kwargs)

    monkeypatch.setattr(blocks_mod.BlockChannel, "_exchange", counted)
    return sent


def _memfds() -> int:
    """Memfd descriptors open in this process (a kept mapping keeps one: Python's mmap dups it)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed meanwhile
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    return n


def _held_bytes(c: CacheClient) -> int:
    """What the server holds for everyone, once ``c`` sent every release it owes."""
    assert c._blocks is not None
    c._blocks.flush_releases(deadline=time.monotonic() + 10)
    held: int = c.stats(timeout=10)["tiers"]["dram"]["held_bytes"]
    return held


def _load(api: str, c: CacheClient, keys: list[str], size: int = SIZE) -> list[bytes]:
    """Load ``keys`` through one of the client's shared-memory load APIs; the bytes of each loaded."""
    if api == "views":
        leases = c.load_views(NS, keys, timeout=30)
        try:
            return [bytes(lease.view) for lease in leases]
        finally:
            for lease in leases:
                lease.release()
    if api == "into":
        bufs = [memoryview(bytearray(size)) for _ in keys]
        got = c.load_into(NS, keys, bufs, timeout=30)
        return [bytes(b) for b in bufs[:got]]
    return c.load(NS, keys, timeout=30)


APIS = ["views", "into", "bytes"]


@pytest.mark.process
@pytest.mark.parametrize("api", APIS)
def test_a_first_load_of_32_resident_blocks_is_one_block_socket_exchange(
    srv: ServerProcess, exchanges: list[bytes], api: str
) -> None:
    keys, payloads = _stored(srv, f"first-{api}", 32)
    exchanges.clear()  # the store's own
    with CacheClient(srv.unix_target, shared_memory=True) as c:  # a fresh engine: nothing mapped
        assert _load(api, c, keys) == payloads
        assert len(exchanges) == 1, [m[:5] for m in exchanges]
        assert exchanges[0].count(b" d_") == 32
        if api != "bytes":
            # Held and kept: the repeated load needs no exchange at all.
            assert _load(api, c, keys) == payloads
            assert len(exchanges) == 1
            maps = c._blocks.maps  # type: ignore[union-attr]
            assert maps is not None
            assert len(maps) == 32
            assert _held_bytes(c) == maps.kept_bytes == 32 * charged(SIZE)


@pytest.mark.process
@pytest.mark.parametrize("api", APIS)
def test_a_load_of_more_blocks_than_one_message_carries_takes_one_exchange_per_64(
    srv: ServerProcess, exchanges: list[bytes], api: str
) -> None:
    n, size = 150, 4096
    keys, payloads = _stored(srv, f"many-{api}", n, size)
    exchanges.clear()
    with CacheClient(srv.unix_target, shared_memory=True) as c:
        assert _load(api, c, keys, size) == payloads
    assert len(exchanges) == math.ceil(n / bp.MAX_NAMES) == 3
    assert [m.count(b" d_") for m in exchanges] == [64, 64, 22]


@pytest.mark.process
def test_a_batch_holds_no_more_than_the_mapping_budget_and_the_books_stay_equal(
    srv: ServerProcess, exchanges: list[bytes]
) -> None:
    keys, payloads = _stored(srv, "budget", 32)
    exchanges.clear()
    per = 10  # blocks the budget takes: a batch makes room for all of its blocks before it asks
    with CacheClient(srv.unix_target, shared_memory=True, mapping_cache_bytes=per * charged(SIZE)) as c:
        assert _load("views", c, keys) == payloads
        assert [m.count(b" d_") for m in exchanges] == [10, 10, 10, 2]
        maps = c._blocks.maps  # type: ignore[union-attr]
        assert maps is not None
        assert maps.kept_bytes <= maps.budget
        assert _held_bytes(c) == maps.kept_bytes


@pytest.mark.process
@pytest.mark.parametrize("api", APIS)
def test_a_block_gone_mid_batch_is_a_miss_from_there_and_what_came_past_it_is_released(
    srv: ServerProcess, monkeypatch: pytest.MonkeyPatch, api: str
) -> None:
    keys, payloads = _stored(srv, f"gone-{api}", 8)
    real = blocks_mod.BlockChannel._exchange
    with (
        CacheClient(srv.unix_target, shared_memory=True) as writer,
        CacheClient(srv.unix_target, shared_memory=True) as c,
    ):

        def delete_first(self: BlockChannel, *args: Any, **kwargs: Any) -> tuple[bytes, list[int]]:
            # Named by ShmLoad, deleted before the block socket is asked: the server cannot lend it.
            if self is c._blocks and writer.delete(NS, keys[3:4], timeout=10) != 1:
                raise AssertionError("key 3 was deleted already")
            monkeypatch.setattr(blocks_mod.BlockChannel, "_exchange", real)
            return real(self, *args, **kwargs)

        baseline = _memfds()
        monkeypatch.setattr(blocks_mod.BlockChannel, "_exchange", delete_first)
        assert _load(api, c, keys) == payloads[:3]
        maps = c._blocks.maps  # type: ignore[union-attr]
        assert maps is not None
        assert _memfds() == baseline + len(maps), "a descriptor fetched past the gone block stayed open"
        if api != "bytes":
            assert {k.key for k in maps._kept.values()} == {f"{NS}/{k}" for k in keys[:3]}
            assert all(k.users == 0 for k in maps._kept.values())
            # The four held past the gone block were released at once (not left for this client's
            # next request, which an idle engine never sends): the server holds what is kept.
            assert c.stats(timeout=10)["tiers"]["dram"]["held_bytes"] == maps.kept_bytes
            assert _held_bytes(c) == maps.kept_bytes == 3 * charged(SIZE)


def _names(srv: ServerProcess, keys: list[str]) -> list[BlockRef]:
    """The blocks a ShmLoad names for ``keys`` (the raw call), with their lengths."""
    with grpc.insecure_channel(srv.unix_target) as ch:
        stub = pb_grpc.CacheStub(ch)  # type: ignore[no-untyped-call]
        call = stub.ShmLoad(pb.LoadRequest(namespace=NS, keys=keys, batch_slots=True), timeout=10)
        return [BlockRef(s.name, s.length, f"{NS}/{k}") for s, k in zip(shm_slots(call), keys, strict=True)]


@pytest.mark.process
@pytest.mark.parametrize("lend", [True, False])
def test_a_batch_failing_half_way_closes_what_it_received_and_leaves_nothing_held_or_lent(
    srv: ServerProcess, monkeypatch: pytest.MonkeyPatch, lend: bool
) -> None:
    keys, payloads = _stored(srv, f"half-{lend}", 8)
    refs = _names(srv, keys)
    refs[5] = refs[5]._replace(length=SIZE + 4096)  # longer than the block: CacheCorrupt when mapped
    inheritable: list[bool] = []
    real_map = blocks_mod._map_block

    def spy(fd: int, length: int, name: str) -> Any:
        inheritable.append(os.get_inheritable(fd))
        return real_map(fd, length, name)

    monkeypatch.setattr(blocks_mod, "_map_block", spy)
    baseline = _memfds()
    with CacheClient(srv.unix_target, shared_memory=True) as c:
        chan = c._blocks
        assert chan is not None
        targets = [memoryview(bytearray(2 * SIZE)) for _ in refs]
        deadline = time.monotonic() + 30
        load: Callable[[], object] = (
            (lambda: chan.borrow_blocks(refs, deadline=deadline))
            if lend
            else (lambda: chan.copy_blocks(refs, targets, deadline=deadline))
        )
        with pytest.raises(errors.CacheCorrupt, match="shorter"):
            load()
        maps = chan.maps
        assert maps is not None
        assert len(maps) == 5
        assert _memfds() == baseline + 5, "a descriptor of the failed batch stayed open"
        assert inheritable == [False] * 6, "a received descriptor was inheritable"
        assert all(k.users == 0 for k in maps._kept.values()), "a lease of the failed load stayed out"
        assert _held_bytes(c) == maps.kept_bytes
        # The same client loads them all afterwards (the first five from their mappings).
        assert _load("views" if lend else "into", c, keys) == payloads


CTRUNC_SCRIPT = textwrap.dedent(
    """
    import os, resource, sys, time
    from kvfabric.client import CacheClient, errors
    target, ns, keys = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    c = CacheClient(target, shared_memory=True)
    c.stats(timeout=10)
    before = len(os.listdir("/proc/self/fd"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (before + 40, hard))
    fillers = []
    while True:
        try:
            fillers.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            break
    for fd in fillers[-8:]:  # eight free: fewer than the batch's 32 descriptors
        os.close(fd)
    del fillers[-8:]
    try:
        c.load_views(ns, keys, timeout=30)
        print("loaded")
    except errors.CacheUnavailable as exc:
        print("unavailable", "no descriptors left" in str(exc))
    memfds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            memfds += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        except OSError:
            pass
    for fd in fillers:
        os.close(fd)
    leases = c.load_views(ns, keys, timeout=30)
    print(memfds, len(leases))
    """
)


@pytest.mark.process
def test_a_batch_the_kernel_truncates_is_unavailable_and_leaks_nothing(srv: ServerProcess) -> None:
    keys, _ = _stored(srv, "ctrunc", 32)
    out = subprocess.run(
        [sys.executable, "-c", CTRUNC_SCRIPT, srv.unix_target, NS, ",".join(keys)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert first == "unavailable True"
    assert second == "0 32", "descriptors of the truncated batch stayed open, or the next load failed"


@pytest.mark.unit
def test_a_batch_to_a_hung_server_is_one_request_and_times_out_at_the_deadline() -> None:
    with temp_dir() as work:
        path = work / "b.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(str(path))
        listener.listen(1)
        got: list[bytes] = []
        done = threading.Event()

        def hang() -> None:
            conn, _ = listener.accept()
            got.append(conn.recv(bp.MAX_MESSAGE))
            done.wait(30)  # never answers
            conn.close()

        server = threading.Thread(target=hang)
        server.start()
        refs = [BlockRef(f"d_{i:032x}", 4096, f"k{i}") for i in range(32)]
        chan = BlockChannel(path, mapping_budget=1 << 20)
        start = time.monotonic()
        try:
            with pytest.raises(errors.CacheTimeout):
                chan.borrow_blocks(refs, deadline=start + 0.5)
            took = time.monotonic() - start
        finally:
            done.set()
            server.join(10)
            chan.close()
            listener.close()
        assert took < 5
        assert len(got) == 1
        assert got[0].startswith(bp.HOLD_PREFIX)
        assert [n.decode() for n in got[0].split()[1:]] == [r.name for r in refs]


@pytest.mark.unit
def test_a_batch_to_a_server_that_knows_no_holds_is_fetched_the_plain_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvfabric.cacheserver.transport import blocksock

    blocks = {f"d_{i:032x}": os.memfd_create(f"b{i}", os.MFD_CLOEXEC) for i in range(6)}
    for i, fd in enumerate(blocks.values()):
        os.write(fd, bytes([i]) * 5000)
    gone = f"d_{4:032x}"
    real_parse = bp.parse_request
    sent: list[bytes] = []

    def older(raw: bytes) -> bp.Request | None:  # a server before KVBH1: a hold request is malformed
        sent.append(raw)
        return None if raw.startswith(bp.HOLD_PREFIX) else real_parse(raw)

    monkeypatch.setattr(bp, "parse_request", older)
    with temp_dir() as work:
        sock = blocksock.BlockSocket(
            work / "b.sock", lambda name: None if name == gone else (os.dup(blocks[name]), 5000)
        )
        sock.start()
        try:
            chan = BlockChannel(sock.path, mapping_budget=1 << 20)
            refs = [BlockRef(name, 5000) for name in blocks]
            targets = [memoryview(bytearray(5000)) for _ in refs]
            assert chan.copy_blocks(refs, targets, deadline=time.monotonic() + 10) == 4
            assert [bytes(t) for t in targets[:4]] == [bytes([i]) * 5000 for i in range(4)]
            assert chan.maps is None
            # One hold request (refused), then one plain request for all six.
            assert [m[:5] for m in sent] == [bp.HOLD_PREFIX, bp.REQUEST_PREFIX]
            assert sent[1].count(b" d_") == 6
            chan.close()
        finally:
            sock.close()
            for fd in blocks.values():
                os.close(fd)
