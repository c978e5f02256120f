"""The Secrets a reconcile reads, remembered between passes for a bounded time.

The operator may never list or watch Secrets (either returns every Secret's data), so no informer
caches them: each is read by name. A pool's reconciles come in bursts (each of its cache-server pods
starting is one), and reading its four credential Secrets and the consumer-keys Secret in every one
of them was half of a reconcile's API calls. :class:`SecretMemo` answers a read from what this
replica last read or wrote under that name while that is younger than ``max_age`` (the controller's
resync period), and from the API server otherwise.

What it may miss is a change by someone else within ``max_age`` (a Secret deleted or edited by
hand): the next read after that age sees it and the reconcile repairs it, as the periodic resync
repairs anything a watch missed. What this replica writes or deletes itself is remembered at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol


class SecretGetter(Protocol):
    """Where Secrets come from when not remembered: the API server (a ``KubeClient``)."""

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """Return one object, or None."""
        ...


class SecretMemo:
    """Secrets by (namespace, name) as last read or written, each trusted for ``max_age`` seconds."""

    def __init__(
        self, client: SecretGetter, *, max_age: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.client = client
        self.max_age = max_age
        self._clock = clock
        self._seen: dict[tuple[str, str], tuple[float, dict[str, Any] | None]] = {}
        self.reads = 0
        """Reads that went to the API server (for tests and the benchmark)."""

    async def get(self, namespace: str, name: str, *, fresh: bool = False) -> dict[str, Any] | None:
        """Return the Secret (None: absent), remembered if younger than ``max_age`` unless ``fresh``."""
        key = (namespace, name)
        seen = self._seen.get(key)
        if not fresh and seen is not None and self._clock() - seen[0] < self.max_age:
            return seen[1]
        self.reads += 1
        found = await self.client.get("Secret", namespace, name)
        self._seen[key] = (self._clock(), found)
        return found

    def put(self, secret: dict[str, Any] | None, namespace: str, name: str) -> None:
        """Remember what a write of ours left under that name (its answer; None after a delete).

        An answer without data (a write whose response was not the object) is forgotten instead,
        so the next read asks the API server.
        """
        if secret is not None and not isinstance(secret.get("data"), dict):
            self._seen.pop((namespace, name), None)
            return
        self._seen[(namespace, name)] = (self._clock(), secret)

    def forget(self, namespace: str, name: str) -> None:
        """Drop what is remembered under that name: the next read asks the API server."""
        self._seen.pop((namespace, name), None)
