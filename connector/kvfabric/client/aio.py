"""The asyncio cache client: the same methods as :class:`~kvfabric.client.CacheClient`, as coroutines."""

from __future__ import annotations

import asyncio

# `timeout=` mirrors the sync client and gRPC's own per-call deadline (a published contract).
# ruff: noqa: ASYNC109
import contextlib
import json
import os
import time
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio

from kvfabric.client import _common as c
from kvfabric.client.errors import CacheTimeout, InvalidRequest
from kvfabric.client.localindex import LocalIndex
from kvfabric.client.results import LookupResult, StoreResult
from kvfabric.rpc.v1 import cache_pb2 as pb
from kvfabric.rpc.v1 import cache_pb2_grpc as pb_grpc

__all__ = ["AsyncCacheClient"]

T = TypeVar("T")


class AsyncCacheClient:
    """Asyncio transport to one cache server; see :class:`kvfabric.client.CacheClient`.

    Shared-memory file copies run in a worker thread so that a 32 MiB copy never blocks the event loop.
    Create it inside a running event loop and ``await close()`` when done.
    """

    def __init__(
        self,
        target: str,
        *,
        shm_dir: str | os.PathLike[str] | None = None,
        token: str | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        tls_server_name: str | None = None,
        local_index: bool = False,
    ) -> None:
        self._target = c.parse_target(target)
        # Same node: answer lookups from the table the server publishes (no call per lookup).
        self._index = c.local_index_for(self._target) if local_index else None
        self._shm_dir = Path(shm_dir) if shm_dir is not None and self._target.is_unix else None
        self._md = c.metadata(token)
        creds = c.credentials(tls_ca, tls_cert, tls_key)
        if creds is not None and not self._target.is_unix:
            options = c.CHANNEL_OPTIONS + c.server_name_option(tls_server_name)
            self._channel = grpc.aio.secure_channel(self._target.address, creds, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(self._target.address, options=c.CHANNEL_OPTIONS)
        # The generated stub is untyped; the request/response messages are typed by cache_pb2.pyi.
        self._stub: Any = pb_grpc.CacheStub(self._channel)  # type: ignore[no-untyped-call]
        self._health_check: Any = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=lambda _: b"",
            response_deserializer=lambda data: data == b"\x08\x01",
        )

    @property
    def local_index(self) -> LocalIndex | None:
        """The published-index reader answering this client's lookups (None: every lookup is a call)."""
        return self._index

    @property
    def uses_shm(self) -> bool:
        """True when bulk bytes go through the shared-memory arena."""
        return self._shm_dir is not None

    async def _call(self, aw: Awaitable[T]) -> T:
        try:
            return await aw
        except grpc.RpcError as exc:
            raise c.map_rpc_error(exc) from exc

    async def lookup(self, namespace: str, keys: Sequence[str], *, timeout: float) -> LookupResult:
        """How many leading ``keys`` are stored, and in which tier each one is."""
        c.check_timeout(timeout)
        raw = c.check_ids(namespace, keys)
        if self._index is not None:
            local = self._index.lookup(namespace, raw)
            if local is not None:
                return local
        req = pb.LookupRequest(namespace=namespace, keys=keys)
        return c.lookup_result(await self._call(self._stub.Lookup(req, timeout=timeout, metadata=self._md)))

    async def load(self, namespace: str, keys: Sequence[str], *, timeout: float) -> list[bytes]:
        """Payloads of the leading present keys (stops at the first miss)."""
        c.check_timeout(timeout)
        c.check_ids(namespace, keys)
        req = pb.LoadRequest(namespace=namespace, keys=keys)
        if self._shm_dir is not None:
            out: list[bytes] = []
            call = self._stub.ShmLoad(req, timeout=timeout, metadata=self._md)
            try:
                async for slot in call:
                    data = await asyncio.to_thread(c.shm_read_one, self._shm_dir, slot)
                    if data is None:
                        break
                    out.append(data)
            except grpc.RpcError as exc:
                raise c.map_rpc_error(exc) from exc
            finally:
                call.cancel()
            return out
        asm = c.LoadAssembler()
        await self._stream_load(req, timeout, asm)
        return asm.payloads

    async def load_into(
        self, namespace: str, keys: Sequence[str], buffers: Sequence[memoryview], *, timeout: float
    ) -> int:
        """Copy the leading present payloads into ``buffers``; returns how many were loaded."""
        c.check_timeout(timeout)
        c.check_ids(namespace, keys)
        if len(buffers) < len(keys):
            raise InvalidRequest(f"{len(keys)} keys but only {len(buffers)} buffers")
        req = pb.LoadRequest(namespace=namespace, keys=keys)
        if self._shm_dir is not None:
            count = 0
            call = self._stub.ShmLoad(req, timeout=timeout, metadata=self._md)
            try:
                async for slot in call:
                    if count >= len(keys):
                        break
                    ok = await asyncio.to_thread(
                        c.shm_read_one_into, self._shm_dir, slot, buffers[count], count
                    )
                    if not ok:
                        break
                    count += 1
            except grpc.RpcError as exc:
                raise c.map_rpc_error(exc) from exc
            finally:
                call.cancel()
            return count
        asm = c.LoadAssembler(buffers)
        await self._stream_load(req, timeout, asm)
        return asm.count

    async def _stream_load(self, req: pb.LoadRequest, timeout: float, asm: c.LoadAssembler) -> None:
        call = self._stub.Load(req, timeout=timeout, metadata=self._md)
        try:
            async for chunk in call:
                asm.feed(chunk)
        except grpc.RpcError as exc:
            raise c.map_rpc_error(exc) from exc
        finally:
            call.cancel()
        asm.done()

    async def store(
        self, namespace: str, keys: Sequence[str], payloads: Sequence[c.Payload], *, timeout: float
    ) -> StoreResult:
        """Store payloads; keys the server cannot take now are dropped (counted), never an error."""
        c.check_timeout(timeout)
        c.check_ids(namespace, keys)
        c.check_payloads(keys, payloads)
        if not keys:
            return StoreResult(0, 0)
        deadline = time.monotonic() + timeout
        if self._shm_dir is not None:
            begin = pb.ShmStoreBeginRequest(
                namespace=namespace, keys=keys, lengths=[memoryview(p).nbytes for p in payloads]
            )
            resp = await self._call(self._stub.ShmStoreBegin(begin, timeout=timeout, metadata=self._md))
            try:
                await asyncio.to_thread(c.shm_write, self._shm_dir, resp.slots, payloads)
            except BaseException:
                abort = pb.ShmStoreCommitRequest(lease_id=resp.lease_id, abort=True)
                # The lease expires on its own if this fails.
                with contextlib.suppress(grpc.RpcError):
                    await self._stub.ShmStoreCommit(abort, timeout=1.0, metadata=self._md)
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise CacheTimeout("deadline passed while writing to the shared-memory arena")
            commit = pb.ShmStoreCommitRequest(lease_id=resp.lease_id)
            done = await self._call(self._stub.ShmStoreCommit(commit, timeout=left, metadata=self._md))
            return StoreResult(done.accepted, done.dropped)
        chunks = c.store_chunks(namespace, keys, payloads)
        done = await self._call(self._stub.Store(chunks, timeout=timeout, metadata=self._md))
        return StoreResult(done.accepted, done.dropped)

    async def delete(self, namespace: str, keys: Sequence[str], *, timeout: float) -> int:
        """Delete keys from every tier; returns how many were stored."""
        c.check_timeout(timeout)
        c.check_ids(namespace, keys)
        req = pb.DeleteRequest(namespace=namespace, keys=keys)
        resp = await self._call(self._stub.Delete(req, timeout=timeout, metadata=self._md))
        return int(resp.deleted)

    async def stats(self, *, timeout: float) -> dict[str, Any]:
        """Return the server's statistics as a dict."""
        c.check_timeout(timeout)
        resp = await self._call(self._stub.Stats(pb.StatsRequest(), timeout=timeout, metadata=self._md))
        out: dict[str, Any] = json.loads(resp.json)
        return out

    async def health(self, *, timeout: float) -> bool:
        """Return True when the server's gRPC health service says SERVING, False on any failure."""
        c.check_timeout(timeout)
        try:
            return bool(await self._health_check(b"", timeout=timeout, metadata=self._md))
        except grpc.RpcError:
            return False

    async def close(self) -> None:
        """Close the channel (and unmap the published index)."""
        await self._channel.close()
        if self._index is not None:
            self._index.close()

    async def __aenter__(self) -> AsyncCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
