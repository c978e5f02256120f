"""The reconciling half of the operator, on its own thread and event loop.

kopf's loop serves the injection webhook and the pool watch; everything that reconciles (informer
caches, the per-pool queue, the periodic resync, leader election) runs here, so an admission review
never waits behind a reconcile's awaits or its CPU work (a GIL switch interval at most). The two
halves share only ``trigger()`` (thread-safe) and a few counters.

Reads come from informers (:mod:`kvfabric.operator.informer`): consumer pods indexed by the pool they
name, and the pool's children and cache-server pods indexed by ``kvfabric.io/owner-pool``; the
Secrets, which may not be watched, are remembered for a resync period (:class:`SecretMemo`). A
reconcile of an unchanged pool costs one GET of the pool, never a LIST of the cluster's pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import gc
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvfabric.operator.api.v1alpha1 import KIND, POOL_LABEL
from kvfabric.operator.cacheinsight import Scraper
from kvfabric.operator.consumerkeys import forget_pool, prune_roots, read_roots
from kvfabric.operator.informer import CachedReader, Informer
from kvfabric.operator.kube import ApiError, KubeClient
from kvfabric.operator.leader import LeaseElector
from kvfabric.operator.podhealth import server_pod_view
from kvfabric.operator.reconcile import AppliedMemo, PoolKey, ReconcileQueue, ReconcileResult, reconcile_pool
from kvfabric.operator.render import names
from kvfabric.operator.render.wipe import wipe_dir
from kvfabric.operator.secretmemo import SecretMemo
from kvfabric.operator.status import consumer_view
from kvfabric.operator.wipe import sweep_finished_wipe_pods, wipe_deleted_pool

log = logging.getLogger("kvfabric.operator.controller")

_OWNED = f"{names.MANAGED_BY}={names.MANAGED_BY_VALUE},{names.OWNER_POOL_LABEL}"
# Kinds cached by owner pool: what a reconcile reads (DaemonSet, Services, PVCs, cache pods, and every
# child's owner before it applies one) and what it must notice when edited or deleted by hand.
OWNED_KINDS = ("DaemonSet", "Service", "PersistentVolumeClaim", "ConfigMap", "NetworkPolicy", "Pod")


@dataclass(frozen=True)
class Election:
    """Where the replicas' Lease lives and who this replica is."""

    namespace: str
    name: str
    identity: str
    lease_seconds: float = 10.0
    renew_seconds: float = 3.0
    retry_seconds: float = 2.0


async def _all_synced(informers: list[Informer]) -> None:
    await asyncio.gather(*(i.synced.wait() for i in informers))


def _log_sweep(task: asyncio.Future[int]) -> None:
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.warning("could not sweep finished wipe pods: %s", exc)
    elif task.result():
        log.info("deleted %d finished wipe pods a previous leader left", task.result())


class Controller:
    """Informers + reconcile queue + resync (+ leader election), on a dedicated thread."""

    def __init__(
        self,
        make_client: Callable[[], KubeClient],
        *,
        injection_enabled: bool,
        namespaces: list[str] | None = None,
        resync_seconds: float = 30.0,
        election: Election | None = None,
        webhook_not_after: Callable[[], dt.datetime | None] | None = None,
        scrape_seconds: float = 60.0,
        freeze_gc: bool = False,
    ) -> None:
        self._make_client = make_client
        self.scrape_seconds = scrape_seconds
        # Once the caches are first complete, move everything alive then (modules, classes, kopf's
        # and pydantic's machinery, the listed objects) out of the garbage collector's sight: its full
        # passes then walk only what came later. Process-wide, so only the operator process sets it.
        self.freeze_gc = freeze_gc
        self._frozen = False
        self.scraper: Scraper | None = None
        self.injection_enabled = injection_enabled
        # Expiry of the certificate the webhook serves now (read across threads: one attribute).
        self.webhook_not_after = webhook_not_after or (lambda: None)
        self.namespaces = namespaces
        self.resync_seconds = resync_seconds
        self.election = election
        # The operator's own namespace, where wipe pods run: the Lease's (both default to
        # $POD_NAMESPACE), so a namespaced install's Role there covers them.
        self.operator_namespace = election.namespace if election is not None else names.operator_namespace()
        self.reconciles = 0
        # The resourceVersion each pool had after this replica last wrote its status: the watch event
        # of that very write brings nothing to reconcile (read from kopf's thread: one dict lookup).
        self._status_written: dict[PoolKey, str] = {}
        # What each child was last applied as, and the version that left it at (see reconcile_pool).
        self._applied: dict[PoolKey, AppliedMemo] = {}
        self.elector: LeaseElector | None = None
        self.reader: CachedReader | None = None
        self.secrets: SecretMemo | None = None
        self._known: set[PoolKey] = set()
        self._queue: ReconcileQueue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self.native_id: int | None = None
        """The kernel's id of the controller thread, once started (its CPU time is in ``/proc``)."""
        self._client: KubeClient | None = None
        self._wipes: set[asyncio.Task[None]] = set()
        # Every node a pool's cache servers were seen on while this replica led: with foreground
        # deletion the pods are gone before the pool's DELETED event, and the cache with them.
        self._pool_nodes: dict[PoolKey, set[str]] = {}

    def api_requests(self) -> dict[str, int]:
        """Requests the leading controller's client sent, by method (empty while it does not lead)."""
        client = self._client
        return dict(getattr(client, "requests", None) or {})

    @property
    def leading(self) -> bool:
        """Whether this replica reconciles now (always, without leader election)."""
        return self._queue is not None

    # --- the thread's API (called from kopf's loop or tests) ----------------------------------
    def start(self) -> None:
        """Start the thread and its loop."""
        self._thread = threading.Thread(target=self._run_thread, name="kvfabric-controller", daemon=True)
        self._thread.start()
        self._started.wait()

    def trigger(self, key: PoolKey, version: str | None = None) -> None:
        """Queue a reconcile of ``key`` (thread-safe; dropped while this replica does not lead).

        ``version``: the pool's resourceVersion when the trigger is its watch event; the event of the
        controller's own status write is then dropped, even when it overtakes the write's answer.
        """
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._trigger, key, version)

    def own_status_echo(self, key: PoolKey, body: Mapping[str, Any]) -> bool:
        """Whether ``body`` is the pool exactly as this replica's last status write left it.

        Its watch event then needs no reconcile: that pass already saw everything the write was
        computed from. Any other change (spec, labels, someone else's status edit) has another
        resourceVersion and is reconciled as always.
        """
        version = (body.get("metadata") or {}).get("resourceVersion")
        return version is not None and self._status_written.get(key) == str(version)

    def forget(self, key: PoolKey, last: dict[str, Any] | None = None) -> None:
        """The pool is gone (thread-safe); ``last`` is its final state, whose disks a leader wipes."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._forget, key, last)

    def stop(self, timeout: float = 20.0) -> None:
        """Cancel everything (releasing the Lease) and join the thread."""
        loop, main = self._loop, self._main
        if loop is not None and main is not None and not loop.is_closed():
            loop.call_soon_threadsafe(main.cancel)
        if self._thread is not None:
            self._thread.join(timeout)

    # --- on the controller's loop -------------------------------------------------------------
    def _run_thread(self) -> None:
        self.native_id = threading.get_native_id()
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        self._main = loop.create_task(self._run())
        self._started.set()
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(self._main)
        loop.close()

    def _trigger(self, key: PoolKey, version: str | None = None) -> None:
        self._known.add(key)
        if version is not None and self._status_written.get(key) == version:
            return
        if self._queue is not None:
            self._queue.trigger(key, version=version)

    def _forget(self, key: PoolKey, last: dict[str, Any] | None = None) -> None:
        self._known.discard(key)
        if self.secrets is not None:
            # A pool created again under this name must not see the old one's credentials.
            for secret_name in names.pool_secret_names(key[1]):
                self.secrets.forget(key[0], secret_name)
            self.secrets.forget(self.operator_namespace, names.CONSUMER_KEYS_SECRET)
        self._status_written.pop(key, None)
        self._applied.pop(key, None)
        seen = self._pool_nodes.pop(key, set())
        if self._queue is not None:
            self._queue.forget(key)
            if self._loop is not None:
                task = self._loop.create_task(self._forget_root(key))
                self._wipes.add(task)
                task.add_done_callback(self._wipes.discard)
            if last is not None and wipe_dir(last) is not None and self._loop is not None:
                task = self._loop.create_task(self._wipe(last, seen))
                self._wipes.add(task)
                task.add_done_callback(self._wipes.discard)

    async def _wipe(self, last: dict[str, Any], seen: set[str]) -> None:
        """Wipe a deleted pool's local-disk blocks on the nodes its servers ran on (docs/security.md)."""
        client, reader = self._client, self.reader
        if client is None or reader is None:
            return
        ns, name = str(last["metadata"]["namespace"]), str(last["metadata"]["name"])
        try:
            pods = await reader.list("Pod", ns, label_selector=names.owned_pod_selector(name))
            nodes = seen | {str(p["spec"]["nodeName"]) for p in pods if (p.get("spec") or {}).get("nodeName")}
            if not nodes:
                log.warning(
                    "deleted pool %s/%s has a local disk but no node known to hold it: not wiped", ns, name
                )
                return
            await wipe_deleted_pool(client, last, nodes, operator_namespace=self.operator_namespace)
        except asyncio.CancelledError:
            raise
        except Exception:  # a wipe never takes the controller down; the log says what was left
            log.exception("wiping the local disks of deleted pool %s/%s failed", ns, name)

    async def _forget_root(self, key: PoolKey) -> None:
        """Remove a deleted pool's entry from the consumer-keys Secret (the resync retries a failure)."""
        client = self._client
        if client is None:
            return
        try:
            if await forget_pool(client, self.operator_namespace, key):
                log.info("removed the consumer-key root of deleted pool %s/%s", *key)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("could not remove the consumer-key root of deleted pool %s/%s: %s", *key, exc)

    def _child_changed(self, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        owner = (meta.get("labels") or {}).get(names.OWNER_POOL_LABEL)
        if not owner:
            return
        key = (str(meta.get("namespace") or ""), owner)
        node = (obj.get("spec") or {}).get("nodeName")
        if node:  # a cache-server pod: remember every node the pool ran on, for its wipe
            self._pool_nodes.setdefault(key, set()).add(str(node))
        if self._queue is not None:
            self._queue.trigger(key)

    def _consumer_changed(self, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        pool = (meta.get("labels") or {}).get(POOL_LABEL)
        pool_ns = (meta.get("annotations") or {}).get(names.POOL_NAMESPACE_ANNOTATION) or meta.get(
            "namespace"
        )
        key = (str(pool_ns or ""), str(pool or ""))
        if key in self._known and self._queue is not None:
            self._queue.trigger(key)

    async def _run(self) -> None:
        client = self._make_client()
        try:
            if self.election is None:
                await self._lead(client)
            else:
                e = self.election
                self.elector = LeaseElector(
                    client,
                    namespace=e.namespace,
                    name=e.name,
                    identity=e.identity,
                    lease_seconds=e.lease_seconds,
                    renew_seconds=e.renew_seconds,
                    retry_seconds=e.retry_seconds,
                )
                await self.elector.run(lambda: self._lead(client))
        finally:
            await client.close()

    def informers(self, client: KubeClient) -> list[Informer]:
        """The caches a leader keeps."""
        out = [
            Informer(
                client,
                "Pod",
                label_selector=POOL_LABEL,
                index_label=POOL_LABEL,
                namespaces=self.namespaces,
                on_change=self._consumer_changed,
                # Thousands of them: only what their pools' status counts (see consumer_view).
                transform=consumer_view,
            )
        ]
        out += [
            Informer(
                client,
                kind,
                label_selector=_OWNED,
                index_label=names.OWNER_POOL_LABEL,
                namespaces=self.namespaces,
                on_change=self._child_changed,
                # One per node: only where each runs and its status (see server_pod_view).
                transform=server_pod_view if kind == "Pod" else None,
            )
            for kind in OWNED_KINDS
        ]
        return out

    async def _lead(self, client: KubeClient) -> None:
        self._client = client
        informers = self.informers(client)
        reader = CachedReader(client, informers)
        self.reader = reader
        scraper = Scraper(interval=self.scrape_seconds, on_update=self._trigger)
        self.scraper = scraper
        # Secrets cannot be watched: each is read again once a resync period old (see SecretMemo).
        secrets = SecretMemo(client, max_age=self.resync_seconds)
        self.secrets = secrets

        async def work(key: PoolKey) -> ReconcileResult | None:
            self.reconciles += 1
            result = await reconcile_pool(
                client,
                key[0],
                key[1],
                injection_enabled=self.injection_enabled,
                reader=reader,
                webhook_not_after=self.webhook_not_after(),
                scraper=scraper if self.scrape_seconds > 0 else None,
                operator_namespace=self.operator_namespace,
                applied=self._applied.setdefault(key, {}),
                secrets=secrets,
            )
            if result is not None and result.status_version is not None:
                self._status_written[key] = result.status_version
            return result

        tasks = [asyncio.ensure_future(i.run()) for i in informers]
        try:
            # Reconcile only from complete caches: a pool must not look as if it had no pods.
            synced: asyncio.Future[Any] = asyncio.ensure_future(_all_synced(informers))
            done, _ = await asyncio.wait([synced, *tasks], return_when=asyncio.FIRST_COMPLETED)
            if synced not in done:
                synced.cancel()
                for task in done:
                    task.result()  # an informer crashed: re-raise
            if self.freeze_gc and not self._frozen:
                # Acyclic objects frozen here (cached objects) are still freed when replaced; only
                # a cycle alive now and dropped later would stay: a one-time, start-up-sized cost.
                gc.collect()
                gc.freeze()
                self._frozen = True
            queue = ReconcileQueue(work)
            self._queue = queue
            sweep = asyncio.ensure_future(sweep_finished_wipe_pods(client, self.operator_namespace))
            sweep.add_done_callback(_log_sweep)
            try:
                for key in list(self._known):
                    queue.trigger(key)
                await asyncio.gather(self._resync_forever(client, queue), *tasks)
            finally:
                self._queue = None
                await queue.close()
                await scraper.close()
        finally:
            self._client = None
            for task in [*tasks, *self._wipes]:
                task.cancel()
            await asyncio.gather(*tasks, *self._wipes, return_exceptions=True)

    async def _read_roots(self, client: KubeClient) -> dict[str, str] | None:
        """The consumer-keys entries, or None (logged) when they cannot be read: the resync goes on."""
        try:
            return await read_roots(client, self.operator_namespace)
        except (ApiError, OSError, TimeoutError) as exc:
            log.warning("could not read %s/%s: %s", self.operator_namespace, names.CONSUMER_KEYS_SECRET, exc)
            return None

    async def _resync_forever(self, client: KubeClient, queue: ReconcileQueue) -> None:
        """Trigger every pool periodically: the safety net behind the watches."""
        while True:
            try:
                # The consumer-keys entries before the pools: an entry a pool created after the list
                # writes is then not in this snapshot, so it is never taken for a deleted pool's.
                roots = await self._read_roots(client)
                live: set[PoolKey] = set()
                scopes: list[str | None] = list(self.namespaces) if self.namespaces else [None]
                for ns in scopes:
                    for pool in await client.list(KIND, ns):
                        meta = pool["metadata"]
                        key = (meta["namespace"], meta["name"])
                        live.add(key)
                        self._known.add(key)
                        queue.trigger(key)
                if roots is not None:
                    # Pools deleted while no replica led (or whose removal failed) leave entries behind.
                    pruned = await prune_roots(client, self.operator_namespace, roots, live, self.namespaces)
                    if pruned and self.secrets is not None:
                        self.secrets.forget(self.operator_namespace, names.CONSUMER_KEYS_SECRET)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the loop alive; the next pass retries
                log.warning("resync failed: %s", exc)
            await asyncio.sleep(self.resync_seconds)
