"""Pure status computation: observed children in, the pool's ``status`` and notable events out.

Ready means the *current* revision is ready on every selected node: the DaemonSet controller has
observed the latest template (``observedGeneration``), every scheduled pod is updated, ready and
available, and the template still carries the configuration hash this reconcile rendered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from kvfabric.operator.render import names
from kvfabric.operator.render.connection import ConnectionSettings

CONDITION_TYPES: Final = ("Ready", "Progressing", "Degraded", "ConfigValid", "StorageReady", "InjectionReady")


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
    # The object tier's probe: (reachable and writable, reason, message); None without an object tier.
    object_store: tuple[bool, str, str] | None = None


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to post about the pool."""

    type: str  # Normal | Warning
    reason: str
    message: str


def _condition(  # noqa: PLR0917 - private helper with one positional call site
    ctype: str,
    ok: bool | None,
    reason: str,
    message: str,
    generation: int,
    previous: dict[str, dict[str, Any]],
    now: str,
) -> dict[str, Any]:
    status = "Unknown" if ok is None else ("True" if ok else "False")
    before = previous.get(ctype)
    # lastTransitionTime moves only when the status flips, as metav1.Condition requires.
    transition = before.get("lastTransitionTime") if before and before.get("status") == status else None
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": transition or now,
    }


def _int(obj: dict[str, Any] | None, key: str) -> int:
    if obj is None:
        return 0
    return int(obj.get(key) or 0)


def consumer_counts(pods: list[dict[str, Any]], current_hash: str | None) -> dict[str, int]:
    """Count opted-in pods: matched, injected with the current hash, stale (older hash), skipped."""
    matched = injected = stale = skipped = 0
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
        elif names.SKIP_REASON_ANNOTATION in annotations:
            skipped += 1
    return {"matched": matched, "injected": injected, "stale": stale, "skipped": skipped}


def compute_status(observed: Observed, now: str) -> tuple[dict[str, Any], list[Event]]:
    """Return the new ``status`` and the events its transitions deserve."""
    gen = observed.generation
    previous_conditions = {c.get("type", ""): c for c in observed.previous_status.get("conditions") or []}
    ds = observed.daemonset
    ds_status = (ds or {}).get("status") or {}
    desired = _int(ds_status, "desiredNumberScheduled")
    ready = _int(ds_status, "numberReady")
    updated = _int(ds_status, "updatedNumberScheduled")
    available = _int(ds_status, "numberAvailable")
    unavailable = _int(ds_status, "numberUnavailable")
    ds_generation_seen = ds is not None and _int(ds_status, "observedGeneration") >= _int(
        ds.get("metadata"), "generation"
    )
    template_hash = (
        (ds or {}).get("spec", {}).get("template", {}).get("metadata", {}).get("annotations") or {}
    ).get(names.CONFIG_HASH_ANNOTATION)
    revision_current = observed.revision is not None and template_hash == observed.revision
    rollout_done = (
        ds is not None
        and ds_generation_seen
        and revision_current
        and updated == desired
        and available == desired
    )
    all_ready = rollout_done and ready == desired and unavailable == 0

    conds: list[dict[str, Any]] = []

    def add(ctype: str, ok: bool | None, reason: str, message: str) -> None:
        conds.append(_condition(ctype, ok, reason, message, gen, previous_conditions, now))

    # ConfigValid
    if observed.config_error is not None:
        add("ConfigValid", False, "InvalidServerConfig", observed.config_error[:1000])
    else:
        add("ConfigValid", True, "Valid", "the server configuration renders and validates")

    # StorageReady
    storage_ok: bool | None
    if observed.claim_name is None:
        storage_ok, reason, message = True, "NoSharedTier", "no shared tier configured"
    elif observed.claim is None:
        storage_ok, reason, message = (
            False,
            "ClaimNotFound",
            f"PersistentVolumeClaim {observed.claim_name} not found",
        )
    else:
        phase = observed.claim.get("status", {}).get("phase", "Pending")
        if phase == "Bound":
            storage_ok, reason, message = (
                True,
                "ClaimBound",
                f"PersistentVolumeClaim {observed.claim_name} is Bound",
            )
        elif phase == "Lost":
            storage_ok, reason, message = (
                False,
                "ClaimLost",
                f"PersistentVolumeClaim {observed.claim_name} is Lost",
            )
        else:
            storage_ok, reason, message = (
                False,
                "ClaimPending",
                f"PersistentVolumeClaim {observed.claim_name} is {phase}",
            )
    if observed.object_store is not None:
        obj_ok, obj_reason, obj_message = observed.object_store
        if observed.claim_name is None:
            storage_ok, reason, message = obj_ok, obj_reason, obj_message
        else:
            if storage_ok and not obj_ok:
                reason = obj_reason
            storage_ok = bool(storage_ok) and obj_ok
            message = f"{message}; {obj_message}"
    add("StorageReady", storage_ok, reason, message)

    # Progressing
    if ds is None:
        progressing, p_reason, p_message = True, "Creating", "waiting for the DaemonSet to be created"
    elif not ds_generation_seen:
        progressing, p_reason, p_message = (
            True,
            "RolloutPending",
            "the DaemonSet controller has not observed the change",
        )
    elif not revision_current:
        progressing, p_reason, p_message = (
            True,
            "RolloutPending",
            "the DaemonSet does not carry the current revision",
        )
    elif updated < desired or available < desired:
        progressing, p_reason, p_message = (
            True,
            "RollingOut",
            f"{updated}/{desired} nodes updated, {available}/{desired} available",
        )
    else:
        progressing, p_reason, p_message = (
            False,
            "RolloutComplete",
            f"revision {observed.revision} on {desired} nodes",
        )
    add("Progressing", progressing, p_reason, p_message)

    # Degraded: something is wrong that waiting for the rollout will not fix.
    if observed.config_error is not None:
        degraded, d_reason, d_message = (
            True,
            "InvalidServerConfig",
            "the pool's spec yields an invalid server config",
        )
    elif storage_ok is False and observed.claim is None:
        degraded, d_reason, d_message = True, "ClaimNotFound", message
    elif storage_ok is False and reason == "ClaimLost":
        degraded, d_reason, d_message = True, "ClaimLost", message
    elif rollout_done and ready < desired:
        degraded, d_reason, d_message = (
            True,
            "NodesNotReady",
            f"{desired - ready}/{desired} cache servers not ready",
        )
    else:
        degraded, d_reason, d_message = False, "AsExpected", "no fault detected"
    add("Degraded", degraded, d_reason, d_message)

    # InjectionReady
    if observed.injection_enabled:
        add("InjectionReady", True, "WebhookServing", "the injection webhook is served by the operator")
    else:
        add("InjectionReady", False, "WebhookDisabled", "the operator runs without its injection webhook")

    # Ready
    if observed.config_error is not None:
        r_ok, r_reason, r_message = False, "InvalidServerConfig", "the server configuration is invalid"
    elif ds is None:
        r_ok, r_reason, r_message = False, "Creating", "the DaemonSet does not exist yet"
    elif ds_generation_seen and desired == 0:
        r_ok, r_reason, r_message = False, "NoNodesSelected", "no node matches spec.placement"
    elif storage_ok is False:
        r_ok, r_reason, r_message = False, "StorageNotReady", message
    elif all_ready:
        r_ok, r_reason, r_message = (
            True,
            "AllNodesReady",
            f"revision {observed.revision} ready on {desired}/{desired} nodes",
        )
    else:
        r_ok, r_reason, r_message = (
            False,
            "NodesNotReady",
            f"{ready}/{desired} ready, {updated}/{desired} updated",
        )
    add("Ready", r_ok, r_reason, r_message)

    counts = consumer_counts(
        observed.consumer_pods, observed.connection.config_hash if observed.connection else None
    )
    conn = observed.connection
    connection: dict[str, Any] = {}
    if conn is not None:
        connection = {
            "socket": conn.socket,
            "shmDir": conn.shm_dir,
            "hostDir": conn.host_dir,
            "remote": conn.remote,
            "service": names.service_name(conn.pool),
            "metricsService": observed.metrics_service or "",
            "configMap": names.configmap_name(conn.pool),
            "configHash": conn.config_hash,
            "chunkTokens": conn.chunk_tokens,
        }
    status: dict[str, Any] = {
        "observedGeneration": gen,
        "revision": observed.revision or observed.previous_status.get("revision", ""),
        "nodeSummary": f"{ready}/{desired}",
        "nodes": {"desired": desired, "ready": ready, "updated": updated, "available": available},
        "connection": connection or observed.previous_status.get("connection") or {},
        "consumers": counts,
        "conditions": conds,
    }
    return status, _events(previous_conditions, conds, observed, counts)


def _events(
    previous: dict[str, dict[str, Any]],
    conds: list[dict[str, Any]],
    observed: Observed,
    counts: dict[str, int],
) -> list[Event]:
    events: list[Event] = []
    by_type = {c["type"]: c for c in conds}

    def flipped(ctype: str) -> bool:
        return bool(previous.get(ctype, {}).get("status") != by_type[ctype]["status"])

    ready = by_type["Ready"]
    if flipped("Ready") and ready["status"] == "True":
        events.append(Event("Normal", "PoolReady", ready["message"]))
    elif flipped("Ready") and previous.get("Ready", {}).get("status") == "True":
        events.append(Event("Warning", "PoolNotReady", ready["message"]))
    if flipped("ConfigValid") and by_type["ConfigValid"]["status"] == "False":
        events.append(Event("Warning", "InvalidServerConfig", by_type["ConfigValid"]["message"]))
    if flipped("StorageReady") and by_type["StorageReady"]["status"] == "False":
        events.append(Event("Warning", by_type["StorageReady"]["reason"], by_type["StorageReady"]["message"]))
    prev_revision = observed.previous_status.get("revision")
    if observed.revision and prev_revision and prev_revision != observed.revision:
        events.append(Event("Normal", "RolloutStarted", f"revision {prev_revision} -> {observed.revision}"))
    if counts["stale"] and not observed.previous_status.get("consumers", {}).get("stale"):
        events.append(
            Event(
                "Warning",
                "StaleConsumers",
                f"{counts['stale']} consumer pods carry an older connection config",
            )
        )
    return events


def strip_times(status: dict[str, Any]) -> dict[str, Any]:
    """Return ``status`` without lastTransitionTime, to compare two statuses for a real change."""
    out = dict(status)
    out["conditions"] = [
        {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions") or []
    ]
    return out
