"""The reconciler against the real local control plane (kube-controller-manager, scheduler, kwok nodes)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.operator.conftest import OperatorProcess, condition, get_pool, is_ready, watch_pool

from kvfabric.localcluster.testing import ClusterHandle, wait_for
from kvfabric.operator.api.v1alpha1 import KVCachePool
from kvfabric.operator.render import names, render_children

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "manifests" / "samples" / "kvfabric.io_v1alpha1_kvcachepool.yaml"


def sample(name: str = "pool-a") -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(SAMPLE.read_text())
    doc["metadata"]["name"] = name
    return doc


def children_exist(cluster: ClusterHandle, ns: str, name: str) -> bool:
    for kind, child in (
        ("configmap", names.configmap_name(name)),
        ("daemonset", names.daemonset_name(name)),
        ("service", names.service_name(name)),
        ("service", names.metrics_service_name(name)),
    ):
        if cluster.kubectl("get", kind, child, "-n", ns, check=False).returncode:
            return False
    return True


def cache_pods(cluster: ClusterHandle, ns: str, name: str) -> list[dict[str, Any]]:
    selector = ",".join(f"{k}={v}" for k, v in names.selector_labels(name).items())
    items: list[dict[str, Any]] = cluster.get_json("pods", "-n", ns, "-l", selector)["items"]
    return items


def ready_sample_servers(cluster: ClusterHandle, ns: str, name: str = "pool-a") -> list[dict[str, Any]]:
    """Apply the sample pool, wait until it is Ready, and return its server pods, sorted by node."""
    cluster.apply(sample(name), namespace=ns)
    wait_for(
        lambda: condition(get_pool(cluster, ns, name), "Ready").get("status") == "True",
        timeout=90,
        message="Ready",
    )
    pods = sorted(cache_pods(cluster, ns, name), key=lambda p: p["spec"]["nodeName"])
    assert len(pods) >= 2
    return pods


def test_sample_pool_creates_children_and_becomes_ready(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    cluster.apply(sample(), namespace=namespace)
    wait_for(lambda: children_exist(cluster, namespace, "pool-a"), timeout=30, message="children")
    pool = get_pool(cluster, namespace, "pool-a")
    expected = {
        (o["kind"], o["metadata"]["name"]): o
        for o in render_children(KVCachePool.model_validate(pool)).objects
    }

    cm = cluster.get_json("configmap", "pool-a-config", "-n", namespace)
    assert cm["data"] == expected[("ConfigMap", "pool-a-config")]["data"]
    assert cm["metadata"]["ownerReferences"][0]["uid"] == pool["metadata"]["uid"]
    ds = cluster.get_json("daemonset", "pool-a-cache", "-n", namespace)
    template = ds["spec"]["template"]
    assert template["metadata"]["annotations"][names.CONFIG_HASH_ANNOTATION] == pool_revision(
        pool, cluster, namespace
    )
    container = template["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/kvfabric/kvfabric:v0.2.0"
    assert container["command"] == ["kvfabric", "cacheserver", "--config", "/etc/kvfabric/config.yaml"]
    assert template["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert ds["metadata"]["ownerReferences"][0]["controller"] is True
    svc = cluster.get_json("service", "pool-a", "-n", namespace)
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    assert cluster.get_json("service", "pool-a-metrics", "-n", namespace)["spec"]["clusterIP"] == "None"

    # One cache server per GPU node, none on the CPU node.
    pods = wait_for(
        lambda: (p := cache_pods(cluster, namespace, "pool-a")) and len(p) == len(cluster.gpu_nodes) and p,
        timeout=60,
        message="a cache pod per GPU node",
    )
    placed = sorted(p["spec"].get("nodeName", "") for p in pods)
    assert placed == sorted(cluster.gpu_nodes)
    assert not set(placed) & set(cluster.cpu_nodes)

    wait_for(lambda: is_ready(cluster, namespace, "pool-a"), timeout=60, message="pool Ready")
    pool = get_pool(cluster, namespace, "pool-a")
    n = len(cluster.gpu_nodes)
    assert pool["status"]["nodes"] == {"desired": n, "ready": n, "updated": n, "available": n}
    assert pool["status"]["connection"]["socket"] == f"/run/kvfabric/{namespace}.pool-a/cache.sock"
    for ctype in ("Ready", "Progressing", "Degraded", "ConfigValid", "StorageReady", "InjectionReady"):
        cond = condition(pool, ctype)
        assert cond["reason"]
        assert cond["observedGeneration"] == pool["metadata"]["generation"]
    assert condition(pool, "Progressing")["status"] == "False"
    assert condition(pool, "Degraded")["status"] == "False"
    # Printer columns.
    table = cluster.kubectl("get", "kvp", "pool-a", "-n", namespace).stdout
    header, row = table.splitlines()[:2]
    assert header.split()[:5] == ["NAME", "READY", "NODES", "CONSUMERS", "AGE"]
    assert row.split()[1:3] == ["True", f"{n}/{n}"]
    # A notable transition was recorded as an Event.
    events = cluster.get_json("events", "-n", namespace, "--field-selector", "involvedObject.name=pool-a")[
        "items"
    ]
    assert "PoolReady" in {e["reason"] for e in events}


def pool_revision(pool: dict[str, Any], cluster: ClusterHandle, namespace: str) -> str:
    def revision() -> str:
        rev: str = (
            get_pool(cluster, namespace, pool["metadata"]["name"]).get("status", {}).get("revision", "")
        )
        return rev

    return str(wait_for(revision, timeout=30, message="status.revision"))


def test_memory_change_rolls_and_delete_collects_children(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    cluster.apply(sample(), namespace=namespace)
    wait_for(lambda: is_ready(cluster, namespace, "pool-a"), timeout=90, message="pool Ready")
    before_cm = cluster.get_json("configmap", "pool-a-config", "-n", namespace)["data"]["config.yaml"]
    before_hash = get_pool(cluster, namespace, "pool-a")["status"]["revision"]
    before_pods = {p["metadata"]["uid"] for p in cache_pods(cluster, namespace, "pool-a")}

    with watch_pool(cluster, namespace, "pool-a") as seen:
        cluster.kubectl(
            "patch",
            "kvp",
            "pool-a",
            "-n",
            namespace,
            "--type=merge",
            "-p",
            json.dumps({"spec": {"tiers": {"memory": {"size": "2Gi"}}}}),
        )
        gen = get_pool(cluster, namespace, "pool-a")["metadata"]["generation"]
        wait_for(
            lambda: is_ready(cluster, namespace, "pool-a", gen), timeout=90, message="Ready after the change"
        )

    after_cm = cluster.get_json("configmap", "pool-a-config", "-n", namespace)["data"]["config.yaml"]
    assert before_cm != after_cm
    assert yaml.safe_load(after_cm)["tiers"]["dram"]["capacity_bytes"] == 2 * 2**30
    after = get_pool(cluster, namespace, "pool-a")
    assert after["status"]["revision"] != before_hash
    ds = cluster.get_json("daemonset", "pool-a-cache", "-n", namespace)
    assert (
        ds["spec"]["template"]["metadata"]["annotations"][names.CONFIG_HASH_ANNOTATION]
        == after["status"]["revision"]
    )
    # Every cache pod was replaced by one of the new revision.
    after_pods = cache_pods(cluster, namespace, "pool-a")
    assert not before_pods & {p["metadata"]["uid"] for p in after_pods}

    # While it rolled, the pool said so, for the new generation, and was not Ready. Every status the
    # operator wrote for the new generation while a node still ran the old revision says so; kwok
    # readies pods at once, so on a loaded machine the rollout can be over before the operator's
    # first status for it (then that status must show it over, never Ready with a node behind).
    def behind(o: dict[str, Any]) -> bool:
        counts = (o.get("status") or {}).get("nodes") or {}
        return int(counts.get("updated", 0)) < int(counts.get("desired", 0))

    for_gen = [o for o in seen if (o.get("status") or {}).get("observedGeneration") == gen]
    assert for_gen, [json.dumps(o.get("status")) for o in seen]
    rolling = [o for o in for_gen if behind(o)]
    assert all(condition(o, "Progressing").get("status") == "True" for o in rolling), rolling
    assert all(condition(o, "Ready").get("status") != "True" for o in rolling), rolling
    if not rolling:
        assert not behind(for_gen[0]), for_gen[0]
    assert all(
        condition(o, "Ready").get("status") != "True"
        for o in seen
        if condition(o, "Progressing").get("status") == "True"
        and condition(o, "Progressing").get("observedGeneration") == gen
    )

    cluster.kubectl("delete", "kvp", "pool-a", "-n", namespace, "--wait=true", "--timeout=60s")

    def all_gone() -> bool:
        for kind in ("configmap", "daemonset", "service"):
            items = cluster.get_json(kind, "-n", namespace, "-l", f"{names.OWNER_POOL_LABEL}=pool-a")["items"]
            if items:
                return False
        return True

    wait_for(all_gone, timeout=90, message="children garbage-collected")


def test_children_deleted_or_edited_come_back(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    shared = sample()
    shared["spec"]["tiers"]["shared"] = {"claimTemplate": {"size": "10Gi"}, "capacity": "5Gi"}
    cluster.apply(shared, namespace=namespace)
    wait_for(lambda: children_exist(cluster, namespace, "pool-a"), timeout=30, message="children")
    pvc = wait_for(
        lambda: cluster.kubectl("get", "pvc", "pool-a-shared", "-n", namespace, check=False).returncode == 0,
        timeout=30,
        message="owned PVC",
    )
    assert pvc
    original_cm = cluster.get_json("configmap", "pool-a-config", "-n", namespace)["data"]
    original_svc_ports = cluster.get_json("service", "pool-a", "-n", namespace)["spec"]["ports"]

    cluster.kubectl("delete", "configmap", "pool-a-config", "-n", namespace)
    cluster.kubectl("delete", "service", "pool-a-metrics", "-n", namespace)
    cluster.kubectl(
        "patch",
        "configmap",
        "pool-a-config",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps({"data": {"config.yaml": "tampered: true\n"}}),
        check=False,
    )
    cluster.kubectl(
        "patch",
        "service",
        "pool-a",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"internalTrafficPolicy": "Cluster"}}),
    )
    cluster.kubectl(
        "patch",
        "daemonset",
        "pool-a-cache",
        "-n",
        namespace,
        "--type=json",
        "-p",
        json.dumps([{"op": "replace", "path": "/spec/template/spec/containers/0/image", "value": "evil:1"}]),
    )

    def restored() -> bool:
        if not children_exist(cluster, namespace, "pool-a"):
            return False
        cm = cluster.get_json("configmap", "pool-a-config", "-n", namespace)["data"]
        svc = cluster.get_json("service", "pool-a", "-n", namespace)["spec"]
        ds = cluster.get_json("daemonset", "pool-a-cache", "-n", namespace)
        image = ds["spec"]["template"]["spec"]["containers"][0]["image"]
        return bool(
            cm == original_cm
            and svc["internalTrafficPolicy"] == "Local"
            and svc["ports"] == original_svc_ports
            and image == "ghcr.io/kvfabric/kvfabric:v0.2.0"
        )

    wait_for(restored, timeout=30, message="children restored to the rendered state")
    # The PVC has no volume to bind to in this cluster: StorageReady says so, Ready stays False.
    pool = wait_for(
        lambda: (
            (p := get_pool(cluster, namespace, "pool-a")) and condition(p, "StorageReady").get("status") and p
        ),
        timeout=30,
        message="StorageReady reported",
    )
    assert condition(pool, "StorageReady")["reason"] in ("ClaimPending", "ClaimBound")
    if condition(pool, "StorageReady")["status"] == "False":
        assert condition(pool, "Ready")["status"] == "False"


def test_restart_mid_reconcile_converges_and_kubectl_diff_is_empty(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    pools = [sample(f"pool-{i}") for i in range(5)]
    cluster.apply(*pools, namespace=namespace)
    # Crash the operator while it is working on them (some children exist, not all pools are Ready);
    # nothing it wrote may matter for correctness.
    wait_for(
        lambda: cluster.get_json("configmaps", "-n", namespace, "-l", names.OWNER_POOL_LABEL)["items"],
        timeout=30,
        message="reconciling started",
    )
    operator.stop(kill=True)
    try:
        for i in range(5, 8):
            cluster.apply(sample(f"pool-{i}"), namespace=namespace)  # created while it is down
    finally:
        operator.start()
    wait_for(
        lambda: all(is_ready(cluster, namespace, f"pool-{i}") for i in range(8)),
        timeout=120,
        message="all Ready",
    )
    for i in range(8):
        pool = get_pool(cluster, namespace, f"pool-{i}")
        # kopf stored nothing in the pool: no kopf annotations, no finalizers.
        meta = pool["metadata"]
        assert not [k for k in meta.get("annotations", {}) if "kopf" in k], meta.get("annotations")
        assert not meta.get("finalizers")
        for obj in render_children(KVCachePool.model_validate(pool)).objects:
            live = cluster.get_json(obj["kind"].lower(), obj["metadata"]["name"], "-n", namespace)
            if obj["kind"] == "ConfigMap":
                assert live["data"] == obj["data"]
            if obj["kind"] == "DaemonSet":
                live_annotations = live["spec"]["template"]["metadata"]["annotations"]
                assert live_annotations == obj["spec"]["template"]["metadata"]["annotations"]

    # The user's own manifest and the operator never fight: kubectl diff of the applied sample is empty,
    # and applying it (and the CRD) again server-side changes nothing.
    doc = sample("pool-0")
    text = yaml.safe_dump(doc)
    diff = cluster.kubectl(
        "diff",
        "--server-side",
        "--field-manager=kvfabric-tests",
        "-n",
        namespace,
        "-f",
        "-",
        input=text,
        check=False,
    )
    assert diff.returncode == 0, diff.stdout + diff.stderr
    rv = get_pool(cluster, namespace, "pool-0")["metadata"]["resourceVersion"]
    crd_rv = cluster.get_json("crd", "kvcachepools.kvfabric.io")["metadata"]["resourceVersion"]
    for _ in range(2):
        cluster.apply(copy.deepcopy(doc), namespace=namespace)
        cluster.kubectl(
            "apply",
            "--server-side",
            "--field-manager=kvfabric-tests",
            "-f",
            str(ROOT / "crds" / "kvfabric.io_kvcachepools.yaml"),
        )
    assert get_pool(cluster, namespace, "pool-0")["metadata"]["resourceVersion"] == rv
    assert cluster.get_json("crd", "kvcachepools.kvfabric.io")["metadata"]["resourceVersion"] == crd_rv


def test_opt_out_node_label_removes_a_node(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    # Uses a pool-specific opt-out key so that labelling a shared node cannot affect other tests' pools.
    key = f"kvfabric.io/deploy-{namespace}"
    doc = sample()
    doc["spec"]["placement"] = {"optOutNodeLabel": key}
    cluster.apply(doc, namespace=namespace)
    n = len(cluster.gpu_nodes)
    wait_for(lambda: is_ready(cluster, namespace, "pool-a"), timeout=90, message="pool Ready")
    node = cluster.gpu_nodes[0]
    cluster.kubectl("label", "node", node, f"{key}=false")
    try:

        def shrunk() -> bool:
            pool = get_pool(cluster, namespace, "pool-a")
            placed = {p["spec"].get("nodeName") for p in cache_pods(cluster, namespace, "pool-a")}
            return bool(
                pool["status"]["nodes"]["desired"] == n - 1
                and node not in placed
                and is_ready(cluster, namespace, "pool-a")
            )

        wait_for(shrunk, timeout=90, message="opted-out node dropped")
        assert get_pool(cluster, namespace, "pool-a")["status"]["nodeSummary"] == f"{n - 1}/{n - 1}"
    finally:
        cluster.kubectl("label", "node", node, f"{key}-", check=False)


def test_disabling_metrics_prunes_the_metrics_service(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    cluster.apply(sample(), namespace=namespace)
    wait_for(lambda: children_exist(cluster, namespace, "pool-a"), timeout=30, message="children")
    cluster.kubectl(
        "patch",
        "kvp",
        "pool-a",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec":{"metrics":{"enabled":false}}}',
    )
    wait_for(
        lambda: (
            cluster.kubectl("get", "service", "pool-a-metrics", "-n", namespace, check=False).returncode != 0
        ),
        timeout=30,
        message="metrics Service pruned",
    )
    # The rest stays.
    assert cluster.kubectl("get", "service", "pool-a", "-n", namespace, check=False).returncode == 0
    pool = get_pool(cluster, namespace, "pool-a")
    wait_for(
        lambda: get_pool(cluster, namespace, "pool-a")["status"]["connection"]["metricsService"] == "",
        timeout=30,
        message="status without metrics Service",
    )
    assert pool["metadata"]["generation"] == 2


def test_routing_events_render_the_router_configmap_and_turning_them_off_prunes_it(
    cluster: ClusterHandle, namespace: str, operator: OperatorProcess
) -> None:
    """What an operator pipes into llm-d's EPP: ``kubectl get cm <pool>-router`` on the real API server."""
    doc = sample()
    doc["spec"].setdefault("consumers", {})["routingEvents"] = {
        "port": 6556,
        "replayPort": 6557,
        "modelName": "llama-8b",
    }
    cluster.apply(doc, namespace=namespace)
    router = names.router_configmap_name("pool-a")

    def epp_config() -> dict[str, Any] | None:
        got = cluster.kubectl(
            "get",
            "configmap",
            router,
            "-n",
            namespace,
            "-o",
            "jsonpath={.data.epp-config\\.yaml}",
            check=False,
        )
        return yaml.safe_load(got.stdout) if got.returncode == 0 and got.stdout.strip() else None

    config = wait_for(epp_config, timeout=30, message="the router ConfigMap")
    assert config is not None
    by_type = {p["type"]: p for p in config["plugins"]}
    assert by_type["token-producer"]["parameters"]["modelName"] == "llama-8b"
    discovery = by_type["precise-prefix-cache-producer"]["parameters"]["kvEventsConfig"]["podDiscoveryConfig"]
    assert (discovery["socketPort"], discovery["replaySocketPort"]) == (6556, 6557)
    owner = cluster.get_json("configmap", router, "-n", namespace)["metadata"]["ownerReferences"]
    assert [(o["kind"], o["name"]) for o in owner] == [("KVCachePool", "pool-a")]
    # Turned off: the router ConfigMap goes, the server's configuration stays.
    cluster.kubectl(
        "patch", "kvp", "pool-a", "-n", namespace, "--type=json",
        "-p", '[{"op":"remove","path":"/spec/consumers/routingEvents"}]',
    )  # fmt: skip
    wait_for(lambda: epp_config() is None, timeout=30, message="the router ConfigMap pruned")
    got = cluster.kubectl("get", "configmap", names.configmap_name("pool-a"), "-n", namespace, check=False)
    assert got.returncode == 0
