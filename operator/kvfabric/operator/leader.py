"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go's leaderelection does it.

Every replica runs :meth:`LeaseElector.run`; the one holding the Lease reconciles (its ``lead()`` task
runs the informers, the reconcile queue and the wipes), all of them serve the webhook. A candidate
takes the Lease when its record has not changed for ``lease_seconds`` as measured on the candidate's
own clock (observed time, so clock skew between nodes does not matter). The holder renews every
``renew_seconds``; each attempt has its own timeout (``attempt_timeout_seconds``), and the holder
steps down — cancels ``lead()``, so no reconcile or wipe starts afterwards — once
``renew_deadline_seconds`` have passed since the *start* of its last successful renewal, whether or
not a hanging request has returned. A replica shutting down cleanly releases the Lease so that the
next one takes over at once.

Why that is safe: a candidate's clock for a record starts when it first reads it, after the holder
sent the renewal that wrote it, so the candidate takes over at the earliest ``lease_seconds`` after
that send; the holder has stopped ``lease_seconds - renew_deadline_seconds`` (3 s by default) before.
Measuring from the end of the renewal instead would let a slow answer eat that margin.

Hand-over after a crash is bounded by ``lease_seconds + 2 * retry_seconds`` (14 s by default) plus
one read of the Lease: a candidate reads the dead holder's last record within one retry, counts
``lease_seconds`` from that read, and notices the expiry at most one retry later.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvfabric.operator.kube import ApiError, KubeClient

log = logging.getLogger("kvfabric.operator.leader")


def _micro_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Attempt(enum.Enum):
    """The outcome of one acquire-or-renew round."""

    HELD = "held"  # this replica holds the Lease (acquired or renewed)
    TAKEN = "taken"  # another replica holds a live Lease
    FAILED = "failed"  # no answer, an error or a lost race: nothing is known


@dataclass
class Tenure:
    """How long a leader may go on leading: until ``deadline`` after its last successful renewal began."""

    renewed_at: float
    deadline: float

    def renewed(self, started_at: float) -> None:
        """A renewal that began at ``started_at`` succeeded."""
        self.renewed_at = max(self.renewed_at, started_at)

    @property
    def ends_at(self) -> float:
        """When the leader must have stepped down unless it renews before."""
        return self.renewed_at + self.deadline

    def over(self, now: float) -> bool:
        """Whether the leader must step down at ``now``."""
        return now >= self.ends_at


class LeaseElector:
    """Acquire, renew and release one Lease; run ``lead`` while holding it.

    Times are the running event loop's (``loop.time()``): the timeouts and sleeps that bound every
    step use the same clock, and a test runs the whole state machine on a loop with virtual time.
    """

    def __init__(
        self,
        client: KubeClient,
        *,
        namespace: str,
        name: str,
        identity: str,
        lease_seconds: float = 10.0,
        renew_seconds: float = 3.0,
        retry_seconds: float = 2.0,
        renew_deadline_seconds: float = 7.0,
        attempt_timeout_seconds: float = 2.0,
    ) -> None:
        if not 0 < attempt_timeout_seconds < renew_deadline_seconds < lease_seconds:
            raise ValueError(
                "leader election needs 0 < attempt timeout < renew deadline < lease duration, got "
                f"{attempt_timeout_seconds}, {renew_deadline_seconds}, {lease_seconds}"
            )
        if not 0 < renew_seconds < renew_deadline_seconds or retry_seconds <= 0:
            raise ValueError("leader election needs 0 < renew period < renew deadline and a positive retry")
        self.client = client
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_seconds = lease_seconds
        self.renew_seconds = renew_seconds
        self.retry_seconds = retry_seconds
        self.renew_deadline_seconds = renew_deadline_seconds
        self.attempt_timeout_seconds = attempt_timeout_seconds
        self.leading = False
        self.transitions = 0
        self._observed: tuple[str, float] | None = None  # (record fingerprint, loop time first seen)
        # Attempts given up on (timed out) that have not finished yet: never awaited by the renew loop.
        self._abandoned: set[asyncio.Future[Attempt]] = set()

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    def _body(self, existing: dict[str, Any] | None, *, acquire: bool) -> dict[str, Any]:
        spec = dict((existing or {}).get("spec") or {})
        now = _micro_now()
        if acquire:
            spec["acquireTime"] = now
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if existing else 0)
        spec.update(
            {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": int(self.lease_seconds),
                "renewTime": now,
            }
        )
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if existing is not None:
            meta["resourceVersion"] = existing["metadata"]["resourceVersion"]
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}

    def _expired(self, lease: dict[str, Any]) -> bool:
        spec = lease.get("spec") or {}
        if not spec.get("holderIdentity"):
            return True  # released
        # The resourceVersion changes with every write, even two renewals in the same microsecond.
        version = (lease.get("metadata") or {}).get("resourceVersion")
        fingerprint = f"{spec.get('holderIdentity')}|{spec.get('renewTime')}|{version}"
        now = self._now()
        if self._observed is None or self._observed[0] != fingerprint:
            self._observed = (fingerprint, now)
            return False
        duration = float(spec.get("leaseDurationSeconds") or self.lease_seconds)
        return now - self._observed[1] > duration

    async def _attempt(self) -> Attempt:
        """One acquire-or-renew round, unbounded (callers bound it with the attempt timeout)."""
        try:
            lease = await self.client.get("Lease", self.namespace, self.name)
            if lease is None:
                await self.client.create(self._body(None, acquire=True))
                return Attempt.HELD
            holder = (lease.get("spec") or {}).get("holderIdentity")
            if holder == self.identity:
                await self.client.replace(self._body(lease, acquire=False))
                return Attempt.HELD
            if self._expired(lease):
                await self.client.replace(self._body(lease, acquire=True))
                return Attempt.HELD
            return Attempt.TAKEN
        except ApiError as exc:
            if exc.status not in (404, 409):  # 409: another replica won this round
                log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
        except (TimeoutError, OSError) as exc:
            log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
        return Attempt.FAILED

    async def _bounded_attempt(self, until: float, also: asyncio.Future[Any] | None = None) -> Attempt:
        """An attempt cut off at loop time ``until`` (or when ``also`` finishes): FAILED if cut off.

        A cut-off attempt is cancelled and left to finish on its own: waiting for it would hand the
        timing back to a request that may ignore its cancellation (the point of the bound).
        """
        attempt = asyncio.ensure_future(self._attempt())
        waiting: set[asyncio.Future[Any]] = {attempt} if also is None else {attempt, also}
        await asyncio.wait(
            waiting, timeout=max(0.0, until - self._now()), return_when=asyncio.FIRST_COMPLETED
        )
        if attempt.done():
            return attempt.result()
        attempt.cancel()
        self._abandoned.add(attempt)
        attempt.add_done_callback(self._forget)
        log.warning(
            "lease %s/%s: no answer within %.1fs", self.namespace, self.name, self.attempt_timeout_seconds
        )
        return Attempt.FAILED

    def _forget(self, attempt: asyncio.Future[Attempt]) -> None:
        self._abandoned.discard(attempt)
        if not attempt.cancelled() and attempt.exception() is not None:
            log.warning("lease %s/%s: abandoned attempt: %s", self.namespace, self.name, attempt.exception())

    async def try_acquire_or_renew(self) -> bool:
        """One round, bounded by the attempt timeout: return whether this replica holds the Lease."""
        until = self._now() + self.attempt_timeout_seconds
        return await self._bounded_attempt(until) is Attempt.HELD

    async def release(self) -> None:
        """Give the Lease up (clean shutdown) so that another replica takes over at once."""
        try:
            async with asyncio.timeout(self.attempt_timeout_seconds):
                lease = await self.client.get("Lease", self.namespace, self.name)
                if lease is not None and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                    body = self._body(lease, acquire=False)
                    body["spec"]["holderIdentity"] = ""
                    await self.client.replace(body)
        except (TimeoutError, ApiError, OSError) as exc:
            log.warning("could not release lease %s/%s: %s", self.namespace, self.name, exc)

    async def run(self, lead: Callable[[], Awaitable[None]]) -> None:
        """Campaign forever; while leading, run ``lead()`` (cancelled when leadership is lost)."""
        try:
            while True:
                acquired_at = await self._campaign()
                self.leading = True
                self.transitions += 1
                log.info("%s leads %s/%s", self.identity, self.namespace, self.name)
                task = asyncio.ensure_future(lead())
                try:
                    await self._renew_until_lost(task, acquired_at)
                finally:
                    self.leading = False
                    log.warning("%s stops leading %s/%s", self.identity, self.namespace, self.name)
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                log.warning("%s lost the lease %s/%s", self.identity, self.namespace, self.name)
        finally:
            self.leading = False
            for attempt in list(self._abandoned):
                attempt.cancel()
            await self.release()

    async def _campaign(self) -> float:
        """Return once this replica holds the Lease: the loop time at which the winning attempt began."""
        while True:
            started = self._now()
            if await self._bounded_attempt(started + self.attempt_timeout_seconds) is Attempt.HELD:
                return started
            await asyncio.sleep(max(0.0, started + self.retry_seconds - self._now()))

    async def _renew_until_lost(self, task: asyncio.Future[None], acquired_at: float) -> None:
        """Renew while ``task`` runs; return to step down (the deadline passed, or another holds it)."""
        tenure = Tenure(acquired_at, self.renew_deadline_seconds)
        next_attempt = acquired_at + self.renew_seconds
        while not task.done():
            now = self._now()
            if tenure.over(now):
                log.warning(
                    "%s: no renewal of %s/%s succeeded for %.1fs: stepping down",
                    self.identity,
                    self.namespace,
                    self.name,
                    now - tenure.renewed_at,
                )
                return
            if now < next_attempt:
                await asyncio.wait({task}, timeout=min(next_attempt, tenure.ends_at) - now)
                continue
            # Bounded by its own timeout and by the deadline, whichever comes first.
            outcome = await self._bounded_attempt(
                min(now + self.attempt_timeout_seconds, tenure.ends_at), task
            )
            if outcome is Attempt.TAKEN:
                return  # another replica holds a live Lease: stop at once
            if outcome is Attempt.HELD:
                tenure.renewed(now)
                next_attempt = now + self.renew_seconds
            else:
                next_attempt = now + self.retry_seconds
        task.result()  # a leader whose work crashed re-raises (the process restarts)
