"""The webhook never answers "pool-not-found" for a pool that exists but is not known yet."""

from __future__ import annotations

from typing import Any

import pytest

from kvfabric.operator.handlers import OperatorApp
from kvfabric.operator.injection import SKIP_POOL_NOT_FOUND, inject
from kvfabric.operator.render import names

POOL: dict[str, Any] = {
    "apiVersion": "kvfabric.io/v1alpha1",
    "kind": "KVCachePool",
    "metadata": {"name": "pool-a", "namespace": "llm"},
    "spec": {
        "image": {"tag": "v1"},
        "tiers": {"memory": {"size": "1Gi"}},
        "consumers": {"failurePolicy": "Fail"},
    },
}
POD: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "p", "namespace": "llm", "labels": {"kvfabric.io/pool": "pool-a"}},
    "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0"}]},
}


class _Client:
    """Just the API-server reads the webhook path makes."""

    def __init__(self, objects: dict[tuple[str, str, str], dict[str, Any]]) -> None:
        self.objects = objects
        self.gets = 0

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        self.gets += 1
        return self.objects.get((kind, namespace or "", name))

    def clone(self) -> _Client:
        return self


@pytest.mark.asyncio
async def test_a_pod_of_a_pool_not_yet_delivered_is_injected() -> None:
    client = _Client({("KVCachePool", "llm", "pool-a"): POOL})
    app = OperatorApp(client=client, injection_enabled=True)  # type: ignore[arg-type]
    assert app.pools == {}  # as right after start-up: kopf has not delivered the pool yet
    # Without the lookup the answer would be a skip...
    assert inject(POD, app.pools, {}).skip_reason == SKIP_POOL_NOT_FOUND
    # ... with it, the pod is injected, and the pool is remembered (one GET, not one per pod).
    result = inject(POD, await app.pools_for(POD, "llm"), {})
    assert result.injected
    assert names.INJECTED_ANNOTATION in result.pod["metadata"]["annotations"]
    await app.pools_for(POD, "llm")
    assert client.gets == 1
    # A pool that really does not exist is still "pool-not-found".
    other = {**POD, "metadata": {**POD["metadata"], "labels": {"kvfabric.io/pool": "nope"}}}
    assert inject(other, await app.pools_for(other, "llm"), {}).skip_reason == SKIP_POOL_NOT_FOUND


def test_injection_ready_reflects_the_served_certificate_and_its_expiry() -> None:
    import datetime as dt

    from kvfabric.operator.status import Observed, injection_verdict

    now = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
    base: dict[str, Any] = {
        "generation": 1,
        "revision": "r",
        "config_error": None,
        "daemonset": None,
        "claim_name": None,
        "claim": None,
        "consumer_pods": [],
        "connection": None,
        "injection_enabled": True,
        "metrics_service": None,
    }
    valid = injection_verdict(Observed(**base, webhook_not_after=now + dt.timedelta(days=20)), now)
    assert valid.ok is True
    assert "2026-12-21T12:00:00Z" in valid.message
    expired = injection_verdict(Observed(**base, webhook_not_after=now - dt.timedelta(seconds=1)), now)
    assert (expired.ok, expired.reason) == (False, "CertificateExpired")
