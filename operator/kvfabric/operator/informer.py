"""Informers: list+watch caches of the objects the reconciler reads, with an index per pool.

Each :class:`Informer` lists one kind under one label selector (paginated), then watches from the
list's resourceVersion, keeping every object in memory and an index from a label's value (the pool's
name) to the objects that carry it. A watch that expires (410 Gone) relists. Every change calls
``on_change`` with the object, which the operator maps to its pool and queues.

What is cached is what the readers use, not the whole object: ``metadata.managedFields`` is always
dropped, and an informer may project its objects further (``transform``; the consumer pods keep only
the fields their pool's status counts). Thousands of full pods would otherwise be hundreds of thousands
of dicts and lists that every full pass of Python's garbage collector walks while holding the GIL,
which stalled the webhook on the same process for up to a second during a pod storm.

:class:`CachedReader` answers the reconciler's reads from these caches: a consumer-pod or child
lookup costs a dictionary access instead of a (cluster-wide) LIST, so reconciles scale with the
pool's own objects, not with the cluster.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, Final

from kvfabric.operator.kube import ApiError, KubeClient

log = logging.getLogger("kvfabric.operator.informer")

ObjKey = tuple[str, str]  # (namespace, name)
_PAGE: Final = "500"


def _key(obj: dict[str, Any]) -> ObjKey:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def strip_managed_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` without ``metadata.managedFields`` (the server-side-apply bookkeeping no reader uses)."""
    meta = obj.get("metadata")
    if isinstance(meta, dict) and "managedFields" in meta:
        return {**obj, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}
    return obj


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return dict((obj.get("metadata") or {}).get("labels") or {})


class Informer:
    """A list+watch cache of one kind, selected by labels, indexed by the value of one label."""

    def __init__(
        self,
        client: KubeClient,
        kind: str,
        *,
        label_selector: str,
        index_label: str,
        namespaces: Iterable[str] | None = None,
        on_change: Callable[[dict[str, Any]], None] | None = None,
        watch_seconds: int = 300,
        transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        """Cache ``kind`` objects under ``label_selector``, indexed by ``index_label``.

        ``transform`` (default :func:`strip_managed_fields`) maps each listed or watched object to what
        is cached and passed to ``on_change``; it must keep the metadata and the index label.
        """
        self.client = client
        self.kind = kind
        self.label_selector = label_selector
        self.index_label = index_label
        self.namespaces: list[str | None] = list(namespaces) if namespaces else [None]
        self.on_change = on_change
        self.watch_seconds = watch_seconds
        self.transform = transform or strip_managed_fields
        self.objects: dict[ObjKey, dict[str, Any]] = {}
        self._index: dict[str, set[ObjKey]] = defaultdict(set)
        self.synced = asyncio.Event()
        self.relists = 0

    # --- the store ----------------------------------------------------------------------------
    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        """Return the cached object, or None."""
        return self.objects.get((namespace, name))

    def by_index(self, value: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """Return the objects whose index label equals ``value`` (in ``namespace``, or anywhere)."""
        keys = self._index.get(value, ())
        return [self.objects[k] for k in keys if namespace is None or k[0] == namespace]

    def _put(self, obj: dict[str, Any]) -> None:
        key = _key(obj)
        old = self.objects.get(key)
        if old is not None:
            self._unindex(key, old)
        self.objects[key] = obj
        value = _labels(obj).get(self.index_label)
        if value is not None:
            self._index[value].add(key)

    def _delete(self, obj: dict[str, Any]) -> None:
        key = _key(obj)
        old = self.objects.pop(key, None)
        if old is not None:
            self._unindex(key, old)

    def _unindex(self, key: ObjKey, obj: dict[str, Any]) -> None:
        value = _labels(obj).get(self.index_label)
        if value is not None:
            keys = self._index.get(value)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._index[value]

    def _notify(self, obj: dict[str, Any]) -> None:
        if self.on_change is not None:
            try:
                self.on_change(obj)
            except Exception:  # a bad callback must not kill the watch
                log.exception("informer %s callback failed", self.kind)

    # --- list and watch -------------------------------------------------------------------------
    async def _list(self, namespace: str | None) -> str:
        """Replace this namespace's objects with a fresh paginated list; return its resourceVersion."""
        params = {"labelSelector": self.label_selector, "limit": _PAGE}
        fresh: dict[ObjKey, dict[str, Any]] = {}
        while True:
            page = await self.client.list_page(self.kind, namespace, params)
            for item in page.get("items") or []:
                fresh[_key(item)] = self.transform(item)
            meta = page.get("metadata") or {}
            if not meta.get("continue"):
                version = str(meta.get("resourceVersion") or "")
                break
            params = {**params, "continue": str(meta["continue"])}
        stale = [
            obj
            for key, obj in self.objects.items()
            if (namespace is None or key[0] == namespace) and key not in fresh
        ]
        for obj in stale:
            self._delete(obj)
            self._notify(obj)
        for key, obj in fresh.items():
            before = self.objects.get(key)
            self._put(obj)
            if before is None or (before.get("metadata") or {}).get("resourceVersion") != (
                obj.get("metadata") or {}
            ).get("resourceVersion"):
                self._notify(obj)
        return version

    async def _run_one(self, namespace: str | None, listed: asyncio.Event) -> None:
        version = ""
        backoff = 0.5
        while True:
            try:
                if not version:
                    version = await self._list(namespace)
                    self.relists += 1
                    listed.set()
                params = {
                    "labelSelector": self.label_selector,
                    "resourceVersion": version,
                    "timeoutSeconds": str(self.watch_seconds),
                }
                async for event in self.client.watch(self.kind, namespace, params):
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":
                        if obj.get("code") == 410:  # too old: relist
                            version = ""
                        break
                    new_version = (obj.get("metadata") or {}).get("resourceVersion")
                    if new_version:
                        version = str(new_version)
                    if kind == "BOOKMARK":
                        continue
                    obj = self.transform(obj)
                    if kind == "DELETED":
                        self._delete(obj)
                    else:
                        self._put(obj)
                    self._notify(obj)
                backoff = 0.5
            except asyncio.CancelledError:
                raise
            except (TimeoutError, ApiError, OSError, ValueError) as exc:
                if isinstance(exc, ApiError) and exc.status == 410:
                    version = ""
                log.warning("informer %s: %s; retrying in %.1fs", self.kind, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(30.0, backoff * 2)

    async def run(self) -> None:
        """List and watch until cancelled; ``synced`` is set once every namespace has been listed."""
        events = [asyncio.Event() for _ in self.namespaces]
        tasks = [
            asyncio.ensure_future(self._run_one(ns, ev))
            for ns, ev in zip(self.namespaces, events, strict=True)
        ]
        try:
            await asyncio.gather(*(ev.wait() for ev in events))
            self.synced.set()
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def parse_selector(selector: str | None) -> tuple[dict[str, str], set[str]] | None:
    """``a=b,c`` -> ({a: b}, {c}); None when the selector uses anything but equality and existence."""
    equal: dict[str, str] = {}
    exists: set[str] = set()
    for part in (selector or "").split(","):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if any(c in part for c in "!() ") or value.startswith("="):
            return None
        if sep:
            equal[key] = value
        else:
            exists.add(key)
    return equal, exists


class CachedReader:
    """The reconciler's :class:`~kvfabric.operator.reconcile.Reader` over informers, API server fallback."""

    def __init__(self, client: KubeClient, informers: Iterable[Informer]) -> None:
        self.client = client
        self.informers: dict[str, list[Informer]] = defaultdict(list)
        for informer in informers:
            self.informers[informer.kind].append(informer)
        self.fallbacks = 0  # reads that went to the API server (the benchmark reports it)

    def _covering(self, kind: str, wanted: dict[str, str]) -> Informer | None:
        """An informer holding every object that matches ``wanted``, indexed by one of its labels."""
        for informer in self.informers.get(kind, []):
            parsed = parse_selector(informer.label_selector)
            if parsed is None or informer.index_label not in wanted:
                continue
            equal, exists = parsed
            if all(wanted.get(k) == v for k, v in equal.items()) and exists <= set(wanted):
                return informer
        return None

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """Return one object from a cache that holds its kind, else from the API server."""
        for informer in self.informers.get(kind, []):
            found = informer.get(namespace or "", name)
            if found is not None:
                return found
        # Every DaemonSet (etc.) the operator owns is cached: absent means absent. PVCs are the
        # exception: an existing claim is the user's and carries no label of ours.
        synced = bool(self.informers.get(kind)) and all(i.synced.is_set() for i in self.informers[kind])
        if synced and kind != "PersistentVolumeClaim":
            return None
        self.fallbacks += 1
        return await self.client.get(kind, namespace, name)

    async def list(
        self,
        kind: str,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        """Return matching objects from an index when a cache covers the selector, else list."""
        parsed = parse_selector(label_selector)
        wanted = parsed[0] if parsed is not None and not parsed[1] else None
        informer = None if wanted is None or field_selector else self._covering(kind, wanted)
        if informer is None or wanted is None or not informer.synced.is_set():
            self.fallbacks += 1
            return await self.client.list(
                kind, namespace, label_selector=label_selector, field_selector=field_selector
            )
        candidates = informer.by_index(wanted[informer.index_label], namespace)
        return [obj for obj in candidates if all(_labels(obj).get(k) == v for k, v in wanted.items())]
