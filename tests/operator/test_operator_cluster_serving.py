"""A cache server whose readiness probe starts failing makes the pool Degraded, on the real control plane.

The kubelet reports a failing readiness probe as the pod's Ready condition turning False while its
container keeps running; on kwok nodes the test writes that status itself (kwok readies only pending
pods, so it stays). The operator reads it from its pod informer and the DaemonSet's counts.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from tests.operator.conftest import OperatorProcess, condition, get_pool, patch_pod_status
from tests.operator.test_operator_cluster_reconcile import ready_sample_servers

from kvfabric.localcluster.testing import ClusterHandle, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

_UNREADY = "containers with unready status: [cache-server]"


def _stamp(at: dt.datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def _report_readiness(cluster: ClusterHandle, ns: str, pod: dict[str, Any], *, ready: bool) -> None:
    """Write the status a kubelet reports when the readiness probe of a running server fails/passes."""
    now = dt.datetime.now(dt.UTC)
    started = _stamp(now - dt.timedelta(minutes=5))
    flag = "True" if ready else "False"
    reason = {} if ready else {"reason": "ContainersNotReady", "message": _UNREADY}
    status = {
        "phase": "Running",
        "conditions": [
            {"type": "Initialized", "status": "True", "lastTransitionTime": started},
            {"type": "Ready", "status": flag, "lastTransitionTime": _stamp(now), **reason},
            {"type": "ContainersReady", "status": flag, "lastTransitionTime": _stamp(now), **reason},
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": started},
        ],
        "containerStatuses": [
            {
                "name": c["name"],
                "image": c["image"],
                "imageID": "",
                "ready": ready,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": started}},
            }
            for c in pod["spec"]["containers"]
        ],
    }
    patch_pod_status(cluster, ns, pod["metadata"]["name"], status)


def test_a_server_that_stops_serving_makes_the_pool_degraded_naming_it(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    pods = ready_sample_servers(cluster, namespace)
    sick = pods[0]
    _report_readiness(cluster, namespace, sick, ready=False)

    def degraded() -> dict[str, Any] | None:
        cond = condition(get_pool(cluster, namespace, "pool-a"), "Degraded")
        return cond if (cond.get("status"), cond.get("reason")) == ("True", "ServersNotServing") else None

    cond = wait_for(degraded, timeout=60, message="Degraded=True ServersNotServing")
    assert "on 1 node" in cond["message"]
    assert sick["spec"]["nodeName"] in cond["message"]
    assert sick["metadata"]["name"] in cond["message"]
    assert _UNREADY in cond["message"]
    pool = get_pool(cluster, namespace, "pool-a")
    ready = condition(pool, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ServersNotServing")
    assert condition(pool, "Progressing")["status"] == "False"  # a fault, not a rollout
    # The server serves again: the pool is Ready and no longer Degraded.
    _report_readiness(cluster, namespace, sick, ready=True)
    wait_for(
        lambda: condition(get_pool(cluster, namespace, "pool-a"), "Ready").get("status") == "True",
        timeout=60,
        message="Ready again",
    )
    assert condition(get_pool(cluster, namespace, "pool-a"), "Degraded")["status"] == "False"
