"""The shipped RBAC is enough: the operator runs as its ServiceAccount (token) and still does its job."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.operator.conftest import OperatorProcess, condition, get_pool, is_ready

from kvfabric.localcluster.testing import ClusterHandle, token_kubeconfig, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
# The name the shipped ClusterRole allows the operator to get/patch (resourceNames); the test renames
# it (in the role and for its operator) so it never touches a configuration another test or demo uses.
SHIPPED_CONFIG_NAME = "kvfabric-pod-injector"
CONFIG_NAME = f"kvfabric-pod-injector-{uuid.uuid4().hex[:6]}"


def _install_rbac(
    cluster: ClusterHandle, ns: str, suffix: str, *, overlay: str = "default", watched: str | None = None
) -> list[dict[str, Any]]:
    """Apply an install's RBAC (and namespace), moved to ``ns`` and renamed so it is private.

    ``overlay`` is the kustomization under manifests/; the namespaced one's per-namespace RoleBinding
    is moved to ``watched``.
    """
    docs = [
        d
        for d in yaml.safe_load_all(cluster.kubectl("kustomize", str(ROOT / "manifests" / overlay)).stdout)
        if d
    ]
    out = []
    renamed = 0
    for doc in docs:
        kind = doc["kind"]
        if kind in ("CustomResourceDefinition", "Deployment", "Service"):
            continue
        # The hostPath admission policy is cluster-wide (test_operator_cluster_host_path_roots.py).
        if kind.startswith("ValidatingAdmissionPolicy") or doc["metadata"]["name"].endswith(
            "host-path-roots"
        ):
            continue
        if kind == "Namespace":
            doc["metadata"]["name"] = ns
        elif kind == "RoleBinding" and doc["roleRef"]["kind"] == "ClusterRole":
            # The namespaced install's grant of the operator's ClusterRole in a watched namespace.
            assert watched is not None
            doc["metadata"]["namespace"] = watched
            doc["roleRef"]["name"] += f"-{suffix}"
            for subject in doc["subjects"]:
                subject["namespace"] = ns
        elif kind in ("ClusterRole", "ClusterRoleBinding"):
            doc["metadata"]["name"] += f"-{suffix}"
            for rule in doc.get("rules", []):
                if SHIPPED_CONFIG_NAME in rule.get("resourceNames", []):
                    rule["resourceNames"] = [CONFIG_NAME]
                    renamed += 1
            if kind == "ClusterRoleBinding":
                doc["roleRef"]["name"] += f"-{suffix}"
                for subject in doc["subjects"]:
                    subject["namespace"] = ns
        else:
            doc["metadata"]["namespace"] = ns
            for subject in doc.get("subjects", []):  # the leader-election RoleBinding
                subject["namespace"] = ns
        out.append(doc)
    assert renamed >= 1, "the shipped ClusterRole no longer names the webhook configuration"
    cluster.kubectl(
        "apply", "--server-side", "--field-manager=kvfabric-tests", "-f", "-", input=yaml.safe_dump_all(out)
    )
    return out


def _restricted_operator(
    cluster: ClusterHandle, tmp_path: Path, operator: OperatorProcess, ns: str, *extra_args: str
) -> OperatorProcess:
    """An operator authenticated as the installed ServiceAccount of ``ns`` (not started yet).

    The session's operator would do the work too; it is stopped so only the restricted one acts.
    With leader election, as the shipped Deployment runs it: the Lease is granted by the namespaced
    Role only, so a pool reconciled at all proves that Role works.
    """
    kubeconfig = token_kubeconfig(cluster, ns, tmp_path / "sa.kubeconfig")
    operator.stop()
    return OperatorProcess(
        cluster,
        tmp_path,
        kubeconfig=kubeconfig,
        config_name=CONFIG_NAME,
        extra_args=[*extra_args, "--leader-election", f"--leader-election-namespace={ns}"],
    )


def _uninstall(
    cluster: ClusterHandle, proc: OperatorProcess, docs: list[dict[str, Any]], operator: OperatorProcess
) -> None:
    """Stop the restricted operator, remove what _install_rbac applied, restart the session's one."""
    proc.stop()
    log = proc.tail(200)
    cluster.kubectl("delete", "mutatingwebhookconfiguration", CONFIG_NAME, "--ignore-not-found", check=False)
    cluster.kubectl(
        "delete", "--ignore-not-found", "--wait=false", "-f", "-", input=yaml.safe_dump_all(docs), check=False
    )
    operator.start()
    # An RBAC denial reads 'is forbidden: User "system:serviceaccount:..." cannot ...' (a 403 for
    # a terminating namespace of another test is not one).
    assert "cannot" not in log or "system:serviceaccount" not in log, log


@pytest.fixture
def sa_operator(
    cluster: ClusterHandle, crd: None, tmp_path: Path, operator: OperatorProcess
) -> Iterator[OperatorProcess]:
    """A second operator, authenticated as the shipped ServiceAccount with the shipped ClusterRole."""
    suffix = uuid.uuid4().hex[:6]
    ns = f"kvfabric-rbac-{suffix}"
    docs = _install_rbac(cluster, ns, suffix)
    proc = _restricted_operator(cluster, tmp_path, operator, ns)
    try:
        proc.start()

        def holder() -> str | None:
            got = cluster.kubectl("get", "lease", "kvfabric-operator", "-n", ns, "-o", "json", check=False)
            return json.loads(got.stdout)["spec"].get("holderIdentity") if got.returncode == 0 else None

        wait_for(
            holder,
            timeout=60,
            message="the operator holds its Lease (granted by the namespaced Role)",
        )
        yield proc
    finally:
        _uninstall(cluster, proc, docs, operator)


CLUSTER_SCOPED = {"namespaces", "customresourcedefinitions", "mutatingwebhookconfigurations"}


def _grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str, tuple[str, ...]]]:
    """Every (group, resource, verb, resourceNames) a list of rules grants."""
    return {
        (group, resource, verb, tuple(rule.get("resourceNames", [])))
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_the_namespaced_installs_cluster_role_is_exactly_the_cluster_scoped_part_of_the_operators() -> None:
    role = yaml.safe_load((ROOT / "manifests" / "rbac" / "role.yaml").read_text())
    docs = list(yaml.safe_load_all((ROOT / "manifests/overlays/namespaced/cluster_role.yaml").read_text()))
    cluster_role = next(d for d in docs if d["kind"] == "ClusterRole")
    operator = _grants(role["rules"])
    assert _grants(cluster_role["rules"]) == {g for g in operator if g[1] in CLUSTER_SCOPED}


@pytest.fixture
def namespaced_operator(
    cluster: ClusterHandle, crd: None, tmp_path: Path, operator: OperatorProcess, namespace: str
) -> Iterator[tuple[OperatorProcess, str]]:
    """An operator installed by manifests/overlays/namespaced, watching only ``namespace``."""
    suffix = uuid.uuid4().hex[:6]
    ns = f"kvfabric-rbac-{suffix}"
    docs = _install_rbac(cluster, ns, suffix, overlay="overlays/namespaced", watched=namespace)
    assert not any(
        d["kind"] == "ClusterRoleBinding" and d["roleRef"]["name"] == f"kvfabric-operator-{suffix}"
        for d in docs
    ), "the namespaced install binds the operator's ClusterRole cluster-wide"
    proc = _restricted_operator(cluster, tmp_path, operator, ns, f"--namespace={namespace}")
    try:
        proc.start()
        yield proc, ns
    finally:
        _uninstall(cluster, proc, docs, operator)


def _assert_consumer_injected(cluster: ClusterHandle, namespace: str) -> None:
    """A pod opting in to pool-a is mutated by the webhook the restricted operator registered."""
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "consumer", "labels": {"kvfabric.io/pool": "pool-a"}},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0"}]},
        },
        namespace=namespace,
    )
    pod = cluster.get_json("pod", "consumer", "-n", namespace)
    assert "kvfabric.io/injected" in pod["metadata"]["annotations"], json.dumps(pod["metadata"])


def _exists(cluster: ClusterHandle, kind: str, name: str, namespace: str) -> bool:
    return cluster.kubectl("get", kind, name, "-n", namespace, check=False).returncode == 0


def _pool(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "kvfabric.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name},
        "spec": {"image": {"tag": "v0.2.0"}, "tiers": {"memory": {"size": "1Gi"}}},
    }


def test_a_namespaced_install_reconciles_its_namespaces_and_can_write_nowhere_else(
    cluster: ClusterHandle, namespace: str, namespaced_operator: tuple[OperatorProcess, str]
) -> None:
    _, sa_ns = namespaced_operator
    sa = f"system:serviceaccount:{sa_ns}:kvfabric-operator"
    with cluster.namespace() as other:
        # A pool outside the watched namespaces is created first, and is never reconciled.
        cluster.apply(_pool("elsewhere"), namespace=other)
        cluster.apply(_pool("pool-a"), namespace=namespace)
        wait_for(
            lambda: (
                get_pool(cluster, namespace, "pool-a").get("status", {}).get("nodes", {}).get("desired")
                == len(cluster.gpu_nodes)
            ),
            timeout=90,
            message="the watched namespace's pool reconciled",
        )
        assert _exists(cluster, "daemonset", "pool-a-cache", namespace)
        # Consumers in the watched namespace are injected through the webhook it registered.
        _assert_consumer_injected(cluster, namespace)
        # Two resync periods later the other namespace's pool is still untouched.
        time.sleep(10)
        assert "status" not in get_pool(cluster, other, "elsewhere")
        assert not _exists(cluster, "daemonset", "elsewhere-cache", other)

        def can(verb: str, resource: str, ns: str, *extra: str) -> bool:
            args = ("auth", "can-i", verb, resource, *extra, "-n", ns, f"--as={sa}")
            got = cluster.kubectl(*args, check=False)
            return got.stdout.strip() == "yes"

        # What the API server's RBAC actually grants the ServiceAccount.
        assert can("create", "daemonsets.apps", namespace)
        assert can("patch", "kvcachepools.kvfabric.io", namespace, "--subresource=status")
        for verb, resource in (("create", "daemonsets.apps"), ("create", "configmaps"), ("get", "secrets")):
            assert not can(verb, resource, other), f"{verb} {resource} outside the watched namespaces"
            assert not can(verb, resource, "kube-system"), f"{verb} {resource} in kube-system"
        assert not can("list", "secrets", namespace), "listing Secrets would read every one of them"
        assert can("list", "namespaces", "default")  # cluster-scoped: Pod Security labels


def test_operator_works_with_the_shipped_least_privilege_rbac(
    cluster: ClusterHandle, namespace: str, sa_operator: OperatorProcess
) -> None:
    cluster.apply(
        {
            "apiVersion": "kvfabric.io/v1alpha1",
            "kind": "KVCachePool",
            "metadata": {"name": "pool-a"},
            "spec": {
                "image": {"tag": "v0.2.0"},
                "tiers": {
                    "memory": {"size": "1Gi"},
                    "shared": {"claimTemplate": {"size": "1Gi"}, "capacity": "1Gi"},
                },
                "consumers": {"routingEvents": {}},
            },
        },
        namespace=namespace,
    )
    # The owned PVC has no volume to bind in this cluster, so the cache pods stay Pending; the status
    # (written through kvcachepools/status) still reports every selected node.
    wait_for(
        lambda: (
            get_pool(cluster, namespace, "pool-a").get("status", {}).get("nodes", {}).get("desired")
            == len(cluster.gpu_nodes)
        ),
        timeout=90,
        message="status with node counts",
    )
    assert cluster.kubectl("get", "pvc", "pool-a-shared", "-n", namespace, check=False).returncode == 0
    events = cluster.get_json("events", "-n", namespace, "--field-selector", "involvedObject.name=pool-a")[
        "items"
    ]
    assert events, "the operator could not post Events"
    # The webhook configuration it registered itself, and injection through it.
    assert (
        cluster.get_json("mutatingwebhookconfiguration", CONFIG_NAME)["webhooks"][0]["failurePolicy"]
        == "Ignore"
    )
    _assert_consumer_injected(cluster, namespace)
    wait_for(
        lambda: get_pool(cluster, namespace, "pool-a")["status"]["consumers"]["injected"] == 1,
        timeout=30,
        message="consumer counted",
    )
    # The consumer-keys Secret in the operator's own namespace, written through the namespaced Role.
    (operator_ns,) = [
        a.split("=", 1)[1] for a in sa_operator.extra_args if a.startswith("--leader-election-namespace=")
    ]

    def published() -> bool:
        got = cluster.kubectl(
            "get", "secret", "kvfabric-consumer-keys", "-n", operator_ns, "-o", "json", check=False
        )
        return got.returncode == 0 and f"{namespace}.pool-a" in (json.loads(got.stdout).get("data") or {})

    wait_for(published, timeout=30, message="the pool's entry in the consumer-keys Secret")
    # StorageReady is False (no volume provisioner here), so Ready stays False: that is honest.
    pool = get_pool(cluster, namespace, "pool-a")
    assert condition(pool, "StorageReady")["reason"] == "ClaimPending"
    assert not is_ready(cluster, namespace, "pool-a")
    # The router ConfigMap a pool with routing events owns is pruned when they are turned off.
    wait_for(
        lambda: _exists(cluster, "configmap", "pool-a-router", namespace), timeout=30, message="router CM"
    )
    cluster.kubectl(
        "patch", "kvp", "pool-a", "-n", namespace, "--type=json",
        "-p", '[{"op":"remove","path":"/spec/consumers/routingEvents"}]',
    )  # fmt: skip
    wait_for(
        lambda: not _exists(cluster, "configmap", "pool-a-router", namespace),
        timeout=30,
        message="the router ConfigMap pruned under the shipped role",
    )
