"""The asyncio twin of :mod:`kvfabric.connector.resilient`, over ``kvfabric.client.AsyncCacheClient``.

Same contract: deadlines enforced by the caller (``asyncio.wait_for``), bounded retries on
``unavailable``, one circuit breaker per endpoint, never raises, every miss counted with its reason.
For asyncio engines and tools; vLLM's connector hooks are synchronous and use the threaded version.
"""

# ruff: noqa: ASYNC109  (the Protocol mirrors AsyncCacheClient, whose calls take a timeout)
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from kvfabric.client.errors import CacheUnavailable
from kvfabric.client.results import LookupResult, StoreResult
from kvfabric.connector.resilient import (
    CircuitBreaker,
    Counters,
    LoadOutcome,
    LookupOutcome,
    Reason,
    classify,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


class AsyncTransport(Protocol):
    """The subset of ``kvfabric.client.AsyncCacheClient`` used here."""

    async def lookup(self, namespace: str, keys: Sequence[str], *, timeout: float) -> LookupResult:
        """Return how many leading keys are stored and their tiers."""
        ...

    async def load_into(
        self,
        namespace: str,
        keys: Sequence[str],
        buffers: Sequence[memoryview],
        *,
        timeout: float,
    ) -> int:
        """Copy leading payloads into ``buffers``; return how many."""
        ...

    async def store(
        self,
        namespace: str,
        keys: Sequence[str],
        payloads: Sequence[bytes | bytearray | memoryview],
        *,
        timeout: float,
    ) -> StoreResult:
        """Store payloads under keys."""
        ...

    async def close(self) -> None:
        """Release the connection."""
        ...


@dataclass
class AsyncEndpoint:
    """One cache server reached through an async transport, with its own breaker."""

    name: str
    factory: Callable[[], AsyncTransport]
    breaker: CircuitBreaker
    _client: AsyncTransport | None = field(default=None, repr=False)

    def client(self) -> AsyncTransport:
        """Return the transport, creating it on first use."""
        if self._client is None:
            self._client = self.factory()
        return self._client

    async def close(self) -> None:
        """Close the transport if it was opened."""
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.close()
            except Exception:  # closing a broken connection must not fail shutdown
                log.debug("closing %s failed", self.name, exc_info=True)


class AsyncResilientCache:
    """Deadline-bounded, never-raising async access to one or more cache endpoints."""

    def __init__(
        self, endpoints: Sequence[AsyncEndpoint], *, retries: int = 1, counters: Counters | None = None
    ) -> None:
        self.endpoints = list(endpoints)
        self.retries = retries
        self.counters = counters or Counters()

    async def _call(
        self, deadline: float, op: Callable[[AsyncTransport, float], Awaitable[T]]
    ) -> tuple[T | None, Reason | None]:
        last = Reason.UNAVAILABLE
        for ep in self.endpoints:
            attempts = 0
            while attempts <= self.retries:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None, Reason.TIMEOUT
                if not ep.breaker.allow():
                    self.counters.add(f"breaker_open.{ep.name}")
                    break
                attempts += 1
                try:
                    result = await asyncio.wait_for(op(ep.client(), remaining), remaining)
                except Exception as exc:  # every failure becomes a reason
                    reason = classify(exc)
                    if reason in (Reason.TIMEOUT, Reason.UNAVAILABLE):
                        ep.breaker.failure()
                    else:
                        ep.breaker.success()
                    self.counters.add(f"error.{ep.name}.{reason.value}")
                    if reason is Reason.UNAVAILABLE:
                        last = reason
                        if not isinstance(exc, CacheUnavailable):
                            break
                        continue
                    return None, reason
                ep.breaker.success()
                return result, None
        return None, last

    async def lookup(self, namespace: str, keys: Sequence[str], deadline_s: float) -> LookupOutcome:
        """Return how many leading ``keys`` are stored; 0 with a reason on any failure."""
        if not keys:
            return LookupOutcome(0, [])
        res, reason = await self._call(
            time.monotonic() + deadline_s, lambda c, t: c.lookup(namespace, keys, timeout=t)
        )
        if res is None:
            return LookupOutcome(0, [], reason or Reason.UNAVAILABLE)
        matched = max(0, min(res.matched, len(keys)))
        return LookupOutcome(matched, list(res.tiers[:matched]), None if matched else Reason.NOT_FOUND)

    async def load_into(
        self,
        namespace: str,
        keys: Sequence[str],
        buffers: Sequence[bytearray | memoryview],
        deadline_s: float,
    ) -> LoadOutcome:
        """Fill the leading ``buffers``; on a timeout the buffers must be dropped, never reused."""
        if not keys:
            return LoadOutcome(0)
        views = [memoryview(b) for b in buffers]
        res, reason = await self._call(
            time.monotonic() + deadline_s, lambda c, t: c.load_into(namespace, keys, views, timeout=t)
        )
        if res is None:
            return LoadOutcome(0, reason or Reason.UNAVAILABLE)
        count = max(0, min(int(res), len(keys)))
        return LoadOutcome(count, None if count == len(keys) else Reason.NOT_FOUND)

    async def store(
        self,
        namespace: str,
        keys: Sequence[str],
        payloads: Sequence[bytes | bytearray | memoryview],
        deadline_s: float,
    ) -> StoreResult | None:
        """Store ``payloads``; return the server's answer or ``None`` (counted) on failure."""
        res, reason = await self._call(
            time.monotonic() + deadline_s, lambda c, t: c.store(namespace, keys, payloads, timeout=t)
        )
        if res is None:
            self.counters.add(f"store_failed.{(reason or Reason.UNAVAILABLE).value}", len(keys))
            return None
        self.counters.add("store_accepted", res.accepted)
        self.counters.add("store_dropped", res.dropped)
        return res

    async def close(self) -> None:
        """Close every transport."""
        for ep in self.endpoints:
            await ep.close()


def async_transport_factory(
    target: str,
    *,
    shm_dir: str | None = None,
    token: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> Callable[[], AsyncTransport]:
    """Return a factory for the real ``kvfabric.client.AsyncCacheClient`` (imported on first use)."""

    def make() -> AsyncTransport:
        from kvfabric.client import AsyncCacheClient

        client: AsyncTransport = AsyncCacheClient(
            target, shm_dir=shm_dir, token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key
        )
        return client

    return make
