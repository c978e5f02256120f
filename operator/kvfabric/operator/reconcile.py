"""Level-triggered reconciliation of one pool: read, render, apply, prune, observe, report.

The outcome depends only on the pool's spec and what the cluster holds now: no "create fired once"
memory, no kopf annotations. Any trigger (pool event, child event, periodic resync, operator start)
runs the same :func:`reconcile_pool`; :class:`ReconcileQueue` coalesces triggers per pool so a burst
of child events costs one reconcile, and retries failures with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, cast

import pydantic

from kvfabric.operator.api.v1alpha1 import KIND, POOL_LABEL, KVCachePool
from kvfabric.operator.cacheinsight import Scraper, scrape_targets
from kvfabric.operator.consumerkeys import publish_root
from kvfabric.operator.kube import ApiError, KubeClient
from kvfabric.operator.objectprobe import probe_object_store
from kvfabric.operator.podhealth import diagnose
from kvfabric.operator.poolpki import owned_by, plan_secrets
from kvfabric.operator.render import (
    ConfigError,
    ConnectionSettings,
    connection_settings,
    names,
    render_children,
)
from kvfabric.operator.render.children import RenderedChildren, owner_reference, surge_is_safe, without_surge
from kvfabric.operator.secretmemo import SecretMemo
from kvfabric.operator.status import Event, Observed, compute_status, strip_times

log = logging.getLogger("kvfabric.operator.reconcile")

# Kinds a pool may own and that are pruned when no longer rendered (e.g. metrics disabled).
_PRUNABLE: Final = ("Service", "PersistentVolumeClaim", "ConfigMap")
# Kinds whose rendered names are checked for someone else's object before applying: every kind a
# pool renders except Secrets, which plan_secrets checks the same way.
_OWNERSHIP_CHECKED: Final = ("ConfigMap", "PersistentVolumeClaim", "DaemonSet", "Service", "NetworkPolicy")
PoolKey = tuple[str, str]  # (namespace, name)
# Kinds whose apply is skipped when nothing changed since the last one (AppliedMemo): those the
# controller's informers cache, so "unchanged" is read from the cache, never from the API server.
_MEMO_KINDS: Final = frozenset(
    {"ConfigMap", "Service", "DaemonSet", "NetworkPolicy", "PersistentVolumeClaim"}
)
AppliedMemo = dict[tuple[str, str, str], tuple[str, str]]
"""(kind, namespace, name) -> (digest of what was applied, the object's resourceVersion after it)."""


def _digest(obj: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def utcnow() -> str:
    """Return the current time as RFC 3339 (seconds), as Kubernetes writes it."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ReconcileResult:
    """What one reconcile did (for logs, tests and the benchmark)."""

    applied: int = 0
    pruned: int = 0
    status_changed: bool = False
    status_version: str | None = None
    """The pool's resourceVersion after this pass wrote its status (None: nothing written)."""
    events: list[Event] = field(default_factory=list)
    ready: bool = False
    # Secrets with the pool's names that are not the pool's: nothing else was applied (the status says).
    secret_conflicts: tuple[str, ...] = ()
    # Children's names ("Kind name") held by objects that are not the pool's: nothing was applied.
    object_conflicts: tuple[str, ...] = ()


class Reader(Protocol):
    """Where a reconcile reads the cluster: the API server itself, or informer caches in front of it."""

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """Return one object, or None."""
        ...

    async def list(
        self,
        kind: str,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        """Return the matching objects."""
        ...


@dataclass
class Plan:
    """What the pool's spec asks for: the rendered children, or why there are none."""

    pool: KVCachePool | None = None
    children: RenderedChildren | None = None
    connection: ConnectionSettings | None = None
    config_error: str | None = None
    claim_name: str | None = None
    metrics_service: str | None = None
    progress_deadline_seconds: int = 300


def plan_pool(raw: dict[str, Any]) -> Plan:
    """Parse and render a pool object (pure)."""
    name = raw["metadata"]["name"]
    try:
        pool = KVCachePool.model_validate(raw)
        plan = Plan(pool=pool, connection=connection_settings(pool), children=render_children(pool))
    except (pydantic.ValidationError, ConfigError) as exc:
        # Keep the children as they are: a bad edit must not tear down a working pool.
        shared_raw = (raw.get("spec", {}).get("tiers", {}) or {}).get("shared")
        claim = (shared_raw.get("existingClaim") or names.shared_claim_name(name)) if shared_raw else None
        return Plan(config_error=str(exc), claim_name=claim)
    shared = pool.spec.tiers.shared
    if shared is not None:
        plan.claim_name = shared.existing_claim or names.shared_claim_name(name)
    if pool.spec.metrics.enabled:
        plan.metrics_service = names.metrics_service_name(name)
    plan.progress_deadline_seconds = pool.spec.update_strategy.progress_deadline_seconds
    return plan


async def _apply_children(
    client: KubeClient,
    reader: Reader,
    pool: KVCachePool,
    children: RenderedChildren,
    result: ReconcileResult,
    *,
    memo: AppliedMemo | None = None,
    secrets: SecretMemo | None = None,
) -> str | None:
    """Apply and prune; return the API server's message if it rejected an object, else None.

    With ``memo``, a child of :data:`_MEMO_KINDS` whose rendering is what was last applied and whose
    cached resourceVersion is the one that apply returned is not applied again: nobody changed it
    since (an edit by hand, a controller's status update or a deletion changes or drops that version,
    and the next pass applies it as always).
    """
    namespace, name = pool.namespace, pool.name
    # The ConfigMap first: pods of a new DaemonSet revision must find the new configuration. The
    # rest are independent and go in parallel (latency matters when many pools change at once).
    configmaps = children.by_kind("ConfigMap")
    others = [obj for obj in children.objects if obj["kind"] != "ConfigMap"]
    rejected: list[str] = []
    foreign = await _foreign_children(client, reader, pool, children.objects)
    if foreign:
        # Applying with force would take the object over (labels, owner reference): pruning or the
        # garbage collector would then delete someone else's object. Nothing is applied or pruned.
        result.object_conflicts = foreign
        return None

    async def apply(obj: dict[str, Any]) -> None:
        kind, name = obj["kind"], obj["metadata"]["name"]
        memo_key = (kind, namespace, name)
        digest = _digest(obj) if memo is not None and kind in _MEMO_KINDS else None
        if digest is not None and memo is not None and memo_key in memo:
            cached = await reader.get(kind, namespace, name)
            version = ((cached or {}).get("metadata") or {}).get("resourceVersion")
            if version is not None and memo[memo_key] == (digest, str(version)):
                return
        try:
            answer = await client.apply(obj, field_manager=names.FIELD_MANAGER)
            version = ((answer or {}).get("metadata") or {}).get("resourceVersion")
            if digest is not None and memo is not None and version is not None:
                memo[memo_key] = (digest, str(version))
        except ApiError as exc:
            if not exc.rejected:
                raise
            rejected.append(f"{obj['kind']} {obj['metadata']['name']}: {exc.message}")

    for obj in configmaps:
        await apply(obj)
    # Credentials before the DaemonSet too: its pods mount them. One of the pool's names taken by a
    # Secret that is not the pool's stops here: its pods would mount someone else's Secret.
    _, conflicts = await _ensure_secrets(client, pool, secrets)
    if conflicts:
        result.applied = len(configmaps)
        result.secret_conflicts = conflicts
        return None
    if pool.spec.update_strategy.hand_over:
        existing = await reader.get("DaemonSet", namespace, names.daemonset_name(name))
        if not surge_is_safe(existing):
            # Pods of a version without hand-over still run: this rollout stops them first.
            others = [without_surge(o, pool) if o["kind"] == "DaemonSet" else o for o in others]
    pruned, *_ = await asyncio.gather(
        _prune(client, reader, pool, children.objects), *(apply(obj) for obj in others)
    )
    result.applied = len(configmaps) + len(others) - len(rejected)
    result.pruned = cast(int, pruned)
    return "; ".join(rejected) or None


async def _foreign_children(
    client: KubeClient, reader: Reader, pool: KVCachePool, objects: list[dict[str, Any]]
) -> tuple[str, ...]:
    """Return ``"Kind name"`` of each rendered child whose name is held by an object not the pool's.

    The pool's own children carry an owner reference to its uid (not merely its labels, which anyone
    can copy). The informers cache only labelled objects, so a name they do not hold is checked
    against the API server: a user's object without our labels is found there.
    """
    uid = str(pool.metadata.get("uid", ""))

    async def foreign(obj: dict[str, Any]) -> str | None:
        kind, name = obj["kind"], obj["metadata"]["name"]
        found = await reader.get(kind, pool.namespace, name)
        if found is None and reader is not client:
            found = await client.get(kind, pool.namespace, name)
        if found is None or owned_by(found, uid):
            return None
        return f"{kind} {name}"

    held = await asyncio.gather(*(foreign(o) for o in objects if o["kind"] in _OWNERSHIP_CHECKED))
    return tuple(sorted(h for h in held if h is not None))


async def _failed_create(
    reader: Reader, namespace: str, daemonset: dict[str, Any] | None
) -> tuple[str | None, int]:
    """Return the latest FailedCreate message of the DaemonSet and how many nodes lack a pod."""
    ds_status = (daemonset or {}).get("status") or {}
    missing = int(ds_status.get("desiredNumberScheduled") or 0) - int(
        ds_status.get("currentNumberScheduled") or 0
    )
    if daemonset is None or missing <= 0:
        return None, 0  # only then can pods be missing: no Event LIST in the normal case
    events = await reader.list(
        "Event",
        namespace,
        field_selector=f"involvedObject.kind=DaemonSet,involvedObject.name={daemonset['metadata']['name']},"
        "reason=FailedCreate",
    )
    uid = daemonset["metadata"].get("uid")
    events = [e for e in events if not uid or (e.get("involvedObject") or {}).get("uid") in (None, uid)]
    if not events:
        return None, missing
    latest = max(events, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
    return str(latest.get("message") or "FailedCreate"), missing


async def _observe(
    reader: Reader,
    raw: dict[str, Any],
    plan: Plan,
    *,
    apply_error: str | None,
    secret_conflicts: tuple[str, ...] = (),
    object_conflicts: tuple[str, ...] = (),
    injection_enabled: bool,
    webhook_not_after: dt.datetime | None = None,
    scraper: Scraper | None = None,
) -> Observed:
    namespace, name = raw["metadata"]["namespace"], raw["metadata"]["name"]
    # The cache-server pods by their ownership labels too, served from the informer's cache (by the
    # selector labels alone each reconcile would LIST the namespace's pods: the webhook's p99 paid).
    selector = names.owned_pod_selector(name)
    daemonset, claim, consumers, servers = await asyncio.gather(
        reader.get("DaemonSet", namespace, names.daemonset_name(name)),
        reader.get("PersistentVolumeClaim", namespace, plan.claim_name) if plan.claim_name else _none(),
        _consumer_pods(reader, namespace, name),
        reader.list("Pod", namespace, label_selector=selector),
    )
    failed_create, missing = await _failed_create(reader, namespace, daemonset)
    cache = None
    if scraper is not None and plan.pool is not None and plan.pool.spec.metrics.enabled:
        scraper.schedule((namespace, name), scrape_targets(servers, plan.pool.spec.metrics.port), utcnow())
        cache = scraper.insights.get((namespace, name))
    return Observed(
        generation=int(raw["metadata"].get("generation") or 0),
        revision=plan.children.config_hash if plan.children is not None else None,
        config_error=plan.config_error,
        daemonset=daemonset,
        claim_name=plan.claim_name,
        claim=claim,
        consumer_pods=consumers,
        connection=plan.connection,
        injection_enabled=injection_enabled,
        webhook_not_after=webhook_not_after,
        metrics_service=plan.metrics_service,
        previous_status=dict(raw.get("status") or {}),
        apply_error=apply_error,
        secret_conflicts=secret_conflicts,
        object_conflicts=object_conflicts,
        pod_problems=diagnose(servers, failed_create, missing),
        progress_deadline_seconds=plan.progress_deadline_seconds,
        cache=cache,
    )


class ApplyRejectedError(Exception):
    """The API server refused a rendered child; the status says why, the queue retries with backoff."""


async def reconcile_pool(
    client: KubeClient,
    namespace: str,
    name: str,
    *,
    injection_enabled: bool,
    reader: Reader | None = None,
    webhook_not_after: dt.datetime | None = None,
    scraper: Scraper | None = None,
    operator_namespace: str | None = None,
    applied: AppliedMemo | None = None,
    secrets: SecretMemo | None = None,
) -> ReconcileResult | None:
    """Bring one pool's children to the rendered state and write its status; None if the pool is gone.

    ``reader`` serves the reads (default: ``client``, i.e. the API server); writes always go to ``client``.
    ``scraper`` (optional) keeps ``status.cache`` current from the cache servers' metrics.
    ``operator_namespace`` (default: ``$POD_NAMESPACE``) holds the consumer-keys Secret.
    ``applied`` (optional, kept across passes) skips applying children nobody changed since.
    ``secrets`` (optional, kept across passes) answers Secret reads from what was read or written lately.
    """
    reader = reader or client
    raw = await client.get(KIND, namespace, name)
    if raw is None or raw.get("metadata", {}).get("deletionTimestamp"):
        return None  # owner references let the garbage collector remove the children
    result = ReconcileResult()
    plan = plan_pool(raw)
    apply_error = None
    if plan.children is not None and plan.pool is not None:
        apply_error = await _apply_children(
            client, reader, plan.pool, plan.children, result, memo=applied, secrets=secrets
        )
        await _publish_consumer_root(
            client, operator_namespace or names.operator_namespace(), plan.pool, secrets
        )
    observed = await _observe(
        reader,
        raw,
        plan,
        apply_error=apply_error,
        secret_conflicts=result.secret_conflicts,
        object_conflicts=result.object_conflicts,
        injection_enabled=injection_enabled,
        webhook_not_after=webhook_not_after,
        scraper=scraper,
    )
    if plan.pool is not None and plan.pool.spec.tiers.object_store is not None:
        # The bucket probe reads the named Secret from the API server (never cached: get only).
        probe = await probe_object_store(client, plan.pool)
        observed = dataclasses.replace(observed, object_store=(probe.ok, probe.reason, probe.message))
    status, events = compute_status(observed, utcnow())
    result.ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status["conditions"])
    if strip_times(status) != strip_times(observed.previous_status):
        result.status_version = await _write_status(client, raw, status)
        result.status_changed = True
        result.events = events
        for event in events:
            await post_event(client, raw, event)
    if apply_error is not None:
        # Reported at once (above); retried with backoff, since a later pass may succeed (an admission
        # webhook or quota that changes, RBAC granted).
        raise ApplyRejectedError(apply_error)
    return result


async def _write_status(client: KubeClient, raw: dict[str, Any], status: dict[str, Any]) -> str | None:
    """Write the status; return the pool's resourceVersion after the write."""
    meta = raw["metadata"]
    try:
        written = await client.patch_status(
            KIND, meta["namespace"], meta["name"], status, resource_version=meta.get("resourceVersion")
        )
        version = ((written or {}).get("metadata") or {}).get("resourceVersion")
        return str(version) if version else None
    except ApiError as exc:
        if exc.status == 409:
            # The pool changed while we looked: the event that changed it triggers another pass.
            raise RetryNow from exc
        raise


async def _ensure_secrets(
    client: KubeClient, pool: KVCachePool, secrets: SecretMemo | None = None
) -> tuple[frozenset[str], tuple[str, ...]]:
    """Create, complete or rotate the pool's credentials.

    Returns the Secret names it should have and those of them held by a Secret that is not the
    pool's (left untouched: never merged into, owned or deleted). With ``secrets``, they are read
    from what this replica read or wrote lately; a conflict is confirmed by the API server first.
    """
    candidates = names.pool_secret_names(pool.name)
    owner = owner_reference(pool)
    if secrets is None:
        found = await asyncio.gather(*(client.get("Secret", pool.namespace, n) for n in candidates))
    else:
        found = await asyncio.gather(*(secrets.get(pool.namespace, n) for n in candidates))
        if any(s is not None and not owned_by(s, owner["uid"]) for s in found):
            # Someone else's, or a previous pool's of that name that is gone by now: ask again.
            found = await asyncio.gather(*(secrets.get(pool.namespace, n, fresh=True) for n in candidates))
    plan = plan_secrets(pool, dict(zip(candidates, found, strict=True)), dt.datetime.now(dt.UTC), owner)
    for body in plan.writes:
        secret_name = body["metadata"]["name"]
        try:
            answer = await client.apply(body, field_manager=names.FIELD_MANAGER)
        except BaseException:
            if secrets is not None:
                secrets.forget(pool.namespace, secret_name)
            raise
        if secrets is not None:
            secrets.put(answer, pool.namespace, secret_name)
    # Secrets are never listed (a list returns every Secret's data): the ones the pool no longer
    # needs (TCP turned off) are known by name, and only the pool's own are deleted.
    for secret_name, secret in zip(candidates, found, strict=True):
        if secret is not None and secret_name not in plan.wanted and owned_by(secret, owner["uid"]):
            if secrets is not None:
                secrets.forget(pool.namespace, secret_name)
            await client.delete("Secret", pool.namespace, secret_name)
    return plan.wanted, plan.conflicts


async def _publish_consumer_root(
    client: KubeClient, operator_namespace: str, pool: KVCachePool, secrets: SecretMemo | None = None
) -> None:
    """Keep the pool's entry in the consumer-keys Secret current (the CSI plugin's only source).

    A failure is logged, never raised: it must not hold the pool's status back, and the periodic
    resync retries it; meanwhile only consumers outside the pool's namespace lack a key (the plugin
    refuses their key volume, and their pods wait in ContainerCreating until it is there).
    """
    try:
        if await publish_root(client, operator_namespace, pool, secrets=secrets):
            log.info("published the consumer-key root of %s/%s", pool.namespace, pool.name)
    except (ApiError, OSError, TimeoutError) as exc:
        log.warning(
            "could not publish the consumer-key root of %s/%s in %s/%s: %s",
            pool.namespace,
            pool.name,
            operator_namespace,
            names.CONSUMER_KEYS_SECRET,
            exc,
        )


async def _none() -> None:
    return None


class RetryNow(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Reconcile again right away (the pool changed under us)."""


async def _prune(client: KubeClient, reader: Reader, pool: KVCachePool, desired: list[dict[str, Any]]) -> int:
    """Delete the pool's children it no longer renders: only those owned by the pool's uid.

    The labels select, the owner reference decides: a labelled object that is not the pool's (a
    copied manifest, or labels added to make the operator delete it) is left alone.
    """
    namespace, name, uid = pool.namespace, pool.name, str(pool.metadata.get("uid", ""))
    wanted = {(obj["kind"], obj["metadata"]["name"]) for obj in desired}
    selector = f"{names.OWNER_POOL_LABEL}={name},{names.MANAGED_BY}={names.MANAGED_BY_VALUE}"
    listed = await asyncio.gather(
        *(reader.list(kind, namespace, label_selector=selector) for kind in _PRUNABLE)
    )
    pruned = 0
    for kind, objs in zip(_PRUNABLE, listed, strict=True):
        for obj in objs:
            obj_name = obj["metadata"]["name"]
            if (
                (kind, obj_name) not in wanted
                and owned_by(obj, uid)
                and await client.delete(kind, namespace, obj_name)
            ):
                pruned += 1
    return pruned


async def _consumer_pods(reader: Reader, namespace: str, name: str) -> list[dict[str, Any]]:
    """Return pods that opted in to this pool: same namespace, or elsewhere naming its namespace."""
    try:
        pods = await reader.list("Pod", None, label_selector=f"{POOL_LABEL}={name}")
    except ApiError as exc:
        if exc.status != 403:
            raise
        # Without cluster-wide pod access (namespaced install), count the pool's own namespace only.
        pods = await reader.list("Pod", namespace, label_selector=f"{POOL_LABEL}={name}")
    out = []
    for pod in pods:
        meta = pod.get("metadata", {})
        target_ns = (meta.get("annotations") or {}).get(names.POOL_NAMESPACE_ANNOTATION) or meta.get(
            "namespace"
        )
        if target_ns == namespace:
            out.append(pod)
    return out


async def post_event(client: KubeClient, pool: dict[str, Any], event: Event) -> None:
    """Post a core/v1 Event about ``pool``; failures are logged, never raised (events are best effort)."""
    meta = pool["metadata"]
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    body = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": pool.get("apiVersion"),
            "kind": pool.get("kind"),
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "type": event.type,
        "reason": event.reason,
        "message": event.message,
        "source": {"component": names.FIELD_MANAGER},
        "reportingComponent": names.FIELD_MANAGER,
        "reportingInstance": names.FIELD_MANAGER,
        "firstTimestamp": now.split(".")[0] + "Z",
        "lastTimestamp": now.split(".")[0] + "Z",
        "count": 1,
    }
    try:
        await client.create(body)
    except (ApiError, OSError) as exc:  # pragma: no cover - best effort
        log.warning(
            "could not post event %s for %s/%s: %s", event.reason, meta["namespace"], meta["name"], exc
        )


@dataclass
class _KeyState:
    dirty: bool = False
    running: bool = False
    failures: int = 0
    # Since the running pass began: the pool versions its triggers named, and whether any trigger
    # named none (a child's event, a resync), which always needs another pass.
    versions: set[str] = field(default_factory=set)
    unversioned: bool = False


class ReconcileQueue:
    """Per-pool coalescing work queue with retry/backoff.

    ``trigger`` marks a pool dirty; at most one reconcile per pool runs at a time, and triggers that
    arrive while it runs fold into one more pass. Failures retry with exponential backoff (max 30 s).
    """

    def __init__(self, worker: Callable[[PoolKey], Awaitable[Any]], *, max_backoff: float = 30.0) -> None:
        self._worker = worker
        self._state: dict[PoolKey, _KeyState] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._max_backoff = max_backoff

    def trigger(self, key: PoolKey, *, version: str | None = None) -> None:
        """Schedule a reconcile of ``key`` (no-op if one is already pending).

        ``version`` is the pool's resourceVersion when the trigger is the pool's own watch event: if
        every trigger that arrived during a pass named the version that pass's status write left the
        pool at (:attr:`ReconcileResult.status_version`), they were its echo and no pass follows.
        """
        state = self._state.setdefault(key, _KeyState())
        state.dirty = True
        if version is None:
            state.unversioned = True
        else:
            state.versions.add(version)
        if not state.running:
            state.running = True
            task = asyncio.get_running_loop().create_task(self._run(key, state))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def forget(self, key: PoolKey) -> None:
        """Drop bookkeeping for a deleted pool (a running pass finds it gone and stops)."""
        state = self._state.get(key)
        if state is not None and not state.running:
            del self._state[key]

    async def _run(self, key: PoolKey, state: _KeyState) -> None:
        try:
            while state.dirty:
                state.dirty = False
                state.versions.clear()
                state.unversioned = False
                try:
                    result = await self._worker(key)
                    state.failures = 0
                    written = getattr(result, "status_version", None)
                    if state.dirty and not state.unversioned and written is not None:
                        state.dirty = not state.versions <= {written}
                except RetryNow:
                    state.dirty = True
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    state.failures += 1
                    delay = min(self._max_backoff, 0.5 * 2 ** min(state.failures, 8))
                    log.warning(
                        "reconcile %s/%s failed (%s); retrying in %.1fs", *key, str(exc) or repr(exc), delay
                    )
                    await asyncio.sleep(delay)
                    state.dirty = True
        finally:
            state.running = False

    async def close(self) -> None:
        """Cancel running passes (operator shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def idle(self) -> bool:
        """Return True when no reconcile is running or pending."""
        return not any(s.running or s.dirty for s in self._state.values())
