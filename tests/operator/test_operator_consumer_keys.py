"""The consumer-keys Secret against an in-memory API: one entry per pool, the root and never the secret.

The CSI node plugin derives the keys of consumers outside a pool's namespace from this Secret alone,
so what it holds is the contract: ``<namespace>.<pool>`` -> ``encode_key(consumer_root(P))``.
"""

from __future__ import annotations

import asyncio
import base64
import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.operator.test_operator_reconcile_fake import FakeKube, add_pool

from kvfabric.contract.consumer_keys import consumer_root, encode_key
from kvfabric.operator import consumerkeys, reconcile
from kvfabric.operator.api.v1alpha1 import KVCachePool

OPNS = "kvfabric-ops"
MIRROR = ("Secret", OPNS, "kvfabric-consumer-keys")


def _payload_secret(kube: FakeKube, namespace: str = "ns", pool: str = "p") -> str:
    cred = kube.objects[("Secret", namespace, f"{pool}-credentials")]
    return base64.b64decode(cred["data"]["payload-key"]).decode()


def _entries(kube: FakeKube) -> dict[str, str]:
    """The mirror's entries, decoded (what the plugin reads)."""
    data = kube.objects[MIRROR].get("data") or {}
    return {k: base64.b64decode(v).decode() for k, v in data.items()}


async def _reconcile(kube: FakeKube, namespace: str = "ns", name: str = "p") -> None:
    await reconcile.reconcile_pool(kube, namespace, name, injection_enabled=True, operator_namespace=OPNS)  # type: ignore[arg-type]


def _add(kube: FakeKube, namespace: str, name: str) -> None:
    body = copy.deepcopy(add_pool(FakeKube()))
    body["metadata"].update(namespace=namespace, name=name, uid=f"u-{namespace}-{name}")
    kube._bump(body)
    kube.objects[("KVCachePool", namespace, name)] = body


@pytest.mark.asyncio
async def test_a_reconcile_publishes_the_root_of_the_pools_consumer_keys_and_not_its_secret() -> None:
    kube = FakeKube()
    add_pool(kube)
    await _reconcile(kube)
    secret = _payload_secret(kube)
    assert _entries(kube) == {"ns.p": encode_key(consumer_root(secret))}
    # The pool's secret itself is nowhere in the mirror (it would give the token's sibling away).
    assert secret not in str(kube.objects[MIRROR])
    assert base64.b64encode(secret.encode()).decode() not in str(kube.objects[MIRROR])
    # A reconcile that changes nothing writes nothing.
    version = kube.objects[MIRROR]["metadata"]["resourceVersion"]
    await _reconcile(kube)
    assert kube.objects[MIRROR]["metadata"]["resourceVersion"] == version


@pytest.mark.asyncio
async def test_a_changed_payload_secret_is_published_again() -> None:
    kube = FakeKube()
    add_pool(kube)
    await _reconcile(kube)
    cred = kube.objects[("Secret", "ns", "p-credentials")]
    cred["data"]["payload-key"] = base64.b64encode(b"rotated").decode()
    await _reconcile(kube)
    assert _entries(kube) == {"ns.p": encode_key(consumer_root("rotated"))}


@pytest.mark.asyncio
async def test_pools_reconciled_at_once_each_set_their_own_entry() -> None:
    """No read-modify-write of the whole map: concurrent first publications all land (one creates
    the Secret, the others find it created and patch their entry in)."""
    kube = FakeKube()
    pools = [(f"ns{i % 3}", f"p{i}") for i in range(12)]
    for ns, name in pools:
        _add(kube, ns, name)
    await asyncio.gather(*(_reconcile(kube, ns, name) for ns, name in pools))
    assert _entries(kube) == {
        f"{ns}.{name}": encode_key(consumer_root(_payload_secret(kube, ns, name))) for ns, name in pools
    }


@pytest.mark.asyncio
async def test_a_deleted_pools_entry_goes_and_a_successors_never_does() -> None:
    kube = FakeKube()
    _add(kube, "ns", "a")
    _add(kube, "ns", "b")
    await _reconcile(kube, "ns", "a")
    await _reconcile(kube, "ns", "b")
    del kube.objects[("KVCachePool", "ns", "a")]
    assert await consumerkeys.forget_pool(kube, OPNS, ("ns", "a"))  # type: ignore[arg-type]
    assert set(_entries(kube)) == {"ns.b"}
    assert not await consumerkeys.forget_pool(kube, OPNS, ("ns", "a"))  # type: ignore[arg-type]
    # b is deleted and created again (a new secret) before the removal of the old entry runs.
    old = kube.objects[MIRROR]["data"]["ns.b"]
    del kube.objects[("KVCachePool", "ns", "b")]
    del kube.objects[("Secret", "ns", "b-credentials")]
    _add(kube, "ns", "b")
    await _reconcile(kube, "ns", "b")
    assert not await consumerkeys.drop_root(kube, OPNS, ("ns", "b"), old)  # type: ignore[arg-type]
    assert _entries(kube)["ns.b"] == encode_key(consumer_root(_payload_secret(kube, "ns", "b")))
    # Removed only once the pool is really gone, and only the value that was read.
    current = kube.objects[MIRROR]["data"]["ns.b"]
    assert not await consumerkeys.drop_root(kube, OPNS, ("ns", "b"), current)  # type: ignore[arg-type]
    del kube.objects[("KVCachePool", "ns", "b")]
    assert await consumerkeys.drop_root(kube, OPNS, ("ns", "b"), current)  # type: ignore[arg-type]
    assert _entries(kube) == {}


@pytest.mark.asyncio
async def test_without_a_payload_secret_nothing_is_published() -> None:
    kube = FakeKube()
    pool = KVCachePool.model_validate(add_pool(kube))
    assert not await consumerkeys.publish_root(kube, OPNS, pool)  # type: ignore[arg-type]
    assert MIRROR not in kube.objects


_NAME = st.from_regex(r"[a-z]([a-z0-9-]{0,6}[a-z0-9])?", fullmatch=True)


@settings(max_examples=80, deadline=None)
@given(
    entries=st.dictionaries(st.tuples(_NAME, _NAME), st.text("0123456789abcdef", min_size=1), max_size=8),
    live=st.sets(st.tuples(_NAME, _NAME), max_size=8),
    watched=st.none() | st.sets(_NAME, max_size=4),
)
def test_stale_entries_are_exactly_the_deleted_pools_in_the_watched_namespaces(
    entries: dict[tuple[str, str], str], live: set[tuple[str, str]], watched: set[str] | None
) -> None:
    snapshot: dict[str, Any] = {f"{ns}.{name}": v for (ns, name), v in entries.items()}
    snapshot["not-an-entry"] = "x"
    stale = dict(consumerkeys.stale_entries(snapshot, live, watched))
    assert stale == {
        pool: v for pool, v in entries.items() if pool not in live and (not watched or pool[0] in watched)
    }


@pytest.mark.asyncio
async def test_a_credentials_secret_that_is_not_the_pools_never_becomes_its_root() -> None:
    """A user's Secret under the pool's credentials name (SecretConflict) is never read for the root:
    its value would become the key of every consumer outside the pool's namespace."""
    kube = FakeKube()
    add_pool(kube)
    kube.objects[("Secret", "ns", "p-credentials")] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "p-credentials", "namespace": "ns", "resourceVersion": "1"},
        "data": {"payload-key": base64.b64encode(b"the users own value").decode()},
    }
    await _reconcile(kube)
    assert MIRROR not in kube.objects or "ns.p" not in (kube.objects[MIRROR].get("data") or {})
