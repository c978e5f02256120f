"""Transport client of the kvfabric cache server (sync and asyncio).

A clean transport: deadlines on every call and typed errors (:mod:`kvfabric.client.errors`), no retries
and no circuit breaker (the connector's resilience layer adds those).

>>> c = CacheClient("unix:///run/kvfabric/cache.sock", shared_memory=True)  # doctest: +SKIP
>>> c.lookup(ns, keys, timeout=0.05).matched                                          # doctest: +SKIP
"""

from kvfabric.client.aio import AsyncCacheClient
from kvfabric.client.results import FlushResult, LookupResult, StoreResult
from kvfabric.client.sync import CacheClient

__all__ = ["AsyncCacheClient", "CacheClient", "FlushResult", "LookupResult", "StoreResult"]
