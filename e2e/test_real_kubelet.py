"""kvfabric on real kubelets (level ``kubelet``): the built images, run by the runtime, as deployed.

A local control plane with two real GPU nodes (``kvfabric cluster up --kubelets 2``: kubelet v1.36.3
and containerd, each node in its own network and mount namespace) and no fake node. The operator is
installed as ``manifests/default`` deploys it (``e2e/kubelet``, which says what the local cluster
changes: the node's network, no pull, the GPU toleration): a Deployment whose pod a real kubelet
runs from ``ghcr.io/kvfabric/operator:v0.2.0``, with its own ServiceAccount token and RBAC, its
webhook reached through its Service. The cache-server pods run ``ghcr.io/kvfabric/kvfabric:v0.2.0``
exactly as ``images/cacheserver/Dockerfile`` built it (``imagePullPolicy: Never``: the images were
loaded from the harness's engine, never pulled).

What the kubelet and the runtime enforce is read from the kernel (``/proc/<pid>/status`` and
``mounts`` of the container's process, found through the node's cgroup subtree), not from the pod
spec: an operator that stopped asking for it, or a runtime that ignored it, fails these tests.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfabric.containers.smoke import process_facts
from kvfabric.contract.consumer_env import KEY_FILE_PATH
from kvfabric.contract.consumer_keys import consumer_root, scope_key
from kvfabric.demo.fabric import repo_root, wait_pool_ready
from kvfabric.localcluster.cluster import LocalCluster
from kvfabric.localcluster.realnodes import CGROUP_PARENT, CGROUP_ROOT, RealNode, node_ready
from kvfabric.localcluster.testing import ClusterHandle, wait_for
from kvfabric.operator.render import names

# Real containers on two shared cores: generous per-test limits (each wait has its own deadline).
pytestmark = [pytest.mark.kubelet, pytest.mark.timeout(600)]

IMAGE = {"repository": "ghcr.io/kvfabric/kvfabric", "tag": "v0.2.0", "pullPolicy": "Never"}
NODES = 2
UID = 65532
CAP_NET_RAW = 1 << 13
OPERATOR_NS = "kvfabric-system"
OPERATOR_SELECTOR = "app.kubernetes.io/name=kvfabric-operator"
WEBHOOK_CONFIG = "kvfabric-pod-injector"
SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
SA_MOUNTS = {SA_MOUNT, SA_MOUNT.removeprefix("/var")}  # /var/run is a symlink to /run in Debian


@dataclass
class RealCluster:
    """The cluster handle and its real nodes."""

    handle: ClusterHandle
    nodes: list[RealNode]


def _install_operator(handle: ClusterHandle, api_port: int) -> None:
    """``e2e/kubelet`` (the default install, adapted to the local cluster), applied as rendered.

    The one value kustomize cannot know is the cluster's API port, which the node relay serves at
    127.0.0.1 in the node's namespace; it becomes ``KUBERNETES_SERVICE_PORT``, as a kubelet would set
    it from the ``kubernetes`` Service.
    """
    rendered = handle.kubectl("kustomize", str(repo_root() / "e2e" / "kubelet")).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    for doc in docs:
        if doc["kind"] in ("Deployment", "DaemonSet"):  # the operator and the CSI node plugin
            env = doc["spec"]["template"]["spec"]["containers"][0]["env"]
            env.append({"name": "KUBERNETES_SERVICE_PORT", "value": str(api_port)})
    crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    handle.apply(*crds)
    handle.wait_crd_established("kvcachepools.kvfabric.io")
    handle.apply(*(d for d in docs if d["kind"] != "CustomResourceDefinition"))


def _operator_diagnostics(handle: ClusterHandle, nodes: list[RealNode]) -> str:
    """The operator's pods, the namespace's events and the container logs the nodes kept."""
    pods = handle.kubectl("get", "pods", "-n", OPERATOR_NS, "-o", "wide", check=False).stdout
    events = handle.kubectl("get", "events", "-n", OPERATOR_NS, check=False).stdout
    logs = []
    for node in nodes:
        for log in sorted((node.dir / "pod-logs").glob(f"{OPERATOR_NS}_*/*/*.log")):
            logs.append(f"--- {log}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:]))
    return "\n".join([pods, events[-3000:], *logs])


def _operator_up(handle: ClusterHandle, nodes: list[RealNode]) -> dict[str, Any]:
    """Until the kubelet reports the operator Ready, its webhook is registered and has an endpoint."""

    def ready_pod() -> dict[str, Any] | None:
        pods = handle.get_json("pods", "-n", OPERATOR_NS, "-l", OPERATOR_SELECTOR)["items"]
        return next((p for p in pods if _pod_ready(p)), None)

    try:
        pod: dict[str, Any] = wait_for(
            ready_pod, timeout=240, interval=1.0, message="the operator's pod to be Ready"
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_operator_diagnostics(handle, nodes)}") from None

    def registered() -> bool:
        out = handle.kubectl("get", "mutatingwebhookconfiguration", WEBHOOK_CONFIG, check=False)
        slices = handle.get_json(
            "endpointslices", "-n", OPERATOR_NS, "-l", "kubernetes.io/service-name=kvfabric-webhook"
        )["items"]
        ready = [
            e
            for s in slices
            for e in s.get("endpoints") or []
            if (e.get("conditions") or {}).get("ready") and pod["status"]["podIP"] in e["addresses"]
        ]
        return out.returncode == 0 and bool(ready)

    try:
        wait_for(registered, timeout=120, interval=1.0, message="the webhook's registration and endpoint")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_operator_diagnostics(handle, nodes)}") from None
    return pod


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    if os.environ.get("KVFABRIC_SKIP_IMAGES") == "1":
        pytest.skip("KVFABRIC_SKIP_IMAGES=1: no container engine, so no real node")
    base = tmp_path_factory.mktemp("kubelet")
    cluster = LocalCluster(base / "cluster")
    state = cluster.up(gpu_nodes=0, cpu_nodes=0, kubelets=NODES, progress=lambda _m: None)
    handle = ClusterHandle(
        kubeconfig=cluster.kubeconfig,
        kubectl_bin=Path(state.bin_dir) / "kubectl",
        api_url=f"https://127.0.0.1:{state.ports.apiserver}",
        gpu_nodes=list(state.real_nodes),
        local_dir=cluster.dir,
    )
    try:
        _install_operator(handle, state.ports.apiserver)
        _operator_up(handle, cluster.real_nodes())
        yield RealCluster(handle, cluster.real_nodes())
    finally:
        cluster.down(progress=lambda _m: None)


def _pool(name: str, tag: str = "v0.2.0") -> dict[str, Any]:
    return {
        "apiVersion": "kvfabric.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name},
        "spec": {"image": {**IMAGE, "tag": tag}, "tiers": {"memory": {"size": "64Mi"}}},
    }


def _selector(pool: str) -> str:
    return f"app.kubernetes.io/name=kvfabric-cache,app.kubernetes.io/instance={pool}"


def _pods(real: RealCluster, ns: str, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = real.handle.get_json("pods", "-n", ns, "-l", selector)["items"]
    return items


def _pod_ready(pod: dict[str, Any]) -> bool:
    conds = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def _node(real: RealCluster, name: str) -> RealNode:
    return next(n for n in real.nodes if n.name == name)


def _container_pid(node: RealNode, container_id: str) -> int:
    """The main process of a container, from the node's cgroup subtree (cgroupfs layout)."""
    cid = container_id.split("://", 1)[-1]
    for d in (CGROUP_ROOT / "pids" / CGROUP_PARENT / node.name).rglob(cid):
        procs = [int(p) for p in (d / "cgroup.procs").read_text().split()]
        if procs:
            return min(procs)
    raise AssertionError(f"no cgroup for container {cid} on {node.name}")


def _pod_log(node: RealNode, pod: dict[str, Any], container: str) -> str:
    meta = pod["metadata"]
    d = node.dir / "pod-logs" / f"{meta['namespace']}_{meta['name']}_{meta['uid']}" / container
    return "".join(p.read_text() for p in sorted(d.glob("*.log"))) if d.is_dir() else ""


@pytest.fixture
def ready_pool(real: RealCluster) -> Iterator[tuple[str, str]]:
    with real.handle.namespace("kl") as ns:
        real.handle.apply(_pool("pool-k"), namespace=ns)
        wait_pool_ready(real.handle, ns, "pool-k", timeout=240)
        yield ns, "pool-k"


def test_real_nodes_look_like_the_fake_gpu_nodes(real: RealCluster) -> None:
    for node in real.nodes:
        obj = real.handle.get_json("node", node.name)
        assert node_ready(obj)
        assert obj["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
        assert obj["status"]["capacity"]["nvidia.com/gpu"] == "8"
        assert {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"} in obj["spec"]["taints"]
        assert obj["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
        assert "kwok.x-k8s.io/node" not in obj["metadata"].get("annotations", {})


def _mount_points(pid: int) -> set[str]:
    return {line.split()[1] for line in Path(f"/proc/{pid}/mounts").read_text().splitlines()}


def test_the_operator_runs_from_its_image_as_the_manifests_deploy_it(real: RealCluster) -> None:
    pods = real.handle.get_json("pods", "-n", OPERATOR_NS, "-l", OPERATOR_SELECTOR)["items"]
    (pod,) = pods
    assert _pod_ready(pod), "Ready by the kubelet's readiness probe of /healthz"
    (status,) = pod["status"]["containerStatuses"]
    assert status["image"].endswith("ghcr.io/kvfabric/operator:v0.2.0")
    node = _node(real, pod["spec"]["nodeName"])
    pid = _container_pid(node, status["containerID"])
    facts = process_facts(pid)
    assert facts["uids"] == [UID] * 4, "runAsUser 65532, enforced by the runtime"
    assert facts["cap_eff"] == 0, "capabilities: drop ALL"
    assert facts["no_new_privs"] is True, "allowPrivilegeEscalation: false"
    assert facts["root_read_only"] is True, "readOnlyRootFilesystem"
    # Its credentials are its ServiceAccount's projected token (added by the API server's
    # ServiceAccount admission, rotated by the kubelet): no kubeconfig exists in the image.
    assert SA_MOUNTS & _mount_points(pid), sorted(_mount_points(pid))
    assert pod["spec"]["serviceAccountName"] == "kvfabric-operator"
    # It holds the leader-election Lease through its namespaced Role...
    lease = real.handle.get_json("lease", "kvfabric-operator", "-n", OPERATOR_NS)
    assert lease["spec"]["holderIdentity"].startswith(pod["metadata"]["name"])
    # ...and registered its webhook behind its Service, which the API server reaches at the pod.
    webhook = real.handle.get_json("mutatingwebhookconfiguration", WEBHOOK_CONFIG)
    (hook,) = webhook["webhooks"]
    assert hook["clientConfig"]["service"] == {
        "namespace": OPERATOR_NS,
        "name": "kvfabric-webhook",
        "path": "/mutate-pods",
        "port": 443,
    }
    assert "url" not in hook["clientConfig"]
    assert hook["clientConfig"]["caBundle"]


def test_cache_server_runs_on_every_real_node_as_the_runtime_enforces(
    real: RealCluster, ready_pool: tuple[str, str]
) -> None:
    ns, pool = ready_pool
    pods = _pods(real, ns, _selector(pool))
    assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(n.name for n in real.nodes)
    for pod in pods:
        assert _pod_ready(pod), "the pool is Ready, so the kubelet must report every pod Ready"
        (status,) = pod["status"]["containerStatuses"]
        assert status["image"].endswith("ghcr.io/kvfabric/kvfabric:v0.2.0")
        node = _node(real, pod["spec"]["nodeName"])
        facts = process_facts(_container_pid(node, status["containerID"]))
        assert facts["uids"] == [UID] * 4, "runAsUser 65532, enforced by the runtime"
        assert facts["gids"] == [UID] * 4
        assert facts["cap_eff"] == 0, "capabilities: drop ALL"
        assert facts["cap_bnd"] & CAP_NET_RAW == 0, "not even in the bounding set"
        assert facts["no_new_privs"] is True, "allowPrivilegeEscalation: false"
        assert facts["root_read_only"] is True, "readOnlyRootFilesystem"
        # The ServiceAccount admission plugin runs here, so this is the rendered
        # automountServiceAccountToken: false at work, not a token nobody added.
        assert not SA_MOUNTS & _mount_points(_container_pid(node, status["containerID"]))
        # The hostPath run directory is the node's own (its mount namespace), not the machine's.
        socket = node.host_dir(names.HOST_RUN_ROOT) / names.pool_dir_name(ns, pool) / names.SOCKET_NAME
        assert socket.is_socket(), f"no socket at {socket}"
        assert socket.stat().st_uid == UID


CLIENT = """
import hashlib, json, os, secrets
from kvfabric.client.sync import CacheClient
client = CacheClient("unix://" + os.environ["KVFABRIC_SOCKET"], shared_memory=True)
payload = secrets.token_bytes(65536)
ns, key = hashlib.sha256(b"kubelet-e2e").hexdigest(), hashlib.sha256(payload).hexdigest()
stored = client.store(ns, [key], [payload], timeout=30)
loaded = client.load(ns, [key], timeout=30)
try:
    os.unlink(os.environ["KVFABRIC_SOCKET"])
    unlink = 0
except OSError as exc:
    unlink = exc.errno
print(json.dumps({"accepted": stored.accepted, "same": loaded == [payload], "uid": os.getuid(),
                  "shm": client.uses_shm, "key": key, "unlink_errno": unlink}))
"""


def test_injected_client_pod_stores_and_loads_through_the_node_socket(
    real: RealCluster, ready_pool: tuple[str, str]
) -> None:
    ns, pool = ready_pool
    node = real.nodes[0]
    pod = _client_pod("client", node, {"kvfabric.io/pool": pool})
    real.handle.apply(pod, namespace=ns)
    created = real.handle.get_json("pod", "client", "-n", ns)
    assert names.INJECTED_ANNOTATION in created["metadata"]["annotations"], "the webhook injected it"
    env = {e["name"] for e in created["spec"]["containers"][0]["env"]}
    assert "KVFABRIC_SOCKET" in env
    assert "KVFABRIC_SHM_DIR" not in env, "no shared directory: payloads come as sealed memfds"
    mount = next(m for m in created["spec"]["containers"][0]["volumeMounts"] if m["name"] == names.RUN_VOLUME)
    assert mount.get("readOnly") is True, "consumers cannot unlink or replace the sockets"
    # The default install has the CSI node plugin: the socket directory is a CSI inline volume.
    run_volume = next(v for v in created["spec"]["volumes"] if v["name"] == names.RUN_VOLUME)
    assert run_volume["csi"]["driver"] == "csi.kvfabric.io", run_volume
    assert not any("hostPath" in v for v in created["spec"]["volumes"])

    def finished() -> dict[str, Any] | None:
        p = real.handle.get_json("pod", "client", "-n", ns)
        return p if p["status"].get("phase") in ("Succeeded", "Failed") else None

    done = wait_for(finished, timeout=180, interval=1.0, message="the client pod to finish")
    log = _pod_log(node, done, "client")
    assert done["status"]["phase"] == "Succeeded", log
    result = json.loads(log.strip().splitlines()[-1].split(" ", 3)[-1])  # CRI log: time stream tag line
    assert result["accepted"] == 1
    assert result["same"] is True
    assert result["uid"] == UID
    assert result["shm"] is True, "same node: payload through the server's sealed memfds"
    assert result["unlink_errno"] == 30, "EROFS: the plugin published the directory read-only"
    # The chunk is in that node's server, which the host can ask through the same socket.
    from kvfabric.client.sync import CacheClient

    run = node.host_dir(names.HOST_RUN_ROOT) / names.pool_dir_name(ns, pool)
    with CacheClient(f"unix://{run / names.SOCKET_NAME}") as host_client:
        lookup = host_client.lookup(hashlib.sha256(b"kubelet-e2e").hexdigest(), [result["key"]], timeout=10)
    assert lookup.matched == 1


def _ready_condition(real: RealCluster, ns: str, pool: str) -> dict[str, Any] | None:
    obj = real.handle.get_json("kvcachepool", pool, "-n", ns)
    if obj.get("status", {}).get("observedGeneration") != obj["metadata"]["generation"]:
        return None
    conds = {c["type"]: c for c in obj["status"].get("conditions", [])}
    return conds.get("Ready")


def test_pool_is_ready_only_when_the_kubelet_says_so(real: RealCluster) -> None:
    with real.handle.namespace("kr") as ns:
        # An image no node has, and pulls are forbidden: the kubelet refuses to start it.
        real.handle.apply(_pool("pool-r", tag="v0.0.0-absent"), namespace=ns)

        def refused() -> bool:
            pods = _pods(real, ns, _selector("pool-r"))

            def reasons(p: dict[str, Any]) -> set[str | None]:
                st = p.get("status", {})
                statuses = st.get("initContainerStatuses", []) + st.get("containerStatuses", [])
                return {s.get("state", {}).get("waiting", {}).get("reason") for s in statuses}

            return len(pods) == NODES and all("ErrImageNeverPull" in reasons(p) for p in pods)

        wait_for(refused, timeout=180, interval=1.0, message="the kubelets to refuse the absent image")
        cond = wait_for(
            lambda: _ready_condition(real, ns, "pool-r"), timeout=60, message="the operator to judge the pool"
        )
        assert cond["status"] == "False", cond
        assert _ready_condition(real, ns, "pool-r") == cond, "still not Ready while the kubelets refuse"

        # The image the nodes have: the kubelets start it, and only then is the pool Ready.
        real.handle.kubectl(
            "patch",
            "kvcachepool",
            "pool-r",
            "-n",
            ns,
            "--type=merge",
            "-p",
            '{"spec":{"image":{"tag":"v0.2.0"}}}',
        )
        wait_pool_ready(real.handle, ns, "pool-r", timeout=240)
        pods = _pods(real, ns, _selector("pool-r"))
        assert len(pods) == NODES
        assert all(_pod_ready(p) for p in pods)


def test_deleting_the_pool_stops_its_servers_and_wipes_its_blocks_from_the_node_disks(
    real: RealCluster,
) -> None:
    """Blocks on a pool's local disk are prompts at rest: when the pool is deleted, the operator waits
    for its servers to stop (they write DRAM back as they go) and then empties the pool's directory
    on every node, with a pod of its own image as the server's uid; other pools' blocks stay."""
    disk = "/var/lib/kvfabric/disk"
    with real.handle.namespace("kd") as ns:
        pool = _pool("pool-d")
        pool["spec"]["tiers"]["localDisk"] = {"hostPath": {"path": disk}, "capacity": "64Mi"}
        real.handle.apply(pool, namespace=ns)
        wait_pool_ready(real.handle, ns, "pool-d", timeout=240)
        runs = [n.host_dir(names.HOST_RUN_ROOT) / names.pool_dir_name(ns, "pool-d") for n in real.nodes]
        assert all((r / names.SOCKET_NAME).is_socket() for r in runs)
        from kvfabric.client.sync import CacheClient

        # A chunk in each node's server (written back to its disk as it stops), and blocks already on
        # the disks (as the server's uid); a sibling pool's directory that must survive.
        blocks = [
            n.host_dir("/var/lib/kvfabric") / "disk" / names.pool_dir_name(ns, "pool-d") for n in real.nodes
        ]
        others = [
            n.host_dir("/var/lib/kvfabric") / "disk" / names.pool_dir_name(ns, "other") for n in real.nodes
        ]
        payload = os.urandom(65536)
        chunk_ns, key = hashlib.sha256(b"wipe").hexdigest(), hashlib.sha256(payload).hexdigest()
        for run, block_dir, other in zip(runs, blocks, others, strict=True):
            with CacheClient(f"unix://{run / names.SOCKET_NAME}") as c:
                assert c.store(chunk_ns, [key], [payload], timeout=30).accepted == 1
            for d in (block_dir / "old", other):
                d.mkdir(parents=True, exist_ok=True)
                (d / "block").write_bytes(payload)
                for path in (d, d / "block"):
                    os.chown(path, UID, UID)
        # Foreground, as GitOps tools prune: the pods (and the informer's cache of them) are gone
        # before the pool's DELETED event, so the operator must have remembered the nodes.
        real.handle.kubectl(
            "delete",
            "kvcachepool",
            "pool-d",
            "-n",
            ns,
            "--cascade=foreground",
            "--wait=true",
            "--timeout=180s",
        )
        assert not _pods(real, ns, _selector("pool-d"))

        def wiped() -> bool:
            return all(d.is_dir() and not any(d.iterdir()) for d in blocks)

        wait_for(wiped, timeout=180, interval=1.0, message="the deleted pool's local-disk blocks to be wiped")
        assert all((o / "block").read_bytes() == payload for o in others), "another pool's blocks stay"

        def no_wipe_pods() -> bool:
            pods = real.handle.get_json(
                "pods", "-n", OPERATOR_NS, "-l", "app.kubernetes.io/name=kvfabric-wipe"
            )
            return not pods["items"]

        wait_for(no_wipe_pods, timeout=60, interval=1.0, message="the wipe pods to be deleted")

        def cleaned() -> list[str]:
            return [str(p) for r in runs if r.exists() for p in r.iterdir()]

        # The kubelets tear the volumes down after the pods are gone; whatever stays is a leak.
        left = cleaned()
        if left:
            wait_for(
                lambda: not cleaned(),
                timeout=60,
                message=f"the node directories to empty ({shlex.join(left)})",
            )


CSI_DRIVER = "csi.kvfabric.io"
CONSUMER_LABEL = "kvfabric-e2e/consumers"


def _client_pod(
    name: str, node: RealNode, labels: dict[str, str], *, restricted: bool = False, script: str = CLIENT
) -> dict[str, Any]:
    """The client pod: uid 65532, read-only root, no capabilities (seccomp too for restricted)."""
    security: dict[str, Any] = {"runAsUser": UID, "runAsGroup": UID, "runAsNonRoot": True}
    if restricted:
        security["seccompProfile"] = {"type": "RuntimeDefault"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "nodeName": node.name,
            "restartPolicy": "Never",
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "securityContext": security,
            "containers": [
                {
                    "name": "client",
                    "image": "ghcr.io/kvfabric/kvfabric:v0.2.0",
                    "imagePullPolicy": "Never",
                    "command": ["python", "-c", script],
                    "securityContext": {
                        "readOnlyRootFilesystem": True,
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
        },
    }


def _restricted_client(
    name: str, node: RealNode, labels: dict[str, str], script: str = CLIENT
) -> dict[str, Any]:
    return _client_pod(name, node, labels, restricted=True, script=script)


@pytest.fixture(scope="module")
def selected_pool(real: RealCluster) -> Iterator[str]:
    """Pool ``pool-x`` (its namespace is returned), which selects the namespaces labelled
    ``CONSUMER_LABEL=yes``, Ready, with the CSI node plugin registered with every kubelet."""

    def registered() -> bool:  # the plugin registered itself with every kubelet
        out = real.handle.kubectl("get", "csinodes", "-o", "json", check=False)
        if out.returncode:
            return False
        on = {i["metadata"]["name"] for i in json.loads(out.stdout)["items"] if CSI_DRIVER in str(i["spec"])}
        return on >= {n.name for n in real.nodes}

    wait_for(registered, timeout=120, interval=1.0, message=f"{CSI_DRIVER} registered with every kubelet")
    with real.handle.namespace("kx") as pool_ns:
        pool = _pool("pool-x")
        pool["spec"]["consumers"] = {"namespaceSelector": {"matchLabels": {CONSUMER_LABEL: "yes"}}}
        real.handle.apply(pool, namespace=pool_ns)
        wait_pool_ready(real.handle, pool_ns, "pool-x", timeout=240)
        yield pool_ns


def _select(real: RealCluster, consumer_ns: str) -> None:
    """Make ``consumer_ns`` a restricted namespace that ``pool-x`` selects."""
    real.handle.kubectl(
        "label",
        "namespace",
        consumer_ns,
        "pod-security.kubernetes.io/enforce=restricted",
        f"{CONSUMER_LABEL}=yes",
    )


def _inject_consumer(real: RealCluster, consumer_ns: str, body: dict[str, Any]) -> dict[str, Any]:
    """Create the consumer pod ``body`` until the webhook injects it; return the created pod."""
    name = body["metadata"]["name"]

    def injected() -> dict[str, Any] | None:
        # The webhook learns namespace labels from a watch: until it has seen these, it skips the
        # pod (namespace-not-selected); delete and retry.
        real.handle.apply(body, namespace=consumer_ns)
        created = real.handle.get_json("pod", name, "-n", consumer_ns)
        if names.INJECTED_ANNOTATION in created["metadata"].get("annotations", {}):
            return created
        real.handle.kubectl("delete", "pod", name, "-n", consumer_ns, "--wait=true")
        return None

    created: dict[str, Any] = wait_for(
        injected, timeout=60, interval=2.0, message=f"the webhook to inject {consumer_ns}/{name}"
    )
    return created


def _finished(real: RealCluster, ns: str, name: str) -> dict[str, Any] | None:
    p: dict[str, Any] = real.handle.get_json("pod", name, "-n", ns)
    return p if p["status"].get("phase") in ("Succeeded", "Failed") else None


def _run_to_completion(real: RealCluster, node: RealNode, ns: str, name: str) -> dict[str, Any]:
    """Wait for the pod to finish, assert it succeeded, and return the JSON its last line printed."""
    done = wait_for(lambda: _finished(real, ns, name), timeout=180, interval=1.0, message=f"{ns}/{name}")
    log = _pod_log(node, done, "client")
    assert done["status"]["phase"] == "Succeeded", log
    result: dict[str, Any] = json.loads(log.strip().splitlines()[-1].split(" ", 3)[-1])  # CRI log line
    return result


def test_the_csi_plugin_serves_restricted_namespaces_and_only_those_the_pool_selects(
    real: RealCluster, selected_pool: str
) -> None:
    """The pool's own namespace cannot enforce baseline (its DaemonSet needs hostPaths), so engines in
    a restricted namespace are cross-namespace consumers. Through the node plugin they are admitted
    by the API server's PodSecurity, and load through the node's socket; a pod of a namespace the
    pool does not select, which writes the same CSI volume by hand, never gets it."""
    pool_ns = selected_pool
    node = real.nodes[1]
    with real.handle.namespace("kc") as consumer_ns:
        _select(real, consumer_ns)
        labels = {"kvfabric.io/pool": "pool-x"}
        annotations = {names.POOL_NAMESPACE_ANNOTATION: pool_ns}
        body = _restricted_client("client-x", node, labels)
        body["metadata"]["annotations"] = annotations
        created = _inject_consumer(real, consumer_ns, body)
        run_volume = next(v for v in created["spec"]["volumes"] if v["name"] == names.RUN_VOLUME)
        assert run_volume["csi"] == {
            "driver": CSI_DRIVER,
            "readOnly": True,
            "volumeAttributes": {"pool": "pool-x", "namespace": pool_ns},
        }

        result = _run_to_completion(real, node, consumer_ns, "client-x")
        assert (result["accepted"], result["same"], result["shm"]) == (1, True, True)
        assert result["unlink_errno"] == 30

        def failed_mount(ns: str, name: str, *words: str) -> str | None:
            events = real.handle.get_json(
                "events", "-n", ns, "--field-selector", f"involvedObject.name={name}"
            )
            messages = [e.get("message", "") for e in events["items"] if e.get("reason") == "FailedMount"]
            return next((m for m in messages if all(w in m for w in words)), None)

        # A selected namespace's pod that writes the volume by hand without readOnly: refused, so no
        # container ever gets the socket directory writable (it could replace the socket).
        writer = _restricted_client("writer", node, {})
        writer["spec"]["volumes"] = [
            {
                "name": "w",
                "csi": {"driver": CSI_DRIVER, "volumeAttributes": {"pool": "pool-x", "namespace": pool_ns}},
            }
        ]
        writer["spec"]["containers"][0]["volumeMounts"] = [{"name": "w", "mountPath": "/run/kvfabric/w"}]
        real.handle.apply(writer, namespace=consumer_ns)
        message = wait_for(
            lambda: failed_mount(consumer_ns, "writer", "readOnly: true"),
            timeout=120,
            interval=2.0,
            message="the plugin to refuse a writable volume",
        )
        assert real.handle.get_json("pod", "writer", "-n", consumer_ns)["status"].get("phase") == "Pending", (
            message
        )

        # The intruder: a namespace the pool does not select, the CSI volume written by hand (no
        # opt-in label, so the webhook does not look at it). The plugin asks the API server and refuses.
        with real.handle.namespace("ki") as intruder_ns:
            real.handle.kubectl(
                "label", "namespace", intruder_ns, "pod-security.kubernetes.io/enforce=restricted"
            )
            intruder = _restricted_client("intruder", node, {})
            intruder["spec"]["volumes"] = [
                {
                    "name": "steal",
                    "csi": {
                        "driver": CSI_DRIVER,
                        "readOnly": True,
                        "volumeAttributes": {"pool": "pool-x", "namespace": pool_ns},
                    },
                }
            ]
            intruder["spec"]["containers"][0]["volumeMounts"] = [
                {"name": "steal", "mountPath": f"/run/kvfabric/{pool_ns}.pool-x", "readOnly": True}
            ]
            intruder["spec"]["containers"][0]["env"] = [
                {"name": "KVFABRIC_SOCKET", "value": f"/run/kvfabric/{pool_ns}.pool-x/{names.SOCKET_NAME}"}
            ]
            real.handle.apply(intruder, namespace=intruder_ns)

            message = wait_for(
                lambda: failed_mount(intruder_ns, "intruder", "does not select namespace"),
                timeout=120,
                interval=2.0,
                message="the plugin to refuse the intruder",
            )
            assert "does not select namespace" in message, message
            p = real.handle.get_json("pod", "intruder", "-n", intruder_ns)
            assert p["status"].get("phase") == "Pending", "never started: no socket, no blocks"


# Run in a consumer pod of pool-x with the environment the webhook injected. Every pod seals a chunk
# with its own key, stores it, loads it and verifies it (the control); the "seal" pod then stores a
# chunk sealed with its key under a namespace and chunk key the "check" pod loads and verifies with
# its own. It prints hashes of its key and payloads, never a key.
KEYS = """
import hashlib, json, os, secrets, sys, types
try:
    import torch  # noqa: F401
except ImportError:  # the image has no torch: layout needs it for gather/scatter, not to seal
    sys.modules["torch"] = types.ModuleType("torch")
from kvfabric.client.sync import CacheClient
from kvfabric.connector import keys, layout
from kvfabric.connector.scheduler import keyed_spec
from kvfabric.connector.settings import ConnectorSettings

settings = ConnectorSettings()  # what the webhook injected, as the connector reads it
key = settings.key
spec = keys.NamespaceSpec(model_id="e2e/tiny", model_revision="r1", kv_dtype="bfloat16", num_layers=2,
                          num_kv_heads=1, head_dim=8, block_size=16, chunk_tokens=16)
digest = keyed_spec(spec, settings).digest()
ns = hashlib.sha256(b"kvfabric-e2e consumer keys").hexdigest()
forged = hashlib.sha256(b"the chunk kd seals for kc").hexdigest()
shape = {"namespace": ns, "num_tokens": 16, "num_layers": 2}

def sealed(chunk):
    payload = bytearray(layout.HEADER_SIZE) + secrets.token_bytes(4096)
    layout.seal(payload, key=chunk, mac_key=key.mac_key, **shape)
    return bytes(payload)

def verdict(payload, chunk):
    try:
        layout.verify(bytearray(payload), key=chunk, mac_key=key.mac_key, **shape)
        return "ok"
    except layout.PayloadError as exc:
        return exc.reason

client = CacheClient("unix://" + settings.socket, shared_memory=True)
out = {"key_sha256": hashlib.sha256(key.mac_key).hexdigest(), "usable": key.usable, "scope": key.scope,
       "pool_secret": settings.payload_key is not None, "key_file": settings.payload_key_file,
       "digest": digest, "chain": keys.chain_namespace(digest, key.chain_key)}
own = hashlib.sha256(("control " + key.scope).encode()).hexdigest()
control = sealed(own)
out["own_accepted"] = client.store(ns, [own], [control], timeout=30).accepted
out["own"] = [verdict(p, own) for p in client.load(ns, [own], timeout=30)]
if os.environ["E2E_ROLE"] == "seal":
    payload = sealed(forged)
    out["forged_accepted"] = client.store(ns, [forged], [payload], timeout=30).accepted
    out["forged_sha256"] = hashlib.sha256(payload).hexdigest()
else:
    loaded = client.load(ns, [forged], timeout=30)
    out["forged_sha256"] = [hashlib.sha256(p).hexdigest() for p in loaded]
    out["forged"] = [verdict(p, forged) for p in loaded]
print(json.dumps(out))
"""


def test_two_consumer_namespaces_of_one_pool_have_key_spaces_of_their_own_on_real_kubelets(
    real: RealCluster, selected_pool: str
) -> None:
    """Two selected restricted namespaces of one pool, kc and kd, each get from the CSI node plugin
    the scope key of their own namespace (derived from the pool's Secret, which neither can read):
    kc's connector refuses a chunk kd sealed and stored under the very namespace and chunk key kc
    loads (a wrong answer otherwise), and names its namespaces apart from kd's."""
    pool_ns = selected_pool
    node = real.nodes[1]  # one node: kd stores into the server kc loads from
    secret = real.handle.get_json("secret", names.credentials_secret_name("pool-x"), "-n", pool_ns)
    root = consumer_root(base64.b64decode(secret["data"][names.PAYLOAD_KEY]).decode())

    def expected_key(ns: str) -> str:
        return hashlib.sha256(scope_key(root, ns)).hexdigest()

    labels = {"kvfabric.io/pool": "pool-x"}
    with real.handle.namespace("kc") as kc, real.handle.namespace("kd") as kd:
        results: dict[str, dict[str, Any]] = {}
        for ns, role in ((kd, "seal"), (kc, "check")):  # kd first: kc loads what kd stored
            _select(real, ns)
            body = _restricted_client(f"keys-{role}", node, labels, script=KEYS)
            body["metadata"]["annotations"] = {names.POOL_NAMESPACE_ANNOTATION: pool_ns}
            body["spec"]["containers"][0]["env"] = [{"name": "E2E_ROLE", "value": role}]
            created = _inject_consumer(real, ns, body)
            key_volume = next(v for v in created["spec"]["volumes"] if v["name"] == names.KEY_VOLUME)
            assert key_volume["csi"]["volumeAttributes"] == {
                "pool": "pool-x",
                "namespace": pool_ns,
                names.KEY_CONTENT_ATTRIBUTE: names.KEY_CONTENT,
            }
            results[ns] = _run_to_completion(real, node, ns, f"keys-{role}")

        sealer, checker = results[kd], results[kc]
        for ns, result in results.items():
            # The connector's own settings, from the injected environment: the key file the plugin
            # published (no pool secret in a foreign namespace), the scope its namespace, the key
            # the scope key of that namespace.
            assert (result["usable"], result["scope"], result["pool_secret"]) == (True, ns, False), result
            assert result["key_file"] == KEY_FILE_PATH
            assert result["key_sha256"] == expected_key(ns), f"{ns} got another namespace's key"
            assert result["own_accepted"] == 1
            assert result["own"] == ["ok"], "a chunk a consumer sealed itself verifies (control)"
        assert sealer["key_sha256"] != checker["key_sha256"]
        # The same model, other namespaces: neither the digest nor the chain root is shared.
        assert sealer["digest"] != checker["digest"]
        assert sealer["chain"] != checker["chain"]
        # kd's chunk reached kc byte for byte through the node's server, and kc refused it.
        assert sealer["forged_accepted"] == 1
        assert checker["forged_sha256"] == [sealer["forged_sha256"]], "kc loaded kd's chunk"
        assert checker["forged"] == ["corrupt"], "kc verified a chunk sealed with kd's key"
