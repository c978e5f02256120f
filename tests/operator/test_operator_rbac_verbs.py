"""Least privilege: every permission the operator's ClusterRole grants has a use in the code.

Each (API group, resource, verb) the shipped role holds must appear in ``USES`` with the code that
needs it (a file under ``operator/kvfabric/operator`` and a pattern found there). A verb added to the
role without a use, or a use that disappears from the code, fails this test; so does a permission
listed here that the role no longer grants (the table must describe the role, not a wish).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from kvfabric.contract.consumer_env import CONSUMER_KEYS_SECRET
from kvfabric.operator.cli import configure

ROOT = Path(__file__).resolve().parents[2]
CODE = ROOT / "operator/kvfabric/operator"

_APPLY = ("reconcile.py", r"client\.apply\(obj")  # server-side apply of rendered children
_KOPF_WATCH = ("handlers.py", r"@kopf\.on\.event\(")
_INFORMER = ("informer.py", r"self\.client\.watch\(")

# (group, resource, verb) -> [(file, regex)]: why the operator needs it.
USES: dict[tuple[str, str, str], list[tuple[str, str]]] = {
    ("kvfabric.io", "kvcachepools", "get"): [("reconcile.py", r"client\.get\(KIND")],
    ("kvfabric.io", "kvcachepools", "list"): [("handlers.py", r'list\("KVCachePool"')],
    ("kvfabric.io", "kvcachepools", "watch"): [("handlers.py", r"kopf\.on\.event\(GROUP, VERSION, PLURAL")],
    ("kvfabric.io", "kvcachepools/status", "patch"): [
        ("kube.py", r'"/status"'),
        ("reconcile.py", r"patch_status\("),
    ],
    ("", "configmaps", "get"): [("objectprobe.py", r'get\("ConfigMap"')],
    ("", "configmaps", "list"): [("controller.py", r'OWNED_KINDS = \(.*"ConfigMap"')],
    ("", "configmaps", "watch"): [("controller.py", r'OWNED_KINDS = \(.*"ConfigMap"'), _INFORMER],
    ("", "configmaps", "create"): [("render/children.py", r'"kind": "ConfigMap"'), _APPLY],
    ("", "configmaps", "patch"): [("render/children.py", r'"kind": "ConfigMap"'), _APPLY],
    ("", "configmaps", "delete"): [
        ("reconcile.py", r'_PRUNABLE: Final = \(.*"ConfigMap"'),
        ("reconcile.py", r"client\.delete\("),
    ],
    ("", "services", "get"): [("reconcile.py", r'_OWNERSHIP_CHECKED: Final = \(.*"Service"')],
    ("", "services", "list"): [("reconcile.py", r'_PRUNABLE: Final = \(.*"Service"')],
    ("", "services", "watch"): [("controller.py", r'OWNED_KINDS = \(.*"Service"'), _INFORMER],
    ("", "services", "create"): [("render/children.py", r'"kind": "Service"'), _APPLY],
    ("", "services", "patch"): [("render/children.py", r'"kind": "Service"'), _APPLY],
    ("", "services", "delete"): [
        ("reconcile.py", r'_PRUNABLE: Final = \(.*"Service"'),
        ("reconcile.py", r"client\.delete\("),
    ],
    ("", "persistentvolumeclaims", "get"): [("reconcile.py", r'get\("PersistentVolumeClaim"')],
    ("", "persistentvolumeclaims", "list"): [
        ("reconcile.py", r'_PRUNABLE: Final = \(.*"PersistentVolumeClaim"')
    ],
    ("", "persistentvolumeclaims", "watch"): [
        ("controller.py", r'OWNED_KINDS = \(.*"PersistentVolumeClaim"')
    ],
    ("", "persistentvolumeclaims", "create"): [
        ("render/children.py", r'"kind": "PersistentVolumeClaim"'),
        _APPLY,
    ],
    ("", "persistentvolumeclaims", "patch"): [
        ("render/children.py", r'"kind": "PersistentVolumeClaim"'),
        _APPLY,
    ],
    ("", "persistentvolumeclaims", "delete"): [
        ("reconcile.py", r'_PRUNABLE: Final = \(.*"PersistentVolumeClaim"')
    ],
    ("", "secrets", "get"): [
        ("reconcile.py", r'client\.get\("Secret"'),
        ("objectprobe.py", r'get\("Secret"'),
        # The consumer-keys Secret, by name, in the operator's namespace (consumer_keys_role.yaml).
        ("consumerkeys.py", r'client\.get\("Secret", operator_namespace, SECRET\)'),
    ],
    ("", "secrets", "create"): [
        ("poolpki.py", r'"kind": "Secret"'),
        ("reconcile.py", r"client\.apply\(body"),
        ("consumerkeys.py", r"client\.create\(body\)"),
    ],
    ("", "secrets", "patch"): [
        ("poolpki.py", r'"kind": "Secret"'),
        ("reconcile.py", r"client\.apply\(body"),
        ("consumerkeys.py", r'client\.patch\(\s*"Secret", operator_namespace, SECRET'),
    ],
    ("", "secrets", "delete"): [("reconcile.py", r'client\.delete\("Secret"')],
    # By name, before applying: a user's NetworkPolicy under the pool's name is not taken over.
    ("networking.k8s.io", "networkpolicies", "get"): [
        # A name the informer does not hold is checked against the API server (someone else's object).
        ("reconcile.py", r'_OWNERSHIP_CHECKED: Final = \(.*"NetworkPolicy"'),
        ("reconcile.py", r"found = await client\.get\(kind"),
    ],
    ("networking.k8s.io", "networkpolicies", "list"): [
        ("controller.py", r'OWNED_KINDS = \(.*"NetworkPolicy"'),
        ("informer.py", r"self\.client\.list_page\("),
    ],
    ("networking.k8s.io", "networkpolicies", "watch"): [
        ("controller.py", r'OWNED_KINDS = \(.*"NetworkPolicy"'),
        _INFORMER,
    ],
    ("networking.k8s.io", "networkpolicies", "create"): [
        ("render/children.py", r'"kind": "NetworkPolicy"'),
        _APPLY,
    ],
    ("networking.k8s.io", "networkpolicies", "patch"): [
        ("render/children.py", r'"kind": "NetworkPolicy"'),
        _APPLY,
    ],
    ("apps", "daemonsets", "get"): [("reconcile.py", r'get\("DaemonSet"')],
    ("apps", "daemonsets", "list"): [("controller.py", r'OWNED_KINDS = \(.*"DaemonSet"')],
    ("apps", "daemonsets", "watch"): [("controller.py", r'OWNED_KINDS = \(.*"DaemonSet"'), _INFORMER],
    ("apps", "daemonsets", "create"): [("render/children.py", r'"kind": "DaemonSet"'), _APPLY],
    ("apps", "daemonsets", "patch"): [("render/children.py", r'"kind": "DaemonSet"'), _APPLY],
    ("", "pods", "list"): [("reconcile.py", r'list\("Pod"')],
    # Wipe pods, in the operator's namespace only (node_cleanup_role.yaml).
    ("", "pods", "create"): [("wipe.py", r"client\.create\(pod\)")],
    ("", "pods", "delete"): [("wipe.py", r'client\.delete\("Pod", namespace, name\)')],
    ("", "pods", "watch"): [("controller.py", r'OWNED_KINDS = \(.*"Pod"'), _KOPF_WATCH],
    ("", "namespaces", "list"): [("handlers.py", r'kopf\.on\.event\("", "v1", "namespaces"')],
    ("", "namespaces", "watch"): [("handlers.py", r'kopf\.on\.event\("", "v1", "namespaces"')],
    ("", "events", "create"): [("reconcile.py", r"await client\.create\(body\)")],
    ("", "events", "list"): [("reconcile.py", r'"Event",')],
    ("coordination.k8s.io", "leases", "get"): [("leader.py", r'get\("Lease"')],
    ("coordination.k8s.io", "leases", "create"): [("leader.py", r"client\.create\(")],
    ("coordination.k8s.io", "leases", "update"): [("leader.py", r"client\.replace\("), ("kube.py", r'"PUT"')],
    # kopf discovers the resources it serves and watches through the CRDs.
    ("apiextensions.k8s.io", "customresourcedefinitions", "get"): [("handlers.py", r"^import kopf")],
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"): [("handlers.py", r"^import kopf")],
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"): [("handlers.py", r"^import kopf")],
    # Server-side apply of the (possibly missing) webhook configuration: create, and patch by name.
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "create"): [
        ("handlers.py", r"client\.apply\(self\.render")
    ],
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", "patch"): [
        ("handlers.py", r"client\.apply\(self\.render")
    ],
}


# The shipped roles: the ClusterRole (pools and their children live in any namespace) and the Role in
# the operator's own namespace (what lives only there).
ROLES = {
    "manifests/rbac/role.yaml": "ClusterRole",
    "manifests/rbac/leader_election_role.yaml": "Role",
    "manifests/rbac/node_cleanup_role.yaml": "Role",
    "manifests/rbac/consumer_keys_role.yaml": "Role",
}


def _rules(path: str) -> list[dict[str, Any]]:
    roles = [
        d for d in yaml.safe_load_all((ROOT / path).read_text()) if d and d["kind"] in ("Role", "ClusterRole")
    ]
    (role,) = roles
    assert role["kind"] == ROLES[path]
    return list(role["rules"])


def _granted(paths: Iterable[str] = ROLES) -> set[tuple[str, str, str]]:
    out = set()
    for path in paths:
        for rule in _rules(path):
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        assert verb != "*", "no wildcard verbs"
                        out.add((group, resource, verb))
    return out


def test_the_leader_election_lease_is_granted_in_the_operators_namespace_only_and_by_name() -> None:
    """The Lease lives in the operator's namespace: no cluster-wide lease access, get/update by name."""
    assert not {p for p in _granted(["manifests/rbac/role.yaml"]) if p[1] == "leases"}
    parser = argparse.ArgumentParser()
    configure(parser)
    lease = parser.get_default("leader_election_id")
    for rule in _rules("manifests/rbac/leader_election_role.yaml"):
        assert rule["resources"] == ["leases"]
        assert rule["verbs"] == ["create"] or rule.get("resourceNames") == [lease], rule


def test_every_granted_verb_has_a_use_in_the_code() -> None:
    granted = _granted()
    unexplained = sorted(granted - set(USES))
    assert not unexplained, f"the role grants permissions no code needs (or USES lacks them): {unexplained}"
    stale = sorted(set(USES) - granted)
    assert not stale, f"USES lists permissions the role does not grant: {stale}"
    for permission, evidence in USES.items():
        for file, pattern in evidence:
            text = (CODE / file).read_text()
            assert re.search(pattern, text, re.MULTILINE), f"{permission}: {pattern!r} no longer in {file}"


def test_the_operator_can_never_list_or_watch_secrets() -> None:
    # A list or watch of Secrets returns their data: every credential in the cluster.
    assert not {(g, r, v) for g, r, v in _granted() if r == "secrets" and v in ("list", "watch")}


def test_webhook_configuration_writes_are_limited_by_name() -> None:
    for rule in _rules("manifests/rbac/role.yaml"):
        if "mutatingwebhookconfigurations" in rule["resources"]:
            # create cannot be limited by name (RBAC); everything else must be.
            assert rule.get("resourceNames") or rule["verbs"] == ["create"], rule


# The CSI node plugin's ClusterRole and Role (manifests/csi/rbac.yaml): its reasons to ask the API server.
CSI_CODE = ROOT / "operator/kvfabric/csi"
CSI_USES: dict[tuple[str, str, str], list[tuple[str, str]]] = {
    ("kvfabric.io", "kvcachepools", "get"): [("access.py", r"get_namespaced_custom_object\(")],
    ("", "namespaces", "get"): [("access.py", r"read_namespace\(")],
}
CSI_NAMESPACED_USES: dict[tuple[str, str, str], list[tuple[str, str]]] = {
    ("", "secrets", "get"): [("access.py", r"read_namespaced_secret\(\s*CONSUMER_KEYS_SECRET")],
}


def _csi_granted(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_every_verb_the_csi_plugin_holds_has_a_use_in_its_code() -> None:
    docs = [d for d in yaml.safe_load_all((ROOT / "manifests/csi/rbac.yaml").read_text()) if d]
    (cluster_role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    (role,) = [d for d in docs if d["kind"] == "Role"]
    for held, uses in ((_csi_granted(cluster_role), CSI_USES), (_csi_granted(role), CSI_NAMESPACED_USES)):
        assert held == set(uses), f"granted {sorted(held)}, used {sorted(uses)}"
        for permission, evidence in uses.items():
            for file, pattern in evidence:
                assert re.search(pattern, (CSI_CODE / file).read_text()), (
                    f"{permission}: {pattern!r} not in {file}"
                )
    # The Secret it may get is the consumer-keys Secret, by name (a Role cannot list or watch it).
    assert [rule.get("resourceNames") for rule in role["rules"]] == [[CONSUMER_KEYS_SECRET]]
    # No Role or binding beyond those two, each bound to its own ServiceAccount only.
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ServiceAccount"], kinds
    for binding in (d for d in docs if d["kind"].endswith("Binding")):
        assert [s["name"] for s in binding["subjects"]] == ["kvfabric-csi-node"], binding


def test_the_operator_creates_and_deletes_pods_only_in_its_own_namespace() -> None:
    # Wipe pods run in the operator's namespace; cluster-wide pod create would be a way onto any node.
    cluster_wide = {(g, r, v) for g, r, v in _granted(["manifests/rbac/role.yaml"]) if r == "pods"}
    assert cluster_wide == {("", "pods", "list"), ("", "pods", "watch")}


def test_the_consumer_keys_secret_is_the_only_secret_granted_in_the_operators_namespace() -> None:
    """get and patch by its name only; create cannot be limited by name (RBAC); nothing else."""
    from kvfabric.operator.render import names

    rules = _rules("manifests/rbac/consumer_keys_role.yaml")
    grants = {(v, tuple(r.get("resourceNames", []))) for r in rules for v in r["verbs"]}
    assert all(r["resources"] == ["secrets"] and r["apiGroups"] == [""] for r in rules)
    assert grants == {
        ("create", ()),
        ("get", (names.CONSUMER_KEYS_SECRET,)),
        ("patch", (names.CONSUMER_KEYS_SECRET,)),
    }
