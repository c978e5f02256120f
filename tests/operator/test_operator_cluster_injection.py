"""The injection webhook, called by the real API server on Pod CREATE."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tests.operator.conftest import OperatorProcess, get_pool, is_ready

from kvfabric.localcluster.testing import ClusterHandle, wait_for
from kvfabric.operator.render import names

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def pool(name: str = "pool-a", **consumers: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvfabric.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name},
        "spec": {"image": {"tag": "v0.2.0"}, "tiers": {"memory": {"size": "1Gi"}}, "consumers": consumers},
    }


def deployment(name: str, labels: dict[str, str], replicas: int = 2) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name, **labels}},
                "spec": {
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "containers": [
                        {
                            "name": "vllm",
                            "image": "vllm/vllm-openai:v0.11.0",
                            "args": ["--model", "meta-llama/Llama-3.1-8B"],
                        }
                    ],
                },
            },
        },
    }


def bare_pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "app", "image": "python:3.12", "command": ["sleep", "inf"]}]},
    }


def restricted_pod(name: str, pool_name: str) -> dict[str, Any]:
    """A vLLM consumer that Pod Security restricted admits as written (non-root, seccomp, no caps)."""
    body = bare_pod(name, {"kvfabric.io/pool": pool_name})
    body["spec"] = {
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [
            {
                "name": "vllm",
                "image": "vllm/vllm-openai:v0.11.0",
                "args": ["--model", "m"],
                "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
            }
        ],
    }
    return body


def pods(cluster: ClusterHandle, ns: str, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.get_json("pods", "-n", ns, "-l", selector)["items"]
    return items


def env_of(pod: dict[str, Any], container: int = 0) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][container].get("env") or []}


def counts(**kw: Any) -> dict[str, Any]:
    """A pool's ``status.consumers`` with these counts (the rest zero)."""
    base: dict[str, Any] = {"matched": 0, "injected": 0, "stale": 0, "skipped": 0, "skippedByReason": {}}
    return base | {"overTcp": 0} | kw


def wait_pool_known(cluster: ClusterHandle, ns: str, name: str) -> dict[str, Any]:
    """Wait until the operator has reconciled the pool (so its webhook knows it too)."""
    wait_for(
        lambda: get_pool(cluster, ns, name).get("status", {}).get("connection", {}).get("configHash"),
        timeout=30,
        message="pool reconciled",
    )
    return get_pool(cluster, ns, name)


def test_labelled_deployment_gets_injected_and_counted(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    cluster.apply(pool(), namespace=namespace)
    current = wait_pool_known(cluster, namespace, "pool-a")["status"]["connection"]
    cluster.apply(deployment("engine", {"kvfabric.io/pool": "pool-a"}), namespace=namespace)
    injected = wait_for(
        lambda: (p := pods(cluster, namespace, "app=engine")) and len(p) == 2 and p,
        timeout=60,
        message="2 pods",
    )
    for p in injected:
        env = env_of(p)
        assert env["KVFABRIC_SOCKET"] == current["socket"]
        assert "KVFABRIC_SHM_DIR" not in env  # no shared directory: payloads come as memfds
        assert env.get("KVFABRIC_REMOTE", "") == current["remote"]  # "" while TCP is off
        assert env["KVFABRIC_CHUNK_TOKENS"] == "256"
        assert env["KVFABRIC_POOL"] == f"{namespace}/pool-a"
        assert env["KVFABRIC_CONFIG_HASH"] == current["configHash"]
        args = p["spec"]["containers"][0]["args"]
        assert args[:2] == ["--model", "meta-llama/Llama-3.1-8B"]
        assert args[2] == "--kv-transfer-config"
        assert json.loads(args[3])["kv_connector"] == "KVFabricConnector"
        volumes = {v["name"]: v for v in p["spec"]["volumes"]}
        assert volumes["kvfabric-run"]["hostPath"]["path"] == current["hostDir"]
        annotations = p["metadata"]["annotations"]
        assert annotations[names.CONFIG_HASH_ANNOTATION] == current["configHash"]
        assert json.loads(annotations[names.INJECTED_ANNOTATION])["pool"] == f"{namespace}/pool-a"

    wait_for(
        lambda: (
            get_pool(cluster, namespace, "pool-a")["status"]["consumers"]
            == counts(matched=2, injected=2, stale=0)
        ),
        timeout=30,
        message="consumers counted",
    )

    # A consumer-visible change (tenant) makes the running pods stale, and status says so.
    cluster.kubectl(
        "patch",
        "kvp",
        "pool-a",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"consumers": {"tenant": "team-a"}}}),
    )
    wait_for(
        lambda: (
            get_pool(cluster, namespace, "pool-a")["status"]["consumers"]
            == counts(matched=2, injected=0, stale=2)
        ),
        timeout=30,
        message="consumers stale",
    )
    # New pods get the new settings.
    cluster.kubectl("delete", "pods", "-n", namespace, "-l", "app=engine", "--wait=false")
    wait_for(
        lambda: (
            get_pool(cluster, namespace, "pool-a")["status"]["consumers"]
            == counts(matched=2, injected=2, stale=0)
        ),
        timeout=60,
        message="replacement pods injected",
    )
    fresh = pods(cluster, namespace, "app=engine")
    assert all(
        env_of(p)["KVFABRIC_TENANT"] == "team-a" for p in fresh if not p["metadata"].get("deletionTimestamp")
    )


def test_unlabelled_and_unknown_pool_pods(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    cluster.apply(pool(), namespace=namespace)
    wait_pool_known(cluster, namespace, "pool-a")
    cluster.apply(
        bare_pod("plain", {"app": "plain"}),
        bare_pod("lost", {"kvfabric.io/pool": "missing"}),
        namespace=namespace,
    )
    plain = cluster.get_json("pod", "plain", "-n", namespace)
    assert "env" not in plain["spec"]["containers"][0]
    assert not [k for k in plain["metadata"].get("annotations") or {} if k.startswith("kvfabric.io/")]
    assert "kvfabric-run" not in {v["name"] for v in plain["spec"].get("volumes") or []}

    lost = cluster.get_json("pod", "lost", "-n", namespace)
    assert lost["metadata"]["annotations"][names.SKIP_REASON_ANNOTATION] == "pool-not-found"
    assert "env" not in lost["spec"]["containers"][0]
    assert "kvfabric-run" not in {v["name"] for v in lost["spec"].get("volumes") or []}


def test_webhook_down_does_not_block_pod_creation(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    cluster.apply(pool(), namespace=namespace)
    wait_pool_known(cluster, namespace, "pool-a")
    operator.stop()
    try:
        cluster.apply(bare_pod("while-down", {"kvfabric.io/pool": "pool-a"}), namespace=namespace)
        created = cluster.get_json("pod", "while-down", "-n", namespace)
        # Admitted unchanged (failurePolicy Ignore)...
        assert "env" not in created["spec"]["containers"][0]
    finally:
        operator.start()
    # ...and visible in status as matched but not injected once the operator is back.
    wait_for(
        lambda: (
            (c := get_pool(cluster, namespace, "pool-a")["status"]["consumers"])["matched"] == 1
            and c["injected"] == 0
        ),
        timeout=30,
        message="uninjected consumer counted",
    )
    wait_for(lambda: is_ready(cluster, namespace, "pool-a"), timeout=60, message="pool Ready after restart")


def test_fail_policy_pool_blocks_uninjectable_pods(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    name = f"strict-{namespace}"  # pool names are matched across namespaces by the object selector
    cluster.apply(pool(name, failurePolicy="Fail"), pool("relaxed"), namespace=namespace)
    wait_pool_known(cluster, namespace, name)

    def registered() -> bool:
        hooks = cluster.get_json("mutatingwebhookconfiguration", operator.config_name)["webhooks"]
        return any(h["failurePolicy"] == "Fail" and name in str(h["objectSelector"]) for h in hooks)

    wait_for(registered, timeout=30, message="fail-closed webhook for the strict pool")
    cluster.apply(bare_pod("strict-up", {"kvfabric.io/pool": name}), namespace=namespace)
    assert (
        "kvfabric.io/injected"
        in cluster.get_json("pod", "strict-up", "-n", namespace)["metadata"]["annotations"]
    )
    operator.stop()
    try:
        refused = cluster.kubectl(
            "create",
            "-n",
            namespace,
            "-f",
            "-",
            input=json.dumps(bare_pod("strict-down", {"kvfabric.io/pool": name})),
            check=False,
        )
        assert refused.returncode != 0
        assert "pods.kvfabric.io" in refused.stderr
        # Consumers of fail-open pools are still admitted.
        cluster.apply(bare_pod("relaxed-down", {"kvfabric.io/pool": "relaxed"}), namespace=namespace)
    finally:
        operator.start()
    cluster.kubectl("delete", "kvp", name, "-n", namespace)
    wait_for(lambda: not registered(), timeout=30, message="fail-closed webhook removed with the pool")


def test_pod_security_restricted_namespace_admits_consumers_over_tcp_or_skips_them(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    """The API server's own PodSecurity admission judges the mutated pods (no hand-written list)."""
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    tcp = pool("pool-tcp")
    tcp["spec"]["server"] = {"tcp": {"enabled": True}}
    cluster.apply(pool("pool-unix"), tcp, namespace=namespace)
    wait_pool_known(cluster, namespace, "pool-unix")
    wait_pool_known(cluster, namespace, "pool-tcp")

    # Without TCP the node socket (a hostPath) is the only way in: skipped, and the pod is admitted.
    cluster.apply(restricted_pod("unix-consumer", "pool-unix"), namespace=namespace)
    skipped = cluster.get_json("pod", "unix-consumer", "-n", namespace)
    assert skipped["metadata"]["annotations"][names.SKIP_REASON_ANNOTATION] == "pod-security"
    assert not any("hostPath" in v for v in skipped["spec"].get("volumes") or [])
    # With TCP: injected, wired to the listener alone, payload init container included, and admitted.
    cluster.apply(restricted_pod("tcp-consumer", "pool-tcp"), namespace=namespace)
    wired = cluster.get_json("pod", "tcp-consumer", "-n", namespace)
    assert json.loads(wired["metadata"]["annotations"][names.INJECTED_ANNOTATION])["transport"] == "tcp"
    assert env_of(wired)["KVFABRIC_REMOTE"].startswith("pool-tcp.")
    assert "KVFABRIC_SOCKET" not in env_of(wired)
    assert [c["name"] for c in wired["spec"].get("initContainers") or []] == [names.PAYLOAD_VOLUME]
    # The pools say which.
    wait_for(
        lambda: (
            get_pool(cluster, namespace, "pool-unix")["status"]["consumers"]
            == counts(matched=1, skipped=1, skippedByReason={"pod-security": 1})
        ),
        timeout=30,
        message="pool-unix counts the skipped pod by reason",
    )
    wait_for(
        lambda: (
            get_pool(cluster, namespace, "pool-tcp")["status"]["consumers"]
            == counts(matched=1, injected=1, overTcp=1)
        ),
        timeout=30,
        message="pool-tcp counts the pod served over TCP",
    )


def test_with_the_csi_plugin_a_restricted_namespace_admits_node_local_consumers(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    """Installed with the node plugin, the mutated pod carries a CSI inline volume instead of a hostPath,
    and the API server's own PodSecurity admission (restricted, the strictest level) admits it."""
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    operator.stop()
    operator.extra_args.append("--csi-driver=csi.kvfabric.io")
    operator.start()
    try:
        cluster.apply(pool("pool-csi"), namespace=namespace)
        wait_pool_known(cluster, namespace, "pool-csi")
        body = restricted_pod("csi-consumer", "pool-csi")
        cluster.apply(body, namespace=namespace)
        admitted = cluster.get_json("pod", "csi-consumer", "-n", namespace)
        detail = json.loads(admitted["metadata"]["annotations"][names.INJECTED_ANNOTATION])
        assert (detail["transport"], detail["socketVolume"]) == ("unix", "csi")
        volumes = admitted["spec"]["volumes"]
        assert not any("hostPath" in v for v in volumes)
        assert {
            "name": names.RUN_VOLUME,
            "csi": {
                "driver": "csi.kvfabric.io",
                "readOnly": True,
                "volumeAttributes": {"pool": "pool-csi", "namespace": namespace},
            },
        } in volumes
        assert env_of(admitted)["KVFABRIC_SOCKET"] == f"/run/kvfabric/{namespace}.pool-csi/cache.sock"
        wait_for(
            lambda: (
                get_pool(cluster, namespace, "pool-csi")["status"]["consumers"]
                == counts(matched=1, injected=1)
            ),
            timeout=30,
            message="pool-csi counts the injected pod",
        )
    finally:
        operator.stop()
        operator.extra_args.remove("--csi-driver=csi.kvfabric.io")
        operator.start()
