"""A user's Secret under one of a pool's fixed names is never adopted (the real API server and GC).

``<pool>-credentials`` is a natural name for the pool's own S3 keys. The operator writes a pool's
Secrets with an owner reference to the pool; one that exists without it is someone else's: the
operator neither merges into it nor owns it (so the garbage collector never takes it with the pool),
and the pool says which Secret is in the way.
"""

from __future__ import annotations

import base64
from typing import Any

import pytest
from tests.operator.conftest import OperatorProcess, condition, get_pool

from kvfabric.localcluster.testing import ClusterHandle, wait_for
from kvfabric.operator.render import names

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _users_secret(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "labels": {"team": "storage"}},
        "type": "Opaque",
        "data": {
            "access-key-id": base64.b64encode(b"AKIAUSER").decode(),
            "secret-access-key": base64.b64encode(b"the user's own key").decode(),
        },
    }


def test_a_users_secret_under_the_pools_names_is_left_alone_and_named_in_the_status(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    theirs = [names.credentials_secret_name("sc"), names.ca_secret_name("sc")]
    for name in theirs:
        cluster.apply(_users_secret(name), namespace=namespace, server_side=False)
    before = {n: cluster.get_json("secret", n, "-n", namespace) for n in theirs}
    cluster.apply(
        {
            "apiVersion": "kvfabric.io/v1alpha1",
            "kind": "KVCachePool",
            "metadata": {"name": "sc"},
            "spec": {
                "image": {"tag": "v0.2.0"},
                "tiers": {"memory": {"size": "1Gi"}},
                "server": {"tcp": {"enabled": True}},
            },
        },
        namespace=namespace,
    )

    def degraded() -> dict[str, Any]:
        pool = get_pool(cluster, namespace, "sc")
        gen = pool["metadata"]["generation"]
        cond = condition(pool, "Degraded")
        return cond if cond.get("observedGeneration") == gen else {}

    cond = wait_for(degraded, timeout=60, message="the pool's Degraded condition")
    assert (cond["status"], cond["reason"]) == ("True", "SecretConflict"), cond
    for name in theirs:
        assert name in cond["message"]
    ready = condition(get_pool(cluster, namespace, "sc"), "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "SecretConflict")

    def untouched() -> None:
        for name in theirs:
            now = cluster.get_json("secret", name, "-n", namespace)
            assert now["data"] == before[name]["data"], name  # nothing merged in
            assert "ownerReferences" not in now["metadata"], now["metadata"]
            assert now["metadata"]["labels"] == {"team": "storage"}

    untouched()
    # Nothing was built on it: no DaemonSet whose pods would mount the user's Secret, and none of the
    # pool's other credentials issued beside it.
    for kind, name in (
        ("daemonset", names.daemonset_name("sc")),
        ("secret", names.server_tls_secret_name("sc")),
        ("secret", names.client_tls_secret_name("sc")),
    ):
        assert cluster.kubectl("get", kind, name, "-n", namespace, check=False).returncode != 0, name

    # Deleting the pool: the garbage collector takes what the pool owns (its ConfigMap), not the
    # user's Secrets.
    assert cluster.kubectl("get", "configmap", names.configmap_name("sc"), "-n", namespace).returncode == 0
    cluster.kubectl("delete", "kvp", "sc", "-n", namespace, "--wait=true", "--timeout=60s")
    wait_for(
        lambda: (
            cluster.kubectl(
                "get", "configmap", names.configmap_name("sc"), "-n", namespace, check=False
            ).returncode
            != 0
        ),
        timeout=90,
        message="the pool's ConfigMap garbage-collected",
    )
    untouched()
