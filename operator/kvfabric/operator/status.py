"""Pure status computation: observed children in, the pool's ``status`` and notable events out.

Ready means the *current* revision is ready on every selected node: the DaemonSet controller has
observed the latest template (``observedGeneration``), every scheduled pod is updated, ready and
available, the template still carries the configuration hash this reconcile rendered, and no
cache-server pod has a problem (:mod:`kvfabric.operator.podhealth`) — the pods are read directly, so
a server whose readiness probe fails makes the pool not Ready, and ``Degraded`` with the reason
(``ServersNotServing``: the pods and nodes whose servers stopped serving), even before the
DaemonSet's counts catch up. Such a pool is not rolling out: ``Progressing`` stays False.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple, TypeVar

import pydantic
from pydantic import BaseModel

from kvfabric.operator.api.v1alpha1 import (
    CacheInsight,
    Condition,
    ConditionStatus,
    Connection,
    ConsumerCounts,
    KVCachePoolStatus,
    NodeCounts,
)
from kvfabric.operator.podhealth import NOT_SERVING, PRIORITY, PodProblem
from kvfabric.operator.render import names
from kvfabric.operator.render.connection import ConnectionSettings

CONDITION_TYPES: Final = (
    "Ready",
    "Progressing",
    "Degraded",
    "ConfigValid",
    "StorageReady",
    "InjectionReady",
    "RoutingEvents",  # only for a pool with spec.consumers.routingEvents
)
_MAX_MESSAGE: Final = 4096  # Condition.message maxLength
DEADLINE_EXCEEDED: Final = "ProgressDeadlineExceeded"
# Degraded reasons that get their own Warning event (the others already have one: PoolNotReady,
# InvalidServerConfig, ClaimNotFound...), and a Normal "Recovered" event when they clear.
SECRET_CONFLICT: Final = "SecretConflict"  # noqa: S105 - a condition reason, not a secret
OBJECT_CONFLICT: Final = "ObjectConflict"
FAILURE_EVENT_REASONS: Final = frozenset(
    {"ApplyFailed", SECRET_CONFLICT, OBJECT_CONFLICT, DEADLINE_EXCEEDED, *PRIORITY}
)


@dataclass(frozen=True)
class Observed:
    """What one reconcile saw in the cluster for one pool."""

    generation: int
    revision: str | None
    config_error: str | None
    daemonset: dict[str, Any] | None
    claim_name: str | None
    claim: dict[str, Any] | None
    consumer_pods: list[dict[str, Any]]
    connection: ConnectionSettings | None
    injection_enabled: bool
    metrics_service: str | None
    previous_status: dict[str, Any] = field(default_factory=dict)
    # The API server's message when it rejected one of the rendered children (server-side apply).
    apply_error: str | None = None
    # The pool's Secret names held by Secrets that are not the pool's (left alone; nothing applied).
    secret_conflicts: tuple[str, ...] = ()
    # The pool's children's names ("Kind name") held by objects that are not the pool's (left alone).
    object_conflicts: tuple[str, ...] = ()
    # Why cache-server pods are not serving (kvfabric.operator.podhealth.diagnose), worst first.
    pod_problems: list[PodProblem] = field(default_factory=list)
    # spec.updateStrategy.progressDeadlineSeconds
    progress_deadline_seconds: int = 300
    # Expiry of the certificate the webhook serves now (None: not known, e.g. no webhook).
    webhook_not_after: dt.datetime | None = None
    # The object tier's probe: (reachable and writable, reason, message); None without an object tier.
    object_store: tuple[bool, str, str] | None = None
    # The latest scrape of the cache servers' metrics (None: keep what the status says).
    cache: CacheInsight | None = None


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to post about the pool."""

    type: str  # Normal | Warning
    reason: str
    message: str


class Verdict(NamedTuple):
    """One condition's outcome: status (None = Unknown), CamelCase reason, message."""

    ok: bool | None
    reason: str
    message: str


def _condition(
    ctype: str, verdict: Verdict, generation: int, previous: dict[str, dict[str, Any]], now: str
) -> Condition:
    status = (
        ConditionStatus.UNKNOWN
        if verdict.ok is None
        else (ConditionStatus.TRUE if verdict.ok else ConditionStatus.FALSE)
    )
    before = previous.get(ctype)
    # lastTransitionTime moves only when the status flips, as metav1.Condition requires.
    transition = before.get("lastTransitionTime") if before and before.get("status") == status else None
    return Condition(
        type=ctype,
        status=status,
        reason=verdict.reason,
        message=verdict.message[:_MAX_MESSAGE],
        observed_generation=generation,
        last_transition_time=transition or now,
    )


def _int(obj: dict[str, Any] | None, key: str) -> int:
    if obj is None:
        return 0
    return int(obj.get(key) or 0)


def _injected_detail(annotations: dict[str, Any]) -> dict[str, Any]:
    """The webhook's ``kvfabric.io/injected`` JSON; ``{}`` when absent or not JSON (a hand edit)."""
    try:
        detail = json.loads(str(annotations.get(names.INJECTED_ANNOTATION) or "{}"))
    except ValueError:
        return {}
    return detail if isinstance(detail, dict) else {}


# What a consumer pod is cached as (:func:`consumer_view`): the fields consumer_counts, the pool
# index and the change callback read.
_CONSUMER_META: Final = (
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "labels",
    "annotations",
    "deletionTimestamp",
)


def consumer_view(pod: dict[str, Any]) -> dict[str, Any]:
    """The part of a consumer pod its pool's status is computed from (the informer caches only this).

    Metadata (labels and annotations: which pool, injected with which settings, or skipped why) and
    the phase. Its labels and annotations are dicts of strings, which the garbage collector does not
    track, so a cached consumer costs it two dicts, however large the pod's spec and status.
    """
    meta = pod.get("metadata") or {}
    view: dict[str, Any] = {"metadata": {k: meta[k] for k in _CONSUMER_META if k in meta}}
    phase = (pod.get("status") or {}).get("phase")
    if phase is not None:
        view["status"] = {"phase": phase}
    return view


def consumer_counts(pods: list[dict[str, Any]], current_hash: str | None) -> dict[str, Any]:
    """Count opted-in pods: matched, injected with the current hash, stale (older hash), skipped.

    Also the skipped ones by reason, and the injected ones wired to the TCP listener alone.
    """
    matched = injected = stale = skipped = over_tcp = 0
    by_reason: dict[str, int] = {}
    for pod in pods:
        if pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            continue
        if pod.get("metadata", {}).get("deletionTimestamp"):
            continue
        matched += 1
        annotations = pod.get("metadata", {}).get("annotations") or {}
        pod_hash = annotations.get(names.CONFIG_HASH_ANNOTATION)
        if pod_hash and names.INJECTED_ANNOTATION in annotations:
            if pod_hash == current_hash:
                injected += 1
            else:
                stale += 1
            if _injected_detail(annotations).get("transport") == "tcp":
                over_tcp += 1
        elif names.SKIP_REASON_ANNOTATION in annotations:
            skipped += 1
            reason = str(annotations[names.SKIP_REASON_ANNOTATION])[:63] or "unknown"
            if reason in by_reason or len(by_reason) < 16:  # bounded like the CRD field
                by_reason[reason] = by_reason.get(reason, 0) + 1
    return {
        "matched": matched,
        "injected": injected,
        "stale": stale,
        "skipped": skipped,
        "skipped_by_reason": by_reason,
        "over_tcp": over_tcp,
    }


@dataclass(frozen=True)
class Rollout:
    """The DaemonSet's state as far as Ready and Progressing are concerned."""

    exists: bool
    nodes: NodeCounts
    unavailable: int
    generation_seen: bool  # the DaemonSet controller has observed the latest template
    revision_current: bool  # the template carries the revision this reconcile rendered

    @property
    def done(self) -> bool:
        """Every scheduled pod runs the current revision and is available."""
        n = self.nodes
        return (
            self.exists
            and self.generation_seen
            and self.revision_current
            and n.updated == n.desired
            and n.available == n.desired
        )

    @property
    def all_ready(self) -> bool:
        """The rollout is done and every pod is ready."""
        return self.done and self.nodes.ready == self.nodes.desired and self.unavailable == 0


def observe_rollout(daemonset: dict[str, Any] | None, revision: str | None) -> Rollout:
    """Read the DaemonSet's status and template into a :class:`Rollout`."""
    ds = daemonset or {}
    ds_status = ds.get("status") or {}
    template_hash = (ds.get("spec", {}).get("template", {}).get("metadata", {}).get("annotations") or {}).get(
        names.CONFIG_HASH_ANNOTATION
    )
    return Rollout(
        exists=daemonset is not None,
        nodes=NodeCounts(
            desired=_int(ds_status, "desiredNumberScheduled"),
            ready=_int(ds_status, "numberReady"),
            updated=_int(ds_status, "updatedNumberScheduled"),
            available=_int(ds_status, "numberAvailable"),
        ),
        unavailable=_int(ds_status, "numberUnavailable"),
        generation_seen=daemonset is not None
        and _int(ds_status, "observedGeneration") >= _int(ds.get("metadata"), "generation"),
        revision_current=revision is not None and template_hash == revision,
    )


def config_verdict(observed: Observed) -> Verdict:
    """ConfigValid: the spec yields a valid server configuration."""
    if observed.config_error is not None:
        return Verdict(False, "InvalidServerConfig", observed.config_error[:1000])
    return Verdict(True, "Valid", "the server configuration renders and validates")


def storage_verdict(observed: Observed) -> Verdict:
    """StorageReady: the shared tier's claim is Bound and the object tier's bucket is writable."""
    claim = _claim_verdict(observed)
    if observed.object_store is None:
        return claim
    obj = Verdict(*observed.object_store)
    if observed.claim_name is None:
        return obj
    ok = bool(claim.ok) and obj.ok
    reason = claim.reason if not claim.ok else obj.reason
    return Verdict(ok, reason, f"{claim.message}; {obj.message}")


def _claim_verdict(observed: Observed) -> Verdict:
    """The shared tier's claim exists and is Bound (True without a shared tier)."""
    claim_name = observed.claim_name
    if claim_name is None:
        return Verdict(True, "NoSharedTier", "no shared tier configured")
    if observed.claim is None:
        return Verdict(False, "ClaimNotFound", f"PersistentVolumeClaim {claim_name} not found")
    phase = observed.claim.get("status", {}).get("phase", "Pending")
    if phase == "Bound":
        return Verdict(True, "ClaimBound", f"PersistentVolumeClaim {claim_name} is Bound")
    if phase == "Lost":
        return Verdict(False, "ClaimLost", f"PersistentVolumeClaim {claim_name} is Lost")
    return Verdict(False, "ClaimPending", f"PersistentVolumeClaim {claim_name} is {phase}")


def progressing_verdict(observed: Observed, rollout: Rollout) -> Verdict:
    """Progressing: a rollout of the current revision is under way."""
    n = rollout.nodes
    if not rollout.exists:
        return Verdict(True, "Creating", "waiting for the DaemonSet to be created")
    if not rollout.generation_seen:
        return Verdict(True, "RolloutPending", "the DaemonSet controller has not observed the change")
    if not rollout.revision_current:
        return Verdict(True, "RolloutPending", "the DaemonSet does not carry the current revision")
    # Updated servers that stopped serving are a fault (Degraded), not a rollout under way.
    not_serving = sum(p.count for p in observed.pod_problems if p.reason == NOT_SERVING)
    if n.updated < n.desired or n.available + not_serving < n.desired:
        return Verdict(
            True, "RollingOut", f"{n.updated}/{n.desired} nodes updated, {n.available}/{n.desired} available"
        )
    done = f"revision {observed.revision} on {n.desired} nodes"
    if n.available < n.desired:
        return Verdict(False, "RolloutComplete", f"{done}; {n.desired - n.available} not serving")
    return Verdict(False, "RolloutComplete", done)


def secret_conflict_message(observed: Observed) -> str:
    """Name the Secrets in the way, and what to do about them."""
    them = ", ".join(observed.secret_conflicts)
    one = len(observed.secret_conflicts) == 1
    return (
        f"Secret{'' if one else 's'} {them} already exist{'s' if one else ''} and "
        f"{'is' if one else 'are'} not this pool's (no owner reference to it): the operator leaves "
        f"{'it' if one else 'them'} as {'it is' if one else 'they are'} and applies nothing for the "
        "pool; rename the pool, or give that Secret another name"
    )


def object_conflict_message(observed: Observed) -> str:
    """Name the objects in the way, and what to do about them."""
    them = ", ".join(observed.object_conflicts)
    one = len(observed.object_conflicts) == 1
    return (
        f"{them} already exist{'s' if one else ''} and {'is' if one else 'are'} not this pool's (no owner "
        f"reference to it): the operator leaves {'it' if one else 'them'} as {'it is' if one else 'they are'}"
        " and applies nothing for the pool; if it was left by an earlier pool of this name (e.g. deleted"
        " with --cascade=orphan), delete it; otherwise rename the pool, or give that object another name"
    )


def degraded_verdict(observed: Observed, rollout: Rollout, storage: Verdict, progressing: Verdict) -> Verdict:
    """Degraded: something is wrong that waiting for the rollout will not fix."""
    n = rollout.nodes
    if observed.config_error is not None:
        return Verdict(True, "InvalidServerConfig", "the pool's spec yields an invalid server config")
    if observed.apply_error is not None:
        return Verdict(True, "ApplyFailed", observed.apply_error)
    if observed.secret_conflicts:
        return Verdict(True, SECRET_CONFLICT, secret_conflict_message(observed))
    if observed.object_conflicts:
        return Verdict(True, OBJECT_CONFLICT, object_conflict_message(observed))
    if storage.reason in ("ClaimNotFound", "ClaimLost"):
        return storage._replace(ok=True)
    if observed.pod_problems:
        worst = observed.pod_problems[0]
        return Verdict(True, worst.reason, "; ".join(p.describe() for p in observed.pod_problems))
    if progressing.reason == DEADLINE_EXCEEDED:
        return Verdict(True, DEADLINE_EXCEEDED, progressing.message)
    if rollout.done and n.ready < n.desired:
        return Verdict(True, "NodesNotReady", f"{n.desired - n.ready}/{n.desired} cache servers not ready")
    return Verdict(False, "AsExpected", "no fault detected")


def injection_verdict(observed: Observed, now: dt.datetime | None = None) -> Verdict:
    """InjectionReady: this operator serves the injection webhook, with a certificate still valid."""
    if observed.injection_enabled:
        expiry = observed.webhook_not_after
        if expiry is None:
            return Verdict(True, "WebhookServing", "the injection webhook is served by the operator")
        stamp = expiry.strftime("%Y-%m-%dT%H:%M:%SZ")
        if expiry <= (now or dt.datetime.now(dt.UTC)):
            return Verdict(
                False, "CertificateExpired", f"the webhook's serving certificate expired at {stamp}"
            )
        return Verdict(
            True, "WebhookServing", f"the injection webhook is served; certificate valid until {stamp}"
        )
    return Verdict(False, "WebhookDisabled", "the operator runs without its injection webhook")


def routing_verdict(observed: Observed) -> Verdict | None:
    """RoutingEvents (pools with spec.consumers.routingEvents only): whether engines announce its tiers."""
    if observed.connection is None or observed.connection.routing_events is None:
        return None
    cache = observed.cache or _previous_cache(observed)
    if cache is None or not cache.scraped_at:
        return Verdict(None, "NotScraped", "the cache servers' metrics have not been read yet")
    if cache.routing_nodes == 0:
        return Verdict(
            False,
            "NoEngineFollows",
            f"no engine follows its node's residency feed on the {cache.nodes_scraped} nodes scraped: "
            "no KV events announce this pool's tiers (engines injected with routing events follow it "
            "once vLLM runs with --kv-events-config)",
        )
    return Verdict(
        True,
        "EventsFlowing",
        f"{cache.routing_subscribers} engines on {cache.routing_nodes}/{cache.nodes_scraped} nodes "
        "announce their node's tiers in their KV events",
    )


def ready_verdict(observed: Observed, rollout: Rollout, storage: Verdict) -> Verdict:
    """Ready: the current revision is ready on every selected node and storage is ready."""
    n = rollout.nodes
    if observed.config_error is not None:
        return Verdict(False, "InvalidServerConfig", "the server configuration is invalid")
    if observed.apply_error is not None:
        return Verdict(False, "ApplyFailed", observed.apply_error)
    if observed.secret_conflicts:
        return Verdict(False, SECRET_CONFLICT, secret_conflict_message(observed))
    if observed.object_conflicts:
        return Verdict(False, OBJECT_CONFLICT, object_conflict_message(observed))
    if not rollout.exists:
        return Verdict(False, "Creating", "the DaemonSet does not exist yet")
    if rollout.generation_seen and n.desired == 0:
        return Verdict(False, "NoNodesSelected", "no node matches spec.placement")
    if storage.ok is False:
        return Verdict(False, "StorageNotReady", storage.message)
    if observed.pod_problems:
        # Read from the pods themselves: not Ready while any server is not, whatever the counts say.
        worst = observed.pod_problems[0]
        return Verdict(False, worst.reason, "; ".join(p.describe() for p in observed.pod_problems))
    if rollout.all_ready:
        return Verdict(
            True, "AllNodesReady", f"revision {observed.revision} ready on {n.desired}/{n.desired} nodes"
        )
    return Verdict(False, "NodesNotReady", f"{n.ready}/{n.desired} ready, {n.updated}/{n.desired} updated")


def _connection(observed: Observed) -> Connection:
    conn = observed.connection
    if conn is None:
        # An invalid spec renders nothing: keep what consumers were last told.
        return _lenient(Connection, observed.previous_status.get("connection"))
    return Connection(
        socket=conn.socket,
        host_dir=conn.host_dir,
        remote=conn.remote,
        service=names.service_name(conn.pool),
        metrics_service=observed.metrics_service or "",
        config_map=names.configmap_name(conn.pool),
        config_hash=conn.config_hash,
        chunk_tokens=conn.chunk_tokens,
    )


_M = TypeVar("_M", bound=BaseModel)


def _lenient(model: type[_M], data: Any) -> _M:
    """Parse ``data`` (written by any operator version) into ``model``, or its defaults if it does not fit."""
    try:
        return model.model_validate(data or {})
    except pydantic.ValidationError:
        return model()


def _made_progress(observed: Observed, rollout: Rollout, progressing: Verdict) -> bool:
    """Whether this pass sees the rollout move: it starts, a new revision, or node counts change."""
    before = observed.previous_status
    progressing_before: dict[str, Any] = next(
        (c for c in before.get("conditions") or [] if c.get("type") == "Progressing"), {}
    )
    # A rollout reported as stalled has not started again just because it is still under way.
    stalled_before = progressing_before.get("reason") == DEADLINE_EXCEEDED
    started = bool(progressing.ok) and progressing_before.get("status") != "True" and not stalled_before
    return (
        started
        or before.get("revision") != (observed.revision or before.get("revision"))
        or _lenient(NodeCounts, before.get("nodes")) != rollout.nodes
    )


def _seconds_between(start: str, end: str) -> float:
    fmt = "%Y-%m-%dT%H:%M:%SZ"
    try:
        return (dt.datetime.strptime(end, fmt) - dt.datetime.strptime(start, fmt)).total_seconds()
    except ValueError:
        return 0.0


def last_progress_time(observed: Observed, rollout: Rollout, now: str) -> str:
    """When the rollout last moved (kept in status, so a restarted operator measures the same)."""
    previous = observed.previous_status.get("lastProgressTime")
    if previous and not _made_progress(observed, rollout, progressing_verdict(observed, rollout)):
        return str(previous)
    return now


def deadline_verdict(observed: Observed, progressing: Verdict, since: str, now: str) -> Verdict:
    """Progressing, or Progressing=False (ProgressDeadlineExceeded) when it stalled past the deadline."""
    deadline = observed.progress_deadline_seconds
    if progressing.ok and _seconds_between(since, now) > deadline:
        return Verdict(
            False, DEADLINE_EXCEEDED, f"no progress for more than {deadline}s: {progressing.message}"
        )
    return progressing


def conditions(observed: Observed, rollout: Rollout, now: str, progress_since: str) -> list[Condition]:
    """Return the pool's conditions, in a fixed order."""
    previous = {c.get("type", ""): c for c in observed.previous_status.get("conditions") or []}
    storage = storage_verdict(observed)
    progressing = deadline_verdict(observed, progressing_verdict(observed, rollout), progress_since, now)
    verdicts = {
        "ConfigValid": config_verdict(observed),
        "StorageReady": storage,
        "Progressing": progressing,
        "Degraded": degraded_verdict(observed, rollout, storage, progressing),
        "InjectionReady": injection_verdict(observed),
        "Ready": ready_verdict(observed, rollout, storage),
    }
    routing = routing_verdict(observed)
    if routing is not None:
        verdicts["RoutingEvents"] = routing
    return [_condition(t, v, observed.generation, previous, now) for t, v in verdicts.items()]


def _previous_cache(observed: Observed) -> CacheInsight | None:
    before = observed.previous_status.get("cache")
    return _lenient(CacheInsight, before) if before else None


def compute_pool_status(observed: Observed, now: str) -> KVCachePoolStatus:
    """Return the new status as the typed model."""
    rollout = observe_rollout(observed.daemonset, observed.revision)
    counts = consumer_counts(
        observed.consumer_pods, observed.connection.config_hash if observed.connection else None
    )
    n = rollout.nodes
    progress_since = last_progress_time(observed, rollout, now)
    return KVCachePoolStatus(
        observed_generation=observed.generation,
        revision=observed.revision or observed.previous_status.get("revision", ""),
        node_summary=f"{n.ready}/{n.desired}",
        nodes=n,
        connection=_connection(observed),
        consumers=ConsumerCounts(**counts),
        conditions=conditions(observed, rollout, now, progress_since),
        cache=observed.cache or _previous_cache(observed),
        last_progress_time=progress_since,
    )


def compute_status(observed: Observed, now: str) -> tuple[dict[str, Any], list[Event]]:
    """Return the new ``status`` (as written to the API) and the events its transitions deserve."""
    status = compute_pool_status(observed, now)
    return status.model_dump(mode="json", by_alias=True, exclude_none=True), _events(observed, status)


def _events(observed: Observed, status: KVCachePoolStatus) -> list[Event]:
    previous = {c.get("type", ""): c for c in observed.previous_status.get("conditions") or []}
    by_type = {c.type: c for c in status.conditions}
    events: list[Event] = []

    def flipped(ctype: str) -> bool:
        return bool(previous.get(ctype, {}).get("status") != by_type[ctype].status.value)

    def became(ctype: str, value: ConditionStatus) -> bool:
        return flipped(ctype) and by_type[ctype].status == value

    ready = by_type["Ready"]
    if became("Ready", ConditionStatus.TRUE):
        events.append(Event("Normal", "PoolReady", ready.message))
    elif flipped("Ready") and previous.get("Ready", {}).get("status") == "True":
        events.append(Event("Warning", "PoolNotReady", ready.message))
    if became("ConfigValid", ConditionStatus.FALSE):
        events.append(Event("Warning", "InvalidServerConfig", by_type["ConfigValid"].message))
    degraded = by_type["Degraded"]
    degraded_before = previous.get("Degraded", {})
    if degraded.reason in FAILURE_EVENT_REASONS and (
        flipped("Degraded") or degraded_before.get("reason") != degraded.reason
    ):
        events.append(Event("Warning", degraded.reason, degraded.message))
    elif became("Degraded", ConditionStatus.FALSE) and degraded_before.get("reason") in FAILURE_EVENT_REASONS:
        events.append(Event("Normal", "Recovered", f"{degraded_before.get('reason')} resolved"))
    if became("StorageReady", ConditionStatus.FALSE):
        events.append(Event("Warning", by_type["StorageReady"].reason, by_type["StorageReady"].message))
    prev_revision = observed.previous_status.get("revision")
    if observed.revision and prev_revision and prev_revision != observed.revision:
        events.append(Event("Normal", "RolloutStarted", f"revision {prev_revision} -> {observed.revision}"))
    splits = status.cache.namespace_splits if status.cache is not None else []
    if splits and splits != (observed.previous_status.get("cache") or {}).get("namespaceSplits"):
        events.append(Event("Warning", "NamespacesDiverge", "; ".join(splits)[:1024]))
    stale = status.consumers.stale
    if stale and not observed.previous_status.get("consumers", {}).get("stale"):
        events.append(
            Event("Warning", "StaleConsumers", f"{stale} consumer pods carry an older connection config")
        )
    return events


def strip_times(status: dict[str, Any]) -> dict[str, Any]:
    """Return ``status`` without lastTransitionTime, to compare two statuses for a real change."""
    out = dict(status)
    out["conditions"] = [
        {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions") or []
    ]
    return out
