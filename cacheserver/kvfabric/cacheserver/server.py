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
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from kvfabric.cacheserver.config import ServerConfig
from kvfabric.cacheserver.engine.tiered import TieredStore
from kvfabric.cacheserver.metrics import Metrics, ProbeServer
from kvfabric.cacheserver.service import CacheService, SharedState, add_to_server
from kvfabric.cacheserver.transport.arena import StagingArena
from kvfabric.cacheserver.transport.indexpub import IndexPublisher, IndexSocket
from kvfabric.rpc.indextable import index_socket_for

__all__ = ["serve"]

log = logging.getLogger(__name__)

_SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 80 << 20),  # a 64 MiB piece plus framing, never more
    ("grpc.max_send_message_length", -1),
    ("grpc.so_reuseport", 0),
]
SERVICE_NAME = "kvfabric.rpc.v1.Cache"


class _BearerAuth(grpc.aio.ServerInterceptor):
    """Rejects TCP calls without ``authorization: Bearer <token>`` (constant-time compare)."""

    def __init__(self, token: str) -> None:
        self._want = f"Bearer {token}".encode()

        async def deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        self._deny: grpc.RpcMethodHandler[Any, Any] = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(got, self._want):
                    return await continuation(details)
        return self._deny


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

    # Secrets and certificates are small files; read them before the loop serves anything.
    token = config.listen.token_file.read_text().strip() if config.listen.token_file else None
    tls = config.listen.tls
    tls_pair = (tls.key_file.read_bytes(), tls.cert_file.read_bytes()) if tls else None
    if config.listen.token_file is not None and not token:
        raise ValueError(f"listen.token_file {config.listen.token_file} is empty")

    store = TieredStore(config)
    # Same-node engines look up in this published copy of the index, without a call; it follows
    # every index change (the start-up scan included), so it is complete before anything is served.
    publisher = IndexPublisher(store.tier_of)
    store.set_listener(publisher.changed)
    await loop.run_in_executor(None, store.start)  # header scan: keep the loop free meanwhile
    publisher.start()
    arena = StagingArena(
        config.shm.dir, config.shm.arena_bytes, config.shm.slot_lease_seconds, store.counters
    )
    metrics = Metrics(store)
    state = SharedState(store, arena, metrics, config.limits)
    health = HealthServicer()

    probes: ProbeServer | None = None
    if config.metrics.port is not None:
        probes = ProbeServer(config.metrics.host, config.metrics.port, metrics)
        probes.start()

    servers: list[grpc.aio.Server] = []
    uds = grpc.aio.server(options=_SERVER_OPTIONS)
    add_to_server(CacheService(state, allow_shm=True), uds)
    health_pb2_grpc.add_HealthServicer_to_server(health, uds)
    sock = config.listen.unix_socket
    sock.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        sock.unlink()  # a stale socket from a killed predecessor
    uds.add_insecure_port(f"unix://{sock.absolute()}")
    servers.append(uds)

    tcp_port: int | None = None
    if config.listen.tcp_port is not None:
        interceptors = []
        if token:
            interceptors.append(_BearerAuth(token))
        tcp = grpc.aio.server(options=_SERVER_OPTIONS, interceptors=interceptors)
        add_to_server(CacheService(state, allow_shm=False), tcp)
        health_pb2_grpc.add_HealthServicer_to_server(health, tcp)
        addr = f"{config.listen.tcp_host}:{config.listen.tcp_port}"
        if tls_pair is not None:
            tcp_port = tcp.add_secure_port(addr, grpc.ssl_server_credentials([tls_pair]))
        else:
            tcp_port = tcp.add_insecure_port(addr)
        servers.append(tcp)

    for s in servers:
        await s.start()
    index_socket = IndexSocket(index_socket_for(sock.absolute()), publisher)
    index_socket.start()
    # Engine pods may run as another user: the socket is guarded by its directory's permissions.
    os.chmod(sock, 0o666)  # noqa: S103
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    if probes is not None:
        probes.ready = True

    async def reap_leases() -> None:
        while True:
            await asyncio.sleep(min(1.0, config.shm.slot_lease_seconds / 4))
            arena.reap()

    reaper = asyncio.create_task(reap_leases())
    log.info(
        "serving",
        extra={
            "unix_socket": str(sock),
            "tcp_port": tcp_port,
            "metrics_port": probes.port if probes else None,
            "shm_dir": str(config.shm.dir),
            "server_id": store.server_id,
            "tiers": store.stats()["tiers"],
        },
    )
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        if probes is not None:
            probes.ready = False
        await health.enter_graceful_shutdown()
        # Retire the published tables first: engines stop answering from them and ask over RPC.
        index_socket.close()
        publisher.close()
        reaper.cancel()
        await asyncio.gather(*(s.stop(grace=5) for s in servers))
        state.close()
        arena.close()
        await loop.run_in_executor(None, store.close)
        metrics.shutdown()
        if probes is not None:
            probes.stop()
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        log.info("stopped")
