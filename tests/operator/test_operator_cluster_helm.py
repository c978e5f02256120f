"""The Helm chart (charts/kvfabric): lint, values schema, one source of truth with the kustomize tree,
a server-side dry run, and a real install, upgrade and uninstall with the operator reconciling a pool.

The chart and the kustomize tree are written apart; :func:`test_chart_renders_the_kustomize_install`
is what keeps them one source of truth: for each kustomize entry point, the chart with the values that
mean the same renders the same objects, field by field.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.operator.conftest import OperatorProcess, get_pool

from kvfabric.localcluster.testing import ClusterHandle, token_kubeconfig, wait_for
from kvfabric.testing.opstools import Helm, ensure_helm, prometheus_operator_crds

pytestmark = [pytest.mark.cluster]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvfabric"
MANIFESTS = ROOT / "manifests"
CRD_NAME = "kvcachepools.kvfabric.io"
KEEP = "helm.sh/resource-policy"
CLUSTER_SCOPED = frozenset(
    {
        "Namespace",
        "CustomResourceDefinition",
        "ClusterRole",
        "ClusterRoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "CSIDriver",
        "MutatingWebhookConfiguration",
    }
)
Key = tuple[str, str | None, str]


@pytest.fixture(scope="module")
def helm(cluster: ClusterHandle, tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """The pinned helm, talking to the session's cluster, with its state in a temporary directory."""
    return Helm(ensure_helm(quiet=True), tmp_path_factory.mktemp("helm"), cluster.kubeconfig)


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def _by_key(docs: list[dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    """Objects by (kind, namespace, name); a cluster-scoped object has no namespace (kustomize sets one
    on every object of a kustomization with `namespace:`, which the API server ignores for those)."""
    out: dict[Key, dict[str, Any]] = {}
    for doc in docs:
        meta = doc["metadata"]
        if doc["kind"] in CLUSTER_SCOPED:
            meta.pop("namespace", None)
        key = (doc["kind"], meta.get("namespace"), meta["name"])
        assert key not in out, f"rendered twice: {key}"
        out[key] = doc
    return out


def _template(helm: Helm, *sets: str, namespace: str = "kvfabric-system") -> list[dict[str, Any]]:
    args = [arg for s in sets for arg in ("--set", s)]
    return _docs(helm("template", "kvfabric", str(CHART), "-n", namespace, *args).stdout)


def _kustomize(cluster: ClusterHandle, path: str) -> list[dict[str, Any]]:
    return _docs(cluster.kubectl("kustomize", str(MANIFESTS / path)).stdout)


def test_chart_lints_clean(helm: Helm) -> None:
    result = helm("lint", "--strict", str(CHART), check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_the_charts_crd_is_the_generated_one() -> None:
    copied = CHART / "files" / "crds" / "kvfabric.io_kvcachepools.yaml"
    assert copied.read_bytes() == (ROOT / "crds" / "kvfabric.io_kvcachepools.yaml").read_bytes(), (
        "charts/kvfabric/files/crds drifted: cp crds/kvfabric.io_kvcachepools.yaml charts/kvfabric/files/crds"
    )


@pytest.mark.parametrize(
    ("kustomization", "sets", "without_namespace"),
    [
        # The chart's defaults: the default install, less the Namespace (Helm creates the release's).
        ("default", [], True),
        ("default", ["namespace.create=true"], False),
        ("base", ["csi.enabled=false", "namespace.create=true"], False),
        ("overlays/namespaced", ["operator.watchNamespaces={team-a}", "namespace.create=true"], False),
        ("overlays/cert-manager", ["namespace.create=true", "webhook.certManager.enabled=true"], False),
        (
            "overlays/monitoring",
            [
                "namespace.create=true",
                "monitoring.podMonitor.enabled=true",
                "monitoring.prometheusRule.enabled=true",
            ],
            False,
        ),
    ],
)
def test_chart_renders_the_kustomize_install(
    cluster: ClusterHandle, helm: Helm, kustomization: str, sets: list[str], without_namespace: bool
) -> None:
    expected = _by_key(_kustomize(cluster, kustomization))
    if without_namespace:
        del expected[("Namespace", None, "kvfabric-system")]
    got = _by_key(_template(helm, *sets))
    assert sorted(got, key=str) == sorted(expected, key=str)
    # The one intended difference: the chart keeps the CRD on uninstall.
    crd = got[("CustomResourceDefinition", None, CRD_NAME)]
    assert crd["metadata"].pop("annotations") == {KEEP: "keep"}
    for key, doc in expected.items():
        assert got[key] == doc, key


def test_chart_values_render_where_they_should(helm: Helm) -> None:
    docs = _by_key(
        _template(
            helm,
            "image.repository=registry.example/kvf",
            "image.tag=v9.9.9",
            "admission.hostPathRoots={/data,/mnt/nvme}",
            "csi.kubeletRoot=/var/lib/k0s/kubelet",
            "crds.install=false",
            namespace="infra",
        )
    )
    deploy = docs[("Deployment", "infra", "kvfabric-operator")]["spec"]["template"]["spec"]["containers"][0]
    assert deploy["image"] == "registry.example/kvf:v9.9.9"
    env = {e["name"]: e.get("value") for e in deploy["env"]}
    assert env["KVFABRIC_OPERATOR_IMAGE"] == "registry.example/kvf:v9.9.9"
    assert docs[("ConfigMap", "infra", "kvfabric-host-path-roots")]["data"] == {"roots": "/data,/mnt/nvme"}
    binding = docs[("ValidatingAdmissionPolicyBinding", None, "kvfabric-host-path-roots")]
    assert binding["spec"]["paramRef"]["namespace"] == "infra"
    assert not any(k[0] == "CustomResourceDefinition" for k in docs)
    ds = docs[("DaemonSet", "infra", "kvfabric-csi-node")]["spec"]["template"]["spec"]
    assert {v["hostPath"]["path"] for v in ds["volumes"] if "hostPath" in v} == {
        "/var/lib/k0s/kubelet/pods",
        "/var/lib/k0s/kubelet/plugins/csi.kvfabric.io",
        "/var/lib/k0s/kubelet/plugins_registry",
        "/run/kvfabric",
    }
    subjects = [s for d in docs.values() for s in d.get("subjects", [])]
    assert len(subjects) >= 1
    assert {s["namespace"] for s in subjects} == {"infra"}


def test_cert_manager_mode_names_the_release_namespace(helm: Helm) -> None:
    docs = _by_key(_template(helm, "webhook.certManager.enabled=true", namespace="infra"))
    cert = docs[("Certificate", "infra", "kvfabric-webhook-cert")]
    assert cert["spec"]["dnsNames"] == [
        "kvfabric-webhook.infra.svc",
        "kvfabric-webhook.infra.svc.cluster.local",
    ]
    hook = docs[("MutatingWebhookConfiguration", None, "kvfabric-pod-injector")]
    assert hook["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": "infra/kvfabric-webhook-cert"
    }
    (webhook,) = hook["webhooks"]
    assert webhook["clientConfig"]["service"]["namespace"] == "infra"
    assert webhook["namespaceSelector"]["matchExpressions"][0]["values"] == ["kube-system", "infra"]
    deploy = docs[("Deployment", "infra", "kvfabric-operator")]["spec"]
    assert deploy["replicas"] == 2
    assert "--register-webhook" not in deploy["template"]["spec"]["containers"][0]["args"]
    one = _by_key(
        _template(helm, "webhook.certManager.enabled=true", "operator.replicas=1", namespace="infra")
    )
    assert one[("Deployment", "infra", "kvfabric-operator")]["spec"]["replicas"] == 1


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
        ("operator.replicas=two", "/operator/replicas"),
        ("csi.enable=false", "enable"),  # a typo of csi.enabled
        ("admission.hostPathRoots={relative/path}", "/admission/hostPathRoots/0"),
        ("operator.watchNamespaces={Team_A}", "/operator/watchNamespaces/0"),
        ("image.digest=sha256:nothex", "/image/digest"),
        ("operator.resources.limits.memory=lots", "/operator/resources/limits/memory"),
        ("monitoring.podMonitor.interval=often", "/monitoring/podMonitor/interval"),
    ],
)
def test_a_wrong_value_is_an_error_naming_it(helm: Helm, value: str, field: str) -> None:
    result = helm("template", "kvfabric", str(CHART), "--set", value, check=False)
    assert result.returncode != 0
    assert field in result.stderr, result.stderr


def test_chart_passes_a_server_side_dry_run(cluster: ClusterHandle, crd: None, helm: Helm) -> None:
    if cluster.kubectl("get", "namespace", "kvfabric-system", check=False).returncode:
        cluster.kubectl("create", "namespace", "kvfabric-system")
    for sets in ([], ["operator.watchNamespaces={kvfabric-system}", "csi.enabled=false"]):
        args = [arg for s in sets for arg in ("--set", s)]
        text = helm("template", "kvfabric", str(CHART), "-n", "kvfabric-system", *args).stdout
        result = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=text, check=False)
        assert result.returncode == 0, result.stderr
        assert f"customresourcedefinition.apiextensions.k8s.io/{CRD_NAME}" in result.stdout


MONITORING_CRDS = ("podmonitors", "servicemonitors", "prometheusrules")


@pytest.fixture(scope="module")
def monitoring_crds(cluster: ClusterHandle) -> None:
    """The Prometheus Operator's own CRDs for the kinds kvfabric ships (from its pinned module zip)."""
    for path in prometheus_operator_crds(quiet=True):
        kind = path.stem.removeprefix("monitoring.coreos.com_")
        if kind in MONITORING_CRDS:
            # Server-side: these CRDs are too large for the last-applied annotation.
            cluster.kubectl("apply", "--server-side", "--field-manager=kvfabric-tests", "-f", str(path))
            cluster.wait_crd_established(f"{kind}.monitoring.coreos.com")


def test_monitors_pass_a_server_side_dry_run_against_the_prometheus_operators_crds(
    cluster: ClusterHandle, crd: None, monitoring_crds: None, helm: Helm
) -> None:
    if cluster.kubectl("get", "namespace", "kvfabric-system", check=False).returncode:
        cluster.kubectl("create", "namespace", "kvfabric-system")
    chart = helm(
        "template", "kvfabric", str(CHART), "-n", "kvfabric-system",
        "--set", "monitoring.podMonitor.enabled=true",
        "--set", "monitoring.prometheusRule.enabled=true",
        "--set", "monitoring.dashboard.enabled=true",
    ).stdout  # fmt: skip
    kustomized = cluster.kubectl("kustomize", str(MANIFESTS / "overlays" / "monitoring")).stdout
    for text in (chart, kustomized):
        result = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=text, check=False)
        assert result.returncode == 0, result.stderr
        assert "podmonitor.monitoring.coreos.com/kvfabric-cache-servers" in result.stdout
        assert "prometheusrule.monitoring.coreos.com/kvfabric-alerts" in result.stdout
    # The dry run validates against the CRDs' schemas: a misspelt field is refused, naming it.
    wrong = chart.replace("podMetricsEndpoints:", "podMetricEndpoints:")
    refused = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=wrong, check=False)
    assert refused.returncode != 0
    assert "podMetricEndpoints" in refused.stderr


def _exists(cluster: ClusterHandle, key: Key) -> bool:
    kind, ns, name = key
    args = ["get", kind.lower(), name, "--ignore-not-found", "-o", "name", *(["-n", ns] if ns else [])]
    return bool(cluster.kubectl(*args).stdout.strip())


def _pool(name: str) -> dict[str, Any]:
    tiers: dict[str, Any] = {"memory": {"size": "1Gi"}}
    return {
        "apiVersion": "kvfabric.io/v1alpha1",
        "kind": "KVCachePool",
        "metadata": {"name": name},
        "spec": {"image": {"tag": "v0.2.0"}, "tiers": tiers},
    }


def _reconciled(cluster: ClusterHandle, ns: str, name: str) -> bool:
    status = get_pool(cluster, ns, name).get("status") or {}
    return bool((status.get("nodes") or {}).get("desired") == len(cluster.gpu_nodes) and cluster.gpu_nodes)


@pytest.fixture
def release_namespace(cluster: ClusterHandle) -> Iterator[str]:
    """The release's namespace; deleted afterwards with whatever the uninstall left there."""
    name = f"kvfabric-helm-{uuid.uuid4().hex[:6]}"
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--ignore-not-found", "--wait=false", check=False)


def test_helm_install_upgrade_and_uninstall_with_the_operator_reconciling(
    cluster: ClusterHandle,
    crd: None,
    operator: OperatorProcess,
    helm: Helm,
    namespace: str,
    release_namespace: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rel = release_namespace
    # Without the admission policy: on this API server, once one ValidatingAdmissionPolicy with a
    # ConfigMap parameter has come and gone, later ones refuse every request ("no params found"), so
    # installing and removing the chart's would break test_operator_cluster_host_path_roots.py (and
    # the reverse). That test and the dry run above cover the policy; this one everything else.
    values = ("--set", "admission.enabled=false")
    # The session's CRD (and any cluster-scoped object an earlier test left, e.g. the CSI plugin's
    # ClusterRoleBinding another test applied with its own field manager) is adopted, not refused.
    install = helm(
        "install",
        "kvfabric",
        str(CHART),
        "-n",
        rel,
        "--create-namespace",
        "--take-ownership",
        "--force-conflicts",
        *values,
    )
    assert "STATUS: deployed" in install.stdout
    rendered = _by_key(_template(helm, "admission.enabled=false", namespace=rel))
    missing = [key for key in rendered if not _exists(cluster, key)]
    assert missing == []

    # The operator, authenticated as the chart's ServiceAccount, so the chart's RBAC is what it has
    # (kwok does not run the Deployment's container; the session's operator is stopped meanwhile).
    monkeypatch.setenv("POD_NAMESPACE", rel)
    operator.stop()
    proc = OperatorProcess(
        cluster,
        tmp_path,
        kubeconfig=token_kubeconfig(cluster, rel, tmp_path / "sa.kubeconfig"),
        config_name="kvfabric-pod-injector",
        extra_args=["--leader-election"],
    )
    try:
        proc.start()
        cluster.apply(_pool("pool-a"), namespace=namespace)
        wait_for(lambda: _reconciled(cluster, namespace, "pool-a"), timeout=120, message="pool-a reconciled")

        # An upgrade to a new image (everywhere it is named) and a changed resource value; the
        # operator keeps reconciling through it (its RBAC and Lease survive the upgrade).
        helm(
            "upgrade", "kvfabric", str(CHART), "-n", rel, *values,
            "--set", "image.tag=v0.1.1",
            "--set", "operator.resources.limits.memory=1Gi",
        )  # fmt: skip
        container = cluster.get_json("deployment", "kvfabric-operator", "-n", rel)["spec"]["template"][
            "spec"
        ]["containers"][0]
        assert container["image"] == "ghcr.io/kvfabric/operator:v0.1.1"
        assert {"name": "KVFABRIC_OPERATOR_IMAGE", "value": "ghcr.io/kvfabric/operator:v0.1.1"} in container[
            "env"
        ]
        assert container["resources"]["limits"] == {"memory": "1Gi"}
        csi = cluster.get_json("daemonset", "kvfabric-csi-node", "-n", rel)["spec"]["template"]["spec"]
        assert csi["containers"][0]["image"] == "ghcr.io/kvfabric/operator:v0.1.1"
        cluster.apply(_pool("pool-b"), namespace=namespace)
        wait_for(lambda: _reconciled(cluster, namespace, "pool-b"), timeout=120, message="pool-b reconciled")
        history = json.loads(helm("history", "kvfabric", "-n", rel, "-o", "json").stdout)
        assert [(h["revision"], h["status"]) for h in history] == [(1, "superseded"), (2, "deployed")]
    finally:
        proc.stop()
        operator.start()

    helm("uninstall", "kvfabric", "-n", rel, "--wait")
    # Left behind, as docs/operations.md says: the CRD (resource policy keep) and so every pool...
    left = sorted(key for key in rendered if _exists(cluster, key))
    assert left == [("CustomResourceDefinition", None, CRD_NAME)]
    assert {p["metadata"]["name"] for p in cluster.get_json("kvcachepool", "-n", namespace)["items"]} == {
        "pool-a",
        "pool-b",
    }
    # ...and what the operator itself created at run time: its webhook registration, and in the
    # release's namespace its Lease and the consumer-keys Secret. Nothing else.
    assert _exists(cluster, ("MutatingWebhookConfiguration", None, "kvfabric-pod-injector"))
    cluster.kubectl("delete", "mutatingwebhookconfiguration", "kvfabric-pod-injector")
    kinds = "configmaps,secrets,serviceaccounts,services,deployments,daemonsets,roles,rolebindings,leases"
    names = cluster.kubectl("get", kinds, "-n", rel, "-o", "name").stdout.split()
    assert sorted(names) == [
        "configmap/kube-root-ca.crt",
        "lease.coordination.k8s.io/kvfabric-operator",
        "secret/kvfabric-consumer-keys",
        "serviceaccount/default",
    ]
    # Cluster-wide, nothing of the release is left but the CRD.
    cluster_kinds = (
        "clusterroles,clusterrolebindings,validatingadmissionpolicies,validatingadmissionpolicybindings"
    )
    ours = [
        item["metadata"]["name"]
        for item in cluster.get_json(f"{cluster_kinds},csidrivers,crds")["items"]
        if (item["metadata"].get("annotations") or {}).get("meta.helm.sh/release-namespace") == rel
    ]
    assert ours == [CRD_NAME]
