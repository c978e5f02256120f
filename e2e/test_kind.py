"""kvfabric on kind (level ``kind``): a kind cluster from the offline node image, as users run it.

``kvfabric kind`` builds the node image without any registry (``kvfabric.kind.nodeimage``). This
module runs ``e2e/kind/up.sh`` exactly as a user would, with ``KIND_NODE_IMAGE`` set to that image:
stock ``kind create cluster`` (one control plane, two GPU workers, one CPU worker), the images
``kind load``-ed, the operator installed from ``manifests/overlays/kind``, then the e2e tests meant
for an existing cluster. The cluster stays up for the tests below, which check it from outside:
the nodes, the operator, and a pool whose CSI-injected client pods store a chunk on one GPU worker
and load it on the other through the shared tier.

It runs when the node image for the current pins is already built (``kvfabric kind image``; the
first build takes minutes, see docs/local-cluster-and-e2e.md), or always with ``KVFABRIC_KIND=1``
(building it first); ``KVFABRIC_KIND=0`` skips it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvfabric.demo.fabric import wait_pool_ready
from kvfabric.demo.workloads import pool_manifest, ready_pods
from kvfabric.localcluster.testing import ClusterHandle, external_cluster, wait_for
from kvfabric.localcluster.versions import KUBERNETES_VERSION
from kvfabric.operator.render import names

pytestmark = [pytest.mark.kind, pytest.mark.timeout(2400)]

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = "kvfabric-e2e"
GPU_LABEL = "nvidia.com/gpu.present"
UID = 65532
# The test up.sh runs against the cluster: the fabric test that needs no engine image.
UP_SH_SELECTS = "test_a_pool_runs_one_ready_cache_server_on_each_gpu_node_and_nowhere_else"
POOL = "pool-kind"


def wanted() -> bool:
    """KVFABRIC_KIND=1: always; 0: never; unset: when the node image for the current pins is built."""
    from kvfabric.kind import nodeimage

    flag = os.environ.get("KVFABRIC_KIND")
    return flag == "1" or (flag != "0" and nodeimage.built_marker().is_file())


@dataclass
class KindRun:
    """The cluster up.sh made and what its run printed."""

    handle: ClusterHandle
    up_output: str
    up_returncode: int
    seconds: float


@pytest.fixture(scope="module")
def kind(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KindRun]:
    if not wanted():
        pytest.skip(
            "no kind node image built for the current pins: `kvfabric kind image`, or KVFABRIC_KIND=1"
        )
    from kvfabric.kind import nodeimage
    from kvfabric.kind.cli import DEFAULT_IMAGES, after_cluster, host_lib_modules, load_images, tool_dir
    from kvfabric.kind.engine import kind_engine

    def say(msg: str) -> None:
        print(f"[kind] {msg}", file=sys.stderr, flush=True)

    # The NVMe stand-ins and the shared volume: on tmpfs where there is one, since the cache servers'
    # disk tiers refuse to write to a filesystem less than 5% free (min_free_fraction), which a CI
    # disk that also holds the nodes' images can be.
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        host_dir = Path(tempfile.mkdtemp(prefix="kvfabric-kind-", dir=shm))
    else:
        host_dir = tmp_path_factory.mktemp("kind")
    kubeconfig = host_dir / "kubeconfig"
    with kind_engine() as eng, host_lib_modules(), pytest.MonkeyPatch.context() as mp:
        tag = nodeimage.ensure_image(eng, say)
        load_images(eng, DEFAULT_IMAGES, say)
        path = f"{tool_dir(nodeimage.kind_binary())}:{os.environ['PATH']}"
        mp.setenv("PATH", path)  # external_cluster's kubectl: the pinned one
        env = {
            **eng.env,
            "PATH": path,
            "KIND_CLUSTER_NAME": CLUSTER,
            "KIND_NODE_IMAGE": tag,
            "KVFABRIC_KIND_HOST_DIR": str(host_dir),
            "SKIP_BUILD": "1",
            "IMAGES": " ".join(DEFAULT_IMAGES),
        }
        env.pop("KVFABRIC_TEST_KUBECONFIG", None)
        start = time.monotonic()
        try:
            proc = subprocess.run(
                ["bash", str(ROOT / "e2e" / "kind" / "up.sh"), "-k", UP_SH_SELECTS, "-p", "no:cacheprovider"],
                env=env,
                capture_output=True,
                text=True,
                timeout=1800,
                check=False,
            )
            seconds = time.monotonic() - start
            say(f"up.sh exited {proc.returncode} after {seconds:.0f}s")
            handle = external_cluster(kubeconfig) if kubeconfig.is_file() else None
            if handle is None:
                pytest.fail(f"up.sh made no cluster:\n{(proc.stdout + proc.stderr)[-6000:]}")
            yield KindRun(handle, proc.stdout + proc.stderr, proc.returncode, seconds)
        finally:
            with contextlib.suppress(subprocess.SubprocessError):
                subprocess.run(
                    ["bash", str(ROOT / "e2e" / "kind" / "down.sh")], env=env, timeout=300, check=False
                )
            # down.sh deletes only a host directory up.sh created; this one the fixture made.
            shutil.rmtree(host_dir, ignore_errors=True)
            after_cluster(eng, DEFAULT_IMAGES)


def test_up_sh_ran_the_tests_for_an_existing_cluster_and_started_no_node_on_this_host(kind: KindRun) -> None:
    out = kind.up_output
    assert kind.up_returncode == 0, out[-6000:]
    # The kubelet and vLLM levels were not selected; the one test asked for ran on kind and passed.
    assert "1 passed" in out, out[-3000:]
    # Against the existing cluster, e2e/conftest.py's guard refused any kubelet, runtime,
    # control-plane or pod-runner process on this host for the whole run (and said so up front).
    assert "no node process may start on this host" in out, out[-3000:]
    assert "HostNodeError" not in out


def test_the_nodes_run_the_pinned_kubernetes_from_the_offline_image(kind: KindRun) -> None:
    nodes = kind.handle.get_json("nodes")["items"]
    assert len(nodes) == 4
    for node in nodes:
        info = node["status"]["nodeInfo"]
        assert info["kubeletVersion"] == KUBERNETES_VERSION
        assert info["osImage"].startswith("Debian GNU/Linux 12"), info
        assert info["containerRuntimeVersion"].startswith("containerd://"), info
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
        assert ready == "True", node["metadata"]["name"]
    gpu = [n for n in nodes if n["metadata"]["labels"].get(GPU_LABEL) == "true"]
    assert len(gpu) == 2
    assert all(n["status"]["allocatable"]["nvidia.com/gpu"] == "8" for n in gpu)
    # The system pods of the image: the control plane, kube-proxy and the CNI stand-in on every
    # node, CoreDNS; all from images made here, none pulled.
    system = kind.handle.get_json("pods", "-n", "kube-system")["items"]
    assert all(p["status"]["phase"] == "Running" for p in system), [
        (p["metadata"]["name"], p["status"]["phase"]) for p in system
    ]
    apps = Counter(p["metadata"].get("labels", {}).get("k8s-app") for p in system)
    assert apps["kube-proxy"] == apps["kindnet"] == 4, apps
    assert apps["kube-dns"] == 2, apps


def test_the_operator_runs_from_its_image_as_the_manifests_install_it(kind: KindRun) -> None:
    deploy = kind.handle.get_json("deployment", "kvfabric-operator", "-n", "kvfabric-system")
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "ghcr.io/kvfabric/operator:v0.2.0"
    conds = {c["type"]: c["status"] for c in deploy["status"]["conditions"]}
    assert conds["Available"] == "True"


# A store on one node, a load on the other: the same 64 KiB payload and key on both sides.
CLIENT = """
import hashlib, json, os, sys, time
from kvfabric.client.sync import CacheClient
client = CacheClient("unix://" + os.environ["KVFABRIC_SOCKET"], shared_memory=True)
payload = hashlib.sha256(b"kind-e2e").digest() * 2048
ns, key = hashlib.sha256(b"kind-e2e-ns").hexdigest(), hashlib.sha256(payload).hexdigest()
if sys.argv[1] == "store":
    stored = client.store(ns, [key], [payload], timeout=30)
    print(json.dumps({"accepted": stored.accepted}))
else:
    deadline, found = time.monotonic() + 120, None
    while time.monotonic() < deadline:
        found = client.lookup(ns, [key], timeout=10)
        if found.matched == 1:
            break
        time.sleep(1)
    loaded = client.load(ns, [key], timeout=30) if found and found.matched == 1 else []
    print(json.dumps({"matched": found.matched if found else 0, "tiers": found.tiers if found else [],
                      "same": loaded == [payload]}))
"""


def _client(name: str, node: str, pool: str, mode: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"kvfabric.io/pool": pool}},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "securityContext": {"runAsUser": UID, "runAsGroup": UID, "runAsNonRoot": True},
            "containers": [
                {
                    "name": "client",
                    "image": "ghcr.io/kvfabric/kvfabric:v0.2.0",
                    "imagePullPolicy": "Never",
                    "command": ["python", "-c", CLIENT, mode],
                    "securityContext": {
                        "readOnlyRootFilesystem": True,
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
        },
    }


def _run(handle: ClusterHandle, ns: str, pod: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    name = pod["metadata"]["name"]
    handle.apply(pod, namespace=ns)

    def finished() -> dict[str, Any] | None:
        p = handle.get_json("pod", name, "-n", ns)
        return p if p["status"].get("phase") in ("Succeeded", "Failed") else None

    done = wait_for(finished, timeout=300, interval=2.0, message=f"the client pod {name} to finish")
    log = handle.kubectl("logs", "-n", ns, name).stdout
    assert done["status"]["phase"] == "Succeeded", log
    return done, json.loads(log.strip().splitlines()[-1])


def test_a_chunk_stored_through_the_csi_socket_on_one_gpu_worker_is_a_hit_on_the_other(kind: KindRun) -> None:
    handle = kind.handle
    a, b = sorted(handle.gpu_nodes)
    with handle.namespace("kind") as ns:
        handle.apply(pool_manifest(POOL), namespace=ns)
        wait_pool_ready(handle, ns, POOL, timeout=600)
        selector = f"app.kubernetes.io/name=kvfabric-cache,app.kubernetes.io/instance={POOL}"
        servers = ready_pods(handle, ns, selector)
        assert sorted(p["spec"]["nodeName"] for p in servers) == [a, b]
        writer, stored = _run(handle, ns, _client("writer", a, POOL, "store"))
        # The webhook injected the client, and the socket directory is the CSI plugin's inline volume.
        assert names.INJECTED_ANNOTATION in writer["metadata"]["annotations"]
        run_volume = next(v for v in writer["spec"]["volumes"] if v["name"] == names.RUN_VOLUME)
        assert run_volume["csi"]["driver"] == "csi.kvfabric.io", run_volume
        assert stored == {"accepted": 1}
        # The other node's server learns of the chunk from the shared volume (both workers mount the
        # same host directory): a hit in the shared tier, with the same bytes.
        _, loaded = _run(handle, ns, _client("reader", b, POOL, "load"))
        assert loaded == {"matched": 1, "tiers": ["shared"], "same": True}, loaded
