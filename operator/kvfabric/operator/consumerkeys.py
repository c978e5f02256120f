"""The consumer-keys Secret: what the CSI node plugin derives consumers' payload keys from.

Consumers outside a pool's namespace cannot read the pool's Secret, and the CSI node plugin must not
either (it runs on every node). So the operator keeps one Secret, ``kvfabric-consumer-keys`` in its own
namespace, with one entry per pool: ``<pool namespace>.<pool name>`` -> the root of the pool's
consumer keys (:func:`kvfabric.contract.consumer_keys.consumer_root` of the pool's payload secret, hex),
from which the plugin derives the key of the namespace it publishes into. The root is not the pool's
secret: it gives the consumer keys of that pool and nothing else (no token, no server credential).

Many pools reconcile at once, so every write touches one entry only: a JSON merge patch that sets it,
or a JSON patch that removes it only while it still holds the value that was read (a pool deleted and
created again under its name has a new secret, hence a new value, which is never removed).
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Collection, Iterable, Mapping
from typing import Any, Final

from kvfabric.contract.consumer_keys import consumer_root, encode_key
from kvfabric.operator.api.v1alpha1 import KIND, KVCachePool
from kvfabric.operator.kube import ApiError, KubeClient
from kvfabric.operator.poolpki import owned_by
from kvfabric.operator.render import names
from kvfabric.operator.render.children import owner_reference
from kvfabric.operator.secretmemo import SecretMemo

log = logging.getLogger(__name__)

PoolKey = tuple[str, str]  # (namespace, name)
SECRET: Final = names.CONSUMER_KEYS_SECRET


def root_entry(payload_secret: str) -> str:
    """The entry of a pool whose payload secret is ``payload_secret``, as Secret data (base64 of hex)."""
    return base64.b64encode(encode_key(consumer_root(payload_secret)).encode()).decode()


def payload_secret_of(credentials: Mapping[str, Any] | None) -> str | None:
    """The pool's payload secret in its credentials Secret, or None when it has none (yet)."""
    raw = ((credentials or {}).get("data") or {}).get(names.PAYLOAD_KEY)
    if not raw:
        return None
    return base64.b64decode(raw).decode()


def pool_of_entry(entry: str) -> PoolKey | None:
    """The (namespace, name) an entry names (the first dot ends the namespace), or None."""
    namespace, dot, name = entry.partition(".")
    return (namespace, name) if dot and namespace and name else None


async def read_roots(client: KubeClient, operator_namespace: str) -> dict[str, str]:
    """Every entry of the Secret (as stored: base64); empty when it does not exist."""
    secret = await client.get("Secret", operator_namespace, SECRET)
    return dict((secret or {}).get("data") or {})


async def publish_root(
    client: KubeClient, operator_namespace: str, pool: KVCachePool, *, secrets: SecretMemo | None = None
) -> bool:
    """Set the pool's entry from its credentials Secret; return whether it had to be written.

    Read first (a GET of each Secret; never a list), so a reconcile that changes nothing writes nothing.
    With ``secrets``, the reads are answered from what this replica read or wrote lately (the
    credentials Secret was just read by the same reconcile) and the writes' answers are remembered.
    """

    async def get(namespace: str, name: str) -> dict[str, Any] | None:
        return await (secrets.get(namespace, name) if secrets else client.get("Secret", namespace, name))

    def wrote(answer: dict[str, Any] | None) -> None:
        if secrets is not None:
            secrets.put(answer, operator_namespace, SECRET)

    credentials = await get(pool.namespace, names.credentials_secret_name(pool.name))
    if credentials is None or not owned_by(credentials, str(owner_reference(pool)["uid"])):
        # Not the pool's (a user's Secret under the pool's name: SecretConflict): never its root.
        return False
    secret = payload_secret_of(credentials)
    if secret is None:
        return False  # no payload key yet: the reconcile that creates it publishes it
    entry = names.consumer_keys_entry(pool.namespace, pool.name)
    value = root_entry(secret)
    current = await get(operator_namespace, SECRET)
    if current is not None and (current.get("data") or {}).get(entry) == value:
        return False
    try:
        if current is not None:
            try:
                wrote(await client.patch("Secret", operator_namespace, SECRET, {"data": {entry: value}}))
                return True
            except ApiError as exc:
                if exc.status != 404:
                    raise
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": SECRET,
                "namespace": operator_namespace,
                "labels": {names.MANAGED_BY: names.MANAGED_BY_VALUE, names.COMPONENT_LABEL: "consumer-keys"},
            },
            "type": "Opaque",
            "data": {entry: value},
        }
        try:
            wrote(await client.create(body))
        except ApiError as exc:
            if exc.status != 409:
                raise
            # Another pool's reconcile created it meanwhile: set this entry in theirs.
            wrote(await client.patch("Secret", operator_namespace, SECRET, {"data": {entry: value}}))
    except BaseException:
        if secrets is not None:  # whatever the Secret holds now is unknown: read it next time
            secrets.forget(operator_namespace, SECRET)
        raise
    return True


async def drop_root(client: KubeClient, operator_namespace: str, pool: PoolKey, value: str) -> bool:
    """Remove a deleted pool's entry if it still holds ``value`` and the pool does not exist again."""
    if await client.get(KIND, pool[0], pool[1]) is not None:
        return False
    entry = names.consumer_keys_entry(*pool)
    patch = [
        {"op": "test", "path": f"/data/{entry}", "value": value},
        {"op": "remove", "path": f"/data/{entry}"},
    ]
    try:
        await client.patch(
            "Secret", operator_namespace, SECRET, patch, content_type="application/json-patch+json"
        )
    except ApiError as exc:
        # 404: no Secret; 422: the entry is gone or holds a newer pool's value. Either way, not ours.
        if exc.status in (404, 422):
            return False
        raise
    return True


async def forget_pool(client: KubeClient, operator_namespace: str, pool: PoolKey) -> bool:
    """A pool was deleted: remove its entry (what it held when read, so never a successor's)."""
    value = (await read_roots(client, operator_namespace)).get(names.consumer_keys_entry(*pool))
    return value is not None and await drop_root(client, operator_namespace, pool, value)


def stale_entries(
    snapshot: Mapping[str, str], live: Collection[PoolKey], namespaces: Iterable[str] | None
) -> list[tuple[PoolKey, str]]:
    """Entries of pools that no longer exist (within ``namespaces``, when the operator watches only those).

    ``snapshot`` must have been read before ``live`` was listed: an entry written after the list by a
    pool created meanwhile is then not in it.
    """
    scope = set(namespaces) if namespaces else None
    out = []
    for entry, value in sorted(snapshot.items()):
        pool = pool_of_entry(entry)
        if pool is None or (scope is not None and pool[0] not in scope):
            continue
        if pool not in live:
            out.append((pool, value))
    return out


async def prune_roots(
    client: KubeClient,
    operator_namespace: str,
    snapshot: Mapping[str, str],
    live: Collection[PoolKey],
    namespaces: Iterable[str] | None = None,
) -> int:
    """Remove the entries of pools deleted while no operator led (the resync's safety net)."""
    removed = 0
    for pool, value in stale_entries(snapshot, live, namespaces):
        if await drop_root(client, operator_namespace, pool, value):
            log.info("removed the consumer-key root of deleted pool %s/%s", *pool)
            removed += 1
    return removed
