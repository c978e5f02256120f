"""The local control plane is a real Kubernetes: controllers, scheduler, GC, CEL and SSA all act."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvfabric.localcluster.testing import ClusterHandle, wait_for

pytestmark = pytest.mark.cluster


def _pods(cluster: ClusterHandle, namespace: str, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.get_json("pods", "-n", namespace, "-l", selector)["items"]
    return items


def _running_and_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status", {})
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))
    return status.get("phase") == "Running" and ready


def test_deployment_pods_are_scheduled_and_run(cluster: ClusterHandle, namespace: str) -> None:
    cluster.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web"},
            "spec": {
                "replicas": 3,
                "selector": {"matchLabels": {"app": "web"}},
                "template": {
                    "metadata": {"labels": {"app": "web"}},
                    "spec": {"containers": [{"name": "web", "image": "nginx:1.27"}]},
                },
            },
        },
        namespace=namespace,
    )

    pods = wait_for(
        lambda: (
            (p := _pods(cluster, namespace, "app=web"))
            and len(p) == 3
            and all(_running_and_ready(x) for x in p)
            and p
        ),
        message="3 running web pods",
    )
    # The scheduler bound them (no GPU toleration, so only the CPU node qualifies)...
    assert {p["spec"]["nodeName"] for p in pods} == set(cluster.cpu_nodes)
    # ...and the Deployment controller saw kwok's readiness.
    wait_for(
        lambda: cluster.get_json("deployment", "web", "-n", namespace)["status"].get("readyReplicas") == 3,
        message="deployment readyReplicas=3",
    )


def test_gpu_daemonset_gets_one_pod_per_gpu_node(cluster: ClusterHandle, namespace: str) -> None:
    cluster.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": "cache"},
            "spec": {
                "selector": {"matchLabels": {"app": "cache"}},
                "template": {
                    "metadata": {"labels": {"app": "cache"}},
                    "spec": {
                        "nodeSelector": {"nvidia.com/gpu.present": "true"},
                        "tolerations": [
                            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
                        ],
                        "containers": [{"name": "cache", "image": "busybox:1.36"}],
                    },
                },
            },
        },
        namespace=namespace,
    )

    pods = wait_for(
        lambda: (
            (p := _pods(cluster, namespace, "app=cache"))
            and len(p) == len(cluster.gpu_nodes)
            and all(_running_and_ready(x) for x in p)
            and p
        ),
        message="one running pod per GPU node",
    )
    nodes = [p["spec"]["nodeName"] for p in pods]
    assert sorted(nodes) == sorted(cluster.gpu_nodes)  # exactly one per GPU node
    assert not set(nodes) & set(cluster.cpu_nodes)
    ds = wait_for(
        lambda: (
            (d := cluster.get_json("daemonset", "cache", "-n", namespace))["status"].get("numberReady")
            == len(cluster.gpu_nodes)
            and d
        ),
        message="daemonset numberReady",
    )
    assert ds["status"]["desiredNumberScheduled"] == len(cluster.gpu_nodes)


def test_deleting_an_owner_garbage_collects_its_children(cluster: ClusterHandle, namespace: str) -> None:
    cluster.apply(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}}, namespace=namespace
    )
    uid = cluster.get_json("configmap", "owner", "-n", namespace)["metadata"]["uid"]
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": "child",
                "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}],
            },
        },
        namespace=namespace,
    )
    cluster.kubectl("delete", "configmap", "owner", "-n", namespace)

    wait_for(
        lambda: cluster.kubectl("get", "configmap", "child", "-n", namespace, check=False).returncode != 0,
        message="the garbage collector to delete the child",
    )


def test_deleting_a_deployment_removes_its_replicasets_and_pods(
    cluster: ClusterHandle, namespace: str
) -> None:
    cluster.kubectl("create", "deployment", "gc", "--image=nginx:1.27", "--replicas=2", "-n", namespace)
    wait_for(lambda: len(_pods(cluster, namespace, "app=gc")) == 2, message="2 pods")
    cluster.kubectl("delete", "deployment", "gc", "-n", namespace, "--cascade=background")
    wait_for(
        lambda: (
            not cluster.get_json("replicasets", "-n", namespace)["items"]
            and not _pods(cluster, namespace, "app=gc")
        ),
        message="ReplicaSet and pods collected",
    )


CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.test.kvfabric.io"},
    "spec": {
        "group": "test.kvfabric.io",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "properties": {"low": {"type": "number"}, "high": {"type": "number"}},
                                "x-kubernetes-validations": [
                                    {
                                        "rule": "self.low < self.high",
                                        "message": "spec.low must be below spec.high",
                                    }
                                ],
                            }
                        },
                    }
                },
            }
        ],
    },
}


def test_crd_cel_rule_rejects_a_bad_object_with_its_message(cluster: ClusterHandle, namespace: str) -> None:
    cluster.apply(CRD)
    wait_for(
        lambda: any(
            c["type"] == "Established" and c["status"] == "True"
            for c in cluster.get_json("crd", "widgets.test.kvfabric.io")["status"].get("conditions", [])
        ),
        message="CRD established",
    )

    def apply_widget(low: float, high: float) -> Any:
        doc = {
            "apiVersion": "test.kvfabric.io/v1",
            "kind": "Widget",
            "metadata": {"name": "w"},
            "spec": {"low": low, "high": high},
        }
        return cluster.kubectl(
            "apply", "-n", namespace, "--server-side", "-f", "-", input=json.dumps(doc), check=False
        )

    # The CRD may be Established a moment before its schema is served everywhere; a good object
    # is accepted once it is.
    wait_for(lambda: apply_widget(1, 2).returncode == 0, message="a valid widget to be accepted")
    bad = apply_widget(5, 2)
    assert bad.returncode != 0
    assert "spec.low must be below spec.high" in bad.stderr


def test_server_side_apply_twice_changes_nothing(cluster: ClusterHandle, namespace: str) -> None:
    doc = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "ssa", "labels": {"a": "b"}},
        "data": {"k": "v"},
    }
    cluster.apply(doc, namespace=namespace)
    first = cluster.get_json("configmap", "ssa", "-n", namespace, "--show-managed-fields")
    cluster.apply(doc, namespace=namespace)
    second = cluster.get_json("configmap", "ssa", "-n", namespace, "--show-managed-fields")

    assert second["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    assert second["metadata"]["managedFields"] == first["metadata"]["managedFields"]
    diff = cluster.kubectl(
        "diff",
        "--server-side",
        "--field-manager=kvfabric-tests",
        "-n",
        namespace,
        "-f",
        "-",
        input=json.dumps(doc),
        check=False,
    )
    assert diff.returncode == 0, diff.stdout + diff.stderr  # 0 = no differences


def test_rbac_is_enforced(cluster: ClusterHandle, namespace: str) -> None:
    # An unprivileged service account may not list secrets: authorization is really RBAC.
    cluster.kubectl("create", "serviceaccount", "nobody", "-n", namespace)
    out = cluster.kubectl(
        "auth",
        "can-i",
        "list",
        "secrets",
        "-n",
        namespace,
        f"--as=system:serviceaccount:{namespace}:nobody",
        check=False,
    )
    assert out.stdout.strip() == "no"
    cluster.kubectl(
        "create",
        "rolebinding",
        "view",
        "--clusterrole=view",
        f"--serviceaccount={namespace}:nobody",
        "-n",
        namespace,
    )
    out = cluster.kubectl(
        "auth",
        "can-i",
        "list",
        "pods",
        "-n",
        namespace,
        f"--as=system:serviceaccount:{namespace}:nobody",
        check=False,
    )
    assert out.stdout.strip() == "yes"
