"""Pure diagnosis of a pool's cache-server pods: why nodes are not serving, and how many.

The DaemonSet's status only counts; the reasons are on its pods (scheduling conditions, container
waiting states) and, for pods that could not even be created, in the DaemonSet controller's
``FailedCreate`` events. :func:`diagnose` turns those into problems the status reports as
``Degraded`` with a reason and the number of affected nodes.
"""

from __future__ import annotations

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
)


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
    return None


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
