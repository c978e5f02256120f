"""Is a pool's bucket reachable and writable? The operator's probe behind ``StorageReady``.

The probe PUTs a small object under the pool's prefix, HEADs it and DELETEs it, with the pool's own
credentials (read from the referenced Secret: ``get`` on secrets, never ``list``) and CA bundle, short
timeouts and no retries. A probe runs at most once per :data:`PROBE_TTL_SECONDS` per pool and spec;
reconciles in between reuse the answer, so a busy pool does not hammer its bucket.
"""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

from kvfabric.operator.api.v1alpha1 import KVCachePool
from kvfabric.operator.kube import ApiError, KubeClient
from kvfabric.operator.render.children import object_store_config

__all__ = ["ProbeResult", "probe_object_store"]

PROBE_TTL_SECONDS: Final = 60.0
_cache: dict[tuple[str, str, str], tuple[float, ProbeResult]] = {}


@dataclass(frozen=True)
class ProbeResult:
    """The StorageReady verdict for the object tier."""

    ok: bool
    reason: str
    message: str


def _put_head_delete(
    cfg: dict[str, Any], access_key: str | None, secret_key: str | None, ca: str | None
) -> None:
    import obstore
    from obstore.store import S3Store

    kwargs: dict[str, Any] = {
        "endpoint": cfg["endpoint"].rstrip("/"),
        "region": cfg["region"],
        "virtual_hosted_style_request": not cfg["path_style"],
    }
    if access_key is not None and secret_key is not None:
        kwargs["access_key_id"] = access_key
        kwargs["secret_access_key"] = secret_key
    client: dict[str, Any] = {
        "allow_http": cfg["endpoint"].startswith("http://"),
        "timeout": timedelta(seconds=5),
        "connect_timeout": timedelta(seconds=2),
    }
    if ca is not None:
        client["root_certificate"] = ca
    store = S3Store(
        cfg["bucket"],
        prefix=cfg["prefix"],
        client_options=client,  # type: ignore[arg-type]
        retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=5)},
        **kwargs,
    )
    path = f"probe/operator-{time.time_ns()}"
    obstore.put(store, path, b"kvfabric storage probe", use_multipart=False)
    obstore.head(store, path)
    obstore.delete(store, path)


async def _secret_value(client: KubeClient, namespace: str, name: str, key: str) -> str | None:
    secret = await client.get("Secret", namespace, name)
    if secret is None:
        return None
    raw = (secret.get("data") or {}).get(key)
    return None if raw is None else base64.b64decode(raw).decode().strip()


async def probe_object_store(client: KubeClient, pool: KVCachePool) -> ProbeResult:
    """PUT + HEAD + DELETE a probe object in the pool's bucket; the verdict names what failed."""
    obj = pool.spec.tiers.object_store
    assert obj is not None
    cfg = object_store_config(pool)
    where = f"s3 bucket {obj.bucket!r} at {obj.endpoint}"
    key = (pool.namespace, pool.name, repr(obj.model_dump()))
    hit = _cache.get(key)
    if hit is not None and time.monotonic() - hit[0] < PROBE_TTL_SECONDS:
        return hit[1]
    access_key = secret_key = ca = None
    try:
        if obj.credentials is not None:
            c = obj.credentials
            access_key = await _secret_value(client, pool.namespace, c.secret_name, c.access_key_id_key)
            secret_key = await _secret_value(client, pool.namespace, c.secret_name, c.secret_access_key_key)
            if access_key is None or secret_key is None:
                return ProbeResult(
                    False,
                    "ObjectStoreCredentialsMissing",
                    f"Secret {c.secret_name} lacks {c.access_key_id_key} or {c.secret_access_key_key}",
                )
        if obj.ca is not None:
            cm = await client.get("ConfigMap", pool.namespace, obj.ca.config_map_name)
            ca = ((cm or {}).get("data") or {}).get(obj.ca.key)
            if ca is None:
                return ProbeResult(
                    False, "ObjectStoreCAMissing", f"ConfigMap {obj.ca.config_map_name} lacks {obj.ca.key}"
                )
    except ApiError as exc:
        return ProbeResult(
            False, "ObjectStoreCredentialsUnreadable", f"reading the credentials failed: {exc}"
        )
    try:
        await asyncio.to_thread(_put_head_delete, cfg, access_key, secret_key, ca)
        result = ProbeResult(True, "ObjectStoreWritable", f"{where} is reachable and writable")
    except Exception as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        result = ProbeResult(False, "ObjectStoreUnreachable", f"{where}: {first}")
    _cache[key] = (time.monotonic(), result)
    return result
