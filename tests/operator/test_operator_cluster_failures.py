"""Status in failure modes, against the real control plane.

Each fault is real where the local cluster can make it real: the API server rejects an invalid pod
template, the scheduler cannot place a pod asking for more memory than a node has, the DaemonSet
controller fails to create pods for a missing PriorityClass. Image-pull failures and crash loops
need a kubelet; on kwok nodes the test writes the pod status a kubelet would report (kwok's own job).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from tests.operator.conftest import OperatorProcess, condition, get_pool, patch_pod_status
from tests.operator.test_operator_cluster_reconcile import ready_sample_servers, sample

from kvfabric.localcluster.testing import ClusterHandle, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def pool_with(name: str, **spec: Any) -> dict[str, Any]:
    doc = sample(name)
    doc["spec"] = {**copy.deepcopy(doc["spec"]), **spec}
    return doc


def degraded(cluster: ClusterHandle, ns: str, name: str, reason: str) -> dict[str, Any] | None:
    cond = condition(get_pool(cluster, ns, name), "Degraded")
    return cond if cond.get("status") == "True" and cond.get("reason") == reason else None


def pool_events(cluster: ClusterHandle, ns: str, name: str) -> list[str]:
    items = cluster.get_json(
        "events", "-n", ns, "--field-selector", f"involvedObject.kind=KVCachePool,involvedObject.name={name}"
    )["items"]
    return [str(e.get("reason")) for e in items]


def test_rejected_apply_is_degraded_at_once_and_recovers(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    # Valid for the CRD, invalid for a pod template: hugepages need a limit equal to the request.
    bad = pool_with("pool-a", resources={"requests": {"memory": "9Gi", "hugepages-2Mi": "2Mi"}})
    cluster.apply(bad, namespace=namespace)
    cond = wait_for(
        lambda: degraded(cluster, namespace, "pool-a", "ApplyFailed"), timeout=30, message="ApplyFailed"
    )
    assert 'DaemonSet.apps "pool-a-cache" is invalid' in cond["message"]
    assert "Limit must be set" in cond["message"]  # the API server's own words
    ready = condition(get_pool(cluster, namespace, "pool-a"), "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ApplyFailed")
    assert "ApplyFailed" in pool_events(cluster, namespace, "pool-a")
    # Fixing the spec (the same field manager drops spec.resources) clears the fault.
    cluster.apply(sample("pool-a"), namespace=namespace)
    wait_for(
        lambda: condition(get_pool(cluster, namespace, "pool-a"), "Ready").get("status") == "True",
        timeout=60,
        message="Ready after the fix",
    )
    assert condition(get_pool(cluster, namespace, "pool-a"), "Degraded")["status"] == "False"
    assert "Recovered" in pool_events(cluster, namespace, "pool-a")


def test_unschedulable_pods_are_degraded_with_the_node_count(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    # 1Ti of DRAM tier asks for more memory than any node (512Gi) has.
    cluster.apply(pool_with("pool-a", tiers={"memory": {"size": "1Ti"}}), namespace=namespace)
    nodes = len(cluster.gpu_nodes)
    cond = wait_for(
        lambda: (
            (c := degraded(cluster, namespace, "pool-a", "Unschedulable"))
            and f"on {nodes} nodes" in c["message"]
            and c
        ),
        timeout=60,
        message="Unschedulable",
    )
    assert "Insufficient memory" in cond["message"]
    assert condition(get_pool(cluster, namespace, "pool-a"), "Ready")["status"] == "False"
    assert "Unschedulable" in pool_events(cluster, namespace, "pool-a")


def test_failed_create_then_progress_deadline(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    doc = pool_with("pool-a", updateStrategy={"progressDeadlineSeconds": 30})
    doc["spec"]["placement"] = {"priorityClassName": "no-such-class"}
    cluster.apply(doc, namespace=namespace)
    nodes = len(cluster.gpu_nodes)
    cond = wait_for(
        lambda: degraded(cluster, namespace, "pool-a", "FailedCreate"), timeout=60, message="FailedCreate"
    )
    assert f"on {nodes} nodes" in cond["message"]
    assert "no-such-class" in cond["message"]
    assert "FailedCreate" in pool_events(cluster, namespace, "pool-a")
    # No node makes progress: after 30 s the rollout is reported as stalled.
    progressing = _wait_pool(
        cluster,
        namespace,
        "pool-a",
        lambda: wait_for(
            lambda: (
                (c := condition(get_pool(cluster, namespace, "pool-a"), "Progressing")).get("reason")
                == "ProgressDeadlineExceeded"
                and c
            ),
            timeout=90,
            message="ProgressDeadlineExceeded",
        ),
    )
    assert progressing["status"] == "False"
    assert condition(get_pool(cluster, namespace, "pool-a"), "Degraded")["status"] == "True"


def _wait_pool(cluster: ClusterHandle, ns: str, name: str, wait: Any) -> Any:
    try:
        return wait()
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}\nstatus: {json.dumps(get_pool(cluster, ns, name).get('status'))}"
        ) from None


def _report(cluster: ClusterHandle, ns: str, pod: dict[str, Any], reason: str) -> None:
    """Write the status a kubelet reports for a container stuck in ``reason``."""
    name = pod["metadata"]["name"]
    status = {
        "phase": "Running",
        "conditions": [
            {"type": "Ready", "status": "False", "reason": "ContainersNotReady"},
            {"type": "ContainersReady", "status": "False", "reason": "ContainersNotReady"},
            {"type": "PodScheduled", "status": "True"},
        ],
        "containerStatuses": [
            {
                "name": "cache-server",
                "image": pod["spec"]["containers"][0]["image"],
                "imageID": "",
                "ready": False,
                "restartCount": 5,
                "state": {"waiting": {"reason": reason, "message": f"simulated {reason}"}},
            }
        ],
    }
    patch_pod_status(cluster, ns, name, status)


def test_crash_loops_and_image_pull_failures_are_degraded(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    pods = ready_sample_servers(cluster, namespace)
    _report(cluster, namespace, pods[0], "CrashLoopBackOff")
    cond = wait_for(
        lambda: degraded(cluster, namespace, "pool-a", "CrashLoopBackOff"),
        timeout=60,
        message="CrashLoopBackOff",
    )
    assert "on 1 node" in cond["message"]
    assert pods[0]["spec"]["nodeName"] in cond["message"]
    _report(cluster, namespace, pods[1], "ImagePullBackOff")
    cond = wait_for(
        lambda: degraded(cluster, namespace, "pool-a", "ImagePullFailed"),
        timeout=60,
        message="ImagePullFailed",
    )
    assert "CrashLoopBackOff on 1 node" in cond["message"]  # both problems are listed
    assert condition(get_pool(cluster, namespace, "pool-a"), "Ready")["status"] == "False"
    events = pool_events(cluster, namespace, "pool-a")
    assert "CrashLoopBackOff" in events
    assert "ImagePullFailed" in events
