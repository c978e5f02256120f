"""The kustomize tree installs cleanly, re-applies as a no-op and matches the code it mirrors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfabric.localcluster.testing import ClusterHandle
from kvfabric.operator.webhookconfig import render_webhook_configuration

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"


def kustomize(cluster: ClusterHandle, path: Path) -> list[dict[str, Any]]:
    text = cluster.kubectl("kustomize", str(path)).stdout
    return [d for d in yaml.safe_load_all(text) if d]


@pytest.mark.cluster
def test_default_install_passes_server_dry_run(cluster: ClusterHandle, crd: None) -> None:
    # A server-side dry run creates nothing, so namespaced objects need their namespace to exist
    # already (kubectl cannot dry-run "create the namespace, then objects in it").
    if cluster.kubectl("get", "namespace", "kvfabric-system", check=False).returncode:
        cluster.kubectl("create", "namespace", "kvfabric-system")
    result = cluster.kubectl("apply", "-k", str(MANIFESTS / "default"), "--dry-run=server", check=False)
    assert result.returncode == 0, result.stderr
    assert "kvcachepools.kvfabric.io" in result.stdout


@pytest.mark.cluster
def test_server_side_apply_twice_changes_nothing(cluster: ClusterHandle, crd: None) -> None:
    docs = kustomize(cluster, MANIFESTS / "default")
    # The CRD is shared with the other tests of the session; apply the rest for real.
    rest = [d for d in docs if d["kind"] != "CustomResourceDefinition"]
    text = yaml.safe_dump_all(rest)
    args = ("apply", "--server-side", "--field-manager=kvfabric-install", "-f", "-")
    try:
        # The first apply takes over what earlier tests of the session (or a Helm release) applied
        # under other field managers; the second must then change nothing.
        cluster.kubectl(*args, "--force-conflicts", input=text)
        versions = {
            (d["kind"], d["metadata"]["name"]): cluster.get_json(
                d["kind"].lower(),
                d["metadata"]["name"],
                *(["-n", d["metadata"]["namespace"]] if "namespace" in d["metadata"] else []),
            )["metadata"]["resourceVersion"]
            for d in rest
            # Their status changes by itself: the (fake) pod starts; the API server type-checks the policy.
            if d["kind"] not in ("Deployment", "ValidatingAdmissionPolicy")
        }
        second = cluster.kubectl(*args, input=text).stdout
        assert "serverside-applied" in second
        for (kind, name), rv in versions.items():
            doc = next(d for d in rest if d["kind"] == kind and d["metadata"]["name"] == name)
            ns = ["-n", doc["metadata"]["namespace"]] if "namespace" in doc["metadata"] else []
            assert cluster.get_json(kind.lower(), name, *ns)["metadata"]["resourceVersion"] == rv, (
                kind,
                name,
            )
        diff = cluster.kubectl(
            "diff", "--server-side", "--field-manager=kvfabric-install", "-f", "-", input=text, check=False
        )
        assert diff.returncode == 0, diff.stdout
    finally:
        # Waited for: a later test that needs kvfabric-system (the kind overlay's dry run) must not
        # find it still terminating.
        cluster.kubectl(
            "delete",
            "--ignore-not-found",
            "--wait=true",
            "--timeout=180s",
            "-f",
            "-",
            input=text,
            check=False,
        )


@pytest.mark.cluster
def test_cert_manager_overlay_renders(cluster: ClusterHandle) -> None:
    docs = kustomize(cluster, MANIFESTS / "overlays" / "cert-manager")
    kinds = {d["kind"] for d in docs}
    assert {"Certificate", "Issuer", "MutatingWebhookConfiguration", "Deployment"} <= kinds
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--register-webhook" not in args
    assert "--webhook-cert=/certs/tls.crt" in args


def test_static_webhook_configuration_matches_the_code() -> None:
    static = yaml.safe_load((MANIFESTS / "webhook" / "mutating_webhook_configuration.yaml").read_text())
    rendered = render_webhook_configuration(
        service={"namespace": "system", "name": "webhook", "path": "/mutate-pods", "port": 443},
        excluded_namespaces=["kvfabric-system"],
    )
    assert static["webhooks"] == rendered["webhooks"]


@pytest.mark.cluster
def test_kind_shared_volumes_pass_server_side_dry_run(cluster: ClusterHandle) -> None:
    volumes = ROOT / "e2e" / "kind" / "shared-volumes.yaml"
    out = cluster.kubectl("apply", "--dry-run=server", "-f", str(volumes)).stdout
    assert out.count("(server dry run)") == len(list(yaml.safe_load_all(volumes.read_text())))


@pytest.mark.cluster
def test_kind_overlay_passes_server_dry_run(cluster: ClusterHandle) -> None:
    # A server-side dry run creates nothing: the namespace must exist for the namespaced objects.
    if cluster.kubectl("get", "namespace", "kvfabric-system", check=False).returncode:
        cluster.kubectl("create", "namespace", "kvfabric-system")
    result = cluster.kubectl(
        "apply", "-k", str(MANIFESTS / "overlays" / "kind"), "--dry-run=server", check=False
    )
    assert result.returncode == 0, result.stderr
    assert "deployment.apps/kvfabric-operator" in result.stdout
