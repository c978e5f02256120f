"""The gRPC servicer: translates messages to engine calls and engine outcomes to status codes.

Backpressure lives here: loads and stores have separate thread pools and separate concurrency limits,
so a load never waits behind a store. A load waits for a slot until its deadline; a store that finds no
free slot is dropped at once and counted (a dropped store costs a future recompute, never correctness).
"""

from __future__ import annotations

# Method names are the RPC names of the generated servicer.
# ruff: noqa: N802
import asyncio
import contextlib
import json
import logging
import os
import queue
import re
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NoReturn, TypeVar, cast

import grpc
import grpc.aio
from google.protobuf.message import DecodeError, Message

from kvfabric.cacheserver.config import LimitsConfig
from kvfabric.cacheserver.engine.base import TierName
from kvfabric.cacheserver.engine.dram import DramBlock
from kvfabric.cacheserver.engine.ids import BlockId, InvalidId, parse_ids
from kvfabric.cacheserver.engine.tiered import HandingOver, Payload, TieredStore
from kvfabric.cacheserver.metrics import Metrics
from kvfabric.cacheserver.transport.arena import BeginResult, StagingArena, UnknownLease
from kvfabric.cacheserver.transport.blocksock import StoreAnswer, StoreHandler
from kvfabric.contract.namespace import InvalidDescriptionError, parse_description, readable
from kvfabric.rpc import CLIENT_ID_HEADER
from kvfabric.rpc import blockproto as bp
from kvfabric.rpc.v1 import cache_pb2 as pb
from kvfabric.rpc.v1 import cache_pb2_grpc as pb_grpc

__all__ = ["CacheService", "SharedState", "StoreRefused", "add_to_server", "block_stores"]

T = TypeVar("T")
# TierName.X is proto TIER_X: one list of names (a missing proto value fails here, at import).
_TIER_ENUM: dict[TierName, pb.Tier] = {
    name: cast("pb.Tier", pb.Tier.Value(f"TIER_{name.name}")) for name in TierName
}
# 1-2 MiB messages measured fastest through grpcio (per-message overhead vs. large-buffer copies).
_DEFAULT_PIECE = 1 << 20
_MIN_PIECE, _MAX_PIECE = 64 << 10, 64 << 20
# Disk promotions in flight per ShmLoad are max(this, limits.io_threads) (4 by default): at least two
# keep the disk busy while the previous block is hashed.
_PROMOTE_WINDOW = 2
_SLOTS_PER_MESSAGE = 256
"""Resident blocks named in one ShmLoad message (about 50 bytes each)."""


def _started_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A pool of ``workers`` threads, all started now, not when work first finds none idle.

    A worker frees its idle permit only after its job's result is set, so a request answered by one
    job and followed at once by the next (a store's begin, then its commit) can find no idle worker
    and ask for a new thread: in a pod at its pids limit that fails, and the request with it.
    Started at start-up, the pool never asks again. (A limit already reached at start-up leaves the
    rest to be started lazily, as before.)
    """
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
    # One party per thread the pool may start: each job holds its thread until all have started.
    ready = threading.Barrier(workers + 1)
    try:
        for _ in range(workers):
            pool.submit(ready.wait, 10)
        ready.wait(10)
    except (RuntimeError, threading.BrokenBarrierError):
        ready.abort()
    return pool


class SharedState:
    """What both listeners' servicers share: the store, the arena, pools, limits and metrics."""

    def __init__(
        self, store: TieredStore, arena: StagingArena, metrics: Metrics, limits: LimitsConfig
    ) -> None:
        self.store = store
        self.arena = arena
        self.metrics = metrics
        self.limits = limits
        # All threads started now: a load's promotion right after another's, a store's commit right
        # after its begin, never ask for a thread at the pod's pids limit.
        self.load_pool = _started_pool(limits.io_threads, "load")
        self.store_pool = _started_pool(limits.max_concurrent_stores, "store")
        self.load_slots = asyncio.Semaphore(limits.max_concurrent_loads)
        self.store_inflight = 0
        self._slot_lock = threading.Lock()
        # (peer address, "load" | "store") -> slots held (or waited for) by that TCP peer
        self.peer_slots: dict[tuple[str, str], int] = {}

    def peer_cap(self, kind: str) -> int:
        """Slots of ``kind`` one TCP peer may hold at once."""
        if self.limits.max_slots_per_peer is not None:
            return self.limits.max_slots_per_peer
        total = self.limits.max_concurrent_loads if kind == "load" else self.limits.max_concurrent_stores
        return max(1, total // 4)

    def enter_peer(self, peer: str | None, kind: str) -> bool:
        """Count a slot of ``peer`` (None: a Unix-socket client, not counted); False at its cap."""
        if peer is None:
            return True
        held = self.peer_slots.get((peer, kind), 0)
        if held >= self.peer_cap(kind):
            return False
        self.peer_slots[peer, kind] = held + 1
        return True

    def leave_peer(self, peer: str | None, kind: str) -> None:
        """Uncount a slot of ``peer``."""
        if peer is None:
            return
        held = self.peer_slots.get((peer, kind), 1) - 1
        if held > 0:
            self.peer_slots[peer, kind] = held
        else:
            self.peer_slots.pop((peer, kind), None)

    def try_store_slot(self, peer: str | None = None) -> bool:
        """Take a store slot if one is free (never waits: stores are dropped, not queued)."""
        # Under a lock: the block socket's store commits take slots on the store pool's threads.
        with self._slot_lock:
            if self.store_inflight >= self.limits.max_concurrent_stores:
                return False
            if not self.enter_peer(peer, "store"):
                return False
            self.store_inflight += 1
            return True

    def release_store_slot(self, peer: str | None = None) -> None:
        """Give back a store slot."""
        with self._slot_lock:
            self.store_inflight -= 1
            self.leave_peer(peer, "store")

    # --- same-node stores: one implementation for ShmStoreBegin/Commit and the block socket --------

    def shm_begin(
        self, namespace: str, keys: list[str], lengths: list[int]
    ) -> tuple[BeginResult, list[bool], bool]:
        """Check a same-node store's begin and stage what the server can take.

        Returns ``(result, present, described)``: which keys were already stored, and whether the
        namespace is described.

        Runs on a store-pool thread (``holds`` may stat a shared volume; a begin may allocate).
        Raises :class:`StoreRefused` for a request the server refuses, naming what is wrong.
        """
        if len(keys) > self.limits.max_keys_per_request:
            raise StoreRefused(
                f"{len(keys)} keys exceed max_keys_per_request={self.limits.max_keys_per_request}"
            )
        try:
            bids = parse_ids(namespace, keys)
        except InvalidId as exc:
            raise StoreRefused(str(exc)) from exc
        if len(lengths) != len(bids):
            raise StoreRefused(f"{len(bids)} keys but {len(lengths)} lengths")
        too_big = [n for n in lengths if n > self.limits.max_payload_bytes]
        if too_big:
            raise StoreRefused(
                f"payload of {too_big[0]} bytes exceeds max_payload_bytes={self.limits.max_payload_bytes}"
            )
        # Keys already here get no staging: checked against the copies, not only the indexes.
        present = [self.store.holds(b) for b in bids]
        res = self.arena.begin(bids, lengths, present)
        offered = sum(1 for n in res.names if n)
        return res, present, self.metrics.namespaces.count_stores(namespace, offered)

    def shm_commit_slot(self, lease_id: str, *, abort: bool = False) -> tuple[int, int] | None:
        """Take the store slot a same-node commit needs, before it queues for the store pool.

        None: a slot is taken (or none is needed: an abort), call :meth:`shm_commit` with the same
        ``abort``. Else there is none free and the commit is answered now: the whole lease is
        dropped, ``(accepted, dropped)`` as a commit's (stores are dropped under pressure, never
        queued). On the caller's thread (the event loop, the block socket's), without waiting.
        Raises :class:`UnknownLease` for a lease that is not (or no longer) there.
        """
        if abort or self.try_store_slot():
            return None
        # Counted now, its pages freed on a thread of their own: truncating hundreds of MiB takes
        # tens of ms, which the event loop or the block socket's thread (loads) must not wait.
        accepted, dropped = self.arena.abort(lease_id, release=_in_background)
        self.store.counters.inc("dropped_stores", "shm", dropped)
        return accepted, dropped

    def shm_commit(
        self, lease_id: str, *, abort: bool = False, release: Callable[[], None] | None = None
    ) -> tuple[int, int]:
        """Commit (or abort) a same-node store's lease; ``(accepted, dropped)``.

        Runs on a store-pool thread, after :meth:`shm_commit_slot` took a slot for a commit (given
        back here, whatever happens, by ``release`` if given: a guard that gives it back once).
        Raises :class:`UnknownLease` for a lease that is not (or no longer) there.
        """
        t0 = time.perf_counter()
        if abort:
            self.arena.abort(lease_id)
            return 0, 0
        try:
            accepted, dropped, nbytes = self.arena.commit(lease_id, self.store)
        finally:
            (release or self.release_store_slot)()
        self.metrics.bytes_in.add(nbytes, {"transport": "shm"})
        self.metrics.store_duration.record(time.perf_counter() - t0, {"transport": "shm"})
        return accepted, dropped

    def close(self) -> None:
        """Stop the pools."""
        self.load_pool.shutdown(wait=True, cancel_futures=True)
        self.store_pool.shutdown(wait=True, cancel_futures=True)


class StoreRefused(ValueError):  # noqa: N818 - mirrors INVALID_ARGUMENT, as UnknownLease NOT_FOUND
    """A same-node store request the server refuses (INVALID_ARGUMENT); the message names the field."""


class BadMessage:
    """Stands in for a request that failed to decode, so the servicer can answer INVALID_ARGUMENT.

    (Left to grpc, an undecodable request is an UNKNOWN status with a Python exception name.)
    """

    def __init__(self, error: Exception) -> None:
        self.error = error


def _decoder(cls: type[Message]) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError) as exc:
            return BadMessage(exc)

    return decode


_CLIENT_ID = re.compile(r"[A-Za-z0-9-]{1,64}")


def peer_key(peer: str, metadata: Iterable[Any] | None = ()) -> str | None:
    """The accounting key of a gRPC peer (None: not capped per client).

    A TCP peer's address without the port; on the Unix socket the client's own id (``kvfabric-client``
    metadata).

    On the Unix socket gRPC shows every peer as the same ``unix:`` (Python exposes no SO_PEERCRED),
    so kvfabric's client names itself, once per client object. The id is declared, not proven: it
    keeps one stuck or runaway engine from taking every slot, not a hostile consumer (which can
    leave it out; the server's global caps and deadlines still bound it).
    """
    if peer.startswith(("ipv4:", "ipv6:")):
        return peer.rsplit(":", 1)[0]
    for key, value in metadata or ():
        if key == CLIENT_ID_HEADER and isinstance(value, str) and _CLIENT_ID.fullmatch(value):
            return f"unix:{value}"
    return None


def block_stores(state: SharedState) -> StoreHandler:
    """The block socket's store handler: the checks and work of ShmStoreBegin/Commit, on the store pool.

    The answer carries the staged keys' writable descriptors (the socket closes them once sent). A
    commit takes its store slot when it arrives, before it queues (none free: dropped at once); a
    request whose connection is gone when the pool starts it is skipped.
    """

    def begin(req: bp.StoreBegin, gone: Callable[[], bool]) -> StoreAnswer:
        if gone():
            return StoreAnswer(b"", [])  # nobody waits for it: stage nothing
        try:
            res, present, described = state.shm_begin(req.namespace, req.keys, req.lengths)
        except StoreRefused as exc:
            return StoreAnswer(bp.encode_store_error(bp.INVALID, str(exc)), [])
        statuses: list[int] = []
        fds: list[int] = []
        try:
            for name, is_present in zip(res.names, present, strict=True):
                if not name:
                    statuses.append(bp.PRESENT if is_present else bp.DROPPED)
                    continue
                got = state.arena.dup_by_name(name)
                if got is None:  # reaped already (a lease shorter than this answer took): none of it
                    raise UnknownLease(res.lease_id)
                fds.append(got[0])
                statuses.append(bp.STAGED)
        except UnknownLease:
            _close_descriptors(fds)
            with contextlib.suppress(UnknownLease):
                state.arena.abort(res.lease_id)
            return StoreAnswer(bp.encode_store_error(bp.UNAVAILABLE, "the store's lease expired at once"), [])
        except BaseException:
            _close_descriptors(fds)
            raise

        def undo(lease: str = res.lease_id) -> None:  # on the block socket's thread: free off it
            with contextlib.suppress(UnknownLease):
                state.arena.abort(lease, release=_in_background)

        return StoreAnswer(bp.encode_store_begun(res.lease_id, not described, statuses), fds, undo)

    def end(req: bp.StoreEnd, gone: Callable[[], bool], slot: Callable[[], None] | None) -> StoreAnswer:
        try:
            if gone():
                # Its client hung up: nobody learns the outcome, and the lease's pages go now. The
                # slot a commit took is given back whatever happens (an unknown lease included).
                try:
                    with contextlib.suppress(UnknownLease):
                        state.shm_commit(req.lease, abort=True)
                finally:
                    if slot is not None:
                        slot()
                return StoreAnswer(b"", [])
            accepted, dropped = state.shm_commit(req.lease, abort=req.abort, release=slot)
        except UnknownLease:
            return _unknown_lease()
        return StoreAnswer(bp.encode_store_done(accepted, dropped), [])

    def serve(req: bp.StoreBegin | bp.StoreEnd, gone: Callable[[], bool]) -> Future[StoreAnswer]:
        if isinstance(req, bp.StoreBegin):
            return state.store_pool.submit(begin, req, gone)
        try:
            dropped = state.shm_commit_slot(req.lease, abort=req.abort)
        except UnknownLease:
            return _answered(_unknown_lease())
        if dropped is not None:
            return _answered(StoreAnswer(bp.encode_store_done(*dropped), []))
        # Given back once: submit can fail after queueing the job (no thread could be started),
        # and the queued job then still runs and gives it back too.
        slot = None if req.abort else _Once(state.release_store_slot)
        try:
            return state.store_pool.submit(end, req, gone, slot)
        except BaseException:
            if slot is not None:
                slot()
            raise

    return serve


class _Once:
    """Call ``fn`` the first time this is called, never again (thread-safe)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is not None:
            fn()


_releases: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
_releaser: threading.Thread | None = None
_releaser_lock = threading.Lock()


def _release_forever() -> None:
    while True:
        release = _releases.get()
        try:
            release()
        except Exception:  # one lease's failure must not end the releases of the others
            logging.getLogger(__name__).exception("freeing a dropped store's staging failed")


def _in_background(release: Callable[[], None]) -> None:
    """Run ``release`` (closing and truncating a lease's memfds) on the process's release thread.

    One thread, started on first use, so a flood of dropped stores costs no thread each; here and
    now when it cannot be started (a pod at its pids limit): late, never lost.
    """
    global _releaser  # noqa: PLW0603 - one release thread per process
    with _releaser_lock:
        if _releaser is None or not _releaser.is_alive():
            thread = threading.Thread(target=_release_forever, name="kvfabric-release", daemon=True)
            try:
                thread.start()
            except RuntimeError:
                release()
                return
            _releaser = thread
    _releases.put(release)


def _unknown_lease() -> StoreAnswer:
    return StoreAnswer(bp.encode_store_error(bp.UNKNOWN_LEASE, "unknown or expired store lease"), [])


def _answered(answer: StoreAnswer) -> Future[StoreAnswer]:
    done: Future[StoreAnswer] = Future()
    done.set_result(answer)
    return done


def _close_descriptors(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def add_to_server(service: CacheService, server: grpc.aio.Server) -> None:
    """Register ``service`` like the generated ``add_CacheServicer_to_server``, with tolerant decoders."""
    enc = _encode
    handlers = {
        "Lookup": grpc.unary_unary_rpc_method_handler(service.Lookup, _decoder(pb.LookupRequest), enc),
        "Load": grpc.unary_stream_rpc_method_handler(service.Load, _decoder(pb.LoadRequest), enc),
        "Store": grpc.stream_unary_rpc_method_handler(service.Store, _decoder(pb.StoreChunk), enc),
        "ShmLoad": grpc.unary_stream_rpc_method_handler(service.ShmLoad, _decoder(pb.LoadRequest), enc),
        "ShmStoreBegin": grpc.unary_unary_rpc_method_handler(
            service.ShmStoreBegin, _decoder(pb.ShmStoreBeginRequest), enc
        ),
        "ShmStoreCommit": grpc.unary_unary_rpc_method_handler(
            service.ShmStoreCommit, _decoder(pb.ShmStoreCommitRequest), enc
        ),
        "Delete": grpc.unary_unary_rpc_method_handler(service.Delete, _decoder(pb.DeleteRequest), enc),
        "Stats": grpc.unary_unary_rpc_method_handler(service.Stats, _decoder(pb.StatsRequest), enc),
        "Flush": grpc.unary_unary_rpc_method_handler(service.Flush, _decoder(pb.FlushRequest), enc),
        "Describe": grpc.unary_unary_rpc_method_handler(service.Describe, _decoder(pb.DescribeRequest), enc),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("kvfabric.rpc.v1.Cache", handlers),)
    )


def _encode(msg: Message) -> bytes:
    return msg.SerializeToString()


async def _check(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    if isinstance(request, BadMessage):
        await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"undecodable request: {request.error}")


class CacheService(pb_grpc.CacheServicer):
    """One listener's view of the cache service; ``allow_shm`` only on the Unix socket."""

    def __init__(self, state: SharedState, *, allow_shm: bool) -> None:
        self.s = state
        self.allow_shm = allow_shm
        self.transport = "unix" if allow_shm else "tcp"

    # --- helpers -------------------------------------------------------------------------------------

    def _deadline(self, context: grpc.aio.ServicerContext[Any, Any]) -> float:
        """Seconds this call may still take: the client's deadline, capped by the server's own."""
        left = context.time_remaining()
        asked = self.s.limits.default_deadline_ms / 1000 if left is None else max(0.0, left)
        return min(asked, self.s.limits.max_call_seconds)

    async def _ids(
        self, namespace: str, keys: list[str], context: grpc.aio.ServicerContext[Any, Any]
    ) -> list[BlockId]:
        if len(keys) > self.s.limits.max_keys_per_request:
            await _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(keys)} keys exceed max_keys_per_request={self.s.limits.max_keys_per_request}",
            )
        try:
            return parse_ids(namespace, keys)
        except InvalidId as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _in_pool(self, pool: ThreadPoolExecutor, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn)

    async def _opened_in_pool(self, fn: Callable[[], Payload | None]) -> Payload | None:
        """Open a block on the load pool; if the call is cancelled meanwhile (its deadline), close it.

        A cancelled await leaves the pool's thread running: the block it then opens would keep its
        file descriptor (and an evicted block's memfd memory) for good.
        """
        job = self.s.load_pool.submit(fn)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            job.add_done_callback(_close_result)
            raise

    async def _require_shm(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        if not self.allow_shm:
            await _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "shared memory is only served on the Unix socket",
            )

    async def _bounded(self, context: grpc.aio.ServicerContext[Any, Any], work: Awaitable[T], what: str) -> T:
        """Run a streaming call's ``work`` within the server-side deadline; DEADLINE_EXCEEDED past it."""
        try:
            async with asyncio.timeout(self._deadline(context)):
                return await work
        except TimeoutError:
            await _abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, f"server-side deadline: {what}")

    @contextlib.asynccontextmanager
    async def _load_slot(self, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[None]:
        peer = peer_key(context.peer(), context.invocation_metadata())
        if not self.s.enter_peer(peer, "load"):
            await _abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this client already holds {self.s.peer_cap('load')} load slots (max_slots_per_peer)",
            )
        try:
            try:
                async with asyncio.timeout(self._deadline(context)):
                    await self.s.load_slots.acquire()
            except TimeoutError:
                await _abort(
                    context, grpc.StatusCode.DEADLINE_EXCEEDED, "no load slot free before the deadline"
                )
            try:
                yield
            finally:
                self.s.load_slots.release()
        finally:
            self.s.leave_peer(peer, "load")

    # --- RPCs ----------------------------------------------------------------------------------------

    async def Lookup(
        self, request: pb.LookupRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.LookupResponse:
        """Index-only answer: leading stored keys and their tiers."""
        await _check(request, context)
        t0 = time.perf_counter()
        bids = await self._ids(request.namespace, list(request.keys), context)
        tiers = self.s.store.lookup(bids)
        m = self.s.metrics
        m.lookup_duration.record(time.perf_counter() - t0)
        described = m.count_lookups(request.namespace, 1, len(tiers), len(bids) - len(tiers))
        return pb.LookupResponse(
            matched=len(tiers), tiers=[_TIER_ENUM[t] for t in tiers], describe=not described
        )

    async def ShmLoad(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Stream the handle names of the leading present payloads, promoting from disk as needed.

        Bounded by the server-side deadline like ``Load``: a promotion stuck on a hung disk or
        network filesystem, with no client deadline, holds its load slot only until then.
        """
        await _check(request, context)
        await self._require_shm(context)
        # Headers first, before any wait for a load slot or a promotion from disk: a same-node
        # client takes them as the sign that this process runs, and gives up on a server that sends
        # none within milliseconds (kvfabric.client.suspicion).
        await context.send_initial_metadata(())
        await self._bounded(context, self._shm_load(request, context), "load not served in time")

    async def _shm_load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        t0 = time.perf_counter()
        bids = await self._ids(request.namespace, list(request.keys), context)
        store = self.s.store
        nbytes = 0
        async with self._load_slot(context):
            # Resident blocks are named inline: index work only, no I/O on the event loop. The first
            # one that is not (never was, or was evicted meanwhile) and every key after it go to the
            # promotion path on the load pool.
            # They go out together, in messages of up to _SLOTS_PER_MESSAGE, to a client that reads
            # ShmSlot.more (one message per block cost more than copying a kept mapping of it).
            start = 0
            per_message = _SLOTS_PER_MESSAGE if request.batch_slots else 1
            msg: pb.ShmSlot | None = None
            for bid in bids:
                blk = store.dram_hit(bid)
                if blk is None:
                    break
                start += 1
                nbytes += blk.length
                if msg is None:
                    msg = pb.ShmSlot(name=blk.name, length=blk.length)
                else:
                    msg.more.add(name=blk.name, length=blk.length)
                if 1 + len(msg.more) == per_message:
                    await context.write(msg)
                    msg = None
            if msg is not None:
                await context.write(msg)
            if start < len(bids):
                # Promote a small window of keys at once, in key order, and name each block as soon as
                # it is in DRAM: the client copies one while the disk reads the next, and the checksum
                # of one overlaps the read of another.
                loop = asyncio.get_running_loop()
                pending: deque[asyncio.Future[DramBlock | None]] = deque()
                todo = iter(bids[start:])

                def submit() -> None:
                    bid = next(todo, None)
                    if bid is not None:
                        pending.append(loop.run_in_executor(self.s.load_pool, store.ensure_dram, bid))

                for _ in range(max(_PROMOTE_WINDOW, self.s.limits.io_threads)):
                    submit()
                try:
                    while pending:
                        blk = await pending.popleft()
                        if blk is None:
                            break
                        submit()
                        nbytes += blk.length
                        await context.write(pb.ShmSlot(name=blk.name, length=blk.length))
                finally:
                    for fut in pending:
                        fut.cancel()
        self.s.metrics.bytes_out.add(nbytes, {"transport": "shm"})
        self.s.metrics.load_duration.record(time.perf_counter() - t0, {"transport": "shm"})

    async def Load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Stream the leading present payloads in pieces (written with ``context.write``).

        The whole stream, its writes included, is bounded by the server-side deadline: a reader
        that stops reading (flow control then blocks the writes) and set no deadline of its own
        holds its load slot only until then, as a trickling store does.
        """
        await _check(request, context)
        await context.send_initial_metadata(())  # a liveness sign, as in ShmLoad
        await self._bounded(context, self._load(request, context), "load not read in time")

    async def _load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        t0 = time.perf_counter()
        bids = await self._ids(request.namespace, list(request.keys), context)
        piece = request.max_message_bytes or _DEFAULT_PIECE
        piece = min(max(piece, _MIN_PIECE), _MAX_PIECE)
        nbytes = 0
        async with self._load_slot(context):
            store = self.s.store
            for i, bid in enumerate(bids):

                def open_one(b: BlockId = bid) -> Payload | None:
                    return store.open_block(b)

                block = await self._opened_in_pool(open_one)
                if block is None:
                    break
                with block:
                    view = block.view()
                    try:
                        n = len(view)
                        for off in range(0, max(n, 1), piece):
                            await context.write(
                                pb.LoadChunk(
                                    index=i, total_length=n, offset=off, data=bytes(view[off : off + piece])
                                )
                            )
                        nbytes += n
                    finally:
                        view.release()
        self.s.metrics.bytes_out.add(nbytes, {"transport": "grpc"})
        self.s.metrics.load_duration.record(time.perf_counter() - t0, {"transport": "grpc"})

    async def Store(
        self, request_iterator: AsyncIterator[pb.StoreChunk], context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.StoreResponse:
        """Receive a stream of payload pieces; each complete payload is put into DRAM.

        The whole stream is bounded by the server-side deadline (``limits.max_call_seconds``), and one
        TCP peer holds at most its share of the store slots.
        """
        return await self._bounded(context, self._store(request_iterator, context), "store too slow")

    async def _store(
        self, request_iterator: AsyncIterator[pb.StoreChunk], context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.StoreResponse:
        t0 = time.perf_counter()
        limits = self.s.limits
        peer = peer_key(context.peer(), context.invocation_metadata())
        have_slot = self.s.try_store_slot(peer)
        accepted = dropped = 0
        namespace: str | None = None
        cur: _Incoming | None = None
        nkeys = 0
        try:
            async for msg in request_iterator:
                await _check(msg, context)
                if namespace is None:
                    namespace = msg.namespace
                    await self._ids(namespace, [], context)
                elif msg.namespace and msg.namespace != namespace:
                    await _abort(
                        context, grpc.StatusCode.INVALID_ARGUMENT, "namespace changed within one store"
                    )
                if msg.key:
                    if cur is not None:
                        ok = await self._finish(cur, have_slot, context)
                        accepted, dropped = accepted + ok, dropped + (not ok)
                    nkeys += 1
                    if nkeys > limits.max_keys_per_request:
                        await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "too many keys in one store")
                    (bid,) = await self._ids(namespace, [msg.key], context)
                    if msg.total_length > limits.max_payload_bytes:
                        await _abort(
                            context,
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"payload of {msg.total_length} bytes exceeds "
                            f"max_payload_bytes={limits.max_payload_bytes}",
                        )
                    cur = _Incoming(bid, msg.total_length)
                elif cur is None:
                    await _abort(
                        context, grpc.StatusCode.INVALID_ARGUMENT, "first store message must carry a key"
                    )
                if cur.filled + len(msg.data) > cur.total:
                    await _abort(
                        context,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"more data than total_length={cur.total} for key {cur.bid.key}",
                    )
                cur.add(msg.data, keep=have_slot)
            if cur is not None:
                ok = await self._finish(cur, have_slot, context)
                accepted, dropped = accepted + ok, dropped + (not ok)
        finally:
            if have_slot:
                self.s.release_store_slot(peer)
        if dropped:
            self.s.store.counters.inc("dropped_stores", "grpc", dropped)
        self.s.metrics.store_duration.record(time.perf_counter() - t0, {"transport": "grpc"})
        described = namespace is None or self.s.metrics.namespaces.count_stores(namespace, accepted)
        return pb.StoreResponse(accepted=accepted, dropped=dropped, describe=not described)

    async def _finish(
        self, cur: _Incoming, have_slot: bool, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bool:
        if cur.filled != cur.total:
            await _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"truncated stream: key {cur.bid.key} got {cur.filled} of {cur.total} bytes",
            )
        if not have_slot:
            return False
        store = self.s.store
        pieces = cur.pieces

        def fill(fd: int) -> None:
            off = 0
            for p in pieces:
                view = memoryview(p)
                done = 0
                while done < len(view):
                    done += os.pwritev(fd, [view[done:]], off + done)
                off += len(view)

        def put() -> tuple[bool, bool]:
            # "Already here" checks the copy, not only an index entry (a stat on a shared volume:
            # on this pool thread, never on the event loop).
            if store.holds(cur.bid):
                return True, False
            return store.put_with(cur.bid, cur.total, fill), True

        ok, copied = await self._in_pool(self.s.store_pool, put)
        if ok and copied:
            self.s.metrics.bytes_in.add(cur.total, {"transport": "grpc"})
        return ok

    async def ShmStoreBegin(
        self, request: pb.ShmStoreBeginRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ShmStoreBeginResponse:
        """Hand out staging memfds, their pages allocated, for the keys the server can take now."""
        await _check(request, context)
        await self._require_shm(context)
        state = self.s
        try:
            res, _, described = await self._in_pool(
                state.store_pool,
                lambda: state.shm_begin(request.namespace, list(request.keys), list(request.lengths)),
            )
        except StoreRefused as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.ShmStoreBeginResponse(
            lease_id=res.lease_id,
            slots=[pb.ShmSlot(name=n, length=ln) for n, ln in zip(res.names, res.lengths, strict=True)],
            dropped=res.dropped,
            present=res.present,
            describe=not described,
        )

    async def ShmStoreCommit(
        self, request: pb.ShmStoreCommitRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.StoreResponse:
        """Seal a lease's staging memfds and put them into DRAM as the blocks (or abort it)."""
        await _check(request, context)
        await self._require_shm(context)
        state = self.s
        try:
            # The slot first, on the event loop: none free and the store is dropped now, not queued.
            dropped = state.shm_commit_slot(request.lease_id, abort=request.abort)
            if dropped is not None:
                accepted, dropped_n = dropped
                return pb.StoreResponse(accepted=accepted, dropped=dropped_n)
            accepted, dropped_n = await self._committed(request.lease_id, abort=request.abort)
        except UnknownLease:
            await _abort(context, grpc.StatusCode.NOT_FOUND, "unknown or expired store lease")
        return pb.StoreResponse(accepted=accepted, dropped=dropped_n)

    async def _committed(self, lease_id: str, *, abort: bool) -> tuple[int, int]:
        """:meth:`SharedState.shm_commit` on the store pool, its slot taken (given back if never run)."""
        state = self.s
        job = state.store_pool.submit(state.shm_commit, lease_id, abort=abort)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            if job.cancel() and not abort:
                state.release_store_slot()  # cancelled before it ran: its finally never will
            raise

    async def Delete(
        self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DeleteResponse:
        """Delete keys from every tier."""
        await _check(request, context)
        bids = await self._ids(request.namespace, list(request.keys), context)
        store = self.s.store
        try:
            n = await self._in_pool(self.s.store_pool, lambda: sum(store.delete(b) for b in bids))
        except HandingOver as exc:
            # Retried in a moment it reaches the successor, which holds this server's blocks by then.
            await _abort(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        return pb.DeleteResponse(deleted=n)

    async def Flush(
        self, request: pb.FlushRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.FlushResponse:
        """Wait for the keys' write-backs (until the deadline); say which durable tiers hold each."""
        await _check(request, context)
        bids = await self._ids(request.namespace, list(request.keys), context)
        # A little before the deadline, so the answer still reaches the client.
        wait = max(0.0, self._deadline(context) * 0.9)
        store = self.s.store
        # The default executor: a flush waits, and must not hold a load or store thread meanwhile.
        tiers, complete = await asyncio.get_running_loop().run_in_executor(
            None, lambda: store.durable_tiers(bids, wait)
        )
        return pb.FlushResponse(
            keys=[pb.KeyTiers(tiers=[_TIER_ENUM[t] for t in held]) for held in tiers], complete=complete
        )

    async def Describe(
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.DescribeResponse:
        """Keep (and export) what a namespace stands for, if the description hashes to it."""
        await _check(request, context)
        await self._ids(request.namespace, [], context)
        try:
            doc = parse_description(request.namespace, request.spec_json)
        except InvalidDescriptionError as exc:
            self.s.metrics.describes.add(1, {"result": "refused"})
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"namespace description refused: {exc}")
        self.s.metrics.namespaces.describe(request.namespace, readable(doc))
        self.s.metrics.describes.add(1, {"result": "accepted"})
        return pb.DescribeResponse()

    async def Stats(
        self, request: pb.StatsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.StatsResponse:
        """Usage and counters as JSON."""
        await _check(request, context)
        stats = self.s.store.stats()
        stats["arena_used_bytes"] = self.s.arena.used_bytes
        stats["arena_quarantined_bytes"] = self.s.arena.quarantined_bytes
        stats["arena_pooled_bytes"] = self.s.arena.pooled_bytes
        stats["store_inflight"] = self.s.store_inflight
        return pb.StatsResponse(json=json.dumps(stats))


class _Incoming:
    """A payload being received in pieces."""

    __slots__ = ("bid", "filled", "pieces", "total")

    def __init__(self, bid: BlockId, total: int) -> None:
        self.bid = bid
        self.total = total
        self.filled = 0
        self.pieces: list[bytes] = []

    def add(self, data: bytes, *, keep: bool) -> None:
        self.filled += len(data)
        if keep and data:
            self.pieces.append(data)


def _close_result(job: Future[Payload | None]) -> None:
    """Close what a job that nobody awaits any more opened."""
    if not job.cancelled() and job.exception() is None:
        block = job.result()
        if block is not None:
            block.close()


async def _abort(context: grpc.aio.ServicerContext[Any, Any], code: grpc.StatusCode, msg: str) -> NoReturn:
    await context.abort(code, msg)
    raise AssertionError("unreachable: abort raises")  # pragma: no cover
