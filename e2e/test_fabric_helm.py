"""``KVFABRIC_INSTALL=helm make demo``: the Helm chart on a fresh cluster, the demo's engines on its pool.

A cluster of its own (not the session's, whose CRDs come from ``crds/``): ``helm install`` of
``charts/kvfabric`` puts the CRD, the RBAC, the admission policy and the operator's Deployment there,
and the operator runs authenticated as the chart's ServiceAccount (the pod runner cannot run the
Deployment's pod with in-cluster credentials: :func:`kvfabric.demo.fabric.helm_install`). Then the
demo's workload, shrunk as in test_demo.py: the sample pool, the reference engines on both GPU nodes,
every answer compared with the no-cache engine's.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator

import pytest

from kvfabric.demo.fabric import HELM_NAMESPACE, Fabric, running_fabric
from kvfabric.demo.replay import deploy_and_replay, print_report

# A fresh cluster of its own, the chart, the demo's workload: more than the default 180 s.
pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def helm_fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fabric]:
    if os.environ.get("KVFABRIC_TEST_KUBECONFIG"):
        pytest.skip("an existing cluster (KVFABRIC_TEST_KUBECONFIG): install the chart there yourself")
    with running_fabric(tmp_path_factory.mktemp("helm"), progress=lambda _m: None, install="helm") as fabric:
        yield fabric


def test_the_demos_engines_hit_a_pool_of_the_helm_install(
    helm_fabric: Fabric, capsys: pytest.CaptureFixture[str]
) -> None:
    fabric = helm_fabric
    cluster = fabric.cluster
    # What is installed is the chart's: the CRD belongs to the release, and no Deployment replica runs
    # beside the operator the fabric runs as the chart's ServiceAccount.
    crd = cluster.get_json("crd", "kvcachepools.kvfabric.io")
    assert crd["metadata"]["annotations"]["meta.helm.sh/release-name"] == "kvfabric"
    assert crd["metadata"]["annotations"]["meta.helm.sh/release-namespace"] == HELM_NAMESPACE
    assert fabric.operator is not None
    assert fabric.operator.kubeconfig != cluster.kubeconfig
    args = argparse.Namespace(
        users=2,
        rounds=3,
        system_tokens=256,
        turn_tokens=192,
        answer_tokens=4,
        preset="tiny",
        object_store=False,
    )
    with cluster.namespace("demo-helm") as ns:
        # replay() compares every answer with the no-cache baseline engine's and raises on a difference.
        report, pool = deploy_and_replay(fabric, ns, args, progress=lambda _m: None)
        print_report(report, fabric, ns, pool)
        # The chart's admission policy is in force: a pool's hostPath outside the allowed roots is
        # refused, naming the field.
        refused = cluster.kubectl(
            "apply", "--dry-run=server", "-n", ns, "-f", "-", check=False,
            input=json.dumps(_pool_on("/etc/kvcache")),
        )  # fmt: skip
        assert refused.returncode != 0
        assert "spec.tiers.localDisk.hostPath.path" in refused.stderr, refused.stderr
    out = capsys.readouterr().out

    # The operator ran as the chart's ServiceAccount, with the chart's leader election: its Lease is
    # in the release's namespace (the chart's Role is what let it write there).
    assert (
        cluster.kubectl("get", "lease", "kvfabric-operator", "-n", HELM_NAMESPACE, check=False).returncode
        == 0
    )
    assert len(report.turns) == args.users * args.rounds
    _first, *later = sorted({t.round for t in report.turns})
    later_turns = [t for t in report.turns if t.round in later]
    # As test_demo.py: the shared system prompt is a hit after the first request (one fallback allowed
    # for the sample pool's 100 ms lookup deadline on two busy cores), and the third round's history
    # stored on the other node comes through the shared tier.
    assert sum(t.hit_tokens >= 256 for t in later_turns) >= len(later_turns) - 1
    assert any(t.hit_tokens >= 512 for t in report.turns if t.round == 2), (report.turns, out)
    assert all(t.hit_tokens < t.prompt_tokens for t in report.turns)
    assert f"{pool}   True" in out  # kubectl get kvp shows the pool Ready


def _pool_on(path: str) -> dict[str, object]:
    return {
        "apiVersion": "kvfabric.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": "pool-etc"},
        "spec": {
            "image": {"tag": "v0.2.0"},
            "tiers": {
                "memory": {"size": "64Mi"},
                "localDisk": {"hostPath": {"path": path}, "capacity": "1Gi"},
            },
        },
    }
