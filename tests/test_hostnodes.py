"""Against an existing cluster (KVFABRIC_TEST_KUBECONFIG), a run starts no node on this host.

``e2e/kind/up.sh`` once ran all of ``pytest e2e`` against kind, including the real-kubelet tier,
which ignores KVFABRIC_TEST_KUBECONFIG and starts its own control plane and kubelets on the host.
up.sh now selects ``-m fabric``, and ``kvfabric.testing.hostnodes`` (installed by e2e/conftest.py)
refuses any node process such a run would start anyway.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfabric.localcluster.realnodes import NODE_SCRIPT
from kvfabric.testing.hostnodes import node_process

ROOT = Path(__file__).resolve().parents[1]
PODRUNNER = "kvfabric.localcluster.podrunner"
# How realnodes.start_node enters a node's namespaces before its script.
_NODE_WRAPPER = [
    "nsenter",
    "--net=/run/netns/kvf-n1",
    "--",
    "unshare",
    "--mount",
    "--propagation",
    "slave",
    "--",
]


@pytest.mark.parametrize(
    ("argv", "found"),
    [
        (["/home/u/.cache/kvfabric/kubelet-v1.36.3-x/bin/kubelet", "--config", "c"], "kubelet"),
        (["etcd", "--data-dir", "d"], "etcd"),
        (["/usr/bin/containerd", "--config", "c"], "containerd"),
        (["kube-apiserver"], "kube-apiserver"),
        (["kwok", "--kubeconfig", "k"], "kwok"),
        (
            [sys.executable, "-m", "kvfabric.localcluster.podrunner", "--base", "b"],
            "kvfabric.localcluster.podrunner",
        ),
        # Wrappers and shells: the program they run, or any node program a -c script names.
        (["sudo", "kubelet", "--config", "c"], "kubelet"),
        (["sudo", "-u", "root", "-E", "/usr/bin/dockerd"], "dockerd"),
        (["env", "A=1", "dockerd"], "dockerd"),
        (["env", "-u", "HOME", "A=1", "B=2", "kube-scheduler"], "kube-scheduler"),
        (["sh", "-c", "etcd --data-dir d"], "etcd"),
        (["/bin/bash", "-o", "pipefail", "-ec", "sleep 1; exec /opt/bin/kube-apiserver &"], "kube-apiserver"),
        (["bash", "-c", "containerd & exec kubelet"], "containerd"),
        (
            [*_NODE_WRAPPER, "bash", "-c", "containerd & exec kubelet"],
            "containerd",
        ),
        # realnodes.start_node's exact command line (its script runs containerd, then exec "$KUBELET").
        (
            [*_NODE_WRAPPER, "bash", "-c", NODE_SCRIPT],
            "containerd",
        ),
        (["timeout", "-s", "KILL", "30", "sudo", "env", "X=y", "kubelet"], "kubelet"),
        (["sudo", sys.executable, "-m", PODRUNNER], PODRUNNER),
        (["kind", "create", "cluster", "--name", "kvfabric"], "kind"),
        (["/usr/local/bin/kind", "delete", "cluster"], "kind"),
        (["sudo", "-u", "kubelet", "ls"], None),
        (["env", "A=1", "echo", "kubelet"], None),
        (["timeout", "30", "kubectl", "get", "nodes"], None),
        (["sh", "-c", "kubectl get nodes && echo ready"], None),
        (["bash", "script.sh", "kubelet"], None),
        (["sh", "-c", "# where the kubelet's files go\nls /tmp"], None),
        (["sudo"], None),
        (["kubectl", "--kubeconfig", "k", "get", "nodes"], None),
        (["uv", "run", "pytest", "e2e", "-m", "kubelet"], None),
        ([sys.executable, "-m", "kvfabric.cli", "operator"], None),
        (["echo", "kubelet"], None),
        ([], None),
    ],
)
def test_node_process_names_what_would_make_this_host_a_node(argv: list[str], found: str | None) -> None:
    assert node_process(argv) == found


@pytest.mark.process
def test_the_real_kubelet_tier_against_an_existing_cluster_is_refused_before_any_node_starts(
    tmp_path: Path,
) -> None:
    """The run up.sh used to make (the kubelet tier with KVFABRIC_TEST_KUBECONFIG): no etcd, no kubelet.

    The kubeconfig names no reachable cluster; the guard must stop the tier's own control plane at
    its first process, and say why.
    """
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "e2e/test_real_kubelet.py",
            "-m",
            "kubelet",
            "-k",
            "test_real_nodes_look_like_the_fake_gpu_nodes",
            "-p",
            "no:cacheprovider",
            "-x",
        ],
        cwd=ROOT,
        env={**os.environ, "KVFABRIC_TEST_KUBECONFIG": str(kubeconfig), "KVFABRIC_SKIP_IMAGES": "0"},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert f"existing cluster {kubeconfig}: no node process may start on this host" in out
    assert "HostNodeError" in out, out[-3000:]
    assert "would start etcd on this host" in out, out[-3000:]
