"""Slow and stalled clients cannot starve others: per-peer slot shares and server-side deadlines.

Real server processes, real gRPC streams. The attacker opens many Store streams that send one piece
and then trickle nothing, and many Loads whose responses it never reads, without any deadline of
its own; a well-behaved client must still store and load within its deadline.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest

from kvfabric.client import CacheClient
from kvfabric.client.errors import CacheError
from kvfabric.rpc.v1 import cache_pb2 as pb
from kvfabric.rpc.v1 import cache_pb2_grpc as pb_grpc
from kvfabric.testing.serverproc import MiB, cache_server, digest, payload_for, wait_until

pytestmark = pytest.mark.process

NS = digest("starvation")


def test_a_slow_loris_client_does_not_make_a_well_behaved_client_miss_its_deadline() -> None:
    limits = {"limits.max_concurrent_loads": 4, "limits.max_concurrent_stores": 4}
    big = digest("big")
    with (
        cache_server(dram_bytes=128 * MiB, overrides=limits) as srv,
        CacheClient(srv.unix_target, shared_memory=True) as seed,
    ):
        assert seed.store(NS, [big], [payload_for(big, 64 * MiB)], timeout=60).accepted == 1
        release = threading.Event()

        def trickle(i: int) -> Iterator[pb.StoreChunk]:
            yield pb.StoreChunk(namespace=NS, key=digest("slow", i), total_length=2, data=b"a")
            release.wait(120)

        channel = grpc.insecure_channel(srv.tcp_target)
        stub = pb_grpc.CacheStub(channel)  # type: ignore[no-untyped-call]
        try:
            # No client deadline at all: only the server bounds these calls.
            stores = [stub.Store.future(trickle(i)) for i in range(8)]
            loads = [stub.Load(pb.LoadRequest(namespace=NS, keys=[big])) for _ in range(8)]
            codes = []
            for stalled in loads:
                try:
                    next(stalled)  # one piece, then never read again: flow control stalls the server
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.append(exc.code())
            # One TCP peer holds at most a quarter of the load slots; its other loads are refused.
            assert sorted(c.name for c in codes) == ["OK"] + ["RESOURCE_EXHAUSTED"] * 7
            keys = [digest("good", i) for i in range(3)]
            payloads = [payload_for(k, 3 * MiB) for k in keys]
            # Well-behaved clients on both paths: shared memory and gRPC streams over the socket.
            with CacheClient(srv.unix_target) as streams:
                for good in (seed, streams):
                    assert good.store(NS, keys, payloads, timeout=10).accepted == 3
                    assert good.load(NS, keys, timeout=10) == payloads
                    assert good.load(NS, [big], timeout=30) == [payload_for(big, 64 * MiB)]
                    assert good.lookup(NS, [*keys, big], timeout=5).matched == 4
        finally:
            release.set()
            for stalled in loads:
                stalled.cancel()
            for f in stores:
                f.cancel()
            channel.close()


def test_on_the_unix_socket_one_stuck_client_holds_only_its_share_of_the_load_slots() -> None:
    """gRPC shows every Unix-socket peer alike, so kvfabric's client names itself (``kvfabric-client``
    metadata, one id per client object) and the per-client cap applies there too: a client whose
    loads stall holds a quarter of the slots, and another client on the same socket is served."""
    limits = {"limits.max_concurrent_loads": 4, "limits.max_concurrent_stores": 4}
    big = digest("big-unix")
    with (
        cache_server(dram_bytes=128 * MiB, overrides=limits) as srv,
        CacheClient(srv.unix_target) as good,
    ):
        assert good.store(NS, [big], [payload_for(big, 64 * MiB)], timeout=60).accepted == 1
        channel = grpc.insecure_channel(srv.unix_target)
        stub = pb_grpc.CacheStub(channel)  # type: ignore[no-untyped-call]
        stuck = (("kvfabric-client", "stuck-engine"),)
        loads = [stub.Load(pb.LoadRequest(namespace=NS, keys=[big]), metadata=stuck) for _ in range(6)]
        try:
            codes = []
            for stalled in loads:
                try:
                    next(stalled)  # one piece, then never read again
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.append(exc.code())
            assert sorted(c.name for c in codes) == ["OK"] + ["RESOURCE_EXHAUSTED"] * 5
            # Another client object on the same socket has its own share and is served in full.
            assert good.load(NS, [big], timeout=30) == [payload_for(big, 64 * MiB)]
            assert good.lookup(NS, [big], timeout=5).matched == 1
        finally:
            for stalled in loads:
                stalled.cancel()
            channel.close()


def test_the_server_ends_a_trickling_store_that_set_no_deadline() -> None:
    with cache_server(dram_bytes=16 * MiB, overrides={"limits.max_call_seconds": 1.0}) as srv:
        release = threading.Event()

        def trickle() -> Iterator[pb.StoreChunk]:
            yield pb.StoreChunk(namespace=NS, key=digest("trickle"), total_length=2, data=b"a")
            release.wait(120)

        with grpc.insecure_channel(srv.tcp_target) as channel:
            stub = pb_grpc.CacheStub(channel)  # type: ignore[no-untyped-call]
            call = stub.Store.future(trickle())  # no client deadline
            try:
                with pytest.raises(grpc.RpcError) as err:
                    call.result(timeout=60)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert "server-side deadline" in (err.value.details() or "")
            finally:
                release.set()
        # The slot came back: a store is accepted again.
        with CacheClient(srv.unix_target) as c:
            assert c.store(NS, [digest("after")], [b"x"], timeout=10).accepted == 1


def test_the_server_ends_a_load_whose_reader_stopped_reading_and_set_no_deadline() -> None:
    """A Load read once and then never again, with no client deadline, holds the only load slot.

    Flow control blocks the server's writes; the server-side deadline (here 1 s) ends the stream
    and frees the slot, so a well-behaved client waiting for it still loads within its deadline.
    Before the bound covered the writes, the stalled stream held the slot until its client went
    away, and the well-behaved load failed with "no load slot free before the deadline".
    """
    overrides = {"limits.max_call_seconds": 1.0, "limits.max_concurrent_loads": 1}
    big = digest("stalled-load")
    with (
        cache_server(dram_bytes=128 * MiB, overrides=overrides) as srv,
        CacheClient(srv.unix_target, shared_memory=True) as good,
    ):
        assert good.store(NS, [big], [payload_for(big, 32 * MiB)], timeout=60).accepted == 1
        with grpc.insecure_channel(srv.tcp_target) as channel:
            stub = pb_grpc.CacheStub(channel)  # type: ignore[no-untyped-call]
            stalled = stub.Load(pb.LoadRequest(namespace=NS, keys=[big]))  # no client deadline
            try:
                next(stalled)  # one piece, then never read again
                # The only load slot is the stalled stream's until the server ends it.
                assert good.load(NS, [big], timeout=20) == [payload_for(big, 32 * MiB)]
                with pytest.raises(grpc.RpcError) as err:
                    for _ in stalled:  # drain what was buffered: the stream ends in the error
                        pass
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert "server-side deadline" in (err.value.details() or "")
            finally:
                stalled.cancel()


def test_the_server_ends_a_shared_memory_load_stuck_on_a_hung_disk_and_frees_its_slot() -> None:
    """A ShmLoad whose promotion hangs on the disk, with no client deadline, holds the only load slot.

    The local disk is made to hang for 6 s per block read (its configured fault hook); the
    server-side deadline (1 s) ends the stuck stream with DEADLINE_EXCEEDED and frees the slot, so a
    well-behaved same-node load of a DRAM block still succeeds within its 4 s deadline. Without the
    bound the stuck stream kept the slot until the read returned, and that load failed with "no load
    slot free before the deadline".
    """
    overrides = {
        "limits.max_call_seconds": 1.0,
        "limits.max_concurrent_loads": 1,
        "tiers.local_disk.faults": {"read_delay_seconds": 6.0},
    }
    on_disk, in_dram = digest("hung-disk"), digest("in-dram")
    with cache_server(dram_bytes=64 * MiB, local_disk_bytes=256 * MiB, overrides=overrides) as srv:
        with CacheClient(srv.unix_target, shared_memory=True) as c:
            assert c.store(NS, [on_disk], [payload_for(on_disk, 1 * MiB)], timeout=30).accepted == 1
            assert c.flush(NS, [on_disk], timeout=30).complete
        srv.restart()  # DRAM is gone; the block is on the (now hanging) local disk only
        with CacheClient(srv.unix_target, shared_memory=True) as good:
            assert good.store(NS, [in_dram], [payload_for(in_dram, 1 * MiB)], timeout=30).accepted == 1
            with grpc.insecure_channel(srv.unix_target) as channel:
                stub = pb_grpc.CacheStub(channel)  # type: ignore[no-untyped-call]
                stuck = stub.ShmLoad(pb.LoadRequest(namespace=NS, keys=[on_disk]))  # no client deadline
                try:

                    def slot_taken() -> bool:
                        try:
                            good.load(NS, [in_dram], timeout=0.2)
                        except CacheError:
                            return True
                        return False

                    # Precondition: the stuck stream holds the only slot (a short load cannot get it).
                    wait_until(slot_taken, timeout=5, interval=0.01, what="the stuck load to hold the slot")
                    assert good.load(NS, [in_dram], timeout=4) == [payload_for(in_dram, 1 * MiB)]
                    with pytest.raises(grpc.RpcError) as err:
                        list(stuck)
                    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                    assert "server-side deadline" in (err.value.details() or "")
                finally:
                    stuck.cancel()
