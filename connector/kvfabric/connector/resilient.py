"""Resilience on top of the transport client: deadlines, bounded retries, a circuit breaker, counters.

The connector must never make a request slower than recomputing it would have been, and never fail
it. So every call here:

- has a deadline that is enforced *by the caller's wait*, not only by the transport: the transport
  call runs on a small thread pool and the caller stops waiting when the deadline passes, even if
  the server is frozen (SIGSTOP) and the transport misbehaves. A call still queued at its deadline
  is cancelled; one that starts late never reaches the transport. A load reports the calls it
  abandoned while they were running (:attr:`LoadOutcome.inflight`): until they finish they may
  still write into its buffers, so the caller must not give those buffers to anyone else;
- never raises: failures become an outcome with a reason (``not-found``, ``timeout``,
  ``unavailable``, ``corrupt``, ``namespace-mismatch``), counted in :class:`Counters`;
- goes through a per-endpoint circuit breaker, so a dead server costs a few deadlines and then
  nothing (fail fast) until a probe succeeds;
- tries the node-local endpoint (Unix socket + shared memory) first and the remote one (TCP) next.

This is the one resilience layer. :class:`ResilientCache` is the core (blocking calls, because vLLM's
connector hooks are synchronous); :class:`AsyncResilientCache` is a facade that runs the same calls
off an asyncio loop. :func:`build_cache` hands every half of the connector in one process the same
:class:`ResilientCache` for the same servers, so the scheduler's lookups and the worker's loads share
one connection per server and one breaker: both see the server come back at the same moment.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import enum
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from kvfabric.client.errors import (
    CacheCorrupt,
    CacheError,
    CacheSuspect,
    CacheTimeout,
    CacheUnavailable,
    NotFound,
)
from kvfabric.client.mappings import Lease, release_all
from kvfabric.client.results import LookupResult, StoreResult
from kvfabric.client.suspicion import REPLY_FLOOR_S
from kvfabric.connector.settings import ConnectorSettings

log = logging.getLogger(__name__)

T = TypeVar("T")


class Reason(enum.StrEnum):
    """Why a chunk was not served from the cache (or a store did not land)."""

    NOT_FOUND = "not-found"
    TIMEOUT = "timeout"
    UNAVAILABLE = "unavailable"
    CORRUPT = "corrupt"
    NAMESPACE_MISMATCH = "namespace-mismatch"
    RECOMPUTE_FASTER = "recompute-faster"
    """Skipped: the cost model expects recomputing the chunks to beat restoring them."""


class Transport(Protocol):
    """The subset of ``kvfabric.client.CacheClient`` the connector uses."""

    def lookup(self, namespace: str, keys: Sequence[str], *, timeout: float) -> LookupResult:
        """Return how many leading keys are stored and their tiers."""
        ...

    def load_into(
        self, namespace: str, keys: Sequence[str], buffers: Sequence[memoryview], *, timeout: float
    ) -> int:
        """Copy leading payloads into ``buffers``; return how many."""
        ...

    def store(
        self,
        namespace: str,
        keys: Sequence[str],
        payloads: Sequence[bytes | bytearray | memoryview],
        *,
        timeout: float,
    ) -> StoreResult:
        """Store payloads under keys."""
        ...

    def close(self) -> None:
        """Release the connection."""
        ...


class Counters:
    """Thread-safe counters of cache outcomes, by reason. ``snapshot()`` returns plain dicts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name``."""
        with self._lock:
            self._c[name] += n

    def miss(self, reason: Reason, chunks: int = 1) -> None:
        """Count a lookup that found nothing usable (per request) for ``reason``."""
        self.add(f"miss.{reason.value}")
        self.add(f"miss_chunks.{reason.value}", chunks)

    def fallback(self, reason: Reason, chunks: int = 1) -> None:
        """Count a hit that could not be loaded and was recomputed, for ``reason``."""
        self.add(f"fallback.{reason.value}")
        self.add(f"fallback_chunks.{reason.value}", chunks)

    def get(self, name: str) -> int:
        """Return counter ``name`` (0 if never incremented)."""
        with self._lock:
            return self._c[name]

    def snapshot(self) -> dict[str, int]:
        """Return a copy of every counter."""
        with self._lock:
            return dict(self._c)


class CircuitBreaker:
    """Consecutive-failure breaker: closed -> open (fail fast) -> half-open (one probe) -> closed.

    Only timeouts and unavailability count as failures: a miss or a corrupt block says the server is
    alive and answering.
    """

    def __init__(
        self,
        failures: int,
        cooldown_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_cooldown_s: float | None = None,
    ) -> None:
        """``cooldown_s`` after the breaker opens; each failed probe doubles it, up to ``max_cooldown_s``.

        A short first cooldown brings a restarted server back quickly; the doubling keeps a server
        that stays hung from costing a probe's deadline every ``cooldown_s``.
        """
        self._threshold = failures
        self._base = cooldown_s
        self._max = max(cooldown_s, max_cooldown_s if max_cooldown_s is not None else cooldown_s)
        self._cooldown = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._open_until: float | None = None
        self._probing = False
        self._probe_at = 0.0

    @property
    def state(self) -> str:
        """``closed``, ``open`` or ``half-open``."""
        with self._lock:
            if self._open_until is None:
                return "closed"
            return "open" if self._clock() < self._open_until else "half-open"

    def allow(self) -> bool:
        """Return whether a call may go through now (at most one probe while half-open).

        A probe that has not reported for a whole cooldown is presumed lost and another is let
        through: a caller that took the probe and never said how it went must not wedge the breaker.
        """
        with self._lock:
            if self._open_until is None:
                return True
            now = self._clock()
            if now < self._open_until or (self._probing and now < self._probe_at + self._cooldown):
                return False
            self._probing, self._probe_at = True, now
            return True

    def success(self) -> None:
        """Record a call that reached a live server."""
        with self._lock:
            self._failures = 0
            self._open_until = None
            self._probing = False
            self._cooldown = self._base

    def abandon(self) -> None:
        """Give back a probe that reached no server (the caller then asks by another path)."""
        with self._lock:
            self._probing = False

    def failure(self, *, slow: bool = True) -> None:
        """Record a timeout (``slow``) or an unreachable server (``slow=False``).

        Only a probe that timed out doubles the cooldown: it cost its caller the whole deadline (a
        hung server). A refused connection fails in microseconds, so a dead server is probed again
        after the first cooldown, and a restarted one is used again within about that long.
        """
        with self._lock:
            self._failures += 1
            if self._probing:  # the half-open probe failed
                self._cooldown = min(self._max, self._cooldown * 2) if slow else self._base
            self._probing = False
            if self._failures >= self._threshold:
                self._open_until = self._clock() + self._cooldown


@dataclass
class Endpoint:
    """One cache server reachable through one transport, with its own breaker."""

    name: str
    factory: Callable[[], Transport]
    breaker: CircuitBreaker
    _client: Transport | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _specs: dict[str, str] = field(default_factory=dict)

    def client(self) -> Transport:
        """Return the transport, connecting on first use (a server may start after the engine)."""
        with self._lock:
            if self._client is None:
                self._client = self.factory()
                for namespace, spec_json in self._specs.items():
                    _announce(self._client, namespace, spec_json)
            return self._client

    def announce(self, namespace: str, spec_json: str) -> None:
        """Have the transport describe ``namespace`` to its server (now and after reconnects)."""
        with self._lock:
            self._specs[namespace] = spec_json
            if self._client is not None:
                _announce(self._client, namespace, spec_json)

    def close(self) -> None:
        """Close the transport if it was opened."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a broken connection must not fail shutdown
                log.debug("closing %s failed", self.name, exc_info=True)


_WARM_TIMEOUT_S = 5.0
"""How long connecting and describing at start may take (a server not up yet: the first call retries)."""


def _warm_done(fut: cf.Future[None]) -> None:
    exc = None if fut.cancelled() else fut.exception()
    if exc is not None:
        log.debug("connecting to the cache server at start failed (the first call retries): %r", exc)


def _announce(client: Transport, namespace: str, spec_json: str) -> None:
    # Optional in the Transport protocol: a transport without it (a test fake) just never describes.
    announce = getattr(client, "announce", None)
    if announce is None:
        return
    try:
        announce(namespace, spec_json)
    except Exception:  # a description is for status only: it must never break the cache path
        log.warning("could not announce namespace %s", namespace[:12], exc_info=True)


@dataclass(frozen=True)
class LookupOutcome:
    """Result of a resilient lookup: ``matched`` leading keys, or 0 with a ``reason``."""

    matched: int
    tiers: list[str]
    reason: Reason | None = None


@dataclass(frozen=True)
class LoadOutcome:
    """Result of a resilient load: ``count`` leading buffers filled; ``reason`` if fewer than asked."""

    count: int
    reason: Reason | None = None
    inflight: tuple[cf.Future[Any], ...] = ()
    """Transport calls given up at the deadline while they were running: until each is done it may
    still write into the buffers of this load (a frozen server, a transport ignoring its timeout)."""

    @property
    def settled(self) -> bool:
        """True when no transport call can write into this load's buffers any more."""
        return all(f.done() for f in self.inflight)


@dataclass(frozen=True)
class ViewsOutcome:
    """Result of :meth:`ResilientCache.load_views`: leases of the leading payloads, in key order."""

    leases: list[Lease]
    reason: Reason | None = None
    """Why fewer payloads than asked were lent (``None`` when all were)."""


def _release_leases(fut: cf.Future[Any]) -> None:
    # A load_views call given up at its deadline: nobody will read what it lent.
    if fut.cancelled() or fut.exception() is not None:
        return
    result = fut.result()
    if isinstance(result, list):
        release_all(x for x in result if isinstance(x, Lease))


def classify(exc: BaseException) -> Reason:
    """Map an exception from a transport call to a miss reason."""
    if isinstance(exc, CacheTimeout | cf.TimeoutError | TimeoutError):
        return Reason.TIMEOUT
    if isinstance(exc, CacheCorrupt):
        return Reason.CORRUPT
    if isinstance(exc, NotFound):
        return Reason.NOT_FOUND
    # CacheUnavailable, permission/invalid-request (misconfiguration), connection errors, bugs:
    # all mean "this server cannot help now".
    return Reason.UNAVAILABLE


def _invoke(op: Callable[[Transport, float], T], ep: Endpoint, deadline: float) -> T:
    # The timeout is computed when the call starts, not when it was queued: a call that waited for
    # a thread past its deadline never reaches the transport (and never touches its buffers).
    timeout = deadline - time.monotonic()
    if timeout <= 0:
        raise CacheTimeout("the call started after its deadline")
    return op(ep.client(), timeout)


class ResilientCache:
    """Deadline-bounded, never-raising access to one or more cache endpoints (first is preferred)."""

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        *,
        retries: int = 1,
        counters: Counters | None = None,
        io_threads: int = 4,
    ) -> None:
        self.endpoints = list(endpoints)
        self.retries = retries
        self.counters = counters or Counters()
        # Lookups and stores never queue behind loads: loads have a pool of their own. With
        # asynchronous loads, loads run while the scheduler looks up, and a lookup queued behind
        # them would time out in the queue (and count against a healthy server's breaker).
        self._io = cf.ThreadPoolExecutor(io_threads, thread_name_prefix="kvfabric-io")
        self._io_loads = cf.ThreadPoolExecutor(io_threads, thread_name_prefix="kvfabric-load-io")
        self._closed = False
        self._users = 1
        self._users_lock = threading.Lock()
        self._on_close: Callable[[], None] | None = None

    def acquire(self) -> ResilientCache:
        """Add a user: the cache closes when every user has called :meth:`close`."""
        with self._users_lock:
            self._users += 1
        return self

    def describe(self, namespace: str, spec_json: str, *, lookups: bool = False) -> None:
        """Tell every endpoint's server what ``namespace`` stands for (its canonical description).

        The transport sends it before its next call and again whenever the server says it lacks it
        (after a restart), so the pool's status can show the namespaces in use. Never raises, never waits.

        The preferred endpoint is also connected and told now, on an I/O thread, and with ``lookups``
        (the caller looks ``namespace`` up) its published table is mapped: otherwise the first
        request's lookup would open the transport (the channel, the block socket, the table) and send
        the description on its own path, over RPC because the table was not open yet.
        """
        for ep in self.endpoints:
            ep.announce(namespace, spec_json)
        if self.endpoints:
            self._warm(self.endpoints[0], namespace if lookups else None)

    def _warm(self, ep: Endpoint, namespace: str | None) -> None:
        """Connect ``ep`` and get it ready, in the background (best effort, never raises)."""

        def send(client: Transport, timeout: float) -> None:
            # Optional in the Transport protocol, as announce is: a fake only connects.
            warm_up = getattr(client, "warm_up", None)
            if warm_up is not None:
                warm_up(namespace, timeout=timeout)

        try:
            fut = self._io.submit(_invoke, send, ep, time.monotonic() + _WARM_TIMEOUT_S)
        except RuntimeError:  # closed
            return
        fut.add_done_callback(_warm_done)

    def _call(
        self,
        deadline: float,
        op: Callable[[Transport, float], T],
        abandoned: list[cf.Future[Any]] | None = None,
        pool: cf.ThreadPoolExecutor | None = None,
    ) -> tuple[T | None, Reason | None]:
        """Run ``op`` against the endpoints in order until one answers, within ``deadline``.

        Attempts given up while running are appended to ``abandoned`` (queued ones are cancelled).
        """
        last: Reason = Reason.UNAVAILABLE
        for ep in self.endpoints:
            attempts = 0
            while attempts <= self.retries:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None, Reason.TIMEOUT
                if not ep.breaker.allow():
                    last = Reason.UNAVAILABLE
                    self.counters.add(f"breaker_open.{ep.name}")
                    break
                attempts += 1
                fut: cf.Future[T] | None = None
                try:
                    fut = (pool or self._io).submit(_invoke, op, ep, deadline)
                    result = fut.result(timeout=remaining)
                except Exception as exc:  # every failure becomes a reason, never an exception
                    # The wait gave up on a call that runs (or finished just after the wait: what it
                    # returns, a load's leases, is nobody's, and the caller must let go of it).
                    gave_up = isinstance(exc, cf.TimeoutError) and fut is not None and not fut.cancel()
                    if gave_up and fut is not None and abandoned is not None:
                        abandoned.append(fut)
                    reason = classify(exc)
                    if isinstance(exc, CacheSuspect):
                        # Suspect, not failed: its heartbeat says within ~50 ms whether it was only
                        # slow, so it does not count against the breaker (which would keep a slow
                        # server's hits away for a whole cooldown). Not retried: a retry now is
                        # refused at once.
                        ep.breaker.abandon()
                        self.counters.add(f"suspect.{ep.name}")
                        last = reason
                        break
                    if reason in (Reason.TIMEOUT, Reason.UNAVAILABLE):
                        ep.breaker.failure(slow=reason is Reason.TIMEOUT)
                    else:
                        ep.breaker.success()
                    log.debug("cache call to %s failed: %s (%r)", ep.name, reason, exc)
                    self.counters.add(f"error.{ep.name}.{reason.value}")
                    if reason is Reason.UNAVAILABLE:
                        last = reason
                        if not isinstance(exc, CacheUnavailable):
                            break  # not transient: go to the next endpoint without retrying
                        continue
                    return None, reason
                ep.breaker.success()
                return result, None
        return None, last

    def _lookup_local(self, namespace: str, keys: Sequence[str], raw: bytes | None) -> LookupOutcome | None:
        """The preferred endpoint's published index, on the caller's thread; None: make the call.

        A lookup answered from shared memory takes microseconds: a hop to the I/O pool would cost
        more than the lookup (and, under load, the GIL's switch interval).
        """
        ep = self.endpoints[0] if self.endpoints else None
        client = ep._client if ep is not None else None  # only once connected (the pool connects)
        local = getattr(client, "lookup_local", None)
        # Only a client with a published index may take the breaker's half-open probe here: one
        # that took it and then asked over RPC would find the probe taken, and the breaker, never
        # told how the probe went, would stay half-open with its probe "in flight" for good.
        if ep is None or local is None or getattr(client, "local_index", None) is None:
            return None
        if not ep.breaker.allow():
            return None
        try:
            res: LookupResult | None = local(namespace, keys) if raw is None else local(namespace, keys, raw)
        except CacheSuspect as exc:
            ep.breaker.abandon()  # as in _call: suspect is not failed
            log.debug("published index of %s: %r", ep.name, exc)
            self.counters.add(f"suspect.{ep.name}")
            return LookupOutcome(0, [], Reason.UNAVAILABLE)
        except CacheUnavailable as exc:
            ep.breaker.failure(slow=False)
            log.debug("published index of %s: %r", ep.name, exc)
            self.counters.add(f"error.{ep.name}.{Reason.UNAVAILABLE.value}")
            return LookupOutcome(0, [], Reason.UNAVAILABLE)
        except Exception:
            ep.breaker.abandon()
            log.debug("published index of %s failed; asking over RPC", ep.name, exc_info=True)
            return None
        if res is None:
            ep.breaker.abandon()  # the index could not answer: the RPC below is the probe
            return None
        ep.breaker.success()
        self.counters.add("lookup_local")
        matched = max(0, min(res.matched, len(keys)))
        return LookupOutcome(matched, list(res.tiers[:matched]), None if matched else Reason.NOT_FOUND)

    def lookup(
        self, namespace: str, keys: Sequence[str], deadline_s: float, *, raw: bytes | None = None
    ) -> LookupOutcome:
        """Return how many leading ``keys`` are stored; 0 with a reason on any failure.

        ``raw``: the keys' digests, concatenated, when the caller holds them (the published index is
        probed with them; see :meth:`kvfabric.client.CacheClient.lookup`).
        """
        if not keys:
            return LookupOutcome(0, [])
        local = self._lookup_local(namespace, keys, raw)
        if local is not None:
            return local
        deadline = time.monotonic() + deadline_s
        res, reason = self._call(deadline, lambda c, t: c.lookup(namespace, keys, timeout=t))
        if res is None:
            return LookupOutcome(0, [], reason or Reason.UNAVAILABLE)
        matched = max(0, min(res.matched, len(keys)))
        tiers = list(res.tiers[:matched])
        return LookupOutcome(matched, tiers, None if matched else Reason.NOT_FOUND)

    def load_into(
        self, namespace: str, keys: Sequence[str], buffers: Sequence[bytearray | memoryview], deadline: float
    ) -> LoadOutcome:
        """Fill the leading ``buffers`` with the payloads of ``keys`` before ``deadline`` (monotonic).

        The buffers are the caller's staging area. After a timeout they may still be written by
        the abandoned transport calls listed in :attr:`LoadOutcome.inflight`: until the outcome is
        :attr:`~LoadOutcome.settled` the caller must not reuse them (nor trust their contents).
        """
        if not keys:
            return LoadOutcome(0)
        views = [memoryview(b) for b in buffers]
        abandoned: list[cf.Future[Any]] = []
        res, reason = self._call(
            deadline, lambda c, t: c.load_into(namespace, keys, views, timeout=t), abandoned, self._io_loads
        )
        if abandoned:
            self.counters.add("load_calls_abandoned", len(abandoned))
        if res is None:
            return LoadOutcome(0, reason or Reason.UNAVAILABLE, tuple(abandoned))
        count = max(0, min(int(res), len(keys)))
        return LoadOutcome(count, None if count == len(keys) else Reason.NOT_FOUND, tuple(abandoned))

    @property
    def lends(self) -> bool:
        """Whether the preferred endpoint lends loaded blocks without a copy (:meth:`load_views`).

        False until it connected (the first load connects it), and for remote endpoints.
        """
        ep = self.endpoints[0] if self.endpoints else None
        client = ep._client if ep is not None else None
        return bool(getattr(client, "lends", False))

    def load_views(
        self, namespace: str, keys: Sequence[str], sizes: Sequence[int], deadline: float
    ) -> ViewsOutcome:
        """Borrow the payloads of the leading ``keys`` before ``deadline`` (monotonic), uncopied.

        From an endpoint that lends (same node, kept mappings) the leases pin the sealed blocks;
        from any other (the remote one, after the local one failed) each payload is loaded into
        a fresh buffer of ``sizes[i]`` bytes that only its lease owns. Either way nothing is ever
        written into memory another load uses, and leases of calls given up at the deadline are
        released when those calls end. The caller releases every lease it got.
        """
        if not keys:
            return ViewsOutcome([])

        def op(client: Transport, timeout: float) -> list[Lease]:
            lend = getattr(client, "load_views", None)
            if lend is not None and getattr(client, "lends", False):
                leases: list[Lease] = lend(namespace, keys, timeout=timeout)
                return leases
            buffers = [bytearray(n) for n in sizes[: len(keys)]]
            got = client.load_into(namespace, keys, [memoryview(b) for b in buffers], timeout=timeout)
            return [Lease(memoryview(b)) for b in buffers[: max(0, min(int(got), len(keys)))]]

        abandoned: list[cf.Future[Any]] = []
        res, reason = self._call(deadline, op, abandoned, self._io_loads)
        for fut in abandoned:
            fut.add_done_callback(_release_leases)
        if abandoned:
            self.counters.add("load_calls_abandoned", len(abandoned))
        if res is None:
            return ViewsOutcome([], reason or Reason.UNAVAILABLE)
        leases, extra = res[: len(keys)], res[len(keys) :]
        release_all(extra)
        return ViewsOutcome(leases, None if len(leases) == len(keys) else Reason.NOT_FOUND)

    def store(
        self,
        namespace: str,
        keys: Sequence[str],
        payloads: Sequence[bytes | bytearray | memoryview],
        deadline_s: float,
    ) -> StoreResult | None:
        """Store ``payloads``; return the server's answer or ``None`` (counted) on failure."""
        deadline = time.monotonic() + deadline_s
        res, reason = self._call(deadline, lambda c, t: c.store(namespace, keys, payloads, timeout=t))
        if res is None:
            self.counters.add(f"store_failed.{(reason or Reason.UNAVAILABLE).value}", len(keys))
            return None
        self.counters.add("store_accepted", res.accepted)
        self.counters.add("store_dropped", res.dropped)
        return res

    def close(self) -> None:
        """Release one user; the last one stops the I/O pool and closes the transports.

        Abandoned calls are not awaited. Closing more often than acquired is harmless.
        """
        with self._users_lock:
            self._users -= 1
            if self._closed or self._users > 0:
                return
            self._closed = True
        if self._on_close is not None:
            self._on_close()
        self._io.shutdown(wait=False, cancel_futures=True)
        self._io_loads.shutdown(wait=False, cancel_futures=True)
        for ep in self.endpoints:
            ep.close()


_shared_lock = threading.Lock()
_shared: dict[tuple[object, ...], ResilientCache] = {}


def _endpoint_key(settings: ConnectorSettings) -> tuple[object, ...]:
    # Everything that decides which servers are reached, how, and how failures are judged. The pid
    # keeps a forked child (whose gRPC channels are unusable) from inheriting its parent's cache.
    return (
        os.getpid(),
        settings.socket,
        settings.shared_memory,
        settings.remote,
        settings.token,
        settings.token_file,
        settings.tls_ca,
        settings.tls_cert,
        settings.tls_key,
        settings.retries,
        settings.breaker_failures,
        settings.breaker_cooldown_ms,
        settings.breaker_max_cooldown_ms,
        settings.local_index,
        settings.shm_mapping_cache_mb,
        settings.reply_floor_ms,
    )


def _new_cache(settings: ConnectorSettings, counters: Counters | None) -> ResilientCache:
    endpoints: list[Endpoint] = []
    cooldown = settings.breaker_cooldown_ms / 1000
    longest = settings.breaker_max_cooldown_ms / 1000
    if settings.socket:
        endpoints.append(
            Endpoint(
                "local",
                transport_factory(
                    f"unix://{settings.socket}",
                    shared_memory=settings.shared_memory,
                    local_index=settings.local_index,
                    mapping_cache_bytes=settings.shm_mapping_cache_mb << 20,
                    reply_floor_s=settings.reply_floor_ms / 1000,
                ),
                CircuitBreaker(settings.breaker_failures, cooldown, max_cooldown_s=longest),
            )
        )
    if settings.remote:
        endpoints.append(
            Endpoint(
                "remote",
                transport_factory(
                    settings.remote,
                    token=settings.token,
                    token_file=settings.token_file,
                    tls_ca=settings.tls_ca,
                    tls_cert=settings.tls_cert,
                    tls_key=settings.tls_key,
                ),
                CircuitBreaker(settings.breaker_failures, cooldown, max_cooldown_s=longest),
            )
        )
    return ResilientCache(endpoints, retries=settings.retries, counters=counters)


def build_cache(
    settings: ConnectorSettings, counters: Counters | None = None, *, shared: bool = True
) -> ResilientCache | None:
    """Return the resilient cache for ``settings`` (``None`` when no server is configured).

    With ``shared`` (and no private ``counters``), every caller in this process that names the same
    servers gets the same cache (one channel and one breaker per server, one set of counters); each
    caller must :meth:`~ResilientCache.close` it once.
    """
    if not settings.configured:
        return None
    if not shared or counters is not None:
        return _new_cache(settings, counters)
    key = _endpoint_key(settings)
    with _shared_lock:
        cache = _shared.get(key)
        if cache is not None:
            return cache.acquire()
        cache = _new_cache(settings, None)
        _shared[key] = cache

    def forget() -> None:
        with _shared_lock:
            if _shared.get(key) is cache:
                del _shared[key]

    cache._on_close = forget
    return cache


class AsyncResilientCache:
    """The resilience layer for asyncio callers: a facade over :class:`ResilientCache`.

    Same contract (deadlines enforced by the caller, bounded retries, one breaker per endpoint,
    never raises, every miss counted); each call runs the blocking core on a worker thread.
    """

    def __init__(self, cache: ResilientCache) -> None:
        """Wrap ``cache`` (closed by :meth:`close`)."""
        self.cache = cache
        self.counters = cache.counters

    async def lookup(self, namespace: str, keys: Sequence[str], deadline_s: float) -> LookupOutcome:
        """See :meth:`ResilientCache.lookup`."""
        return await asyncio.to_thread(self.cache.lookup, namespace, keys, deadline_s)

    async def load_into(
        self,
        namespace: str,
        keys: Sequence[str],
        buffers: Sequence[bytearray | memoryview],
        deadline_s: float,
    ) -> LoadOutcome:
        """See :meth:`ResilientCache.load_into` (``deadline_s`` is relative here)."""
        deadline = time.monotonic() + deadline_s
        return await asyncio.to_thread(self.cache.load_into, namespace, keys, buffers, deadline)

    async def store(
        self,
        namespace: str,
        keys: Sequence[str],
        payloads: Sequence[bytes | bytearray | memoryview],
        deadline_s: float,
    ) -> StoreResult | None:
        """See :meth:`ResilientCache.store`."""
        return await asyncio.to_thread(self.cache.store, namespace, keys, payloads, deadline_s)

    async def close(self) -> None:
        """Close the wrapped cache."""
        self.cache.close()


def transport_factory(
    target: str,
    *,
    shared_memory: bool = False,
    token: str | None = None,
    token_file: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    local_index: bool = False,
    mapping_cache_bytes: int = 512 << 20,
    reply_floor_s: float = REPLY_FLOOR_S,
) -> Callable[[], Transport]:
    """Return a factory for the real ``kvfabric.client.CacheClient`` (imported on first use).

    ``local_index``: a Unix target answers lookups from the index its server publishes.
    ``mapping_cache_bytes``: shared memory keeps loaded blocks' mappings up to this many bytes (the
    client's default, ``DEFAULT_MAPPING_CACHE_BYTES``; not imported here, which would start grpc).
    ``reply_floor_s``: the shortest wait for a first reply (the client's default, ``REPLY_FLOOR_S``;
    not imported here either).
    """

    def make() -> Transport:
        from kvfabric.client import CacheClient  # deferred: grpc starts threads

        client: Transport = CacheClient(
            target,
            shared_memory=shared_memory,
            token=token,
            token_file=token_file,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            local_index=local_index,
            mapping_cache_bytes=mapping_cache_bytes,
            reply_floor_s=reply_floor_s,
        )
        return client

    return make


__all__ = [
    "AsyncResilientCache",
    "CacheError",
    "CircuitBreaker",
    "Counters",
    "Endpoint",
    "LoadOutcome",
    "LookupOutcome",
    "Reason",
    "ResilientCache",
    "Transport",
    "build_cache",
    "transport_factory",
]
