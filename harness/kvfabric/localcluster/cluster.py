"""Start, stop and inspect a local control plane made of plain processes on loopback.

State lives in one directory (certificates, etcd data, logs, ``kubeconfig`` and ``state.json`` with
the ports and process ids), so ``up``, ``status`` and ``down`` can run in different processes.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvfabric.localcluster import binaries, components, nodes, pki, realnodes

Progress = Callable[[str], None]

CONTEXT = "kvfabric-local"
# Processes this interpreter started, so they can be reaped (no zombies, no ResourceWarning) when
# `down` runs in the same process; `down` from another process works from the pids alone.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}
_STARTUP_TIMEOUT = 90.0
_LOG_TAIL_LINES = 25


class ClusterStartError(RuntimeError):
    """A component failed to start; the message names it and shows the tail of its log."""

    def __init__(self, component: str, reason: str, log: Path) -> None:
        self.component = component
        self.log = log
        tail = _tail(log)
        super().__init__(f"{component} failed to start: {reason}\n--- last lines of {log} ---\n{tail}")


def _tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def default_dir() -> Path:
    """``$KVFABRIC_CLUSTER_DIR``, else ``$XDG_STATE_HOME/kvfabric/cluster`` (``~/.local/state/...``)."""
    env = os.environ.get("KVFABRIC_CLUSTER_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_STATE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "state") / "kvfabric" / "cluster"


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_in_use(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class ClusterState:
    """What ``up`` started, persisted as ``state.json``."""

    ports: components.Ports
    pids: dict[str, int] = field(default_factory=dict)
    bin_dir: str = ""
    gpu_nodes: list[str] = field(default_factory=list)
    cpu_nodes: list[str] = field(default_factory=list)
    real_nodes: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        """Serialize for ``state.json``."""
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ClusterState:
        """Parse ``state.json``."""
        raw = json.loads(text)
        raw["ports"] = components.Ports(**raw["ports"])
        return cls(**raw)


def kubeconfig_document(api_url: str, p: pki.Pki) -> dict[str, Any]:
    """An admin kubeconfig with the certificates embedded, so it can be copied anywhere."""
    import base64

    def b64(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": CONTEXT, "cluster": {"server": api_url, "certificate-authority-data": b64(p.ca_crt)}}
        ],
        "users": [
            {
                "name": f"{CONTEXT}-admin",
                "user": {"client-certificate-data": b64(p.admin_crt), "client-key-data": b64(p.admin_key)},
            }
        ],
        "contexts": [{"name": CONTEXT, "context": {"cluster": CONTEXT, "user": f"{CONTEXT}-admin"}}],
        "current-context": CONTEXT,
    }


class LocalCluster:
    """A control plane whose state lives in ``directory``."""

    def __init__(self, directory: Path | None = None) -> None:
        self.dir = (directory or default_dir()).absolute()

    # --- paths -------------------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig of this cluster."""
        return self.dir / "kubeconfig"

    @property
    def state_file(self) -> Path:
        """Ports and process ids of the running cluster."""
        return self.dir / "state.json"

    @property
    def log_dir(self) -> Path:
        """One ``<component>.log`` per process."""
        return self.dir / "logs"

    def state(self) -> ClusterState | None:
        """The persisted state, or ``None`` when the cluster was never started or is down."""
        try:
            return ClusterState.from_json(self.state_file.read_text())
        except FileNotFoundError:
            return None

    def kubectl_path(self) -> Path:
        """The pinned kubectl this cluster was started with."""
        state = self.state()
        bin_dir = Path(state.bin_dir) if state else binaries.ensure(quiet=True)
        return bin_dir / "kubectl"

    def kubectl(
        self,
        *args: str,
        check: bool = True,
        input: str | None = None,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        """Run the pinned kubectl against this cluster."""
        return subprocess.run(
            [str(self.kubectl_path()), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
        )

    # --- lifecycle ---------------------------------------------------------------------------
    def up(
        self, *, gpu_nodes: int = 3, cpu_nodes: int = 1, kubelets: int = 0, progress: Progress = print
    ) -> ClusterState:
        """Start every component, wait until each is healthy and the fake nodes are Ready.

        ``kubelets`` adds that many real GPU nodes (:mod:`kvfabric.localcluster.realnodes`): a kubelet
        and containerd each, in network and mount namespaces of their own, running real containers.

        Idempotent: a cluster that is already running and healthy is left as it is. If a component
        fails, everything started so far is stopped and :class:`ClusterStartError` says which one.
        """
        existing = self.state()
        if existing is not None:
            if self._all_alive(existing) and self._api_ready(existing):
                progress(f"cluster in {self.dir} is already running")
                return existing
            progress("found a stale cluster state; cleaning it up first")
            self.down(progress=lambda _m: None)

        bin_dir = binaries.ensure()
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.log_dir.mkdir(parents=True)
        (self.dir / "kwok.yaml").write_text(
            components.KWOK_CONFIG + (bin_dir / "kwok-stages.yaml").read_text()
        )
        ports = components.Ports(*(free_port() for _ in range(6)))
        certs = pki.write_pki(self.dir / "pki", service_ip=components.SERVICE_IP)
        api_url = f"https://127.0.0.1:{ports.apiserver}"
        self.kubeconfig.write_text(yaml.safe_dump(kubeconfig_document(api_url, certs)))
        self.kubeconfig.chmod(0o600)

        gpu_names, cpu_names = nodes.node_names(gpu_nodes, cpu_nodes)
        state = ClusterState(ports=ports, bin_dir=str(bin_dir), gpu_nodes=gpu_names, cpu_nodes=cpu_names)
        procs = components.commands(
            bin_dir,
            self.dir,
            ports,
            certs,
            self.kubeconfig,
            endpoint_routing=kubelets > 0,
            service_account_tokens=kubelets > 0 and not (gpu_nodes or cpu_nodes),
        )
        try:
            for comp in procs:
                progress(f"starting {comp.name}")
                state.pids[comp.name] = self._spawn(comp)
                self.state_file.write_text(state.to_json())
                self._wait_healthy(comp.name, state, certs)
            progress(f"registering {gpu_nodes} GPU and {cpu_nodes} CPU fake nodes")
            docs = [nodes.node_manifest(n, gpus=8) for n in gpu_names]
            docs += [nodes.node_manifest(n, gpus=0) for n in cpu_names]
            if docs:
                self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
                self._wait_nodes_ready(state, [*gpu_names, *cpu_names])
            self._wait_default_service_account(state)
            if kubelets:
                self._start_real_nodes(state, certs, kubelets, progress)
        except BaseException:
            self.down(progress=lambda _m: None)
            raise
        progress(f"cluster ready: {api_url}  (KUBECONFIG={self.kubeconfig})")
        return state

    def down(self, *, progress: Progress = print) -> None:
        """Stop every process ``up`` started and wait until their ports are free."""
        state = self.state()
        if state is None:
            progress("no cluster is running")
            return
        if state.real_nodes:
            self._stop_real_nodes(progress)
        # Reverse start order: clients first, etcd last, so nothing logs a storm of reconnects.
        for name, pid in reversed(list(state.pids.items())):
            progress(f"stopping {name}")
            _stop(pid, Path(state.bin_dir))
        ports = asdict(state.ports).values()
        deadline = time.monotonic() + 15
        while any(port_in_use(p) for p in ports) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.state_file.unlink(missing_ok=True)
        progress("cluster stopped")

    def status(self) -> dict[str, Any]:
        """Per-component liveness and health, and the nodes the API server knows."""
        state = self.state()
        if state is None:
            return {"running": False, "dir": str(self.dir)}
        comps = {name: {"pid": pid, "alive": _alive(pid)} for name, pid in state.pids.items()}
        result: dict[str, Any] = {
            "running": all(c["alive"] for c in comps.values()),
            "dir": str(self.dir),
            "api_server": f"https://127.0.0.1:{state.ports.apiserver}",
            "kubeconfig": str(self.kubeconfig),
            "components": comps,
        }
        if result["running"]:
            out = self.kubectl("get", "nodes", "-o", "json", check=False)
            if out.returncode == 0:
                result["nodes"] = [
                    {
                        "name": n["metadata"]["name"],
                        "ready": any(
                            c["type"] == "Ready" and c["status"] == "True"
                            for c in n.get("status", {}).get("conditions", [])
                        ),
                        "gpus": n.get("status", {}).get("capacity", {}).get(nodes.GPU_RESOURCE, "0"),
                    }
                    for n in json.loads(out.stdout)["items"]
                ]
        return result

    # --- real nodes --------------------------------------------------------------------------
    def real_nodes(self) -> list[realnodes.RealNode]:
        """The real nodes of this cluster (names, namespaces, per-node host directories)."""
        state = self.state()
        count = len(state.real_nodes) if state else 0
        return realnodes.plan(self.dir, _run_root(), count)

    def _start_real_nodes(self, state: ClusterState, certs: pki.Pki, count: int, progress: Progress) -> None:
        from kvfabric.localcluster import nodeimages

        kubelet_bin = binaries.ensure_kubelet()
        progress("saving the images the real nodes run (pause, kvfabric's) from the harness's engine")
        tarballs = nodeimages.node_images(kubelet_bin / "pause")
        planned = realnodes.plan(self.dir, _run_root(), count)
        state.real_nodes = [n.name for n in planned]
        self.state_file.write_text(state.to_json())
        started: list[realnodes.NodeProcesses] = []
        for node in planned:
            progress(f"starting real node {node.name} (netns {node.netns}, pods {node.pod_subnet})")
            realnodes.write_node_files(node, certs, state.ports.apiserver, tarballs)
            started.append(realnodes.start_node(node, kubelet_bin / "kubelet", state.ports.apiserver))
            realnodes.save_state(self.dir, started)
        for node, procs in zip(planned, started, strict=True):
            realnodes.wait_ready(self.kubectl, node, procs)
            realnodes.advertise_gpus(self.kubectl, node.name, 8)
            progress(f"real node {node.name} is Ready")

    def _stop_real_nodes(self, progress: Progress) -> None:
        procs = {p.name: p for p in realnodes.load_state(self.dir)}
        for node in self.real_nodes():
            progress(f"stopping real node {node.name}")
            realnodes.stop_node(node, procs.get(node.name))
        realnodes.state_path(self.dir).unlink(missing_ok=True)

    # --- helpers -----------------------------------------------------------------------------
    def _spawn(self, comp: components.Component) -> int:
        log = (self.log_dir / f"{comp.name}.log").open("ab")
        # A new session: the processes outlive `kvfabric cluster up` and are stopped as a group.
        proc = subprocess.Popen(
            comp.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=self.dir,
        )
        log.close()
        _CHILDREN[proc.pid] = proc
        return proc.pid

    def _check_alive(self, name: str, pid: int) -> None:
        if not _alive(pid):
            raise ClusterStartError(name, "the process exited", self.log_dir / f"{name}.log")

    def _wait_healthy(self, name: str, state: ClusterState, certs: pki.Pki) -> None:
        pid = state.pids[name]
        ports = state.ports
        checks: dict[str, Callable[[], bool]] = {
            "etcd": lambda: _http_ok(f"http://127.0.0.1:{ports.etcd_client}/health"),
            "kube-apiserver": lambda: self._api_ready(state, certs),
            "kube-controller-manager": lambda: _http_ok(
                f"https://127.0.0.1:{ports.controller_manager}/healthz", insecure=True
            ),
            "kube-scheduler": lambda: _http_ok(f"https://127.0.0.1:{ports.scheduler}/healthz", insecure=True),
            "kwok": lambda: _http_ok(f"http://127.0.0.1:{ports.kwok}/healthz"),
        }
        deadline = time.monotonic() + _STARTUP_TIMEOUT
        while True:
            self._check_alive(name, pid)
            if checks[name]():
                return
            if time.monotonic() > deadline:
                raise ClusterStartError(
                    name, f"not healthy after {_STARTUP_TIMEOUT:.0f}s", self.log_dir / f"{name}.log"
                )
            time.sleep(0.2)

    def _api_ready(self, state: ClusterState, certs: pki.Pki | None = None) -> bool:
        p = certs or pki.Pki.in_dir(self.dir / "pki")
        ctx = ssl.create_default_context(cafile=str(p.ca_crt))
        ctx.load_cert_chain(str(p.admin_crt), str(p.admin_key))
        return _http_ok(f"https://127.0.0.1:{state.ports.apiserver}/readyz", context=ctx)

    def _all_alive(self, state: ClusterState) -> bool:
        return bool(state.pids) and all(_alive(pid) for pid in state.pids.values())

    def _wait_nodes_ready(self, state: ClusterState, names: list[str]) -> None:
        deadline = time.monotonic() + _STARTUP_TIMEOUT
        while True:
            self._check_alive("kwok", state.pids["kwok"])
            out = self.kubectl("get", "nodes", "-o", "json", check=False)
            if out.returncode == 0:
                ready = {
                    n["metadata"]["name"]
                    for n in json.loads(out.stdout)["items"]
                    if any(
                        c["type"] == "Ready" and c["status"] == "True"
                        for c in n.get("status", {}).get("conditions", [])
                    )
                }
                if set(names) <= ready:
                    return
            if time.monotonic() > deadline:
                raise ClusterStartError("kwok", "fake nodes did not become Ready", self.log_dir / "kwok.log")
            time.sleep(0.3)

    def _wait_default_service_account(self, state: ClusterState) -> None:
        # Pods are rejected until the service-account controller has created `default` in their
        # namespace; waiting here spares every test from racing it.
        deadline = time.monotonic() + _STARTUP_TIMEOUT
        while self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode:
            self._check_alive("kube-controller-manager", state.pids["kube-controller-manager"])
            if time.monotonic() > deadline:
                raise ClusterStartError(
                    "kube-controller-manager",
                    "no default ServiceAccount appeared",
                    self.log_dir / "kube-controller-manager.log",
                )
            time.sleep(0.3)


def _run_root() -> Path:
    from kvfabric.containers.engine import run_dir

    return run_dir() / "nodes"


def _alive(pid: int) -> bool:
    _reap(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (our own exited child that nobody reaped) is dead for our purposes.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def _ours(pid: int, bin_dir: Path) -> bool:
    """Whether ``pid`` still runs one of our binaries (guards against a recycled pid)."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    return exe.startswith(str(bin_dir))


def _stop(pid: int, bin_dir: Path, grace: float = 10.0) -> None:
    if not _alive(pid) or not _ours(pid, bin_dir):
        _reap(pid)
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _alive(pid) and time.monotonic() < deadline:
        _reap(pid)
        time.sleep(0.05)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        while _alive(pid):
            _reap(pid)
            time.sleep(0.05)
    _reap(pid)


@atexit.register
def _reap_all() -> None:
    """Collect every child that has exited, so none is left a zombie (or reported as leaked)."""
    for pid in list(_CHILDREN):
        _reap(pid)


def _reap(pid: int) -> None:
    proc = _CHILDREN.get(pid)
    if proc is not None:
        if proc.poll() is not None:
            del _CHILDREN[pid]
        return
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _http_ok(url: str, *, insecure: bool = False, context: ssl.SSLContext | None = None) -> bool:
    if insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:  # noqa: S310
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


@contextlib.contextmanager
def running(
    directory: Path, *, gpu_nodes: int = 3, cpu_nodes: int = 1, progress: Progress = print
) -> Iterator[LocalCluster]:
    """Bring a cluster up in ``directory`` for the duration of a ``with`` block."""
    cluster = LocalCluster(directory)
    cluster.up(gpu_nodes=gpu_nodes, cpu_nodes=cpu_nodes, progress=progress)
    try:
        yield cluster
    finally:
        cluster.down(progress=progress)
