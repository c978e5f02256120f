"""Typed errors of the cache client: one class per way a call can fail.

The resilience layer above this client (retries, circuit breaker, miss reasons) dispatches on these
classes, so each maps one gRPC status family and keeps the original error as ``__cause__``.
"""

from __future__ import annotations

# The class names are a published contract (the connector dispatches on them); no "Error" suffix.
# ruff: noqa: N818

__all__ = [
    "CacheCorrupt",
    "CacheError",
    "CacheOverloaded",
    "CacheSuspect",
    "CacheTimeout",
    "CacheUnavailable",
    "InvalidRequest",
    "NotFound",
    "PermissionDenied",
]


class CacheError(Exception):
    """Base class of every error raised by :mod:`kvfabric.client`."""


class CacheUnavailable(CacheError):
    """The server cannot be reached or is shutting down (retry later or recompute)."""


class CacheOverloaded(CacheUnavailable):
    """The server refused the call for lack of capacity (RESOURCE_EXHAUSTED)."""


class CacheSuspect(CacheUnavailable):
    """A same-node server sent no first reply within its reply bound, or is suspect since one did not.

    Fails in milliseconds instead of the heartbeat's staleness bound (:mod:`kvfabric.client.suspicion`);
    not the server's failure yet: a slow one is cleared by its next heartbeat.
    """


class CacheTimeout(CacheError):
    """The call's deadline passed before the server answered."""


class CacheCorrupt(CacheError):
    """The server or its shared memory returned data that failed an integrity check."""


class InvalidRequest(CacheError):
    """The request was malformed (bad namespace/key, oversized payload, mismatched lengths)."""


class NotFound(CacheError):
    """A named object (e.g. a store lease) does not exist on the server."""


class PermissionDenied(CacheError):
    """Missing or wrong bearer token, or a TLS problem."""
