"""StorageReady for the object tier: the operator's probe against a real S3 server (SeaweedFS)."""

from __future__ import annotations

import asyncio
import base64
import copy
from typing import Any, cast

import pytest

from kvfabric.operator import objectprobe
from kvfabric.operator.api.v1alpha1 import KVCachePool
from kvfabric.operator.kube import KubeClient
from kvfabric.operator.objectprobe import probe_object_store
from kvfabric.operator.status import Observed, storage_verdict
from kvfabric.testing.s3server import S3Server, s3_server

pytestmark = pytest.mark.process  # a real S3 server process


class Secrets:
    """The one call the probe makes: ``get`` of the Secret (and ConfigMap) a pool names."""

    def __init__(self, objects: dict[tuple[str, str], dict[str, Any]]) -> None:
        self.objects = objects

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.objects.get((kind, name)))


def _b64(v: str) -> str:
    return base64.b64encode(v.encode()).decode()


def pool(s3: S3Server, name: str) -> KVCachePool:
    return KVCachePool.model_validate(
        {
            "metadata": {"name": name, "namespace": "llm", "uid": "u"},
            "spec": {
                "image": {"repository": "example.com/kvfabric", "tag": "v0.2.0"},
                "tiers": {
                    "memory": {"size": "1Gi"},
                    "objectStore": {
                        "endpoint": s3.endpoint,
                        "bucket": s3.bucket,
                        "capacity": "1Gi",
                        "credentials": {"secretName": "s3-keys"},
                    },
                },
            },
        }
    )


def probe(kube: Secrets, p: KVCachePool) -> objectprobe.ProbeResult:
    objectprobe._cache.clear()
    return asyncio.run(probe_object_store(cast(KubeClient, kube), p))


@pytest.fixture(scope="module")
def s3() -> Any:
    with s3_server() as srv:
        yield srv


def test_storage_ready_says_whether_the_bucket_is_reachable_and_writable(s3: S3Server) -> None:
    keys = {"AWS_ACCESS_KEY_ID": _b64(s3.access_key), "AWS_SECRET_ACCESS_KEY": _b64(s3.secret_key)}
    good = Secrets({("Secret", "s3-keys"): {"data": keys}})
    ok = probe(good, pool(s3, "a"))
    assert (ok.ok, ok.reason) == (True, "ObjectStoreWritable"), ok.message
    wrong = Secrets({("Secret", "s3-keys"): {"data": {**keys, "AWS_SECRET_ACCESS_KEY": _b64("nope")}}})
    denied = probe(wrong, pool(s3, "a"))
    assert (denied.ok, denied.reason) == (False, "ObjectStoreUnreachable")
    assert s3.bucket in denied.message
    missing = probe(
        Secrets({("Secret", "s3-keys"): {"data": {"AWS_ACCESS_KEY_ID": keys["AWS_ACCESS_KEY_ID"]}}}),
        pool(s3, "a"),
    )
    assert (missing.ok, missing.reason) == (False, "ObjectStoreCredentialsMissing")
    assert "AWS_SECRET_ACCESS_KEY" in missing.message
    # The probe object is gone again.
    import obstore
    from obstore.store import S3Store

    store = S3Store(s3.bucket, endpoint=s3.endpoint, region="us-east-1", access_key_id=s3.access_key,
                    secret_access_key=s3.secret_key, client_options={"allow_http": True})  # fmt: skip
    assert not [m for batch in obstore.list(store, "kvfabric/llm/a/probe/") for m in batch]


def test_a_dead_store_is_storage_not_ready() -> None:
    with s3_server() as own:
        keys = {"AWS_ACCESS_KEY_ID": _b64(own.access_key), "AWS_SECRET_ACCESS_KEY": _b64(own.secret_key)}
        p = pool(own, "b")
        own.kill()
        dead = probe(Secrets({("Secret", "s3-keys"): {"data": keys}}), p)
    assert (dead.ok, dead.reason) == (False, "ObjectStoreUnreachable")


def _observed(**kw: Any) -> Observed:
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
    return Observed(**{**base, **kw})


def test_the_verdict_combines_the_claim_and_the_bucket() -> None:
    bad = (False, "ObjectStoreUnreachable", "s3 bucket down")
    assert storage_verdict(_observed(object_store=bad)).reason == "ObjectStoreUnreachable"
    bound = {"status": {"phase": "Bound"}}
    both = storage_verdict(_observed(claim_name="c", claim=bound, object_store=bad))
    assert (both.ok, both.reason) == (False, "ObjectStoreUnreachable")
    assert "Bound" in both.message
    assert "down" in both.message
    good = storage_verdict(
        _observed(claim_name="c", claim=bound, object_store=(True, "ObjectStoreWritable", "ok"))
    )
    assert good.ok is True
    pending = storage_verdict(
        _observed(claim_name="c", claim={"status": {"phase": "Pending"}}, object_store=bad)
    )
    assert (pending.ok, pending.reason) == (False, "ClaimPending")
