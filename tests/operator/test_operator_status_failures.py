"""Status tells the truth when things fail: rejected applies, broken pods, stalled rollouts."""

from __future__ import annotations

from typing import Any

from tests.operator.test_operator_status import NOW, cond, ds, observe

from kvfabric.operator.podhealth import PodProblem, diagnose, pod_problem
from kvfabric.operator.status import compute_status

LATER = "2026-11-30T12:10:00Z"


def server_pod(node: str, *, waiting: str | None = None, unschedulable: bool = False) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Pending" if unschedulable or waiting else "Running"}
    if unschedulable:
        status["conditions"] = [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes: memory",
            }
        ]
    if waiting:
        status["containerStatuses"] = [
            {
                "name": "cache-server",
                "state": {"waiting": {"reason": waiting, "message": f"{waiting} detail"}},
            }
        ]
    return {"metadata": {"name": f"pod-{node}"}, "spec": {"nodeName": node}, "status": status}


def test_rejected_apply_is_degraded_and_not_ready_at_once() -> None:
    status, events = compute_status(
        observe(apply_error="DaemonSet p-cache: spec.template: Invalid value"), NOW
    )
    assert cond(status, "Degraded") | {"lastTransitionTime": None} == cond(status, "Degraded") | {
        "lastTransitionTime": None,
        "status": "True",
        "reason": "ApplyFailed",
        "message": "DaemonSet p-cache: spec.template: Invalid value",
    }
    assert cond(status, "Ready")["status"] == "False"
    assert cond(status, "Ready")["reason"] == "ApplyFailed"
    assert ("Warning", "ApplyFailed") in [(e.type, e.reason) for e in events]


def test_each_pod_failure_is_degraded_with_reason_and_node_count() -> None:
    cases = [
        ([server_pod("n1", unschedulable=True), server_pod("n2", unschedulable=True)], "Unschedulable", 2),
        ([server_pod("n1", waiting="ImagePullBackOff"), server_pod("n2")], "ImagePullFailed", 1),
        ([server_pod("n1", waiting="ErrImagePull")], "ImagePullFailed", 1),
        (
            [server_pod("n1", waiting="CrashLoopBackOff"), server_pod("n3", waiting="CrashLoopBackOff")],
            "CrashLoopBackOff",
            2,
        ),
        ([server_pod("n1", waiting="CreateContainerConfigError")], "ContainerCreateFailed", 1),
    ]
    for pods, reason, count in cases:
        problems = diagnose(pods, None, 0)
        assert [(p.reason, p.count) for p in problems] == [(reason, count)]
        status, events = compute_status(
            observe(daemonset=ds(ready=3 - count, available=3 - count), pod_problems=problems), NOW
        )
        degraded = cond(status, "Degraded")
        assert (degraded["status"], degraded["reason"]) == ("True", reason)
        assert f"on {count} node" in degraded["message"]
        assert cond(status, "Ready")["status"] == "False"
        assert reason in [e.reason for e in events]


def test_failed_create_counts_nodes_without_a_pod() -> None:
    problems = diagnose([], 'pods "p-cache-" is forbidden: no PriorityClass with name x was found', 3)
    assert problems == [
        PodProblem("FailedCreate", 3, 'pods "p-cache-" is forbidden: no PriorityClass with name x was found')
    ]
    # A stale FailedCreate event does not count once every node has its pod.
    assert diagnose([], "old event", 0) == []
    status, _ = compute_status(
        observe(daemonset=ds(ready=0, updated=0, available=0), pod_problems=problems), NOW
    )
    assert cond(status, "Degraded")["reason"] == "FailedCreate"
    assert "on 3 nodes" in cond(status, "Degraded")["message"]


def test_problems_are_ordered_most_fundamental_first() -> None:
    pods = [server_pod("n1", waiting="CrashLoopBackOff"), server_pod("n2", unschedulable=True)]
    assert [p.reason for p in diagnose(pods, "quota", 1)] == [
        "FailedCreate",
        "Unschedulable",
        "CrashLoopBackOff",
    ]


def test_healthy_and_terminating_pods_are_no_problem() -> None:
    assert pod_problem(server_pod("n1")) is None
    gone = server_pod("n1", waiting="CrashLoopBackOff")
    gone["metadata"]["deletionTimestamp"] = NOW
    assert pod_problem(gone) is None
    # Waiting for an image to be pulled for the first time is not a failure.
    assert pod_problem(server_pod("n1", waiting="ContainerCreating")) is None


def test_unscheduled_daemonset_pod_names_its_node_from_the_affinity() -> None:
    pod = server_pod("x", unschedulable=True)
    pod["spec"] = {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "values": ["gpu-7"]}]}]
                }
            }
        }
    }
    assert diagnose([pod], None, 0)[0].nodes == ("gpu-7",)


def test_stalled_rollout_exceeds_its_deadline() -> None:
    stalled = ds(updated=1, available=2)
    first, _ = compute_status(observe(daemonset=stalled, progress_deadline_seconds=300), NOW)
    assert cond(first, "Progressing")["status"] == "True"
    assert first["lastProgressTime"] == NOW
    # Five minutes later with the same counts: still within the deadline (300 s, not more).
    within, _ = compute_status(
        observe(daemonset=stalled, previous_status=first, progress_deadline_seconds=300),
        "2026-11-30T12:05:00Z",
    )
    assert cond(within, "Progressing")["reason"] == "RollingOut"
    late, events = compute_status(
        observe(daemonset=stalled, previous_status=within, progress_deadline_seconds=300), LATER
    )
    assert (cond(late, "Progressing")["status"], cond(late, "Progressing")["reason"]) == (
        "False",
        "ProgressDeadlineExceeded",
    )
    assert (cond(late, "Degraded")["status"], cond(late, "Degraded")["reason"]) == (
        "True",
        "ProgressDeadlineExceeded",
    )
    assert "ProgressDeadlineExceeded" in [e.reason for e in events]
    # It stays stalled on the next pass (no flapping back to Progressing=True).
    still, events = compute_status(
        observe(daemonset=stalled, previous_status=late, progress_deadline_seconds=300),
        "2026-11-30T12:10:30Z",
    )
    assert cond(still, "Progressing")["reason"] == "ProgressDeadlineExceeded"
    assert still["lastProgressTime"] == late["lastProgressTime"]
    assert events == []
    # Progress (one more node updated) restarts the clock and clears the fault, with a Recovered event.
    moving, events = compute_status(
        observe(daemonset=ds(updated=2, available=2), previous_status=late, progress_deadline_seconds=300),
        "2026-11-30T12:11:00Z",
    )
    assert cond(moving, "Progressing")["reason"] == "RollingOut"
    assert cond(moving, "Degraded")["status"] == "False"
    assert moving["lastProgressTime"] == "2026-11-30T12:11:00Z"
    assert "Recovered" in [e.reason for e in events]


def test_a_complete_rollout_never_exceeds_the_deadline() -> None:
    first, _ = compute_status(observe(progress_deadline_seconds=30), NOW)
    again, events = compute_status(observe(previous_status=first, progress_deadline_seconds=30), LATER)
    assert cond(again, "Progressing")["reason"] == "RolloutComplete"
    assert cond(again, "Degraded")["status"] == "False"
    assert again["lastProgressTime"] == first["lastProgressTime"]
    assert events == []


def test_a_secret_in_the_way_is_degraded_naming_it_with_a_warning_then_recovers() -> None:
    status, events = compute_status(observe(daemonset=None, secret_conflicts=("p-credentials",)), NOW)
    degraded, ready = cond(status, "Degraded"), cond(status, "Ready")
    assert (degraded["status"], degraded["reason"]) == ("True", "SecretConflict")
    assert (ready["status"], ready["reason"]) == ("False", "SecretConflict")
    assert "Secret p-credentials already exists and is not this pool's" in degraded["message"]
    assert ("Warning", "SecretConflict") in [(e.type, e.reason) for e in events]
    # Gone (renamed by its owner): the next pass proceeds and says the conflict is resolved.
    _, events = compute_status(observe(previous_status=status), NOW)
    assert ("Normal", "Recovered") in [(e.type, e.reason) for e in events]
