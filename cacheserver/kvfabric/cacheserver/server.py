"""Server lifecycle: build the store, listen on the Unix socket and TCP, serve until told to stop.

``serve(config, shutdown_trigger=...)`` is the whole server; the CLI only parses arguments and wires
SIGTERM/SIGINT to the trigger, so tests can stop a server deterministically.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from kvfabric.cacheserver.config import ServerConfig, TLSConfig
from kvfabric.cacheserver.engine.dram import descriptor_budget
from kvfabric.cacheserver.engine.ids import BlockId
from kvfabric.cacheserver.engine.tiered import TieredStore
from kvfabric.cacheserver.health import (
    PROBE_NAMESPACE,
    ListenerProbes,
    Probe,
    probe_blocks,
    probe_grpc,
    probe_index,
)
from kvfabric.cacheserver.metrics import Metrics, ProbeServer
from kvfabric.cacheserver.service import CacheService, SharedState, add_to_server, block_stores
from kvfabric.cacheserver.transport.arena import STAGING_PREFIX, StagingArena
from kvfabric.cacheserver.transport.blocksock import BlockLimits, BlockSocket
from kvfabric.cacheserver.transport.handover import (
    HandoverFailed,
    HandoverOffer,
    Inbound,
    handover_socket_for,
    receive,
)
from kvfabric.cacheserver.transport.indexpub import IndexPublisher, IndexSocket
from kvfabric.cacheserver.transport.residencyfeed import FeedSocket, ResidencyFeed
from kvfabric.cacheserver.transport.socketfile import SocketFile
from kvfabric.rpc.blockproto import block_socket_for
from kvfabric.rpc.indextable import index_socket_for
from kvfabric.rpc.residency import residency_socket_for

__all__ = ["serve"]

log = logging.getLogger(__name__)

GRPC_CONNECTION_SHARE = 1 / 32
"""Share of the descriptor limit each gRPC listener's connections may take (at most 1,024)."""
GRPC_HANDSHAKE_SECONDS = 5
"""A connection that has not finished its handshake (HTTP/2, TLS) this long after its accept is closed."""


def _server_options() -> list[tuple[str, int]]:
    """The options of both gRPC listeners.

    Connections are bounded: each holds a descriptor, and a same-node process (or, over TCP, anyone
    who can reach the port, before any authentication) opening them without end took every
    descriptor the DRAM tier, the staging areas and the other listeners need.
    """
    return [
        ("grpc.max_receive_message_length", 80 << 20),  # a 64 MiB piece plus framing, never more
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", 0),
        ("grpc.max_allowed_incoming_connections", min(1024, descriptor_budget(GRPC_CONNECTION_SHARE))),
        ("grpc.server_handshake_timeout_ms", GRPC_HANDSHAKE_SECONDS * 1000),
    ]


SERVICE_NAME = "kvfabric.rpc.v1.Cache"


class _WatchedFile:
    """The bytes of a small file, read again when the file changes (a rotated Secret volume).

    Kubernetes updates a Secret volume by swapping a symlink, so (inode, size, mtime) of the resolved
    path changes with every update.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int, int] | None = None
        self.data = b""
        self.changed()

    def changed(self) -> bool:
        """Re-read the file if it changed since the last call; True when it did."""
        try:
            st = self.path.stat()
        except OSError:
            return False  # mid-swap or removed: keep serving the last good copy
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self._stamp:
            return False
        try:
            data = self.path.read_bytes()
        except OSError:
            return False
        self._stamp, self.data = stamp, data
        return True


class _BearerAuth(grpc.aio.ServerInterceptor):
    """Rejects every TCP call without ``authorization: Bearer <token>`` (constant-time compare).

    Applies to every service on the listener, health included; the token file is re-read when it
    changes, so a rotated token takes effect without a restart.
    """

    def __init__(self, token_file: Path) -> None:
        self._file = _WatchedFile(token_file)
        self._want = self._expected()

        async def deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        async def deny_stream(request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await deny(None, context)

        # The denial has the same shape as the method it replaces, so a streaming client reads a
        # status instead of a protocol error.
        self._deny: dict[tuple[bool, bool], grpc.RpcMethodHandler[Any, Any]] = {
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (False, True): grpc.unary_stream_rpc_method_handler(_deny_unary_stream),
            (True, False): grpc.stream_unary_rpc_method_handler(deny_stream),
            (True, True): grpc.stream_stream_rpc_method_handler(_deny_stream_stream),
        }

    def _expected(self) -> bytes:
        token = self._file.data.decode(errors="replace").strip()
        if not token:
            raise ValueError(f"listen.token_file {self._file.path} is empty")
        return f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        if self._file.changed():
            with contextlib.suppress(ValueError):  # an emptied file keeps the previous token
                self._want = self._expected()
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(got, self._want):
                    return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        return self._deny[handler.request_streaming, handler.response_streaming]


def _refuse(context: grpc.aio.ServicerContext[Any, Any]) -> list[Any]:
    """Set the refusal status; the (empty) stream then ends with it."""
    context.set_code(grpc.StatusCode.UNAUTHENTICATED)
    context.set_details("missing or invalid bearer token")
    return []


async def _deny_unary_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
    for never in _refuse(context):
        yield never


async def _deny_stream_stream(
    request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[Any]:
    for never in _refuse(context):
        yield never


def _server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """TLS credentials that pick up rotated certificate files at the next handshake."""
    files = [_WatchedFile(tls.key_file), _WatchedFile(tls.cert_file)]
    if tls.client_ca_file is not None:
        files.append(_WatchedFile(tls.client_ca_file))

    def current() -> grpc.ServerCertificateConfiguration:
        key, cert = files[0].data, files[1].data
        ca = files[2].data if len(files) > 2 else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        # Called by grpc before every handshake. A half-written rotation (key and certificate from
        # different generations) would fail every handshake, so Secret volumes (atomic swap) are
        # the supported way to rotate.
        changed = [f.changed() for f in files]
        return current() if any(changed) else None

    # The stub omits the documented None ("no change") from the fetcher's return type.
    fetcher: Any = fetch
    return grpc.dynamic_ssl_server_credentials(
        current(), fetcher, require_client_authentication=tls.client_ca_file is not None
    )


def check_directories(config: ServerConfig) -> None:
    """Refuse to start on a directory that is a symbolic link or not a directory at all.

    The block and socket directories are where the server writes; a symlink planted there
    (by whoever else can write the host path) would redirect those writes anywhere on the node.
    Missing directories are fine: the server creates them.
    """
    paths = [("listen.unix_socket's directory", config.listen.unix_socket.parent)]
    tiers = config.tiers
    if tiers.local_disk is not None:
        paths.append(("tiers.local_disk.path", tiers.local_disk.path))
    if tiers.shared is not None:
        paths.append(("tiers.shared.path", tiers.shared.path))
    if config.handover.socket_dir is not None:
        paths.append(("handover.socket_dir", config.handover.socket_dir))
    for field, path in paths:
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            raise ValueError(f"{field} {path} is a symbolic link; refusing to use it")
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"{field} {path} exists and is not a directory; refusing to use it")


async def serve(
    config: ServerConfig,
    *,
    shutdown_trigger: asyncio.Event | None = None,
    install_signal_handlers: bool = False,
) -> None:
    """Run the cache server until ``shutdown_trigger`` is set (or SIGTERM/SIGINT when installed)."""
    stop = shutdown_trigger or asyncio.Event()
    loop = asyncio.get_running_loop()
    if install_signal_handlers:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

    # Secrets and certificates are small files; read them before the loop serves anything (a missing
    # or empty one fails the start, not the first call).
    auth = _BearerAuth(config.listen.token_file) if config.listen.token_file else None
    tls = config.listen.tls
    tls_creds = _server_credentials(tls) if tls else None
    check_directories(config)

    store = TieredStore(config)
    metrics = Metrics(store, max_namespaces=config.limits.max_described_namespaces)
    # Same-node engines look up in this published copy of the index, without a call; it follows
    # every index change (the start-up scan included), so it is complete before anything is served.
    # An empty namespace gets a table only once a client described it over gRPC.
    # The readiness probe asks for its own namespace's table, the way an engine does (``health``).
    publisher: IndexPublisher | None = IndexPublisher(
        store.tier_of, known=lambda ns: ns == PROBE_NAMESPACE or metrics.namespaces.known(ns)
    )
    # Same-node connectors follow each chunk's tiers here to announce them to routers (KV events).
    feed: ResidencyFeed | None = ResidencyFeed(
        store.tiers_holding,
        known=metrics.namespaces.known,
        max_names_bytes=config.limits.max_resident_names_bytes,
    )
    if not store.set_listener(_listeners(publisher, feed)):
        log.warning("a tier cannot report index changes: same-node lookups go over RPC, no residency feed")
        publisher = feed = None
    if feed is not None:
        # The local disk keeps each chunk's names with its copy; its scan hands them back to the feed.
        store.set_names(feed.encoded, feed.restore)
        feed.on_named = store.names_changed  # names that arrive after the write-back reach the disk too
    sock = config.listen.unix_socket
    handover_path = _handover_path(config) if config.handover.enabled else None
    # A predecessor still serving on this node (a rolling update's old pod) hands over its DRAM
    # blocks, clock and deletes before we scan the disks; it stops changing them first. A live one
    # that does not hand over raises HandoverFailed: we never serve beside it (the restart retries).
    inbound: Inbound | None = None
    if handover_path is not None:
        inbound = await loop.run_in_executor(None, receive, handover_path, config.handover.timeout_seconds)
    try:
        if inbound is not None:
            store.learn(inbound.last_gen, inbound.tombstones)
        await loop.run_in_executor(None, store.start)  # header scan: keep the loop free meanwhile
        if inbound is not None:
            blocks, inbound.blocks = inbound.blocks, []
            adopted = await loop.run_in_executor(None, store.adopt, blocks)
            log.info(
                "adopted the predecessor's DRAM blocks", extra={"blocks": adopted, "offered": len(blocks)}
            )
    except BaseException:
        if inbound is not None:
            inbound.close()  # the predecessor thaws and serves on
        raise
    if publisher is not None:
        publisher.start()
    arena = StagingArena(
        config.shm.arena_bytes,
        config.shm.slot_lease_seconds,
        store.counters,
        prealloc_bytes=config.shm.prealloc_bytes,
    )
    state = SharedState(store, arena, metrics, config.limits)
    health = HealthServicer()

    probes: ProbeServer | None = None
    if config.metrics.port is not None:
        query = feed.match if feed is not None and config.metrics.residency_query else None
        probes = ProbeServer(config.metrics.host, config.metrics.port, metrics, query=query)
        probes.start()

    sock.parent.mkdir(parents=True, exist_ok=True)
    # Every socket is bound under a fresh name and published (renamed onto its path) once all serve:
    # the rename replaces a killed server's (or the predecessor's) file in one step.
    grpc_file = SocketFile(sock)
    servers = [_unix_server(grpc_file.bound, state, health)]
    tcp_port: int | None = None
    if config.listen.tcp_port is not None:
        tcp, tcp_port = _tcp_server(config, state, health, auth, tls_creds)
        servers.append(tcp)
    for s in servers:
        await s.start()
    index_socket = None
    if publisher is not None:
        index_socket = IndexSocket(
            index_socket_for(sock.absolute()),
            publisher,
            on_lookups=metrics.count_lookups,
            on_report_dropped=metrics.count_dropped_report,
            max_keys_per_lookup=config.limits.max_keys_per_request,
        )
        index_socket.start(publish=False)
    feed_socket = None
    if feed is not None:
        feed_socket = FeedSocket(residency_socket_for(sock.absolute()), feed)
        feed_socket.start(publish=False)
    # Same-node clients trade the handle names of their loads and stores for memfd descriptors here.
    block_socket = BlockSocket(
        block_socket_for(sock.absolute()),
        lambda name: (
            arena.dup_by_name(name) if name.startswith(STAGING_PREFIX) else store.dram.dup_by_name(name)
        ),
        holds=store.dram,
        limits=BlockLimits(
            max_connections=config.shm.max_block_connections,
            max_connections_per_client=config.shm.max_block_connections_per_client,
            hold_bytes_per_client=config.shm.hold_bytes_per_client,
            hold_blocks_per_client=config.shm.hold_blocks_per_client,
            # As many queued as running: enough to keep the pool busy, never a backlog that outlives
            # a store's deadline.
            max_store_jobs=2 * config.limits.max_concurrent_stores,
        ),
        stores=block_stores(state),
    )
    block_socket.start(publish=False)
    # Engine pods may run as another user: the socket is guarded by its directory's permissions.
    os.chmod(grpc_file.bound, 0o666)  # noqa: S103
    if inbound is not None:
        # Frozen until the predecessor answers nothing any more: meanwhile both serve the same loads,
        # and no delete taken here can be contradicted by what the predecessor still answers.
        await loop.run_in_executor(None, store.freeze, config.handover.freeze_timeout_seconds)
        try:
            await loop.run_in_executor(None, inbound.commit)
        except HandoverFailed:
            await asyncio.gather(*(s.stop(grace=0) for s in servers))
            for closing in (index_socket, block_socket, feed_socket):
                if closing is not None:
                    closing.close()
            grpc_file.remove()
            await loop.run_in_executor(None, store.close)
            raise
    grpc_file.publish()
    if index_socket is not None:
        index_socket.publish()
    if feed_socket is not None:
        feed_socket.publish()
    block_socket.publish()
    if inbound is not None:
        await loop.run_in_executor(None, inbound.published)
        store.thaw(reclaim=False)
    handed = asyncio.Event()
    offer: HandoverOffer | None = None
    if handover_path is not None:

        def took_over() -> None:  # on the offer's thread
            loop.call_soon_threadsafe(handed.set)

        offer = HandoverOffer(
            handover_path,
            store,
            took_over,
            freeze_timeout=config.handover.freeze_timeout_seconds,
            successor_timeout=config.handover.successor_timeout_seconds,
        )
        offer.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    # Ready means every same-node listener answers a client's request, checked from here, now and
    # every second from now on (a flag set once would stay true over a dead accept loop).
    listeners = ListenerProbes(_listener_probes(sock.absolute(), index_socket is not None))
    await loop.run_in_executor(None, listeners.check)
    listeners.start()
    metrics.watch_listeners(listeners)
    if feed is not None:
        metrics.watch_residency(feed.stats)
    if probes is not None:
        probes.listeners = listeners
        probes.ready = True

    reaper = asyncio.create_task(_reap_leases(arena, config.shm.slot_lease_seconds))
    log.info(
        "serving",
        extra={
            "unix_socket": str(sock),
            "tcp_port": tcp_port,
            "metrics_port": probes.port if probes else None,
            "server_id": store.server_id,
            "tiers": store.stats()["tiers"],
        },
    )
    handed_over = False
    try:
        await _first(stop.wait(), handed.wait())
        handed_over = handed.is_set()
    finally:
        log.info("handed over: shutting down" if handed_over else "shutting down")
        if probes is not None:
            probes.ready = False
        listeners.stop()
        await health.enter_graceful_shutdown()
        # Socket files are removed only while they are still ours: after a hand-over each path names
        # the successor's socket (or is about to).
        # Retire the published tables first: engines stop answering from them and ask over RPC.
        if index_socket is not None:
            index_socket.close()
        if feed_socket is not None:
            feed_socket.close()
        block_socket.close()
        if publisher is not None:
            publisher.close()
        reaper.cancel()
        # Calls in flight get a grace period. Only once none is left may a successor take changes:
        # until then it refuses them (it has published its sockets already, so clients reconnect to it).
        await asyncio.gather(*(s.stop(grace=5) for s in servers))
        if offer is not None:
            offer.release()
            offer.close()
        state.close()
        arena.close()
        await loop.run_in_executor(None, lambda: store.close(handed_over=handed_over))
        grpc_file.remove()
        if handed_over and not stop.is_set():
            # Exiting now would make the kubelet restart this container, which would take the node's
            # cache back; the rollout deletes this pod once its successor is ready. Alive, not ready.
            log.info("handed over to the successor; idle until terminated")
            await stop.wait()
        metrics.shutdown()
        if probes is not None:
            probes.stop()
        log.info("stopped")


def _listener_probes(sock: Path, index: bool) -> dict[str, Probe]:
    """The probes of the same-node listeners, each at the path its clients reach (``health``)."""
    probes = {"grpc": probe_grpc(sock), "blocks": probe_blocks(block_socket_for(sock))}
    if index:
        probes["index"] = probe_index(index_socket_for(sock))
    return probes


def _listeners(
    publisher: IndexPublisher | None, feed: ResidencyFeed | None
) -> Callable[[list[BlockId]], None] | None:
    """One store listener that tells the published index, then the residency feed."""
    if publisher is None or feed is None:
        return publisher.changed if publisher is not None else (feed.changed if feed is not None else None)

    def changed(bids: list[BlockId]) -> None:
        publisher.changed(bids)
        feed.changed(bids)

    return changed


def _unix_server(sock: Path, state: SharedState, health: HealthServicer) -> grpc.aio.Server:
    """The same-node listener: every method, shared memory included, on the Unix socket ``sock``.

    Not started yet.
    """
    uds = grpc.aio.server(options=_server_options())
    add_to_server(CacheService(state, allow_shm=True), uds)
    health_pb2_grpc.add_HealthServicer_to_server(health, uds)
    uds.add_insecure_port(f"unix://{sock.absolute()}")
    return uds


def _handover_path(config: ServerConfig) -> Path:
    """The hand-over socket: in ``handover.socket_dir`` (created 0700) if set, else beside the socket."""
    sock = config.listen.unix_socket.absolute()
    where = config.handover.socket_dir
    if where is None:
        return handover_socket_for(sock)
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    # The kubelet creates a missing hostPath directory 0755: only this uid may even look inside.
    try:
        os.chmod(where, 0o700)
    except PermissionError:
        log.warning("cannot make the hand-over directory private", extra={"path": str(where)})
    return where / f"{sock.name}.handover"


async def _first(*waits: Awaitable[Any]) -> None:
    """Wait until the first of ``waits`` completes; cancel the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def _tcp_server(
    config: ServerConfig,
    state: SharedState,
    health: HealthServicer,
    auth: _BearerAuth | None,
    tls_creds: grpc.ServerCredentials | None,
) -> tuple[grpc.aio.Server, int]:
    """The remote listener (no shared memory; bearer auth and TLS when configured) and its bound port.

    Not started yet.
    """
    tcp = grpc.aio.server(options=_server_options(), interceptors=[auth] if auth else [])
    add_to_server(CacheService(state, allow_shm=False), tcp)
    health_pb2_grpc.add_HealthServicer_to_server(health, tcp)
    addr = f"{config.listen.tcp_host}:{config.listen.tcp_port}"
    if tls_creds is not None:
        return tcp, tcp.add_secure_port(addr, tls_creds)
    return tcp, tcp.add_insecure_port(addr)


async def _reap_leases(arena: StagingArena, lease_seconds: float) -> None:
    """Free staging slots whose lease ran out, a few times per lease, until cancelled."""
    while True:
        await asyncio.sleep(min(1.0, lease_seconds / 4))
        arena.reap()
