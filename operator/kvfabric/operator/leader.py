"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go's leaderelection does it.

Every replica runs :meth:`LeaseElector.run`; the one holding the Lease reconciles, all of them serve
the webhook. A candidate takes the Lease when its record has not changed for ``lease_seconds`` as
measured on the candidate's own clock (observed time, so clock skew between nodes does not matter),
the holder renews every ``renew_seconds`` and steps down when it could not renew for
``lease_seconds`` (a partitioned leader stops before another may start). A replica shutting down
cleanly releases the Lease so that the next one takes over at once.

Hand-over after a crash is bounded by ``lease_seconds + retry_seconds`` (10 s + 2 s by default).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvfabric.operator.kube import ApiError, KubeClient

log = logging.getLogger("kvfabric.operator.leader")


def _micro_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseElector:
    """Acquire, renew and release one Lease; run ``lead`` while holding it."""

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
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_seconds = lease_seconds
        self.renew_seconds = renew_seconds
        self.retry_seconds = retry_seconds
        self.leading = False
        self.transitions = 0
        self._observed: tuple[str, float] | None = None  # (record fingerprint, monotonic time seen)

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
        fingerprint = f"{spec.get('holderIdentity')}|{spec.get('renewTime')}"
        now = time.monotonic()
        if self._observed is None or self._observed[0] != fingerprint:
            self._observed = (fingerprint, now)
            return False
        duration = float(spec.get("leaseDurationSeconds") or self.lease_seconds)
        return now - self._observed[1] > duration

    async def try_acquire_or_renew(self) -> bool:
        """One round: return whether this replica holds the Lease afterwards."""
        try:
            lease = await self.client.get("Lease", self.namespace, self.name)
            if lease is None:
                await self.client.create(self._body(None, acquire=True))
                return True
            holder = (lease.get("spec") or {}).get("holderIdentity")
            if holder == self.identity:
                await self.client.replace(self._body(lease, acquire=False))
                return True
            if self._expired(lease):
                await self.client.replace(self._body(lease, acquire=True))
                return True
        except ApiError as exc:
            if exc.status not in (404, 409):  # 409: another replica won this round
                log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
        except (TimeoutError, OSError) as exc:
            log.warning("lease %s/%s: %s", self.namespace, self.name, exc)
        return False

    async def release(self) -> None:
        """Give the Lease up (clean shutdown) so that another replica takes over at once."""
        try:
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
                await self._campaign()
                self.leading = True
                self.transitions += 1
                log.info("%s leads %s/%s", self.identity, self.namespace, self.name)
                task = asyncio.ensure_future(lead())
                try:
                    await self._renew_until_lost(task)
                finally:
                    self.leading = False
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                log.warning("%s lost the lease %s/%s", self.identity, self.namespace, self.name)
        finally:
            if self.leading:
                self.leading = False
            await self.release()

    async def _campaign(self) -> None:
        """Return once this replica holds the Lease."""
        acquired = await self.try_acquire_or_renew()
        while not acquired:
            await asyncio.sleep(self.retry_seconds)
            acquired = await self.try_acquire_or_renew()

    async def _renew_until_lost(self, task: asyncio.Future[None]) -> None:
        last_renewed = time.monotonic()
        while not task.done():
            await asyncio.sleep(self.renew_seconds)
            if await self.try_acquire_or_renew():
                last_renewed = time.monotonic()
            elif time.monotonic() - last_renewed > self.lease_seconds - self.renew_seconds:
                return  # stop before anyone else may take the lease
        task.result()  # a leader whose work crashed re-raises (the process restarts)
