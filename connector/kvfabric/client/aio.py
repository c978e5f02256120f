"""The asyncio cache client: a facade that runs :class:`~kvfabric.client.CacheClient` calls off the loop.

There is one client implementation, the blocking :class:`~kvfabric.client.CacheClient` (why it is the
core and not an asyncio one: docs/connector.md, "One client, one resilience layer"). This facade
gives asyncio callers the same methods as coroutines: each call runs the blocking client on a small
thread pool owned by this facade, so neither a gRPC wait nor a 32 MiB shared-memory copy blocks the
event loop, and the errors, deadlines and results are exactly the blocking client's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import functools

# `timeout=` mirrors the sync client and gRPC's own per-call deadline (a published contract).
# ruff: noqa: ASYNC109
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvfabric.client import _common as c
from kvfabric.client.localindex import LocalIndex
from kvfabric.client.results import FlushResult, LookupResult, StoreResult
from kvfabric.client.sync import DEFAULT_MAPPING_CACHE_BYTES, CacheClient

__all__ = ["AsyncCacheClient"]

T = TypeVar("T")

# Concurrent calls per facade; more wait for a thread (gRPC itself multiplexes them on one channel).
_THREADS = 8


class AsyncCacheClient:
    """Asyncio transport to one cache server; see :class:`kvfabric.client.CacheClient`.

    ``await close()`` when done (or use ``async with``).
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
    ) -> None:
        self._client = CacheClient(
            target,
            shared_memory=shared_memory,
            token=token,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls_server_name=tls_server_name,
            local_index=local_index,
            token_file=token_file,
            mapping_cache_bytes=mapping_cache_bytes,
        )
        self._pool = cf.ThreadPoolExecutor(_THREADS, thread_name_prefix="kvfabric-aio")

    @property
    def uses_shm(self) -> bool:
        """True when bulk bytes go through shared memory (memfds from the block socket)."""
        return self._client.uses_shm

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    @property
    def local_index(self) -> LocalIndex | None:
        """The published-index reader answering this client's lookups (None: every lookup is a call)."""
        return self._client.local_index

    async def lookup(self, namespace: str, keys: Sequence[str], *, timeout: float) -> LookupResult:
        """How many leading ``keys`` are stored, and in which tier each one is."""
        index = self._client.local_index
        if index is not None and not self._client.describes_pending:
            # Answered from the published table in microseconds: no thread hop, no call.
            c.check_timeout(timeout)
            local = index.lookup(namespace, c.check_ids(namespace, keys))
            if local is not None:
                return local
        return await self._run(self._client.lookup, namespace, keys, timeout=timeout)

    async def load(self, namespace: str, keys: Sequence[str], *, timeout: float) -> list[bytes]:
        """Payloads of the leading present keys (stops at the first miss)."""
        return await self._run(self._client.load, namespace, keys, timeout=timeout)

    async def load_into(
        self, namespace: str, keys: Sequence[str], buffers: Sequence[memoryview], *, timeout: float
    ) -> int:
        """Copy the leading present payloads into ``buffers``; returns how many were loaded."""
        return await self._run(self._client.load_into, namespace, keys, buffers, timeout=timeout)

    async def store(
        self, namespace: str, keys: Sequence[str], payloads: Sequence[c.Payload], *, timeout: float
    ) -> StoreResult:
        """Store payloads; keys the server cannot take now are dropped (counted), never an error."""
        return await self._run(self._client.store, namespace, keys, payloads, timeout=timeout)

    async def delete(self, namespace: str, keys: Sequence[str], *, timeout: float) -> int:
        """Delete keys from every tier; returns how many were stored."""
        return await self._run(self._client.delete, namespace, keys, timeout=timeout)

    async def flush(self, namespace: str, keys: Sequence[str], *, timeout: float) -> FlushResult:
        """Wait (within ``timeout``) for the keys' pending write-backs; say which durable tiers hold each."""
        return await self._run(self._client.flush, namespace, keys, timeout=timeout)

    async def describe(self, namespace: str, spec_json: str, *, timeout: float) -> None:
        """See :meth:`kvfabric.client.CacheClient.describe`."""
        await self._run(self._client.describe, namespace, spec_json, timeout=timeout)

    def announce(self, namespace: str, spec_json: str) -> None:
        """See :meth:`kvfabric.client.CacheClient.announce` (no call now: it only records the description)."""
        self._client.announce(namespace, spec_json)

    async def stats(self, *, timeout: float) -> dict[str, Any]:
        """Return the server's statistics as a dict."""
        return await self._run(self._client.stats, timeout=timeout)

    async def health(self, *, timeout: float) -> bool:
        """Return True when the server's gRPC health service says SERVING, False on any failure."""
        return await self._run(self._client.health, timeout=timeout)

    async def close(self) -> None:
        """Close the channel and stop the threads (calls in flight end at their deadline)."""
        self._client.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> AsyncCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
