"""Test helpers: a handle on a cluster (the local one, or any cluster named by a kubeconfig).

Used by the pytest fixtures of ``tests/`` and ``e2e/``. Setting ``KVFABRIC_TEST_KUBECONFIG`` points
the suites at an existing cluster (for example kind) instead of starting a local one.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvfabric.localcluster.nodes import GPU_LABEL


@dataclass
class ClusterHandle:
    """What a test needs to talk to a cluster."""

    kubeconfig: Path
    kubectl_bin: Path
    api_url: str
    gpu_nodes: list[str] = field(default_factory=list)
    cpu_nodes: list[str] = field(default_factory=list)
    local_dir: Path | None = None  # set for the local control plane (logs live there)

    def kubectl(
        self,
        *args: str,
        check: bool = True,
        input: str | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against the cluster; raises with stderr included when ``check`` fails."""
        proc = subprocess.run(
            [str(self.kubectl_bin), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def wait_crd_established(self, name: str, timeout: float = 60) -> None:
        """Wait until the CRD ``name`` is Established.

        Not ``kubectl wait --for=condition=Established``: right after a create, before the API server
        has written any condition, kubectl exits with "status.conditions accessor error" instead of
        waiting (seen when a large CRD with many CEL rules takes a moment to be compiled).
        """
        deadline = time.monotonic() + timeout
        jsonpath = '{.status.conditions[?(@.type=="Established")].status}'
        while True:
            proc = self.kubectl("get", f"crd/{name}", "-o", f"jsonpath={jsonpath}", check=False)
            if proc.returncode == 0 and proc.stdout.strip() == "True":
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"CRD {name} not Established after {timeout:.0f} s: {proc.stderr}")
            time.sleep(0.2)

    def get_json(self, *args: str) -> dict[str, Any]:
        """``kubectl get ARGS -o json`` parsed."""
        result: dict[str, Any] = json.loads(self.kubectl("get", *args, "-o", "json").stdout)
        return result

    def apply(self, *docs: dict[str, Any], namespace: str | None = None, server_side: bool = True) -> str:
        """Apply manifests; returns kubectl's output."""
        ns = [f"--namespace={namespace}"] if namespace else []
        ssa = ["--server-side", "--field-manager=kvfabric-tests"] if server_side else []
        return self.kubectl("apply", *ns, *ssa, "-f", "-", input=yaml.safe_dump_all(docs)).stdout

    @contextmanager
    def namespace(self, prefix: str = "t") -> Iterator[str]:
        """A fresh namespace, deleted afterwards (without waiting for it to go)."""
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.kubectl("create", "namespace", name)
        deadline = time.monotonic() + 60
        # Pods are rejected until the service-account controller created `default` there.
        while self.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode:
            if time.monotonic() > deadline:
                raise AssertionError(f"no default ServiceAccount in {name}")
            time.sleep(0.2)
        try:
            yield name
        finally:
            self.kubectl("delete", "namespace", name, "--wait=false", check=False)


def stop_process(proc: subprocess.Popen[Any], *, grace: float = 20) -> None:
    """SIGTERM ``proc``, wait up to ``grace`` seconds, then SIGKILL; always reaps it."""
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_for(
    predicate: Callable[[], Any], *, timeout: float = 60, interval: float = 0.25, message: str = "condition"
) -> Any:
    """Poll ``predicate`` until it returns something truthy; return that value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {message} (last value: {last!r})")


def external_cluster(kubeconfig: Path) -> ClusterHandle:
    """A handle on an existing cluster; GPU nodes are those labelled ``nvidia.com/gpu.present=true``."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise RuntimeError("KVFABRIC_TEST_KUBECONFIG is set but kubectl is not on PATH")
    handle = ClusterHandle(kubeconfig=kubeconfig, kubectl_bin=Path(kubectl), api_url="")
    nodes = handle.get_json("nodes")["items"]
    handle.api_url = json.loads(handle.kubectl("config", "view", "--minify", "-o", "json").stdout)[
        "clusters"
    ][0]["cluster"]["server"]
    for node in nodes:
        labels = node["metadata"].get("labels", {})
        if labels.get("node-role.kubernetes.io/control-plane") is not None:
            continue
        (handle.gpu_nodes if labels.get(GPU_LABEL) == "true" else handle.cpu_nodes).append(
            node["metadata"]["name"]
        )
    return handle


@contextmanager
def session_cluster(base: Path) -> Iterator[ClusterHandle]:
    """The cluster a test session uses: ``$KVFABRIC_TEST_KUBECONFIG``, else a fresh local one."""
    env = os.environ.get("KVFABRIC_TEST_KUBECONFIG")
    if env:
        yield external_cluster(Path(env))
        return
    from kvfabric.localcluster.cluster import LocalCluster

    cluster = LocalCluster(base / "cluster")
    state = cluster.up(progress=lambda _m: None)
    try:
        yield ClusterHandle(
            kubeconfig=cluster.kubeconfig,
            kubectl_bin=Path(state.bin_dir) / "kubectl",
            api_url=f"https://127.0.0.1:{state.ports.apiserver}",
            gpu_nodes=list(state.gpu_nodes),
            cpu_nodes=list(state.cpu_nodes),
            local_dir=cluster.dir,
        )
    finally:
        cluster.down(progress=lambda _m: None)


@contextmanager
def pod_runner(
    handle: ClusterHandle,
    base: Path,
    node_specs: list[str],
    *,
    run_as_pod_user: bool = False,
    relay_ports: tuple[int, ...] = (),
) -> Iterator[Path]:
    """Run ``python -m kvfabric.localcluster.podrunner`` for ``node_specs`` (``NAME[:GPUS]``).

    Yields the runner's base directory (per-node hostPath dirs under ``nodes/<name>/host``, the
    shared PVC dirs under ``shared/pvc``, pod logs under ``pods/``) once every node is Ready.
    """
    import sys

    base.mkdir(parents=True, exist_ok=True)
    args = [
        sys.executable,
        "-m",
        "kvfabric.localcluster.podrunner",
        "--kubeconfig",
        str(handle.kubeconfig),
        "--base",
        str(base),
    ]
    for item in node_specs:
        args += ["--node", item]
    if run_as_pod_user:
        args.append("--run-as-pod-user")
    for port in relay_ports:
        args += ["--relay-port", str(port)]
    with (base / "podrunner.log").open("ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    names = [s.partition(":")[0] for s in node_specs]
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"pod runner exited:\n{(base / 'podrunner.log').read_text()[-3000:]}")
            items = handle.get_json("nodes")["items"]
            return set(names) <= {
                n["metadata"]["name"]
                for n in items
                if any(
                    c["type"] == "Ready" and c["status"] == "True" for c in n["status"].get("conditions", [])
                )
            }

        wait_for(ready, message="pod-runner nodes Ready")
        yield base
    finally:
        stop_process(proc, grace=60)


def token_kubeconfig(
    cluster: ClusterHandle, ns: str, path: Path, account: str = "kvfabric-operator", duration: str = "1h"
) -> Path:
    """A kubeconfig that authenticates as a ServiceAccount (a token from the API server, for ``duration``)."""
    token = cluster.kubectl("create", "token", account, "-n", ns, f"--duration={duration}").stdout.strip()
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    cluster_entry = admin["clusters"][0]["cluster"]
    ca = cluster_entry.get("certificate-authority-data")
    if ca is None:
        ca = base64.b64encode(Path(cluster_entry["certificate-authority"]).read_bytes()).decode()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "c", "cluster": {"server": cluster_entry["server"], "certificate-authority-data": ca}}
        ],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "c", "user": "operator"}}],
        "current-context": "operator",
    }
    path.write_text(yaml.safe_dump(config))
    return path
