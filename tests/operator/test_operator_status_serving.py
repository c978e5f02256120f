"""A cache server that stops serving (its readiness probe fails) makes the pool Degraded, not "rolling out".

Pure planning: pods as the kubelet reports them → :func:`diagnose` → :func:`compute_status`. The
real control plane does the same in ``test_operator_cluster_serving.py``.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from tests.operator.test_operator_status import NOW, cond, ds, observe

from kvfabric.operator.podhealth import diagnose, pod_problem
from kvfabric.operator.status import compute_status

STARTED = "2026-11-30T11:00:00Z"
LATER = "2026-11-30T11:30:00Z"
EARLIER = "2026-11-30T10:59:59Z"
UNREADY = "containers with unready status: [cache-server]"


def server(node: str, state: str) -> dict[str, Any]:
    """A cache-server pod in ``state``: ready, starting, stopped (was ready, probe fails now), crashing."""
    ready = state == "ready"
    # A pod's Ready condition last changed at its creation (starting), when it became ready, or
    # when its probe began to fail (stopped): the last two after its container started.
    transition = {"ready": STARTED, "starting": EARLIER, "stopped": LATER, "crashing": LATER}[state]
    container: dict[str, Any] = {"name": "cache-server", "ready": ready, "started": state != "crashing"}
    if state == "crashing":
        container["state"] = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}}
    else:
        container["state"] = {"running": {"startedAt": STARTED}}
    return {
        "metadata": {"name": f"p-cache-{node}"},
        "spec": {"nodeName": node},
        "status": {
            "phase": "Running",
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True" if ready else "False",
                    "reason": "" if ready else "ContainersNotReady",
                    "message": "" if ready else UNREADY,
                    "lastTransitionTime": transition,
                }
            ],
            "containerStatuses": [container],
        },
    }


def test_a_server_that_stopped_passing_its_probe_is_a_problem_naming_the_pod() -> None:
    found = pod_problem(server("gpu-1", "stopped"))
    assert found is not None
    reason, message = found
    assert reason == "ServersNotServing"
    assert "p-cache-gpu-1" in message
    assert UNREADY in message
    assert "/readyz" in message


def test_a_starting_or_ready_server_is_no_problem() -> None:
    assert pod_problem(server("gpu-1", "ready")) is None
    assert pod_problem(server("gpu-1", "starting")) is None
    # A container restarting (Ready turned False before its new start) is still starting.
    restarted = server("gpu-1", "stopped")
    restarted["status"]["containerStatuses"][0]["state"]["running"]["startedAt"] = "2026-11-30T11:45:00Z"
    assert pod_problem(restarted) is None
    gone = server("gpu-1", "stopped")
    gone["metadata"]["deletionTimestamp"] = NOW
    assert pod_problem(gone) is None


def test_a_stopped_server_is_degraded_not_ready_and_not_rolling_out() -> None:
    pods = [server("gpu-1", "ready"), server("gpu-2", "stopped"), server("gpu-3", "ready")]
    problems = diagnose(pods, None, 0)
    # The DaemonSet counts the unready pod out of ready and available.
    status, events = compute_status(observe(daemonset=ds(ready=2, available=2), pod_problems=problems), NOW)
    degraded = cond(status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ServersNotServing")
    assert "on 1 node (gpu-2)" in degraded["message"]
    assert "p-cache-gpu-2" in degraded["message"]
    ready = cond(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ServersNotServing")
    progressing = cond(status, "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("False", "RolloutComplete")
    assert "1 not serving" in progressing["message"]
    assert ("Warning", "ServersNotServing") in [(e.type, e.reason) for e in events]
    # Serving again: the fault clears with a Recovered event.
    healed, events = compute_status(observe(previous_status=status), NOW)
    assert cond(healed, "Degraded")["status"] == "False"
    assert cond(healed, "Ready")["status"] == "True"
    assert "Recovered" in [e.reason for e in events]


def test_ready_is_not_true_while_a_server_is_not_even_if_the_daemonset_counts_lag() -> None:
    pods = [server("gpu-1", "ready"), server("gpu-2", "stopped"), server("gpu-3", "ready")]
    status, _ = compute_status(observe(daemonset=ds(), pod_problems=diagnose(pods, None, 0)), NOW)
    assert cond(status, "Ready")["status"] == "False"
    assert cond(status, "Degraded")["reason"] == "ServersNotServing"


@given(states=st.lists(st.sampled_from(["ready", "starting", "stopped", "crashing"]), min_size=1, max_size=6))
def test_conditions_follow_the_servers(states: list[str]) -> None:
    """Whatever mix of servers: Ready only when all serve; Degraded when any stopped or crashes."""
    pods = [server(f"gpu-{i}", s) for i, s in enumerate(states)]
    ready = states.count("ready")
    daemonset = ds(desired=len(states), ready=ready, available=ready, updated=len(states))
    status, _ = compute_status(observe(daemonset=daemonset, pod_problems=diagnose(pods, None, 0)), NOW)
    assert (cond(status, "Ready")["status"] == "True") == (ready == len(states))
    faulty = {"stopped", "crashing"} & set(states)
    assert (cond(status, "Degraded")["status"] == "True") == bool(faulty)
    if faulty:
        expected = "CrashLoopBackOff" if "crashing" in faulty else "ServersNotServing"
        assert cond(status, "Degraded")["reason"] == expected
    # Rolling out only while some server is still starting.
    assert (cond(status, "Progressing")["status"] == "True") == ("starting" in states or "crashing" in states)
