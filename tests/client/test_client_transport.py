"""The transport client against real server processes: both transports, typed errors, auth, asyncio."""

from __future__ import annotations

import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfabric.client import AsyncCacheClient, CacheClient, FlushResult, LookupResult, StoreResult
from kvfabric.client.errors import (
    CacheTimeout,
    CacheUnavailable,
    InvalidRequest,
    PermissionDenied,
)
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, payload_for, wait_until

pytestmark = pytest.mark.process  # real processes (test level, see kvfabric.testing.levels)

NS = digest("client-ns")


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProcess]:
    with cache_server(dram_bytes=64 * MiB) as s:
        yield s


@pytest.fixture(scope="module")
def slow_disk_srv() -> Iterator[ServerProcess]:
    """A server whose local-disk write-backs sleep 2 s before committing (its fault hook)."""
    slow = {
        "tiers.local_disk.faults": {"write_delay_seconds": 2.0},
        "tiers.local_disk.min_free_fraction": 0.0,
    }
    with cache_server(dram_bytes=64 * MiB, overrides=slow) as s:
        yield s


def _writebacks_done(c: CacheClient) -> None:
    wait_until(lambda: c.stats(timeout=5)["writeback_pending_bytes"] == 0, what="write-backs finished")


@pytest.mark.parametrize("disk", ["settled", "racing"])
def test_round_trip_over_shm_and_grpc_streams(disk: str, request: pytest.FixtureRequest) -> None:
    # The delete below must give the same answers whether the local-disk write-backs of the keys
    # finished before it ("settled": the deleted key is on disk too) or are still queued or asleep
    # in the disk's commit delay ("racing"); and the same again once those write-backs are done.
    srv: ServerProcess = request.getfixturevalue("srv" if disk == "settled" else "slow_disk_srv")
    keys = [digest("rt", i) for i in range(4)]
    # 9 MiB + 1 crosses several 4 MiB stream pieces; 0 bytes is a legal (if odd) payload.
    payloads = [payload_for(keys[0], 9 * MiB + 1), b"", payload_for(keys[2], 4096), payload_for(keys[3], 1)]
    with CacheClient(srv.unix_target, shared_memory=True) as shm, CacheClient(srv.tcp_target) as tcp:
        assert shm.uses_shm
        assert not tcp.uses_shm
        assert shm.store(NS, keys[:2], payloads[:2], timeout=10) == StoreResult(accepted=2, dropped=0)
        assert tcp.store(NS, keys[2:], [memoryview(p) for p in payloads[2:]], timeout=10) == StoreResult(2, 0)
        # Storing again is accepted (already present), not dropped.
        assert shm.store(NS, keys[:1], payloads[:1], timeout=10) == StoreResult(1, 0)
        assert shm.lookup(NS, keys, timeout=5) == LookupResult(4, ["dram"] * 4)
        for c in (shm, tcp):
            assert c.load(NS, keys, timeout=10) == payloads
            bufs = [memoryview(bytearray(len(p) + 10)) for p in payloads]
            assert c.load_into(NS, keys, bufs, timeout=10) == 4
            assert all(bytes(b[: len(p)]) == p for b, p in zip(bufs, payloads, strict=True))
        # Leading keys only: a miss in the middle stops the answer there.
        gap = [keys[0], digest("missing"), keys[2]]
        assert shm.lookup(NS, gap, timeout=5).matched == 1
        assert shm.load(NS, gap, timeout=10) == payloads[:1]
        assert tcp.load(NS, gap, timeout=10) == payloads[:1]
        if disk == "settled":
            _writebacks_done(tcp)
            assert tcp.lookup(NS, keys, timeout=5).tiers == ["dram"] * 4
        assert shm.delete(NS, keys[3:], timeout=5) == 1
        assert tcp.lookup(NS, keys, timeout=5).matched == 3
        _writebacks_done(tcp)
        # A write-back that was still in flight never brings the deleted key back.
        for c in (shm, tcp):
            assert c.lookup(NS, keys, timeout=5).matched == 3
            assert c.load(NS, keys, timeout=10) == payloads[:3]
        stats = tcp.stats(timeout=5)
        assert stats["tiers"]["dram"]["blocks"] >= 3
        assert shm.health(timeout=5)
        assert tcp.health(timeout=5)


def test_client_side_validation_is_invalid_request() -> None:
    c = CacheClient("unix:///nonexistent/x.sock")
    with pytest.raises(InvalidRequest):
        c.lookup("NOT-HEX", [], timeout=1)
    with pytest.raises(InvalidRequest):
        c.lookup(NS, ["../etc/passwd"], timeout=1)
    with pytest.raises(InvalidRequest):
        c.store(NS, [digest(1)], [], timeout=1)
    with pytest.raises(InvalidRequest):
        c.lookup(NS, [], timeout=0)
    with pytest.raises(InvalidRequest):
        CacheClient("unix:relative.sock")
    c.close()


def test_load_into_too_small_buffer(srv: ServerProcess) -> None:
    key = digest("small-buf")
    with CacheClient(srv.unix_target, shared_memory=True) as c:
        c.store(NS, [key], [b"x" * 1000], timeout=5)
        with pytest.raises(InvalidRequest):
            c.load_into(NS, [key], [memoryview(bytearray(10))], timeout=5)


def test_unreachable_server_is_unavailable(tmp_path: Path) -> None:
    with CacheClient(f"unix://{tmp_path}/none.sock") as c:
        with pytest.raises(CacheUnavailable):
            c.lookup(NS, [digest(1)], timeout=2)
        assert c.health(timeout=1) is False


def test_silent_server_is_a_timeout() -> None:
    # A TCP listener that accepts and never speaks: the deadline, not a hang, ends the call.
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        lsock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(lsock.accept()[0])
            except TimeoutError:
                continue

    t = threading.Thread(target=accept)
    t.start()
    try:
        with CacheClient(f"127.0.0.1:{lsock.getsockname()[1]}") as c, pytest.raises(CacheTimeout):
            c.lookup(NS, [digest(1)], timeout=0.5)
    finally:
        stop.set()
        t.join()
        for s in held:
            s.close()
        lsock.close()


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "tls.crt", tmp / "tls.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def test_tcp_with_tls_and_bearer_token(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    overrides = {
        "listen.token_file": str(token_file),
        "listen.tls": {"cert_file": str(cert), "key_file": str(key)},
    }
    k = digest("tls")
    with cache_server(dram_bytes=16 * MiB, overrides=overrides) as s:
        target = f"localhost:{s.config.listen.tcp_port}"
        with CacheClient(target, token="s3cret-token", tls_ca=cert) as ok:
            assert ok.store(NS, [k], [b"payload"], timeout=10).accepted == 1
            assert ok.load(NS, [k], timeout=10) == [b"payload"]
        with CacheClient(target, token="wrong", tls_ca=cert) as bad, pytest.raises(PermissionDenied):
            bad.lookup(NS, [k], timeout=10)
        with CacheClient(target, tls_ca=cert) as anonymous, pytest.raises(PermissionDenied):
            anonymous.lookup(NS, [k], timeout=10)
        # The Unix socket needs no token (file permissions guard it).
        with CacheClient(s.unix_target) as local:
            assert local.lookup(NS, [k], timeout=5).matched == 1


@pytest.mark.asyncio
async def test_async_client_round_trip(srv: ServerProcess) -> None:
    keys = [digest("async", i) for i in range(3)]
    payloads = [payload_for(k, 3 * MiB + 7) for k in keys]
    async with (
        AsyncCacheClient(srv.unix_target, shared_memory=True) as shm,
        AsyncCacheClient(srv.tcp_target) as tcp,
    ):
        assert await shm.store(NS, keys[:2], payloads[:2], timeout=10) == StoreResult(2, 0)
        assert await tcp.store(NS, keys[2:], payloads[2:], timeout=10) == StoreResult(1, 0)
        for c in (shm, tcp):
            res = await c.lookup(NS, keys, timeout=5)
            assert res.matched == 3
            assert await c.load(NS, keys, timeout=10) == payloads
            bufs = [memoryview(bytearray(len(p))) for p in payloads]
            assert await c.load_into(NS, keys, bufs, timeout=10) == 3
            assert [bytes(b) for b in bufs] == payloads
            assert await c.health(timeout=5)
            assert "tiers" in await c.stats(timeout=5)
        assert await tcp.delete(NS, keys, timeout=5) == 3
        with pytest.raises(InvalidRequest):
            await tcp.lookup(NS, ["x"], timeout=5)


@pytest.fixture(scope="module")
def disk_srv() -> Iterator[ServerProcess]:
    """A server whose local disk tier writes whatever the shared machine's filesystem has free."""
    with cache_server(dram_bytes=64 * MiB, overrides={"tiers.local_disk.min_free_fraction": 0.0}) as s:
        yield s


def test_flush_says_which_tiers_hold_keys_durably_over_both_transports(disk_srv: ServerProcess) -> None:
    srv = disk_srv
    keys = [digest("client-flush", i) for i in range(3)]
    absent = digest("client-flush", "never stored")
    with CacheClient(srv.unix_target, shared_memory=True) as shm, CacheClient(srv.tcp_target) as tcp:
        assert (
            shm.store(NS, keys[:2], [payload_for(k, 70 * 1024) for k in keys[:2]], timeout=10).accepted == 2
        )
        assert tcp.store(NS, keys[2:], [payload_for(keys[2], 5)], timeout=10).accepted == 1
        for c in (shm, tcp):
            # Durable means written back: the local disk tier, not DRAM; a key never stored holds nowhere.
            assert c.flush(NS, [*keys, absent], timeout=30) == FlushResult([["local_disk"]] * 3 + [[]], True)
        assert tcp.flush(NS, [], timeout=5) == FlushResult([], True)
        with pytest.raises(InvalidRequest):
            tcp.flush(NS, ["not a digest"], timeout=5)
        with pytest.raises(InvalidRequest):
            tcp.flush(NS, keys, timeout=0)
        assert tcp.delete(NS, keys, timeout=5) == 3
        assert shm.flush(NS, keys, timeout=30) == FlushResult([[]] * 3, True), "deleted: durable nowhere"


@pytest.mark.asyncio
async def test_async_client_flush(disk_srv: ServerProcess) -> None:
    key = digest("async-flush")
    async with AsyncCacheClient(disk_srv.tcp_target) as tcp:
        assert await tcp.store(NS, [key], [payload_for(key, 4096)], timeout=10) == StoreResult(1, 0)
        assert await tcp.flush(NS, [key], timeout=30) == FlushResult([["local_disk"]], True)


def test_load_into_any_contiguous_buffer_shape(srv: ServerProcess) -> None:
    import array

    key = digest("shapes")
    payload = payload_for(key, 4096)
    with CacheClient(srv.unix_target, shared_memory=True) as shm, CacheClient(srv.tcp_target) as tcp:
        shm.store(NS, [key], [payload], timeout=10)
        for c in (shm, tcp):
            floats = array.array("f", [0.0]) * 1024  # 4096 bytes as float32
            grid = memoryview(bytearray(4096)).cast("B", shape=[64, 64])
            assert c.load_into(NS, [key], [memoryview(floats)], timeout=10) == 1
            assert floats.tobytes() == payload
            assert c.load_into(NS, [key], [grid], timeout=10) == 1
            assert grid.tobytes() == payload
            with pytest.raises(InvalidRequest, match="writable"):
                c.load_into(NS, [key], [memoryview(bytes(4096))], timeout=10)
