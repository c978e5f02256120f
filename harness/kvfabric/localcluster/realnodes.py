"""The real-kubelet tier of the local cluster: nodes that run containers.

Each real node is a kubelet (built at the pinned Kubernetes version, see ``build-kubelet.sh``) with
its own containerd (Debian's), started next to the kwok nodes:

- its own **network namespace** (``ip netns``, made here and deleted at ``down``): a veth pair
  with the node's address inside and a host-only address outside (how the API server reaches a
  webhook on the node), a CNI bridge for its pods (Debian's containernetworking-plugins), and a
  relay (:mod:`kvfabric.localcluster.nsrelay`) that makes the host-loopback API server reachable at
  127.0.0.1 inside the namespace;
- its own **mount namespace**, in which ``/run/kvfabric`` and ``/var/lib/kvfabric`` are bind mounts
  of per-node directories (``/run/kvfabric-<uid>/nodes/<node>/host/...``): hostPath volumes stay
  node-local although every node shares one machine, and a test reads them from the host;
- its own **cgroup subtree** (``/kvfabric-nodes/<name>`` in every cgroup v1 hierarchy, the kubelet's
  ``cgroupRoot``); ``down`` kills everything in it, containers and shims included;
- the node **certificate** ``system:node:<name>`` (Node authorizer, NodeRestriction), and the same
  GPU label, ``nvidia.com/gpu`` capacity (a status patch, as the Kubernetes docs advertise extended
  resources) and taint as the fake GPU nodes.

Settings this machine kind needs (cgroup v1, no CAP_SYS_RESOURCE): ``failCgroupV1: false`` and the
``cgroupfs`` driver for the kubelet; ``restrict_oom_score_adj`` and the runc wrapper for containerd.
Images cannot be pulled (no registry is reachable): they are loaded from the harness's Docker engine
(``docker save | ctr images import``), the sandbox image being a static ``pause`` binary.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from kvfabric.localcluster import nodes
from kvfabric.localcluster.pki import Pki
from kvfabric.operator.certs import make_leaf

Progress = Callable[[str], None]

PAUSE_IMAGE = "kvfabric-local/pause:1"
CNI_BIN_DIR = "/usr/lib/cni"
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_PARENT = "kvfabric-nodes"
NODE_PREFIX = "kubelet-gpu"
RUNC_WRAPPER = Path(__file__).resolve().parents[1] / "containers" / "runc-wrapper"
# Host paths the cache DaemonSet uses (names.HOST_RUN_ROOT and the local-disk root) and the kubelet's
# root directory, which the CSI node plugin mounts at the path a real node has it: per node.
KUBELET_ROOT = "/var/lib/kubelet"
NODE_LOCAL_DIRS = ("/run/kvfabric", "/var/lib/kvfabric", KUBELET_ROOT)
_READY_TIMEOUT = 180.0
# Processes this interpreter started, so they are reaped (no zombie, no ResourceWarning) when the
# same process stops them; `down` from another process works from the persisted pids alone.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


class RealNodeError(RuntimeError):
    """A real node did not come up; the message names the step and shows the log's tail."""


@dataclass(frozen=True)
class RealNode:
    """Names and paths of one real node."""

    name: str
    index: int
    netns: str
    dir: Path
    run: Path  # short paths for sockets

    @property
    def address(self) -> str:
        """The node's InternalIP (its end of a veth pair whose other end is the host's)."""
        return f"10.201.{self.index}.2"

    @property
    def host_address(self) -> str:
        """The host's end of that veth pair: the node's gateway, and how the host reaches it."""
        return f"10.201.{self.index}.1"

    @property
    def host_link(self) -> str:
        """The name of the host's end (unique per node; at most 15 bytes, the kernel's limit)."""
        return self.netns.replace("-", "")[:15]

    @property
    def pod_subnet(self) -> str:
        """The node's pod range (CNI host-local)."""
        return f"10.244.{100 + self.index}.0/24"

    @property
    def containerd_socket(self) -> Path:
        """Containerd's gRPC socket."""
        return self.run / "containerd.sock"

    @property
    def cgroup(self) -> str:
        """The kubelet's cgroupRoot (the same path in every cgroup v1 hierarchy)."""
        return f"/{CGROUP_PARENT}/{self.name}"

    def host_dir(self, node_path: str) -> Path:
        """Where the node's ``node_path`` (e.g. ``/run/kvfabric``) lives on the host.

        Under the short run directory: the cache server's socket is in there, and a Unix socket's
        path must stay under 108 bytes for clients on the host.
        """
        return self.run / "host" / node_path.strip("/").replace("/", "-")


def plan(cluster_dir: Path, run_root: Path, count: int) -> list[RealNode]:
    """The real nodes of a cluster in ``cluster_dir``: names, namespaces and paths (pure)."""
    tag = hashlib.sha256(str(cluster_dir).encode()).hexdigest()[:6]
    return [
        RealNode(
            name=f"{NODE_PREFIX}-{i}",
            index=i,
            netns=f"kvf-{tag}-{i}",
            dir=cluster_dir / "nodes" / f"{NODE_PREFIX}-{i}",
            run=run_root / f"n{tag}{i}",
        )
        for i in range(count)
    ]


def kubelet_config(node: RealNode, ca_crt: Path) -> dict[str, Any]:
    """The KubeletConfiguration of one node."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # This machine kind has cgroup v1 only; v1.36 refuses it unless told otherwise.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": node.cgroup,
        "cgroupsPerQOS": True,
        "containerRuntimeEndpoint": f"unix://{node.containerd_socket}",
        "address": node.address,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(ca_crt)},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDomain": "cluster.local",
        "failSwapOn": False,
        "maxPods": 20,
        # No registry: an image garbage-collected is an image lost. Eviction only on real shortage.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "serializeImagePulls": False,
        "nodeStatusUpdateFrequency": "5s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
        "registerNode": True,
        "registerWithTaints": [{"key": nodes.GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}],
        "resolvConf": "",
        "protectKernelDefaults": False,
        "enforceNodeAllocatable": ["pods"],
        "localStorageCapacityIsolation": True,
        # Container logs next to the node's other files: the API server cannot reach the kubelet in its
        # namespace for `kubectl logs`, so tests read them here.
        "podLogsDir": str(node.dir / "pod-logs"),
    }


def containerd_config(node: RealNode) -> str:
    """Containerd's config.toml (version 2) for one node."""
    c = json.dumps  # TOML basic strings are JSON strings for these values
    return f"""version = 2
root = {c(str(node.dir / "containerd"))}
state = {c(str(node.run / "state"))}
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.internal.v1.tracing", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = {c(str(node.containerd_socket))}
[ttrpc]
  address = {c(str(node.run / "containerd.ttrpc.sock"))}
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = {c(str(node.dir / "opt"))}
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = {c(PAUSE_IMAGE)}
  # oom_score_adj -998 for sandboxes needs CAP_SYS_RESOURCE, which this machine kind lacks.
  restrict_oom_score_adj = true
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = {c(str(RUNC_WRAPPER))}
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = {c(CNI_BIN_DIR)}
    conf_dir = {c(str(node.dir / "cni"))}
"""


def cni_config(node: RealNode) -> dict[str, Any]:
    """A bridge network for the node's pods, inside the node's namespace."""
    return {
        "cniVersion": "1.0.0",
        "name": "kvfabric",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": node.pod_subnet}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(node.dir / "cni-ipam"),
                },
            }
        ],
    }


NODE_SCRIPT = r"""
# Runs in the node's network namespace and a fresh mount namespace (see realnodes.py).
set -euo pipefail
echo $$ > "$CGROUP_PROCS_HINT"
for cg in $CGROUP_DIRS; do echo $$ > "$cg/cgroup.procs"; done
mount --make-rslave /
for pair in $BIND_MOUNTS; do mkdir -p "${pair#*=}"; mount --bind "${pair%%=*}" "${pair#*=}"; done
# As on a systemd host: the kubelet's directory is a shared mount, so a CSI plugin's bind under it
# (Bidirectional propagation) reaches the node and the consumer's container.
mount --make-rshared "$KUBELET_ROOT"
containerd --config "$NODE_DIR/containerd.toml" >>"$NODE_DIR/containerd.log" 2>&1 &
for _ in $(seq 300); do [ -S "$CONTAINERD_SOCKET" ] && break; sleep 0.1; done
for img in "$NODE_DIR"/images/*.tar; do
  [ -e "$img" ] || continue
  ctr --address "$CONTAINERD_SOCKET" -n k8s.io images import "$img" >>"$NODE_DIR/images.log" 2>&1
done
exec "$KUBELET" --config="$NODE_DIR/kubelet.yaml" --kubeconfig="$NODE_DIR/kubeconfig" \
  --hostname-override="$NODE_NAME" --node-ip="$NODE_IP" --root-dir="$KUBELET_ROOT" \
  --cert-dir="$NODE_DIR/kubelet-pki" --node-labels="$NODE_LABELS" --v=1 >>"$NODE_DIR/kubelet.log" 2>&1
"""


@dataclass
class NodeProcesses:
    """What ``up`` started for one node, persisted in ``<cluster>/nodes/state.json``."""

    name: str
    netns: str
    node_pid: int
    relay_pid: int


def _run(*argv: str) -> None:
    subprocess.run(list(argv), check=True, capture_output=True, text=True)


def _cgroup_dirs(node: RealNode) -> list[Path]:
    """The node's directory in every cgroup v1 hierarchy (the empty cgroup2 ``unified`` excluded)."""
    out = []
    for h in sorted(CGROUP_ROOT.iterdir()):
        if h.name == "unified" or not (h / "cgroup.procs").exists():
            continue
        out.append(h / CGROUP_PARENT / node.name)
    return out


def _make_cgroups(node: RealNode) -> list[Path]:
    dirs = _cgroup_dirs(node)
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
        if d.parent.parent.name == "cpuset":  # a new cpuset has no CPUs until given its parent's
            for level in (d.parent, d):
                for f in ("cpuset.cpus", "cpuset.mems"):
                    if not (level / f).read_text().strip():
                        (level / f).write_text((level.parent / f).read_text())
    return dirs


def _kill_cgroups(node: RealNode) -> None:
    """Kill every process in the node's cgroup subtrees, then remove the cgroups bottom-up."""
    for _round in range(50):
        pids: set[int] = set()
        for d in _cgroup_dirs(node):
            if d.exists():
                for procs in d.rglob("cgroup.procs"):
                    with contextlib.suppress(OSError, ValueError):
                        pids |= {int(p) for p in procs.read_text().split()}
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    for d in _cgroup_dirs(node):
        if d.exists():
            for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    sub.rmdir()
            with contextlib.suppress(OSError):
                d.rmdir()


def _setup_netns(node: RealNode) -> None:
    ns = node.netns
    with contextlib.suppress(subprocess.CalledProcessError):
        _run("ip", "netns", "delete", ns)
    # Links a killed run left behind: this node's by name, and any other holding its address (a
    # cluster in another directory has other names but the same addresses; a second route to the
    # same /24 would send the API server's calls into a dead namespace).
    for link in {node.host_link, *_links_with_address(node.host_address)}:
        with contextlib.suppress(subprocess.CalledProcessError):
            _run("ip", "link", "delete", link)
    _run("ip", "netns", "add", ns)
    _run("ip", "-n", ns, "link", "set", "lo", "up")
    # The node's address on its end of a veth pair whose other end is the host's (this kernel has no
    # dummy interfaces): a route for the kubelet to find a usable interface, and a way for the API
    # server to reach what listens on the node's address (a webhook in a hostNetwork pod). The link
    # is host-only: the host never forwards what arrives from the node (forwarding off on that link,
    # whatever the host's ip_forward), and the host's own services listen on loopback only.
    # Deleting the namespace deletes the pair.
    _run("ip", "link", "add", node.host_link, "type", "veth", "peer", "name", "kvf0", "netns", ns)
    Path(f"/proc/sys/net/ipv4/conf/{node.host_link}/forwarding").write_text("0")
    _run("ip", "addr", "add", f"{node.host_address}/24", "dev", node.host_link)
    _run("ip", "link", "set", node.host_link, "up")
    _run("ip", "-n", ns, "addr", "add", f"{node.address}/24", "dev", "kvf0")
    _run("ip", "-n", ns, "link", "set", "kvf0", "up")
    _run("ip", "-n", ns, "route", "add", "default", "via", node.host_address, "dev", "kvf0")


def _links_with_address(address: str) -> list[str]:
    """Names of the host's veth links that carry ``address``.

    Only veths, which is what ``up`` makes: another interface that happens to hold the address (a
    VPN, a bridge) is left alone, and the node's start then fails on the duplicate address instead.
    """

    def ip(*args: str) -> list[list[str]]:
        out = subprocess.run(["ip", "-o", *args], capture_output=True, text=True, check=False)
        return [line.split() for line in out.stdout.splitlines()]

    veths = {f[1].rstrip(":").split("@")[0] for f in ip("link", "show", "type", "veth") if len(f) > 1}
    return [
        f[1]
        for f in ip("-4", "addr", "show")
        if len(f) >= 4 and f[1] in veths and f[3].split("/")[0] == address
    ]


def node_kubeconfig(api_port: int, ca_crt: bytes, crt: bytes, key: bytes) -> dict[str, Any]:
    """The kubelet's kubeconfig: the API server as the relay in the node's namespace shows it."""
    import base64

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "local",
                "cluster": {
                    "server": f"https://127.0.0.1:{api_port}",
                    "certificate-authority-data": b64(ca_crt),
                },
            }
        ],
        "users": [
            {"name": "node", "user": {"client-certificate-data": b64(crt), "client-key-data": b64(key)}}
        ],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "node"}}],
        "current-context": "local",
    }


def write_node_files(node: RealNode, pki: Pki, api_port: int, images: Sequence[Path]) -> None:
    """Configuration, certificate and image tarballs of one node."""
    if node.dir.exists():
        subprocess.run(["rm", "-rf", str(node.dir)], check=True)
    node.dir.mkdir(parents=True)
    if node.run.exists():
        subprocess.run(["rm", "-rf", str(node.run)], check=True)
    node.run.mkdir(parents=True)
    for p in NODE_LOCAL_DIRS:
        node.host_dir(p).mkdir(parents=True, exist_ok=True)
    (node.dir / "cni").mkdir()
    (node.dir / "cni" / "10-kvfabric.conflist").write_text(json.dumps(cni_config(node), indent=2))
    (node.dir / "containerd.toml").write_text(containerd_config(node))
    (node.dir / "kubelet.yaml").write_text(yaml.safe_dump(kubelet_config(node, pki.ca_crt)))
    ca_crt, ca_key = pki.ca_crt.read_bytes(), pki.ca_key.read_bytes()
    crt, key = make_leaf(
        ca_crt,
        ca_key,
        common_name=f"system:node:{node.name}",
        organization="system:nodes",
        client=True,
        days=365,
    )
    kc = node.dir / "kubeconfig"
    kc.write_text(yaml.safe_dump(node_kubeconfig(api_port, ca_crt, crt, key)))
    kc.chmod(0o600)
    (node.dir / "images").mkdir()
    for i, tar in enumerate(images):
        (node.dir / "images" / f"{i:02d}-{tar.name}").symlink_to(tar)


def start_node(node: RealNode, kubelet: Path, api_port: int) -> NodeProcesses:
    """Namespace, cgroups, relay, containerd and kubelet of one node (files already written)."""
    _setup_netns(node)
    cgroups = _make_cgroups(node)
    relay_log = (node.dir / "relay.log").open("ab")
    relay = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvfabric.localcluster.nsrelay",
            f"/run/netns/{node.netns}",
            str(api_port),
            str(api_port),
        ],
        stdout=relay_log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    relay_log.close()
    labels = {nodes.GPU_LABEL: "true", "type": "kubelet", "kvfabric.io/real-node": "true"}
    env = {
        **os.environ,
        "NODE_DIR": str(node.dir),
        "NODE_NAME": node.name,
        "NODE_IP": node.address,
        "KUBELET": str(kubelet),
        "CONTAINERD_SOCKET": str(node.containerd_socket),
        "CGROUP_DIRS": " ".join(str(d) for d in cgroups),
        "CGROUP_PROCS_HINT": str(node.dir / "node.pid"),
        "BIND_MOUNTS": " ".join(f"{node.host_dir(p)}={p}" for p in NODE_LOCAL_DIRS),
        "KUBELET_ROOT": KUBELET_ROOT,
        "NODE_LABELS": ",".join(f"{k}={v}" for k, v in labels.items()),
    }
    log = (node.dir / "node.log").open("ab")
    proc = subprocess.Popen(
        [
            "nsenter",
            f"--net=/run/netns/{node.netns}",
            "--",
            "unshare",
            "--mount",
            "--propagation",
            "slave",
            "--",
            "bash",
            "-c",
            NODE_SCRIPT,
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    log.close()
    _CHILDREN[proc.pid] = proc
    _CHILDREN[relay.pid] = relay
    return NodeProcesses(node.name, node.netns, proc.pid, relay.pid)


def stop_node(node: RealNode, procs: NodeProcesses | None) -> None:
    """Stop the kubelet, containerd and every container of the node; delete its namespace."""
    if procs is not None:
        for pid in (procs.node_pid, procs.relay_pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
    time.sleep(0.5)
    _kill_cgroups(node)
    if procs is not None:
        for pid in (procs.node_pid, procs.relay_pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            child = _CHILDREN.pop(pid, None)
            if child is not None:
                child.wait()
            else:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
    # Mounts made inside the node's mount namespace vanish with it; only the network namespace
    # (and the iptables chains the kubelet made in it) has to go explicitly.
    with contextlib.suppress(subprocess.CalledProcessError):
        _run("ip", "netns", "delete", node.netns)
    # Sockets, containerd's state and the node-local host directories (kept on disk: node.dir).
    subprocess.run(["rm", "-rf", str(node.run)], check=False)


def state_path(cluster_dir: Path) -> Path:
    """Where the real nodes' process ids are kept."""
    return cluster_dir / "nodes" / "state.json"


def save_state(cluster_dir: Path, procs: list[NodeProcesses]) -> None:
    """Persist ``procs``."""
    path = state_path(cluster_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(p) for p in procs], indent=2))


def load_state(cluster_dir: Path) -> list[NodeProcesses]:
    """The persisted processes (empty when no real node runs)."""
    try:
        return [NodeProcesses(**p) for p in json.loads(state_path(cluster_dir).read_text())]
    except (OSError, ValueError, TypeError):
        return []


def advertise_gpus(kubectl: Callable[..., subprocess.CompletedProcess[str]], name: str, gpus: int) -> None:
    """Add ``nvidia.com/gpu`` to the node's capacity (the documented way for extended resources)."""
    patch = [
        {"op": "add", "path": "/status/capacity/nvidia.com~1gpu", "value": str(gpus)},
    ]
    kubectl("patch", "node", name, "--subresource=status", "--type=json", "-p", json.dumps(patch))


def node_ready(node_doc: dict[str, Any]) -> bool:
    """Whether a Node object's Ready condition is True."""
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in node_doc.get("status", {}).get("conditions", [])
    )


def tail(path: Path, lines: int = 30) -> str:
    """The last lines of a log (or a note that there is none)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_ready(
    kubectl: Callable[..., subprocess.CompletedProcess[str]],
    node: RealNode,
    procs: NodeProcesses,
    timeout: float = _READY_TIMEOUT,
) -> None:
    """Until the node is registered and Ready (its CNI network included)."""
    deadline = time.monotonic() + timeout
    while True:
        out = kubectl("get", "node", node.name, "-o", "json", check=False)
        if out.returncode == 0 and node_ready(json.loads(out.stdout)):
            return
        child = _CHILDREN.get(procs.node_pid)
        dead = child is not None and child.poll() is not None
        if dead or time.monotonic() > deadline:
            why = "its processes exited" if dead else f"not Ready after {timeout:.0f}s"
            raise RealNodeError(
                f"real node {node.name}: {why}\n--- kubelet.log ---\n{tail(node.dir / 'kubelet.log')}\n"
                f"--- containerd.log ---\n{tail(node.dir / 'containerd.log', 10)}\n"
                f"--- node.log ---\n{tail(node.dir / 'node.log', 10)}"
            )
        time.sleep(1.0)
