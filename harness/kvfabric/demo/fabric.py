"""The whole fabric on the local control plane, as users would run it — for the demo and e2e tests.

:func:`running_fabric` brings up a local cluster whose GPU nodes are served by the pod runner (so the
cache servers and inference pods the scheduler places there really run), installs the CRD from
``crds/`` (or the Helm chart: ``install="helm"``), creates a PersistentVolume for pools' shared tiers,
and runs the operator as a local process with its injection webhook registered on 127.0.0.1. It can
also target an existing cluster named by ``KVFABRIC_TEST_KUBECONFIG`` (kind), where the pod runner is
not needed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfabric.localcluster.cluster import LocalCluster, free_port
from kvfabric.localcluster.podrunner.runner import add_image, pod_request
from kvfabric.localcluster.testing import (
    ClusterHandle,
    external_cluster,
    pod_runner,
    stop_process,
    token_kubeconfig,
    wait_for,
)
from kvfabric.testing.opstools import Helm, ensure_helm
from kvfabric.testing.s3server import S3Server, s3_server

Progress = Callable[[str], None]

SHARED_STORAGE_CLASS = "kvfabric-shared"
SHARED_VOLUMES = 8
INSTALLS = ("kustomize", "helm")
"""How :func:`running_fabric` installs kvfabric: the CRDs from ``crds/`` (kustomize), or the Helm chart."""
HELM_NAMESPACE = "kvfabric-system"


def repo_root() -> Path:
    """The checkout holding ``crds/`` and ``manifests/`` (this file lives at operator/kvfabric/demo/)."""
    for candidate in (Path(__file__).resolve().parents[3], Path.cwd()):
        if (candidate / "crds" / "kustomization.yaml").exists():
            return candidate
    raise FileNotFoundError("cannot find the repository's crds/ directory; run from a kvfabric checkout")


@dataclass
class Fabric:
    """A running fabric: the cluster handle and where the pod runner keeps node directories."""

    cluster: ClusterHandle
    runner_base: Path | None
    gpu_nodes: list[str]
    operator_log: Path | None = None
    object_store: S3Server | None = None
    """The S3 server of the object tier (``running_fabric(object_store=True)``), reachable at
    ``object_store.endpoint`` from the operator and from every pod."""
    operator: OperatorProcess | None = None
    """The operator process (None on an existing cluster, whose operator is its own)."""

    def add_image(self, image: str, env: dict[str, str]) -> None:
        """Make containers of ``image`` run with ``env`` added (a release's ``PYTHONPATH``: its code).

        Only where the pod runner runs the pods: it has no images, every container runs this host's
        files (:func:`kvfabric.localcluster.podrunner.runner.add_image`).
        """
        if self.runner_base is None:
            raise RuntimeError("an existing cluster runs real images: the fabric cannot choose their code")
        add_image(self.runner_base, image, env)

    def request(
        self, pod: dict[str, Any], port: int, path: str, data: str | None = None, timeout: float = 120
    ) -> tuple[int, str]:
        """Send an HTTP request to a pod's port.

        Through the pod's network namespace when the pod runner runs it, else through the API
        server's pod proxy (kind or a real cluster).
        """
        if self.runner_base is not None:
            return pod_request(pod["metadata"]["uid"], port, path, data=data, timeout=timeout)
        meta = pod["metadata"]
        url = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}:{port}/proxy{path}"
        if data is None:
            out = self.cluster.kubectl("get", "--raw", url, check=False, timeout=timeout)
        else:
            out = self.cluster.kubectl(
                "create", "--raw", url, "-f", "-", input=data, check=False, timeout=timeout
            )
        return (200 if out.returncode == 0 else 500), (out.stdout if out.returncode == 0 else out.stderr)


def shared_volume(name: str, directory: Path) -> dict[str, Any]:
    """A ReadWriteMany PersistentVolume that pools' shared claims bind to."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name, "labels": {"kvfabric.io/test-volume": "shared"}},
        "spec": {
            "capacity": {"storage": "1Ti"},
            "accessModes": ["ReadWriteMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": SHARED_STORAGE_CLASS,
            "hostPath": {"path": str(directory), "type": "DirectoryOrCreate"},
        },
    }


def install(cluster: ClusterHandle, root: Path) -> None:
    """Apply the CRDs (and wait until they are served)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-k", str(root / "crds"))
    cluster.wait_crd_established("kvcachepools.kvfabric.io")


def helm_install(cluster: ClusterHandle, root: Path, workdir: Path, progress: Progress) -> OperatorProcess:
    """Install the Helm chart as the README does; the operator it returns runs as the chart's.

    ``helm install`` of ``charts/kvfabric`` into ``kvfabric-system`` (labelled as the README says): the
    CRD, the operator's ServiceAccount and RBAC, the admission policy on pools' hostPaths and the
    operator's Deployment. The Deployment has no replica here: the pod runner cannot give a pod the
    API server's in-cluster address, so the operator runs as a host process instead, authenticated
    with the chart's ServiceAccount token (the chart's RBAC is all it may do), with the Deployment's
    leader election and ``POD_NAMESPACE``. Without the CSI plugin, which the pod runner cannot run
    (injected pods get the node socket as a hostPath, as with the kustomize install's ``base``).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    progress(f"installing the Helm chart charts/kvfabric into {HELM_NAMESPACE}")
    cluster.kubectl("create", "namespace", HELM_NAMESPACE)
    cluster.kubectl(
        "label", "namespace", HELM_NAMESPACE,
        "kvfabric.io/control-plane=true", "pod-security.kubernetes.io/enforce=privileged",
    )  # fmt: skip
    helm = Helm(ensure_helm(quiet=True), workdir / "helm", cluster.kubeconfig)
    helm(
        "install", "kvfabric", str(root / "charts" / "kvfabric"), "-n", HELM_NAMESPACE,
        "--set", "operator.replicas=0", "--set", "csi.enabled=false",
    )  # fmt: skip
    cluster.wait_crd_established("kvcachepools.kvfabric.io")
    kubeconfig = token_kubeconfig(cluster, HELM_NAMESPACE, workdir / "operator.kubeconfig", duration="24h")
    return OperatorProcess(
        cluster,
        workdir / "operator",
        progress,
        kubeconfig=kubeconfig,
        env={"POD_NAMESPACE": HELM_NAMESPACE},
        extra_args=("--leader-election",),
    )


class OperatorProcess:
    """The fabric's operator: a local process with its injection webhook registered on 127.0.0.1.

    Restartable as another release (``env={"PYTHONPATH": tree.pythonpath}``, see
    :mod:`kvfabric.testing.release`) or as another identity (``kubeconfig``: a ServiceAccount's), so a
    test can upgrade it, or run it as a Helm install's operator would run.
    """

    def __init__(
        self,
        cluster: ClusterHandle,
        workdir: Path,
        progress: Progress,
        *,
        kubeconfig: Path | None = None,
        env: dict[str, str] | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        """``kubeconfig``, ``env`` and ``extra_args``: how every start runs it (default: as the admin)."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.cluster = cluster
        self.workdir = workdir
        self.log_path = workdir / "operator.log"
        self.progress = progress
        self.kubeconfig = kubeconfig or cluster.kubeconfig
        self.env = env or {}
        self.extra_args = extra_args
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, *, env: dict[str, str] | None = None, kubeconfig: Path | None = None) -> None:
        """Start the operator (``env`` added to its own) and wait until it serves."""
        assert self._proc is None, "the operator is already running"
        health = free_port()
        args = [
            sys.executable,
            "-m",
            "kvfabric.cli",
            "operator",
            "--kubeconfig",
            str(kubeconfig or self.kubeconfig),
            "-A",
            "--register-webhook",
            "--webhook-port",
            str(free_port()),
            "--webhook-cert-dir",
            str(self.workdir / "certs"),
            "--liveness",
            f"http://127.0.0.1:{health}/healthz",
            "--resync-seconds",
            "5",
            *self.extra_args,
        ]
        self.progress("starting the operator (reconciler + injection webhook on 127.0.0.1)")
        environ = {**os.environ, **self.env, **(env or {})}
        with self.log_path.open("ab") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=environ)
        self._proc = proc

        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"the operator exited:\n{self.log_path.read_text()[-3000:]}")
            import urllib.request

            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=1) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        try:
            wait_for(up, timeout=90, message="the operator's health endpoint")
            wait_for(
                lambda: (
                    self.cluster.kubectl(
                        "get", "mutatingwebhookconfiguration", "kvfabric-pod-injector", check=False
                    ).returncode
                    == 0
                ),
                message="the webhook registration",
            )
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int | None:
        """The running operator's process id (None while stopped)."""
        return self._proc.pid if self._proc is not None else None

    def stop(self) -> None:
        """Stop the operator (its webhook stays registered: it fails open until the next one serves)."""
        if self._proc is not None:
            stop_process(self._proc, grace=20)
            self._proc = None

    def restart(self, *, env: dict[str, str] | None = None, kubeconfig: Path | None = None) -> None:
        """Stop the operator and start it again, as ``start`` would."""
        self.stop()
        self.start(env=env, kubeconfig=kubeconfig)


@contextlib.contextmanager
def _operator_process(operator: OperatorProcess) -> Iterator[OperatorProcess]:
    cluster = operator.cluster
    operator.start()
    try:
        yield operator
    finally:
        operator.stop()
        # The webhook fails open, but leaving it registered would slow every later pod creation.
        cluster.kubectl(
            "delete",
            "mutatingwebhookconfiguration",
            "kvfabric-pod-injector",
            "--ignore-not-found",
            check=False,
        )


@contextlib.contextmanager
def running_fabric(
    base: Path,
    *,
    gpu_nodes: int = 2,
    progress: Progress = print,
    object_store: bool = False,
    install: str = "kustomize",
) -> Iterator[Fabric]:
    """Bring the whole fabric up under ``base`` and tear it down afterwards.

    ``object_store``: also run a real S3 server (SeaweedFS, built by the bootstrap) on the host's
    loopback, which the pod runner relays into every pod at the same address, for pools whose
    cross-node tier is an object store.

    ``install``: ``kustomize`` applies the CRDs from ``crds/`` and runs the operator as the admin;
    ``helm`` installs the Helm chart and runs the operator as the chart's (:func:`helm_install`).
    """
    if install not in INSTALLS:
        raise ValueError(f"install: {install!r} is not one of {', '.join(INSTALLS)}")
    if object_store and not os.environ.get("KVFABRIC_TEST_KUBECONFIG"):
        progress("starting the S3 server (SeaweedFS) for the object tier")
        with s3_server() as s3, _running_fabric(base, gpu_nodes, progress, s3, install) as fabric:
            yield fabric
        return
    with _running_fabric(base, gpu_nodes, progress, None, install) as fabric:
        yield fabric


@contextlib.contextmanager
def _running_fabric(
    base: Path, gpu_nodes: int, progress: Progress, s3: S3Server | None, install_with: str
) -> Iterator[Fabric]:
    root = repo_root()
    external = os.environ.get("KVFABRIC_TEST_KUBECONFIG")
    if external:
        if install_with != "kustomize":
            raise ValueError(
                f"install: {install_with} on an existing cluster: install the chart there yourself"
            )
        handle = external_cluster(Path(external))
        progress(f"using the existing cluster at {handle.api_url}")
        install(handle, root)
        yield Fabric(cluster=handle, runner_base=None, gpu_nodes=list(handle.gpu_nodes))
        return

    cluster = LocalCluster(base / "cluster")
    # kwok keeps one CPU node; the GPU nodes belong to the pod runner, which really runs their pods.
    state = cluster.up(gpu_nodes=0, cpu_nodes=1, progress=progress)
    handle = ClusterHandle(
        kubeconfig=cluster.kubeconfig,
        kubectl_bin=Path(state.bin_dir) / "kubectl",
        api_url=f"https://127.0.0.1:{state.ports.apiserver}",
        cpu_nodes=list(state.cpu_nodes),
        local_dir=cluster.dir,
    )
    names = [f"gpu-node-{chr(ord('a') + i)}" for i in range(gpu_nodes)]
    try:
        progress(f"starting the pod runner for nodes {', '.join(names)}")
        relay = (s3.ports["s3"],) if s3 is not None else ()
        # Containers run as their pods' users (runAsUser, runAsGroup, fsGroup), as a kubelet runs them.
        nodes = [f"{n}:8" for n in names]
        runner = pod_runner(handle, base / "nodes", nodes, run_as_pod_user=True, relay_ports=relay)
        with runner as runner_base:
            handle.gpu_nodes = names
            if install_with == "helm":
                operator = helm_install(handle, root, base / "helm", progress)
            else:
                progress("installing the CRDs from crds/")
                install(handle, root)
                operator = OperatorProcess(handle, base / "operator", progress)
            # A PersistentVolume binds one claim, so offer several: one per pool's shared claim.
            handle.apply(
                *(
                    shared_volume(f"kvfabric-shared-{i}", runner_base / "shared" / f"volume-{i}")
                    for i in range(SHARED_VOLUMES)
                )
            )
            with _operator_process(operator):
                yield Fabric(
                    cluster=handle,
                    runner_base=runner_base,
                    gpu_nodes=names,
                    operator_log=operator.log_path,
                    object_store=s3,
                    operator=operator,
                )
    finally:
        progress("stopping the cluster")
        cluster.down(progress=lambda _m: None)


def wait_pool_ready(
    cluster: ClusterHandle, namespace: str, pool: str, timeout: float = 180
) -> dict[str, Any]:
    """Wait until the pool's Ready condition is True for its current generation; return the pool."""

    def ready() -> dict[str, Any] | None:
        obj = cluster.get_json("kvcachepool", pool, "-n", namespace)
        conds = {c["type"]: c for c in obj.get("status", {}).get("conditions", [])}
        r = conds.get("Ready")
        if (
            r
            and r["status"] == "True"
            and obj["status"].get("observedGeneration") == obj["metadata"]["generation"]
        ):
            return obj
        return None

    result: dict[str, Any] = wait_for(ready, timeout=timeout, interval=0.5, message=f"pool {pool} Ready")
    return result
