"""The host-path admission policy installed again after it was removed: the API server refuses every pool.

On the Kubernetes 1.36 API server (the local control plane's), once no ValidatingAdmissionPolicyBinding
uses the ConfigMap parameter kind, the API server stops its ConfigMap parameter informer; a policy
installed later reads through that stopped informer, finds no parameters, and denies every request it
matches ("no params found for policy binding with `Deny` parameterNotFoundAction"), good pools
included, until kube-apiserver restarts. Measured on the local control plane (v1.36.3, 2026-12-05):
still refusing 400 s after the reinstall, with a new ConfigMap, policy and binding.
docs/operations.md ("Uninstall and install again") tells users; this test pins the behaviour: when an
API server with the upstream fix makes it fail, the caveat can go.

It runs on a control plane of its own: the state it leaves breaks every later ConfigMap-parameter
policy of that API server (the session's would fail test_operator_cluster_host_path_roots.py).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfabric.localcluster.testing import ClusterHandle, session_cluster, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
NO_PARAMS = "no params found for policy binding"
OBSERVED_S = 60.0


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[ClusterHandle]:
    """A control plane for this test alone, with the CRD installed."""
    if os.environ.get("KVFABRIC_TEST_KUBECONFIG"):
        pytest.skip("it would leave an existing cluster's API server refusing ConfigMap-parameter policies")
    with session_cluster(tmp_path) as handle:
        handle.kubectl("apply", "--server-side", "-k", str(ROOT / "crds"))
        handle.wait_crd_established("kvcachepools.kvfabric.io")
        yield handle


def _pool(path: str) -> dict[str, Any]:
    return {
        "apiVersion": "kvfabric.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": "probe"},
        "spec": {
            "image": {"tag": "v0.2.0"},
            "tiers": {
                "memory": {"size": "1Gi"},
                "localDisk": {"hostPath": {"path": path}, "capacity": "1Gi"},
            },
        },
    }


def _install(cluster: ClusterHandle, namespace: str) -> list[dict[str, Any]]:
    """The shipped policy, its ConfigMap and its binding, under fresh names, bound to ``namespace``."""
    docs = [
        d for d in yaml.safe_load_all((ROOT / "manifests/admission/host_path_roots.yaml").read_text()) if d
    ]
    suffix = uuid.uuid4().hex[:6]
    config, policy, binding = docs
    config["metadata"] = {"name": f"roots-{suffix}", "namespace": namespace}
    policy["metadata"]["name"] = f"kvfabric-host-path-roots-{suffix}"
    binding["metadata"]["name"] = f"kvfabric-host-path-roots-{suffix}"
    binding["spec"]["policyName"] = policy["metadata"]["name"]
    binding["spec"]["paramRef"] = {
        **binding["spec"]["paramRef"],
        "name": f"roots-{suffix}",
        "namespace": namespace,
    }
    binding["spec"]["matchResources"] = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    }
    cluster.apply(config, policy, binding)
    return [binding, policy, config]


def _uninstall(cluster: ClusterHandle, objects: list[dict[str, Any]]) -> None:
    for obj in objects:  # binding, policy, then the ConfigMap: as an uninstall removes them
        ns = obj["metadata"].get("namespace")
        cluster.kubectl("delete", obj["kind"].lower(), obj["metadata"]["name"], *(["-n", ns] if ns else []))


def _outcome(cluster: ClusterHandle, namespace: str, path: str) -> str:
    result = cluster.kubectl(
        "apply",
        "--dry-run=server",
        "-n",
        namespace,
        "-f",
        "-",
        input=yaml.safe_dump(_pool(path)),
        check=False,
    )
    return "admitted" if result.returncode == 0 else result.stderr


def test_a_policy_installed_again_after_it_was_removed_refuses_every_pool(own_cluster: ClusterHandle) -> None:
    cluster = own_cluster
    with cluster.namespace() as ns:
        installed = _install(cluster, ns)
        # The first install works: a pool under the roots is admitted, one outside refused, naming the field.
        wait_for(
            lambda: "is not under an allowed root" in _outcome(cluster, ns, "/opt/x"),
            timeout=60,
            message="policy",
        )
        assert _outcome(cluster, ns, "/mnt/nvme/kv") == "admitted"
        _uninstall(cluster, installed)
        wait_for(lambda: _outcome(cluster, ns, "/opt/x") == "admitted", timeout=60, message="the policy gone")
        time.sleep(5)  # a few of the API server's policy refresh ticks with no binding

        installed = _install(cluster, ns)
        # Installed again (a new ConfigMap, policy and binding): once the API server loaded it, every
        # pool is refused for want of the parameters that exist, the good one included, as long as
        # this test watches.
        first = wait_for(
            lambda: (o := _outcome(cluster, ns, "/opt/x")) != "admitted" and o,
            timeout=60,
            message="the policy again",
        )
        assert NO_PARAMS in first, first
        deadline = time.monotonic() + OBSERVED_S
        while time.monotonic() < deadline:
            good = _outcome(cluster, ns, "/mnt/nvme/kv")
            assert NO_PARAMS in good, good
            time.sleep(5)
        assert cluster.get_json("configmap", installed[2]["metadata"]["name"], "-n", ns)["data"]["roots"]
