"""Hostile and broken input against a real server: clear errors, and the server keeps serving."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfabric.client import CacheClient
from kvfabric.rpc.v1 import cache_pb2 as pb
from kvfabric.rpc.v1 import cache_pb2_grpc as pb_grpc
from kvfabric.testing.serverproc import MiB, ServerProcess, cache_server, digest, payload_for

pytestmark = [pytest.mark.process, pytest.mark.slow]

METHODS = (
    "Lookup", "Load", "Store", "ShmLoad", "ShmStoreBegin", "ShmStoreCommit", "Delete", "Stats", "Describe",
)  # fmt: skip


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProcess]:
    with cache_server(dram_bytes=16 * MiB, overrides={"limits.max_payload_bytes": 1 * MiB}) as s:
        yield s


def _stub(target: str) -> tuple[grpc.Channel, Any]:
    ch = grpc.insecure_channel(target)
    return ch, pb_grpc.CacheStub(ch)  # type: ignore[no-untyped-call]


def _rpc_error(call: Callable[[], object]) -> grpc.RpcError | None:
    try:
        call()
    except grpc.RpcError as exc:
        return exc
    return None


def _serving(srv: ServerProcess) -> bool:
    with CacheClient(srv.unix_target) as c, CacheClient(srv.tcp_target) as r:
        return c.health(timeout=10) and r.health(timeout=10)


BAD_KEYS = [
    "../../../../etc/passwd",
    "../" * 21 + "a",  # 64 characters of path traversal
    "a" * 63,
    "a" * 65,
    "A" * 64,  # upper case
    "g" * 64,  # not hex
    "",
    "0" * 62 + "/x",
    "\x00" * 64,
]


def _calls(stub: Any, namespace: str, keys: list[str]) -> list[Callable[[], object]]:
    return [
        lambda: stub.Lookup(pb.LookupRequest(namespace=namespace, keys=keys), timeout=5),
        lambda: list(stub.ShmLoad(pb.LoadRequest(namespace=namespace, keys=keys), timeout=5)),
        lambda: list(stub.Load(pb.LoadRequest(namespace=namespace, keys=keys), timeout=5)),
        lambda: stub.Delete(pb.DeleteRequest(namespace=namespace, keys=keys), timeout=5),
        lambda: stub.ShmStoreBegin(
            pb.ShmStoreBeginRequest(namespace=namespace, keys=keys, lengths=[1]), timeout=5
        ),
        lambda: stub.Store(
            iter([pb.StoreChunk(namespace=namespace, key=keys[0], total_length=1, data=b"x")]), timeout=5
        ),
    ]


@pytest.mark.parametrize("bad", BAD_KEYS)
def test_bad_keys_and_namespaces_are_invalid_argument(srv: ServerProcess, bad: str) -> None:
    ns = digest("ns")
    ch, stub = _stub(srv.unix_target)
    with ch:
        for namespace, keys in ((ns, [bad]), (bad, [digest("k")])):
            for call in _calls(stub, namespace, keys):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                details = err.value.details() or ""
                # An empty key in a store stream means "continuation": reported as such.
                assert "64 lower-case hex" in details or (bad == "" and "carry a key" in details)
    # Nothing outside the server's directories was created or touched, and it still serves.
    assert _serving(srv)


def test_oversized_payloads_are_rejected(srv: ServerProcess) -> None:
    ns, key = digest("ns"), digest("big")
    with CacheClient(srv.tcp_target) as r, CacheClient(srv.unix_target, shared_memory=True) as c:
        from kvfabric.client.errors import InvalidRequest

        for client in (r, c):
            with pytest.raises(InvalidRequest, match="max_payload_bytes"):
                client.store(ns, [key], [b"x" * (2 * MiB)], timeout=10)
        assert c.lookup(ns, [key], timeout=5).matched == 0
    assert _serving(srv)


def test_truncated_and_malformed_store_streams(srv: ServerProcess) -> None:
    ns, k1, k2 = digest("ns"), digest("t1"), digest("t2")
    ch, stub = _stub(srv.tcp_target)
    cases = {
        "truncated stream": [pb.StoreChunk(namespace=ns, key=k1, total_length=1000, data=b"x" * 500)],
        "truncated stream: key": [
            pb.StoreChunk(namespace=ns, key=k1, total_length=10, data=b"x" * 5),
            pb.StoreChunk(key=k2, total_length=1, data=b"y"),
        ],
        "more data than total_length": [pb.StoreChunk(namespace=ns, key=k1, total_length=1, data=b"xx")],
        "first store message must carry a key": [pb.StoreChunk(namespace=ns, data=b"x")],
        "namespace changed": [
            pb.StoreChunk(namespace=ns, key=k1, total_length=1, data=b"x"),
            pb.StoreChunk(namespace=digest("other"), key=k2, total_length=1, data=b"y"),
        ],
    }
    with ch:
        for expected, msgs in cases.items():
            with pytest.raises(grpc.RpcError) as err:
                stub.Store(iter(msgs), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, expected
            assert expected in (err.value.details() or ""), expected
        # A client that disappears mid-stream: cancel after the first piece.
        fut = stub.Store.future(
            iter([pb.StoreChunk(namespace=ns, key=k2, total_length=10 * MiB, data=b"z" * MiB)]), timeout=5
        )
        fut.cancel()
        lookups = stub.Lookup(pb.LookupRequest(namespace=ns, keys=[k2]), timeout=5)
        assert lookups.matched == 0, "half a payload is never stored"
    assert _serving(srv)


def test_shm_calls_are_refused_on_tcp_and_lengths_must_match(srv: ServerProcess) -> None:
    ns, key = digest("ns"), digest("k")
    ch, stub = _stub(srv.tcp_target)
    with ch:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ShmLoad(pb.LoadRequest(namespace=ns, keys=[key]), timeout=5))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    ch, stub = _stub(srv.unix_target)
    with ch:
        with pytest.raises(grpc.RpcError) as err:
            stub.ShmStoreBegin(pb.ShmStoreBeginRequest(namespace=ns, keys=[key], lengths=[]), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            stub.ShmStoreCommit(pb.ShmStoreCommitRequest(lease_id="../../x"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_too_many_keys(srv: ServerProcess) -> None:
    ns = digest("ns")
    ch, stub = _stub(srv.unix_target)
    with ch, pytest.raises(grpc.RpcError) as err:
        stub.Lookup(pb.LookupRequest(namespace=ns, keys=[digest(i) for i in range(5000)]), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_keys_per_request" in (err.value.details() or "")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=4096), method=st.sampled_from(METHODS), tcp=st.booleans())
def test_fuzz_random_message_bodies(srv: ServerProcess, data: bytes, method: str, tcp: bool) -> None:
    target = srv.tcp_target if tcp else srv.unix_target
    with grpc.insecure_channel(target) as ch:
        path = f"/kvfabric.rpc.v1.Cache/{method}"
        call: Callable[[], object]
        if method == "Store":
            call = lambda: ch.stream_unary(path)(iter([data, data]), timeout=5)  # type: ignore[arg-type]  # noqa: E731
        elif method in ("Load", "ShmLoad"):
            call = lambda: list(ch.unary_stream(path)(data, timeout=5))  # type: ignore[arg-type]  # noqa: E731
        else:
            call = lambda: ch.unary_unary(path)(data, timeout=5)  # type: ignore[arg-type]  # noqa: E731
        error = _rpc_error(call)
        if error is not None:
            # Every failure is a status with a message, never a hang or a crash.
            assert error.code() in {
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.FAILED_PRECONDITION,
            }, error
            assert error.details()
    assert srv.proc is not None
    assert srv.proc.poll() is None


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(min_size=1, max_size=8192), tcp=st.booleans())
def test_fuzz_random_bytes_on_both_listeners(srv: ServerProcess, data: bytes, tcp: bool) -> None:
    if tcp:
        s = socket.create_connection(("127.0.0.1", srv.config.listen.tcp_port or 0), timeout=5)
    else:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(str(srv.config.listen.unix_socket))
    with s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        except OSError:
            pass  # the server may reset the connection: that is a fine answer to garbage
    assert srv.proc is not None
    assert srv.proc.poll() is None


def test_still_serving_after_the_fuzzing(srv: ServerProcess) -> None:
    ns, key = digest("ns"), digest("after")
    with CacheClient(srv.unix_target, shared_memory=True) as c:
        assert c.store(ns, [key], [payload_for(key, 1000)], timeout=10).accepted == 1
        assert c.load(ns, [key], timeout=10) == [payload_for(key, 1000)]
    assert _serving(srv)
