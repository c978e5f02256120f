"""The blocking cache client."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from kvfabric.client import _common as c
from kvfabric.client.blocks import BlockChannel, StoreBusy
from kvfabric.client.errors import (
    CacheError,
    CacheOverloaded,
    CacheSuspect,
    CacheTimeout,
    CacheUnavailable,
    InvalidRequest,
)
from kvfabric.client.hangwatch import HangWatch
from kvfabric.client.localindex import LocalIndex
from kvfabric.client.mappings import Lease, release_all
from kvfabric.client.results import FlushResult, LookupResult, StoreResult
from kvfabric.client.suspicion import REPLY_FLOOR_S, ReplyClock, Suspicion
from kvfabric.rpc.blockproto import MAX_NAMES
from kvfabric.rpc.v1 import cache_pb2 as pb
from kvfabric.rpc.v1 import cache_pb2_grpc as pb_grpc

__all__ = ["CacheClient"]

T = TypeVar("T")
log = logging.getLogger(__name__)
DEFAULT_MAPPING_CACHE_BYTES = 512 << 20
"""Kept block mappings per client by default: half the server's default hold budget per client
(``shm.hold_bytes_per_client``, 1 GiB), so the server never refuses a hold this client made room for
(of blocks large enough; a server also caps the *number* of blocks a client holds, and a block it
refuses to hold is copied, not kept)."""
_DESCRIBE_TIMEOUT_S = 2.0
"""Longest a description may take (it is for status only; the call it precedes has its own deadline)."""


@dataclass(frozen=True)
class _Conn:
    """A channel, its stubs and the token its calls carry: replaced as one on a rotation."""

    channel: grpc.Channel
    stub: Any  # the generated stub is untyped; its messages are typed by cache_pb2.pyi
    health: Any
    md: tuple[tuple[str, str], ...] | None


class CacheClient:
    """A transport to one cache server: deadlines on every call, typed errors, no retries.

    ``target`` is ``unix:///abs/path.sock`` (same node) or ``host:port`` (remote). With a Unix target and
    ``shared_memory``, payloads move through memfds the server hands out on its block socket (one copy,
    no shared directory); otherwise they are streamed in gRPC messages. ``token`` is sent as a bearer
    token, ``tls_ca`` (a PEM file) turns on TLS for TCP targets; ``tls_cert``/``tls_key`` add a client
    certificate (mutual TLS); ``tls_server_name`` verifies the server's certificate against that name
    instead of the target's host (e.g. the pool's Service name through a port-forward). ``token_file``
    holds the token instead. The TLS and token files are watched: when one changes (the kubelet updates
    a Secret volume in place), the next call runs on a channel built from the new ones, so rotated
    credentials apply without a restart. ``mapping_cache_bytes`` (shared memory only) keeps the mappings
    of loaded blocks across loads, up to that many bytes, so a repeated load is one memcpy
    (:mod:`kvfabric.client.mappings`); 0 maps every block afresh. With ``local_index``, a load whose
    server sends no first reply within ``max(reply_floor_s, 4 x its recent p98)`` fails at once and
    the server is suspect until its heartbeat advances (:mod:`kvfabric.client.suspicion`).
    Thread-safe; reuse one client per process.
    """

    def __init__(
        self,
        target: str,
        *,
        shared_memory: bool = False,
        token: str | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_server_name: str | None = None,
        local_index: bool = False,
        token_file: str | os.PathLike[str] | None = None,
        mapping_cache_bytes: int = DEFAULT_MAPPING_CACHE_BYTES,
        reply_floor_s: float = REPLY_FLOOR_S,
    ) -> None:
        self._target = c.parse_target(target)
        # Same node: answer lookups from the table the server publishes (no call per lookup).
        self._index = c.local_index_for(self._target) if local_index else None
        # With the published index, a load waiting on a server that stopped beating is cancelled, and
        # one that got no first reply within the reply bound is given up (the server turns suspect
        # until its heartbeat says whether it was slow or hung).
        self._hangs = HangWatch(self._index) if self._index is not None else None
        stale_s = self._index.stale_ns / 1e9 if self._index is not None else 0.5
        self._clock = (
            ReplyClock(floor_s=reply_floor_s, ceiling_s=max(reply_floor_s, stale_s))
            if self._index is not None
            else None
        )
        self.suspicion = Suspicion(
            self._index.stale_ns if self._index is not None else 0,
            on_cleared=self._clock.missed if self._clock is not None else None,
        )
        """Suspicions of this client's server and how they ended (counters)."""
        # Named once per client object: the server caps slots per client on the Unix socket too, and
        # budgets holds and connections per client on the block socket.
        self._client_id = c.new_client_id()
        self._blocks = (
            c.block_channel_for(self._target, mapping_cache_bytes, self._client_id) if shared_memory else None
        )
        if self._blocks is not None:
            self._blocks.clock = self._clock
        # Stores on a connection of their own (opened on the first store): a store's begin may wait
        # for the server (a stat of a shared volume, a page allocation), and a load on this client
        # must never wait behind it for the channel's lock. It has no reply clock: a begin may
        # allocate pages, and a store waits for its deadline.
        self._store_blocks = c.block_channel_for(self._target, 0, self._client_id) if shared_memory else None
        self._token = token
        self._token_file = Path(token_file) if token_file is not None else None
        self._tls = (tls_ca, tls_cert, tls_key)
        self._tls_server_name = tls_server_name
        # Credential files (a Secret volume the kubelet updates in place) are watched: when one
        # changes, the next call runs on a channel built from the new ones (no restart to rotate).
        self._watched = [Path(f) for f in (*self._tls, token_file) if f is not None]
        self._stamp = c.file_stamps(self._watched)
        self._next_check = 0.0
        self._reload_lock = threading.Lock()
        self._retired: list[tuple[grpc.Channel, threading.Timer]] = []
        self._closed = False
        self._connect()
        # Namespaces announced by the caller (namespace -> description) and those the server does
        # not know yet: described before this client's next call (see announce()).
        self._specs: dict[str, str] = {}
        self._undescribed: set[str] = set()
        self._restarts_seen = 0  # the published index's restart count when descriptions were last due
        self._describe_lock = threading.Lock()  # guards the two above
        # Lookups read the published index one thread at a time (its table fetches poll a socket):
        # a lookup finding it busy (the start-up warm-up mapping a table) asks over RPC instead.
        # (The hang watch's alive() is not under this lock: each table guards its own poll.)
        self._index_lock = threading.Lock()
        self._sending = threading.Lock()  # held by the one thread sending descriptions

    @property
    def local_index(self) -> LocalIndex | None:
        """The published-index reader answering this client's lookups (None: every lookup is a call)."""
        return self._index

    @property
    def uses_shm(self) -> bool:
        """True when bulk bytes go through shared memory (memfds from the block socket)."""
        return self._blocks is not None

    def _connect(self) -> None:
        token = c.read_token(self._token_file) if self._token_file is not None else self._token
        md = c.metadata(token, self._client_id)
        creds = c.credentials(*self._tls)
        if creds is not None and not self._target.is_unix:
            options = c.CHANNEL_OPTIONS + c.server_name_option(self._tls_server_name)
            channel = grpc.secure_channel(self._target.address, creds, options=options)
        else:
            channel = grpc.insecure_channel(self._target.address, options=c.CHANNEL_OPTIONS)
        # The generated stub is untyped; the request/response messages are typed by cache_pb2.pyi.
        stub: Any = pb_grpc.CacheStub(channel)  # type: ignore[no-untyped-call]
        health: Any = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=_health_request,
            response_deserializer=_health_status,
        )
        # One object swapped whole: a call made during a rotation uses the new channel with the new
        # token, or the old with the old, never a mix (the token is checked per call).
        self._conn = _Conn(channel, stub, health, md)

    def _refresh_credentials(self) -> None:
        """Rebuild the channel when a credential file changed (checked at most once a second)."""
        if not self._watched or time.monotonic() < self._next_check:
            return
        with self._reload_lock:
            if self._closed or time.monotonic() < self._next_check:
                return
            self._next_check = time.monotonic() + c.CREDENTIAL_CHECK_SECONDS
            stamp = c.file_stamps(self._watched)
            if stamp == self._stamp:
                return
            old = self._conn.channel
            try:
                self._connect()
            except (OSError, ValueError) as exc:
                # A rotation caught half-way (or a file removed): keep the old channel, retry later.
                log.warning("cannot reload the cache credentials", extra={"error": str(exc)})
                return
            self._stamp = stamp
            log.info("cache credentials reloaded", extra={"target": self._target.address})
            # Calls in flight on the old channel finish there; it is closed once they are long over
            # (every call has a deadline, and the connector's are seconds).
            timer = threading.Timer(c.RETIRED_CHANNEL_GRACE_SECONDS, old.close)
            timer.daemon = True
            timer.start()
            self._retired = [(ch, t) for ch, t in self._retired if t.is_alive()] + [(old, timer)]

    def _call(self, fn: Callable[[_Conn], T]) -> T:
        self._refresh_credentials()
        conn = self._conn
        try:
            return fn(conn)
        except grpc.RpcError as exc:
            raise c.map_rpc_error(exc) from exc

    def describe(self, namespace: str, spec_json: str, *, timeout: float) -> None:
        """Tell the server what ``namespace`` stands for: ``spec_json`` is the canonical document it hashes.

        Raises :class:`~kvfabric.client.errors.InvalidRequest` when the server refuses it (it does
        not hash to the namespace, or is malformed). See :meth:`announce` for the automatic way.
        """
        c.check_timeout(timeout)
        c.check_ids(namespace, [])
        req = pb.DescribeRequest(namespace=namespace, spec_json=spec_json)
        self._call(lambda r: r.stub.Describe(req, timeout=timeout, metadata=r.md))

    def announce(self, namespace: str, spec_json: str) -> None:
        """Describe ``namespace`` to the server before this client's next call, and again when it asks.

        Once per namespace and connection: the server says in a lookup's or a store's answer when it
        holds no description (it restarted, or forgot the least recently used one), and the next call
        describes it first. A failed description is retried at the next call; a refused one (a
        description that does not hash to the namespace: a bug) is dropped with a warning. Never raises
        for the server's sake and never costs more than one small call, inside the next call's deadline.
        """
        c.check_ids(namespace, [])
        with self._describe_lock:
            self._specs[namespace] = spec_json
            self._undescribed.add(namespace)

    def warm_up(self, namespace: str | None = None, *, timeout: float) -> None:
        """Get ready for the first calls: send the descriptions due, map ``namespace``'s table.

        The descriptions are those of :meth:`announce`; the table is the published index's of
        ``namespace`` (one this client will look up). A connector calls it when it starts, so that
        its first request's lookup neither carries a description nor opens the table, and is
        answered from the table with no call. Never raises for the server's sake: what fails here is
        done by the next call.
        """
        c.check_timeout(timeout)
        self._describe_due(time.monotonic() + timeout, wait=True)
        if namespace is None or self._index is None:
            return
        c.check_ids(namespace, [])
        with self._describe_lock:
            # The server serves tables of namespaces it knows: described, or with blocks.
            described = namespace in self._specs and namespace not in self._undescribed
        if described:
            with self._index_lock, contextlib.suppress(CacheError):
                self._index.lookup(namespace, b"")  # no keys: maps the table, answers nothing

    @property
    def describes_pending(self) -> bool:
        """Whether a description is due before this client's next call (see :meth:`announce`).

        With the published index, a table from another server process (a restart) makes every
        description due: the new process knows none, and lookups answered from its table would never
        hear it ask. A server that is only hung or gone is not a new one: its lookups stay on the
        table, which answers "unavailable" in microseconds, instead of an RPC that would wait its
        deadline to send a description nobody reads.
        """
        index = self._index
        if index is not None and index.restarts != self._restarts_seen:
            with self._describe_lock:
                self._restarts_seen = index.restarts
                self._undescribed = set(self._specs)
        return bool(self._undescribed)

    def _describe_due(self, deadline: float, *, wait: bool = False) -> None:
        """Send the descriptions the server lacks (at most once each), within ``deadline``.

        One thread sends; a call on another thread meanwhile goes ahead without waiting (a lookup
        must never wait behind a description to a hung server). ``wait``: a background sender
        waits for the one sending, then sends what is still due (a namespace announced meanwhile).
        """
        if not self.describes_pending:
            return
        if wait:
            if not self._sending.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return
        elif not self._sending.acquire(blocking=False):
            return
        try:
            with self._describe_lock:
                due = [(ns, self._specs[ns]) for ns in sorted(self._undescribed) if ns in self._specs]
            for namespace, spec_json in due:
                left = min(deadline - time.monotonic(), _DESCRIBE_TIMEOUT_S)
                if left <= 0:
                    return
                try:
                    self.describe(namespace, spec_json, timeout=left)
                except InvalidRequest as exc:
                    log.warning("the cache server refused the description of %s: %s", namespace[:12], exc)
                    with self._describe_lock:
                        self._specs.pop(namespace, None)
                except CacheError as exc:
                    log.debug("describing %s failed (retried at the next call): %s", namespace[:12], exc)
                    return
                with self._describe_lock:
                    self._undescribed.discard(namespace)
        finally:
            self._sending.release()

    def _asked_to_describe(self, namespace: str, resp: Any) -> None:
        """The server said it lacks ``namespace``'s description: send it before the next call."""
        if getattr(resp, "describe", False):
            self._undescribed_if_announced(namespace)

    def _undescribed_if_announced(self, namespace: str) -> None:
        """Send ``namespace``'s description before the next call, if the caller announced it."""
        if namespace in self._specs:
            with self._describe_lock:
                if namespace in self._specs:
                    self._undescribed.add(namespace)

    def lookup(
        self, namespace: str, keys: Sequence[str], *, timeout: float, raw: bytes | None = None
    ) -> LookupResult:
        """How many leading ``keys`` are stored, and in which tier each one is.

        ``raw``: the keys' 32-byte digests, concatenated (``bytes.fromhex`` of each key), when the
        caller holds them: the published index is probed with them without decoding the keys again
        (:func:`~kvfabric.client._common.check_raw_ids`).
        """
        c.check_timeout(timeout)
        given = raw is not None
        raw = c.check_ids(namespace, keys) if raw is None else c.check_raw_ids(namespace, keys, raw)
        deadline = time.monotonic() + timeout
        self._check_suspect()
        self._describe_due(deadline)
        if self._index is not None and self._index_lock.acquire(blocking=False):
            try:
                local = self._index.lookup(namespace, raw)
            finally:
                self._index_lock.release()
            if local is not None:
                return local
        if given:
            c.check_ids(namespace, keys)  # the keys themselves are checked before they are sent
        req = pb.LookupRequest(namespace=namespace, keys=keys)
        left = _remaining(deadline)
        resp = self._call(lambda r: r.stub.Lookup(req, timeout=left, metadata=r.md))
        self._asked_to_describe(namespace, resp)
        return c.lookup_result(resp)

    def lookup_local(
        self, namespace: str, keys: Sequence[str], raw: bytes | None = None
    ) -> LookupResult | None:
        """Answer from the published index only (microseconds, no call, no thread); None if it cannot.

        Raises :class:`~kvfabric.client.errors.CacheUnavailable` when the server is gone or hung
        (:class:`~kvfabric.client.errors.CacheSuspect` while it is suspect). ``raw`` as for :meth:`lookup`.
        """
        self._check_suspect()
        if self._index is None or self.describes_pending:
            return None  # a description is due: the call that sends it first is an RPC lookup
        raw = c.check_ids(namespace, keys) if raw is None else c.check_raw_ids(namespace, keys, raw)
        if not self._index_lock.acquire(blocking=False):
            return None  # the index is busy on another thread (see __init__): ask over RPC
        try:
            return self._index.lookup(namespace, raw, fetch=False)
        finally:
            self._index_lock.release()

    def load(self, namespace: str, keys: Sequence[str], *, timeout: float) -> list[bytes]:
        """Payloads of the leading present keys (stops at the first miss)."""
        c.check_timeout(timeout)
        c.check_ids(namespace, keys)
        req = pb.LoadRequest(namespace=namespace, keys=keys, batch_slots=True)
        if self._blocks is not None:
            blocks = self._blocks
            deadline = time.monotonic() + timeout
            out: list[bytes] = []

            def read_all(r: _Conn) -> None:
                call = r.stub.ShmLoad(req, timeout=timeout, metadata=r.md)
                with self._watch(namespace, call):
                    for group in c.shm_slot_groups(call):
                        refs = c.shm_refs(namespace, keys, len(out), group)
                        got = blocks.read_blocks(refs, deadline=deadline)
                        out.extend(got)
                        if len(got) < len(group):  # a block gone (a miss from here on), or too many
                            call.cancel()
                            break

            self._call(read_all)
            return out
        asm = c.LoadAssembler()
        self._stream_load(req, timeout, asm)
        return asm.payloads

    def load_into(
        self, namespace: str, keys: Sequence[str], buffers: Sequence[memoryview], *, timeout: float
    ) -> int:
        """Copy the leading present payloads into ``buffers``; returns how many were loaded."""
        c.check_timeout(timeout)
        c.check_ids(namespace, keys)
        if len(buffers) < len(keys):
            raise InvalidRequest(f"{len(keys)} keys but only {len(buffers)} buffers")
        req = pb.LoadRequest(namespace=namespace, keys=keys, batch_slots=True)
        if self._blocks is not None:
            blocks = self._blocks
            deadline = time.monotonic() + timeout
            count = 0

            def read_into(r: _Conn) -> None:
                nonlocal count
                call = r.stub.ShmLoad(req, timeout=timeout, metadata=r.md)
                # Copy the blocks of each message as soon as they are named, while the server
                # promotes the next ones.
                with self._watch(namespace, call):
                    for group in c.shm_slot_groups(call):
                        refs = c.shm_refs(namespace, keys, count, group)
                        mine = buffers[count : count + len(refs)]
                        got = c.shm_read_into(blocks, refs, mine, count, deadline)
                        count += got
                        if got < len(group):
                            call.cancel()
                            break

            self._call(read_into)
            return count
        asm = c.LoadAssembler(buffers)
        self._stream_load(req, timeout, asm)
        return asm.count

    @property
    def lends(self) -> bool:
        """Whether :meth:`load_views` lends blocks without copying (same node, kept mappings)."""
        return self._blocks is not None and self._blocks.maps is not None

    def load_views(self, namespace: str, keys: Sequence[str], *, timeout: float) -> list[Lease]:
        """Lend the leading present payloads, read-only and in order, without copying them.

        Same node only (shared memory). Each :class:`~kvfabric.client.mappings.Lease` pins a kept
        mapping of a sealed block (or owns a private copy of a block this client could not hold);
        the caller releases every lease it got. On an error nothing stays lent.
        """
        c.check_timeout(timeout)
        c.check_ids(namespace, keys)
        if self._blocks is None:
            raise InvalidRequest("load_views needs shared memory (a Unix target with shared_memory=True)")
        blocks = self._blocks
        req = pb.LoadRequest(namespace=namespace, keys=keys, batch_slots=True)
        deadline = time.monotonic() + timeout
        out: list[Lease] = []

        def lend(r: _Conn) -> None:
            call = r.stub.ShmLoad(req, timeout=timeout, metadata=r.md)
            with self._watch(namespace, call):
                for group in c.shm_slot_groups(call):
                    refs = c.shm_refs(namespace, keys, len(out), group)
                    got = blocks.borrow_blocks(refs, deadline=deadline)
                    out.extend(got)
                    if len(got) < len(group):
                        call.cancel()
                        break

        try:
            self._call(lend)
        except BaseException:
            release_all(out)
            raise
        return out

    def _check_suspect(self) -> None:
        """Raise :class:`CacheSuspect` while the server is suspect (one word read at most)."""
        index = self._index
        if index is not None and self.suspicion.active(index.heartbeat, time.monotonic_ns()):
            raise CacheSuspect("the cache server is suspect: a load got no first reply in time")

    @contextlib.contextmanager
    def _watch(self, namespace: str, call: Any) -> Iterator[None]:
        """Run a load's stream under the hang watch: a server that stops beating fails it at once.

        And one that sends no first reply (the stream's headers, which a server sends before any
        promotion) within the reply bound fails it in milliseconds, as :class:`CacheSuspect`.
        """
        if self._hangs is None or self._clock is None:
            yield
            return
        try:
            self._check_suspect()
        except CacheSuspect:
            call.cancel()
            raise
        clock = self._clock
        start = time.monotonic()
        with self._hangs.watching(namespace, call, reply_by=start + clock.bound()) as w:
            try:
                call.initial_metadata()  # returns once the headers came, or the call ended
                if not w.slow:
                    w.reply()
                    clock.record(time.monotonic() - start)
                yield
            except grpc.RpcError as exc:
                if w.slow:
                    self.suspicion.suspect(namespace, time.monotonic_ns())
                    raise CacheSuspect(
                        f"no first reply from the cache server within {(w.reply_by or start) - start:.3f} s"
                    ) from exc
                if w.hung:
                    raise CacheUnavailable(
                        "the cache server stopped beating while this load waited (published index)"
                    ) from exc
                raise
            except CacheSuspect:  # the block socket gave up on an answer
                self.suspicion.suspect(namespace, time.monotonic_ns())
                raise

    def _stream_load(self, req: pb.LoadRequest, timeout: float, asm: c.LoadAssembler) -> None:
        def run(r: _Conn) -> None:
            call = r.stub.Load(req, timeout=timeout, metadata=r.md)
            with self._watch(req.namespace, call):
                for chunk in call:
                    asm.feed(chunk)
            asm.done()

        self._call(run)

    def store(
        self, namespace: str, keys: Sequence[str], payloads: Sequence[c.Payload], *, timeout: float
    ) -> StoreResult:
        """Store payloads; keys the server cannot take now are dropped (counted), never an error."""
        c.check_timeout(timeout)
        c.check_ids(namespace, keys)
        c.check_payloads(keys, payloads)
        if not keys:
            return StoreResult(0, 0)
        deadline = time.monotonic() + timeout
        self._describe_due(deadline)
        if self._blocks is not None:
            blocks = self._blocks
            assert self._store_blocks is not None
            on_socket = self._block_store(self._store_blocks, namespace, keys, payloads, deadline)
            if on_socket is not None:
                return on_socket
            begin = pb.ShmStoreBeginRequest(
                namespace=namespace, keys=keys, lengths=[memoryview(p).nbytes for p in payloads]
            )
            left = _remaining(deadline)
            resp = self._call(lambda r: r.stub.ShmStoreBegin(begin, timeout=left, metadata=r.md))
            self._asked_to_describe(namespace, resp)
            try:
                c.shm_write(blocks, resp.slots, payloads, deadline)
                commit = pb.ShmStoreCommitRequest(lease_id=resp.lease_id)
                left = _remaining(deadline, "while writing to shared memory")
                done = self._call(lambda r: r.stub.ShmStoreCommit(commit, timeout=left, metadata=r.md))
            except BaseException:
                # Failed, or out of time, before the commit was answered: abort, so the staged pages
                # go now, not when the lease expires (a lease committed after all is unknown by now).
                abort = pb.ShmStoreCommitRequest(lease_id=resp.lease_id, abort=True)
                with contextlib.suppress(grpc.RpcError):
                    conn = self._conn
                    conn.stub.ShmStoreCommit(abort, timeout=1.0, metadata=conn.md)
                raise
            return StoreResult(done.accepted, done.dropped)
        chunks = c.store_chunks(namespace, keys, payloads)
        left = _remaining(deadline)
        done = self._call(lambda r: r.stub.Store(chunks, timeout=left, metadata=r.md))
        self._asked_to_describe(namespace, done)
        return StoreResult(done.accepted, done.dropped)

    def _block_store(
        self,
        blocks: BlockChannel,
        namespace: str,
        keys: Sequence[str],
        payloads: Sequence[c.Payload],
        deadline: float,
    ) -> StoreResult | None:
        """Store on the block socket (two exchanges per ``MAX_NAMES`` keys, no gRPC call).

        None when the server serves no stores there (the caller stores over gRPC).
        """
        accepted = dropped = 0
        asked = False  # the server asked for the namespace's description (it restarted)
        for start in range(0, len(keys), MAX_NAMES):
            batch = keys[start : start + MAX_NAMES]
            data = payloads[start : start + MAX_NAMES]
            lengths = [memoryview(p).nbytes for p in data]
            try:
                begun = blocks.store_begin(namespace, batch, lengths, deadline=deadline)
            except (StoreBusy, CacheOverloaded):
                # Dropped under pressure, as the server drops a store (busy, or no connection free):
                # the server is up and said so at once.
                dropped += len(batch)
                continue
            if begun is None:
                if start:  # the server changed under us (restarted older): the rest over gRPC
                    rest = self.store(namespace, keys[start:], payloads[start:], timeout=_remaining(deadline))
                    return StoreResult(accepted + rest.accepted, dropped + rest.dropped)
                return None
            lease, describe, fds = begun
            if describe:
                self._undescribed_if_announced(namespace)
                asked = True
            try:
                c.write_staged(fds, data)
                _remaining(deadline, "while writing to shared memory")
                got, lost = blocks.store_end(lease, deadline=deadline)
            except BaseException:
                # Failed, or out of time, before the commit was answered (the connection may have
                # gone with the commit unread, closed for a newcomer): abort, on a fresh connection
                # if need be, so the staged pages go now, not when the lease expires. An unknown
                # lease: the commit was served after all.
                with contextlib.suppress(CacheError):
                    blocks.store_end(lease, abort=True, deadline=time.monotonic() + 1.0)
                raise
            accepted, dropped = accepted + got, dropped + lost
        if asked:
            # Now, on the storer's thread: over the block socket and the published table a client
            # may make no other call that would carry it (a restarted server stays undescribed).
            self._describe_due(time.monotonic() + _DESCRIBE_TIMEOUT_S)
        return StoreResult(accepted, dropped)

    def delete(self, namespace: str, keys: Sequence[str], *, timeout: float) -> int:
        """Delete keys from every tier; returns how many were stored."""
        c.check_timeout(timeout)
        c.check_ids(namespace, keys)
        req = pb.DeleteRequest(namespace=namespace, keys=keys)
        resp = self._call(lambda r: r.stub.Delete(req, timeout=timeout, metadata=r.md))
        return int(resp.deleted)

    def flush(self, namespace: str, keys: Sequence[str], *, timeout: float) -> FlushResult:
        """Wait (within ``timeout``) for the keys' pending write-backs; say which durable tiers hold each.

        A store is acknowledged once its payload is in DRAM; this is how a caller learns when it
        survives a restart. The server answers a little before the deadline, so a slow write-back
        reads ``complete=False`` rather than a timeout.
        """
        c.check_timeout(timeout)
        c.check_ids(namespace, keys)
        req = pb.FlushRequest(namespace=namespace, keys=keys)
        return c.flush_result(self._call(lambda r: r.stub.Flush(req, timeout=timeout, metadata=r.md)))

    def stats(self, *, timeout: float) -> dict[str, Any]:
        """Return the server's statistics (tiers' usage, counters) as a dict."""
        c.check_timeout(timeout)
        resp = self._call(lambda r: r.stub.Stats(pb.StatsRequest(), timeout=timeout, metadata=r.md))
        out: dict[str, Any] = json.loads(resp.json)
        return out

    def health(self, *, timeout: float) -> bool:
        """Return True when the server's gRPC health service says SERVING, False on any failure."""
        c.check_timeout(timeout)
        self._refresh_credentials()
        try:
            conn = self._conn
            return bool(conn.health(b"", timeout=timeout, metadata=conn.md))
        except grpc.RpcError:
            return False

    def close(self) -> None:
        """Close the channel (and unmap the published index, and close the block socket)."""
        with self._reload_lock:
            self._closed = True
            retired, self._retired = self._retired, []
        for channel, timer in retired:
            timer.cancel()
            channel.close()
        self._conn.channel.close()
        if self._hangs is not None:
            self._hangs.close()
        if self._index is not None:
            self._index.close()
        if self._blocks is not None:
            self._blocks.close()
        if self._store_blocks is not None:
            self._store_blocks.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _remaining(deadline: float, what: str = "before the call was sent") -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise CacheTimeout(f"deadline passed {what}")
    return left


# The health service's messages are tiny; hand-rolled (de)serializers avoid importing grpc_health's
# generated modules into every client process. HealthCheckRequest{service=""} encodes as b"".
def _health_request(_: bytes) -> bytes:
    return b""


def _health_status(data: bytes) -> bool:
    # HealthCheckResponse: field 1 (varint) status; SERVING == 1 -> b"\x08\x01".
    return data == b"\x08\x01"
