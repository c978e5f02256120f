"""A user's object under one of a pool's child names is never adopted, pruned or collected.

Server-side apply with force takes over whatever object holds the name (labels, owner reference):
the prune and the garbage collector would then delete it. The operator checks the owner reference
to the pool's uid before applying, and prunes only what carries it: labels alone decide nothing,
since anyone who can patch an object can copy them.
"""

from __future__ import annotations

from typing import Any

import pytest
from tests.operator.conftest import OperatorProcess, condition, get_pool

from kvfabric.localcluster.testing import ClusterHandle, wait_for
from kvfabric.operator.render import names

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

USERS_DATA = {"router.yaml": "the user's own router settings\n"}


def _pool(name: str, *, routing: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {"image": {"tag": "v0.2.0"}, "tiers": {"memory": {"size": "1Gi"}}}
    if routing:
        spec["consumers"] = {"routingEvents": {}}
    return {
        "apiVersion": "kvfabric.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name},
        "spec": spec,
    }


def _current(cluster: ClusterHandle, namespace: str, name: str, kind: str) -> dict[str, Any]:
    pool = get_pool(cluster, namespace, name)
    cond = condition(pool, kind)
    return cond if cond.get("observedGeneration") == pool["metadata"]["generation"] else {}


def test_a_users_configmap_under_the_router_name_survives_routing_on_off_and_pool_deletion(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    router = names.router_configmap_name("oc")
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": router, "labels": {"team": "routing"}},
            "data": USERS_DATA,
        },
        namespace=namespace,
        server_side=False,
    )

    def untouched() -> None:
        now = cluster.get_json("configmap", router, "-n", namespace)
        assert now["data"] == USERS_DATA
        assert "ownerReferences" not in now["metadata"], now["metadata"]
        assert now["metadata"]["labels"] == {"team": "routing"}

    cluster.apply(_pool("oc", routing=True), namespace=namespace)
    cond = wait_for(
        lambda: (
            _current(cluster, namespace, "oc", "Degraded").get("reason") == "ObjectConflict"
            and _current(cluster, namespace, "oc", "Degraded")
        ),
        timeout=60,
        message="the pool's ObjectConflict",
    )
    assert cond["status"] == "True", cond
    assert f"ConfigMap {router}" in cond["message"], cond
    ready = condition(get_pool(cluster, namespace, "oc"), "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ObjectConflict")
    untouched()

    # Routing events off: the router ConfigMap is no longer rendered; the pool's children are applied
    # and the prune passes the user's ConfigMap by.
    cluster.apply(_pool("oc", routing=False), namespace=namespace)
    wait_for(
        lambda: _current(cluster, namespace, "oc", "Degraded").get("reason") not in (None, "ObjectConflict"),
        timeout=60,
        message="the conflict cleared",
    )
    wait_for(
        lambda: (
            cluster.kubectl(
                "get", "daemonset", names.daemonset_name("oc"), "-n", namespace, check=False
            ).returncode
            == 0
        ),
        timeout=60,
        message="the pool's DaemonSet",
    )
    untouched()

    cluster.kubectl("delete", "kvp", "oc", "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for(
        lambda: (
            cluster.kubectl(
                "get", "configmap", names.configmap_name("oc"), "-n", namespace, check=False
            ).returncode
            != 0
        ),
        timeout=90,
        message="the pool's own ConfigMap garbage-collected",
    )
    untouched()


def test_a_labelled_foreign_configmap_is_not_pruned(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    cluster.apply(_pool("ol", routing=False), namespace=namespace)
    wait_for(
        lambda: (
            cluster.kubectl(
                "get", "configmap", names.configmap_name("ol"), "-n", namespace, check=False
            ).returncode
            == 0
        ),
        timeout=60,
        message="the pool's ConfigMap",
    )
    # Someone copies the operator's labels onto their own ConfigMap (no owner reference).
    labels = cluster.get_json("configmap", names.configmap_name("ol"), "-n", namespace)["metadata"]["labels"]
    decoy = "ol-decoy"
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": decoy, "labels": labels},
            "data": USERS_DATA,
        },
        namespace=namespace,
        server_side=False,
    )
    # Two reconciles later (the decoy's own event triggers one; a spec change another), it is there.
    cluster.apply(
        {
            **_pool("ol", routing=False),
            "spec": {**_pool("ol", routing=False)["spec"], "tiers": {"memory": {"size": "2Gi"}}},
        },
        namespace=namespace,
    )
    wait_for(
        lambda: _current(cluster, namespace, "ol", "Degraded") != {},
        timeout=60,
        message="the pool reconciled after the change",
    )
    now = cluster.get_json("configmap", decoy, "-n", namespace)
    assert now["data"] == USERS_DATA


def test_a_users_networkpolicy_under_the_pools_name_is_not_taken_over(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    """The NetworkPolicy is checked like every other child (the role reads it by name): a user's own
    ``<pool>-cache`` policy keeps its spec and gets no owner reference; the pool reports the conflict."""
    policy = names.network_policy_name("onp")
    users_spec = {"podSelector": {"matchLabels": {"app": "theirs"}}, "policyTypes": ["Ingress"]}
    cluster.apply(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": policy, "labels": {"team": "net"}},
            "spec": users_spec,
        },
        namespace=namespace,
        server_side=False,
    )
    cluster.apply(_pool("onp", routing=False), namespace=namespace)
    cond = wait_for(
        lambda: (
            _current(cluster, namespace, "onp", "Degraded").get("reason") == "ObjectConflict"
            and _current(cluster, namespace, "onp", "Degraded")
        ),
        timeout=60,
        message="the pool's ObjectConflict",
    )
    assert cond["status"] == "True", cond
    assert f"NetworkPolicy {policy}" in cond["message"], cond
    now = cluster.get_json("networkpolicy", policy, "-n", namespace)
    assert now["spec"] == users_spec
    assert "ownerReferences" not in now["metadata"], now["metadata"]
    assert now["metadata"]["labels"] == {"team": "net"}
    assert (
        cluster.kubectl(
            "get", "daemonset", names.daemonset_name("onp"), "-n", namespace, check=False
        ).returncode
        != 0
    )
