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

from kvfabric.testing.hostnodes import node_process

ROOT = Path(__file__).resolve().parents[1]
PODRUNNER = "kvfabric.localcluster.podrunner"


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
