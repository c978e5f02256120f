"""The install's hostPath allow-list, enforced by the real API server (ValidatingAdmissionPolicy).

The shipped policy is applied with its parameter ConfigMap, renamed for this test and bound only to
the test's namespace, so it cannot affect other tests of the session.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfabric.localcluster.testing import ClusterHandle, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _pool(name: str, path: str) -> dict[str, Any]:
    return {
        "apiVersion": "kvfabric.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name},
        "spec": {
            "image": {"tag": "v0.2.0"},
            "tiers": {
                "memory": {"size": "1Gi"},
                "localDisk": {"hostPath": {"path": path}, "capacity": "1Gi"},
            },
        },
    }


def test_host_paths_outside_the_installed_roots_are_rejected_naming_the_field(
    cluster: ClusterHandle, namespace: str, crd: None
) -> None:
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
    try:

        def outcome(name: str, path: str) -> str:
            result = cluster.kubectl(
                "apply", "--server-side", "--field-manager=kvfabric-tests", "-n", namespace, "-f", "-",
                input=yaml.safe_dump(_pool(name, path)), check=False,
            )  # fmt: skip
            return "admitted" if result.returncode == 0 else result.stderr

        # The policy takes effect once the API server has loaded it (a few seconds).
        first = wait_for(
            lambda: (o := outcome("probe", "/opt/cni")) != "admitted" and o, timeout=60, message="policy"
        )
        assert "spec.tiers.localDisk.hostPath.path /opt/cni is not under an allowed root" in first
        assert "/mnt, /var/lib/kvfabric" in first
        for i, path in enumerate(
            ["/home/user", "/srv/data", "/var/cache/x", "/mnt2/x", "/var/lib/kvfabricx"]
        ):
            assert f"spec.tiers.localDisk.hostPath.path {path} is not under an allowed root" in outcome(
                f"bad-{i}", path
            )
        # System directories are refused by the CRD's own rules before the policy runs.
        assert "spec.tiers.localDisk.hostPath.path" in outcome("system", "/var/lib/etcd")
        for i, path in enumerate(["/mnt", "/mnt/nvme/kv", "/var/lib/kvfabric", "/var/lib/kvfabric/disk1"]):
            assert outcome(f"ok-{i}", path) == "admitted", path
        # The admin widens the list at install time, without touching the operator.
        config["data"]["roots"] = "/mnt, /data/nvme"
        cluster.apply(config)
        wait_for(lambda: outcome("later", "/data/nvme/kv") == "admitted", timeout=60, message="new roots")
    finally:
        cluster.kubectl(
            "delete", "validatingadmissionpolicybinding", binding["metadata"]["name"], check=False
        )
        cluster.kubectl("delete", "validatingadmissionpolicy", policy["metadata"]["name"], check=False)
