"""Pure diagnosis of a pool's cache-server pods: why nodes are not serving, and how many.

The DaemonSet's status only counts; the reasons are on its pods (scheduling conditions, container
waiting states) and, for pods that could not even be created, in the DaemonSet controller's
``FailedCreate`` events. :func:`diagnose` turns those into problems the status reports as
``Degraded`` with a reason and the number of affected nodes.

A running server whose readiness probe fails (``/readyz`` says which listener stopped serving) is
``ServersNotServing``: its pod's Ready condition turned False after its containers last started, so
it had been ready and stopped — unlike a server still starting, which waiting fixes.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

# Container waiting reasons that waiting will not fix, mapped to the reason the pool reports.
_WAITING: Final = {
    "ErrImagePull": "ImagePullFailed",
    "ImagePullBackOff": "ImagePullFailed",
    "InvalidImageName": "ImagePullFailed",
    "ErrImageNeverPull": "ImagePullFailed",
    "CrashLoopBackOff": "CrashLoopBackOff",
    "CreateContainerConfigError": "ContainerCreateFailed",
    "CreateContainerError": "ContainerCreateFailed",
    "RunContainerError": "ContainerCreateFailed",
}
# Reported in this order when several problems coexist (the first is the condition's reason).
PRIORITY: Final = (
    "PodSecurityRejected",
    "FailedCreate",
    "Unschedulable",
    "ImagePullFailed",
    "ContainerCreateFailed",
    "CrashLoopBackOff",
    "ServersNotServing",
)
NOT_SERVING: Final = "ServersNotServing"


@dataclass(frozen=True)
class PodProblem:
    """One kind of failure and the nodes it affects."""

    reason: str
    count: int  # affected nodes
    message: str
    nodes: tuple[str, ...] = ()  # their names, when known (pods never created have none)

    def describe(self) -> str:
        """One line for a condition message."""
        shown = ", ".join(self.nodes[:3]) + (", ..." if len(self.nodes) > 3 else "")
        where = f" ({shown})" if shown else ""
        return f"{self.reason} on {self.count} node{'s' if self.count != 1 else ''}{where}: {self.message}"


def _node_of(pod: dict[str, Any]) -> str:
    spec = pod.get("spec") or {}
    if spec.get("nodeName"):
        return str(spec["nodeName"])
    # A DaemonSet pod that is not scheduled names its node in a matchFields affinity term.
    terms = (
        (spec.get("affinity") or {})
        .get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution", {})
        .get("nodeSelectorTerms", [])
    )
    for term in terms:
        for field in term.get("matchFields") or []:
            if field.get("key") == "metadata.name" and field.get("values"):
                return str(field["values"][0])
    return str((pod.get("metadata") or {}).get("name", "?"))


def _time(stamp: Any) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")) if stamp else None
    except ValueError:
        return None


def _stopped_serving(pod: dict[str, Any]) -> str | None:
    """The Ready condition's message when a running pod was ready and is not any more, else None."""
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return None
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") != "False":
        return None
    containers = list(status.get("containerStatuses") or [])
    started = [_time(((cs.get("state") or {}).get("running") or {}).get("startedAt")) for cs in containers]
    if not containers or any(t is None for t in started):
        return None  # waiting or terminated: another reason, or still starting
    went_unready = _time(ready.get("lastTransitionTime"))
    # A container starts unready: Ready can only have turned False after its start by having been True.
    if went_unready is None or went_unready <= max(t for t in started if t is not None):
        return None
    unready = ", ".join(str(cs.get("name")) for cs in containers if not cs.get("ready")) or "?"
    name = (pod.get("metadata") or {}).get("name", "?")
    detail = ready.get("message") or f"containers with unready status: [{unready}]"
    since = ready.get("lastTransitionTime")
    return f"pod {name} stopped passing its readiness probe (/readyz) at {since}: {detail}"


def pod_problem(pod: dict[str, Any]) -> tuple[str, str] | None:
    """Return (reason, message) for a pod that will not become ready by waiting, else None."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return None
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        scheduled = cond.get("type") == "PodScheduled" and cond.get("status") == "False"
        if scheduled and cond.get("reason") == "Unschedulable":
            return "Unschedulable", str(cond.get("message") or "the scheduler cannot place the pod")
    statuses = list(status.get("initContainerStatuses") or []) + list(status.get("containerStatuses") or [])
    for cs in statuses:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = _WAITING.get(str(waiting.get("reason") or ""))
        if reason is not None:
            detail = waiting.get("message") or waiting.get("reason")
            return reason, f"container {cs.get('name')}: {detail}"
    stopped = _stopped_serving(pod)
    if stopped is not None:
        return NOT_SERVING, stopped
    return None


# The parts of a cache-server pod's spec anything in the operator reads: where it runs, or is meant to.
_SERVER_SPEC: Final = ("nodeName", "affinity")


def server_pod_view(pod: dict[str, Any]) -> dict[str, Any]:
    """The part of a cache-server pod the operator reads (its informer caches only this).

    Its metadata but the managed fields, where it runs (``spec.nodeName``, or the node its affinity
    names while it is pending) and its whole status: what :func:`diagnose`, the metrics scrape
    targets and a deleted pool's wipe read. Without the containers, volumes and tolerations of its
    spec a cached server pod is a fraction of the objects Python's garbage collector walks.
    """
    meta = {k: v for k, v in (pod.get("metadata") or {}).items() if k != "managedFields"}
    spec = pod.get("spec") or {}
    view = {k: v for k, v in pod.items() if k not in ("metadata", "spec")}
    view["metadata"] = meta
    view["spec"] = {k: spec[k] for k in _SERVER_SPEC if k in spec}
    return view


def diagnose(
    pods: Iterable[dict[str, Any]], failed_create: str | None, missing_pods: int
) -> list[PodProblem]:
    """Return the pool's pod problems, most fundamental first.

    ``failed_create`` is the message of the DaemonSet's latest ``FailedCreate`` event, counted only
    while ``missing_pods`` (nodes that should run a pod but have none) is positive.
    """
    by_reason: dict[str, tuple[list[str], str]] = {}
    for pod in pods:
        found = pod_problem(pod)
        if found is None:
            continue
        reason, message = found
        nodes, _first = by_reason.setdefault(reason, ([], message))
        nodes.append(_node_of(pod))
    problems = [
        PodProblem(reason, len(set(nodes)), message, tuple(sorted(set(nodes))))
        for reason, (nodes, message) in by_reason.items()
    ]
    if failed_create and missing_pods > 0:
        # The namespace's enforced Pod Security level rejects the pods (the cache server needs
        # hostPath): say so, it is fixed by the namespace's label, not by the pool (docs/security.md).
        reason = "PodSecurityRejected" if "violates PodSecurity" in failed_create else "FailedCreate"
        problems.append(PodProblem(reason, missing_pods, failed_create))
    return sorted(problems, key=lambda p: PRIORITY.index(p.reason))
