"""Pure parts of the local cluster: certificates, node manifests, kubeconfig merging, start errors."""

from __future__ import annotations

import datetime as dt
import socket
import subprocess
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvfabric.localcluster import cluster as cluster_mod
from kvfabric.localcluster import components, kubeconfig, nodes, pki, versions

pytestmark = pytest.mark.process  # starts control-plane binaries (test level, see kvfabric.testing.levels)


def test_leaf_certificates_chain_to_the_ca(tmp_path: Path) -> None:
    p = pki.write_pki(tmp_path / "pki", service_ip="10.96.0.1")
    ca = x509.load_pem_x509_certificate(p.ca_crt.read_bytes())
    api = x509.load_pem_x509_certificate(p.apiserver_crt.read_bytes())
    admin = x509.load_pem_x509_certificate(p.admin_crt.read_bytes())
    for leaf in (api, admin):
        leaf.verify_directly_issued_by(ca)
        assert leaf.not_valid_after_utc > dt.datetime.now(dt.UTC) + dt.timedelta(days=300)
    sans = api.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "kubernetes.default.svc" in sans.get_values_for_type(x509.DNSName)
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "10.96.0.1"}
    assert admin.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:masters"
    eku = admin.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.CLIENT_AUTH in eku
    assert oct(p.admin_key.stat().st_mode & 0o777) == "0o600"


def test_gpu_node_manifest_looks_like_a_gpu_node() -> None:
    gpu = nodes.node_manifest("g", gpus=8)
    cpu = nodes.node_manifest("c", gpus=0)
    assert gpu["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
    assert gpu["status"]["capacity"]["nvidia.com/gpu"] == "8"
    assert gpu["spec"]["taints"] == [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
    assert "nvidia.com/gpu.present" not in cpu["metadata"]["labels"]
    assert "taints" not in cpu["spec"]
    assert nodes.node_manifest("x", gpus=0, managed_by_kwok=False)["metadata"]["annotations"] == {}


def test_kubeconfig_merge_replaces_only_our_entries() -> None:
    existing = {
        "clusters": [{"name": "prod", "cluster": {}}, {"name": "kvfabric-local", "cluster": {"old": 1}}],
        "users": [{"name": "me"}],
        "contexts": [{"name": "prod"}],
        "current-context": "prod",
    }
    ours = {
        "clusters": [{"name": "kvfabric-local", "cluster": {"new": 1}}],
        "users": [{"name": "u"}],
        "contexts": [{"name": "kvfabric-local"}],
        "current-context": "kvfabric-local",
    }
    out = kubeconfig.merged(existing, ours, make_current=False)
    assert [c["name"] for c in out["clusters"]] == ["prod", "kvfabric-local"]
    assert out["clusters"][1]["cluster"] == {"new": 1}
    assert out["current-context"] == "prod"
    assert kubeconfig.merged(existing, ours, make_current=True)["current-context"] == "kvfabric-local"


def test_cache_dir_is_keyed_by_the_pins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVFABRIC_CACHE_DIR", str(tmp_path))
    first = versions.bin_dir()
    assert first.is_relative_to(tmp_path)
    monkeypatch.setitem(versions.PINS, "kwok", "v9.9.9")
    assert versions.bin_dir() != first


def test_a_component_that_crashes_is_named_with_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = components.commands

    def broken(*args: object, **kwargs: object) -> list[components.Component]:
        procs = real(*args, **kwargs)  # type: ignore[arg-type]
        sched = next(c for c in procs if c.name == "kube-scheduler")
        sched.argv.append("--no-such-flag-for-this-test")
        return procs

    monkeypatch.setattr(components, "commands", broken)
    c = cluster_mod.LocalCluster(tmp_path / "c")
    with pytest.raises(cluster_mod.ClusterStartError) as err:
        c.up(progress=lambda _m: None)
    assert err.value.component == "kube-scheduler"
    assert "no-such-flag-for-this-test" in str(err.value)  # the log tail explains it
    # The components that did start were stopped again: nothing listens, no state is left.
    assert c.state() is None
    assert c.status() == {"running": False, "dir": str(c.dir)}


def test_down_frees_every_port(tmp_path: Path) -> None:
    c = cluster_mod.LocalCluster(tmp_path / "c")
    state = c.up(gpu_nodes=1, cpu_nodes=0, progress=lambda _m: None)
    ports = [state.ports.etcd_client, state.ports.apiserver, state.ports.kwok]
    assert all(cluster_mod.port_in_use(p) for p in ports)
    assert c.up(progress=lambda _m: None).pids == state.pids  # idempotent: nothing restarted
    c.down(progress=lambda _m: None)
    for port in ports:
        with socket.socket() as s:
            # SO_REUSEADDR, as servers set it: TIME_WAIT remnants are fine, a listener is not.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
    assert not any(cluster_mod._alive(pid) for pid in state.pids.values())


def test_cli_status_of_a_stopped_cluster(tmp_path: Path) -> None:
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "cluster", "--dir", str(tmp_path), "status"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 1
    assert "no cluster running" in out.stdout


def test_kubeconfig_document_embeds_credentials(tmp_path: Path) -> None:
    p = pki.write_pki(tmp_path, service_ip="10.96.0.1")
    doc = cluster_mod.kubeconfig_document("https://127.0.0.1:1", p)
    text = yaml.safe_dump(doc)
    assert "certificate-authority-data" in text
    assert "client-key-data" in text
    assert doc["current-context"] == "kvfabric-local"
